"""A worker's copy of each study's finished trials: read once, in bulk, then only what is new or
still running is read again. Samplers and pruners read every trial of the study at each trial;
Optuna's RDB storage builds them through its ORM (23 s for 20,000 trials on PostgreSQL, some
700,000 objects), its own cache behind a private name. This one reads the same trials with
plain SQL (storage.study_queries, checked against Optuna's `get_trial` in the tests).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Container
from dataclasses import dataclass, field

from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from hpo.storage import study_queries


@dataclass
class _Study:
    trials: dict[int, FrozenTrial] = field(default_factory=dict)  # by number
    unfinished: set[int] = field(default_factory=set)  # trial ids to read again
    last_finished: int = -1  # the highest trial id read finished: newer ones are read again


class TrialCache:
    """Finished trials of the studies of one database, by study."""

    def __init__(self, backend: RDBStorage) -> None:
        self.backend = backend
        self._studies: dict[int, _Study] = {}
        self._finished: dict[int, FrozenTrial] = {}  # by trial id
        self._lock = threading.Lock()

    def all_trials(
        self, study_id: int, deepcopy: bool, states: Container[TrialState] | None
    ) -> list[FrozenTrial]:
        """As `BaseStorage.get_all_trials`: the study's trials by number."""
        with self._lock:
            study = self._studies.get(study_id)
            if study is None:
                self.backend.get_study_name_from_id(study_id)  # KeyError for no such study
                study = self._studies[study_id] = _Study()
            self._refresh(study_id, study)
            trials = [
                study.trials[n]
                for n in sorted(study.trials)
                if states is None or study.trials[n].state in states
            ]
        return copy.deepcopy(trials) if deepcopy else trials

    def finished_trial(self, trial_id: int) -> FrozenTrial | None:
        """The trial, if this cache holds it finished (a finished trial never changes)."""
        with self._lock:
            return self._finished.get(trial_id)

    def _refresh(self, study_id: int, study: _Study) -> None:
        read = study_queries.study_trials(
            self.backend.engine, study_id, study.last_finished, sorted(study.unfinished)
        )
        for trial_id, trial in read:
            study.trials[trial.number] = trial
            if trial.state.is_finished():
                self._finished[trial_id] = trial
                study.unfinished.discard(trial_id)
                study.last_finished = max(study.last_finished, trial_id)
            else:
                study.unfinished.add(trial_id)
