"""The life of a trial on a study shared by many workers, with Optuna's public ask-and-tell API:
a study-wide budget (count, then `study.ask()`, under the study's lock), heartbeats while a trial
runs, a sweep that fails and re-queues the trials of dead or paused workers, and hand-backs of
interrupted trials. Everything that fails a trial and queues it again happens under the same
lock, so a checkpoint cleanup never sees a failed trial without its retry.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from hpo.storage.artifacts import ArtifactStore, ArtifactStoreError
from hpo.storage.engine import StudyStorage
from hpo.storage.heartbeats import Heartbeats, HeartbeatThread, LastBeat, silences
from hpo.study.device_time import device_hours
from hpo.study.front import rule_for
from hpo.study.kept_models import (
    models_kept,
    remove_stale_checkpoints,
    remove_unneeded_artifacts,
    remove_unneeded_folders,
)
from hpo.study.retry import retry_trial
from hpo.tracking.observer import NoObserver, TrialObserver

log = logging.getLogger(__name__)


RETRY_ATTR = "failed_trial"  # a retry's system attribute: the trial it takes the place of


def counted_trials(trials: list[FrozenTrial]) -> int:
    """Trials the budget counts: started ones, less the failed ones a retry replaces (each
    retry carries the `failed_trial` system attribute, and takes its failed trial's place)."""
    started = sum(t.state != TrialState.WAITING for t in trials)
    retries = sum(RETRY_ATTR in t.system_attrs for t in trials)
    return started - retries


def unsure_trials(
    watched: dict[int, LastBeat | None], now: dict[int, LastBeat | None]
) -> list[int]:
    """Of the running trials `watched` since some moment, those still running whose worker has
    not beaten since: it may be dead. A new beat (the time of the last one changed, or a
    heartbeat row that appeared or went) says that their worker is alive."""
    return sorted(
        n for n, beat in watched.items() if n in now and _beat_at(now[n]) == _beat_at(beat)
    )


def _beat_at(beat: LastBeat | None) -> dt.datetime | None:
    return None if beat is None else beat.beat_at


class StudyTrials:
    """One worker's view of the trials of a shared study."""

    def __init__(
        self,
        study: optuna.Study,
        storage: StudyStorage,
        worker: str,
        budget: int | None,
        liveness: tuple[float, float, int],
        queued_only: bool = False,
    ) -> None:
        self.study, self.storage, self.worker, self.budget = study, storage, worker, budget
        # Only queued trials (a retrain study's runs, its retries): nothing is ever sampled.
        self.queued_only = queued_only
        self.said_waiting = False  # whether it logged that it waits for others' trials
        # Trials whose workers beat while this worker waited for them (hpo.study.loop): those
        # workers are alive, so this one does not wait for these trials again.
        self.seen_beating: set[int] = set()
        self.heartbeat_interval_s, self.grace_period_s, self.max_retries = liveness
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.beats = Heartbeats(storage.engine, self.study_id)
        self._last_sweep: float | None = None
        self._cleanup: threading.Thread | None = None  # the artifact store's cleanup
        self._cleanup_due: ArtifactStore | None = None  # skipped: a cleanup was running
        # Hears of the trials this worker hands back (run_trials gives it the worker's trackers).
        self.observer: TrialObserver = NoObserver()
        # study.budget_device_hours, held as n_trials is; the study's device-hours once found
        # spent (then no trial starts).
        self.device_hours_budget: float | None = None
        self.device_hours_spent: float | None = None

    def next_trial(self, checkpoints: Path | None = None) -> optuna.Trial | None:
        """A new (or queued) trial for this worker, or None when the study holds its budget.
        With `checkpoints`, the folders no trial needs any more go first, from the same read of
        the trials under the same lock."""
        with self.storage.lock(self.study_id):
            trials = self.study.get_trials(deepcopy=False)
            if checkpoints is not None and checkpoints.is_dir():
                remove_unneeded_folders(
                    checkpoints,
                    self.study.study_name,
                    trials,
                    rule_for(self.study),
                    models_kept(self.study),
                )
            if self.budget is not None and counted_trials(trials) >= self.budget:
                return None
            if self._device_hours_spent(trials):
                return None
            if self.queued_only and not any(t.state == TrialState.WAITING for t in trials):
                return None
            trial = self.study.ask()
            self.beats.start(trial.number, self.worker)  # before any sweep can find it silent
        return trial

    def _device_hours_spent(self, trials: list[FrozenTrial]) -> bool:
        """Whether the study's device-hours (as `hpo status` counts them) reach its budget."""
        if self.device_hours_budget is None:
            return False
        silent = silences(self.storage.engine, self.study_id)
        used = device_hours(trials, dt.datetime.now(), silent)
        if used < self.device_hours_budget:
            return False
        self.device_hours_spent = used
        return True

    @contextmanager
    def heartbeat(self, trial: optuna.Trial) -> Iterator[HeartbeatThread]:
        """Beats while the block runs; the thread's `lost` is set once another worker has
        taken the trial over (its heartbeat row is gone)."""
        with HeartbeatThread(
            self.beats, trial.number, self.worker, self.heartbeat_interval_s
        ) as thread:
            yield thread

    def sweep_if_due(self) -> list[int]:
        """A sweep at most once per heartbeat interval: a trial can go stale no faster."""
        now = time.monotonic()
        if self._last_sweep is not None and now - self._last_sweep < self.heartbeat_interval_s:
            return []
        self._last_sweep = now
        return self.sweep()

    def running(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    def running_beats(self) -> dict[int, LastBeat | None]:
        """Each running trial and its last heartbeat (None: it has no heartbeat row)."""
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        beats = self.beats.last_beats([t.number for t in running])
        return {t.number: beats.get(t.number) for t in running}

    def sweep(self) -> list[int]:
        """Fail the running trials whose worker stopped beating, each with its reason, and
        queue each again; returns the numbers failed."""
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not running or not self.beats.stale(running, self.grace_period_s):
            return []
        failed = []
        with self.storage.lock(self.study_id):
            running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            started = {t.number: t.datetime_start for t in running}
            for stale in self.beats.stale(running, self.grace_period_s):
                ran_s = _time_until_silent(started.get(stale.number), stale.silent_s)
                if self._fail(stale.number, stale.reason(self.grace_period_s), ran_s):
                    failed.append(stale.number)
                    self._queue_again(stale.number, "lost its worker")
        return failed

    def tell(
        self, trial: optuna.Trial, state: TrialState, value: float | list[float] | None = None
    ) -> bool:
        """Record how this worker's trial ended; False (and one line) when another worker took
        it over meanwhile, whose record stands."""
        try:
            self.study.tell(trial, value, state=state)
            return True
        except (ValueError, UpdateFinishedTrialError):
            if not self.taken_over(trial.number):
                raise
        log.warning(
            "trial %d was taken over by another worker while this one was unresponsive; "
            "dropping this worker's result",
            trial.number,
        )
        return False

    def fail(self, trial: optuna.Trial, reason: str) -> bool:
        """Record this worker's trial as FAIL with `reason`, unless a reason is recorded already
        (the trial's own, more precise): `hpo status` counts failures by reason. False (and one
        line) when another worker took it over meanwhile."""
        if not trial.user_attrs.get("fail_reason"):
            # If another worker took the trial over meanwhile, its reason stands (this write
            # fails) and tell() below logs it.
            with contextlib.suppress(UpdateFinishedTrialError):
                trial.set_user_attr("fail_reason", reason[:1000])
        return self.tell(trial, TrialState.FAIL)

    def hand_back(self, trial: optuna.Trial, reason: str) -> None:
        """A trial stopped for a reason that is not its own (the worker was asked to stop, its
        process was stopped or lost): FAIL with `reason`, then queued again with the same
        parameters."""
        with self.storage.lock(self.study_id):
            if self.fail(trial, reason):
                self._queue_again(trial.number, "was interrupted")

    def taken_over(self, number: int) -> bool:
        return self._frozen(number).state.is_finished()

    def remove_stale_checkpoints(self, root: Path) -> list[Path]:
        """Under the lock: no trial is between its FAIL and its retry while this decides."""
        if not root.is_dir():
            return []
        with self.storage.lock(self.study_id):
            return remove_stale_checkpoints(self.study, root)

    def remove_stale_artifacts(self, store: ArtifactStore) -> None:
        """The trials read under the lock (none is between its FAIL and its retry); the store's
        requests made after it, in a thread of its own: a slow or hanging store never holds
        the study's lock, the next trial or a stop. One cleanup at a time: what one leaves, a
        later one finds."""
        if self._cleanup is not None and self._cleanup.is_alive():
            self._cleanup_due = store  # done by the next cleanup, or by finish_cleanup
            return
        self._cleanup_due = None
        with self.storage.lock(self.study_id):
            trials = self.study.get_trials(deepcopy=False)
        self._cleanup = threading.Thread(
            target=self._remove_artifacts,
            args=(store, trials),
            name="hpo-artifact-cleanup",
            daemon=True,  # a worker stopped by a signal does not wait for it
        )
        self._cleanup.start()

    def finish_cleanup(self, timeout_s: float) -> None:
        """Give a cleanup still running up to `timeout_s` to end (a worker done with its trials),
        then one more if one was skipped meanwhile: the last trials' stored states (a finished
        trial's goes only here) would otherwise stay, with no later worker to remove them. One
        cut short leaves objects no manifest lists: never read, and removed by no one."""
        deadline = time.monotonic() + timeout_s
        if self._cleanup is not None:
            self._cleanup.join(timeout_s)
        due = self._cleanup_due
        if due is not None and self._cleanup is not None and not self._cleanup.is_alive():
            self.remove_stale_artifacts(due)
            self._cleanup.join(max(0.0, deadline - time.monotonic()))

    def _remove_artifacts(self, store: ArtifactStore, trials: list[FrozenTrial]) -> None:
        """Never raises: a store that fails now is cleaned after a later trial."""
        try:
            name, rule = self.study.study_name, rule_for(self.study)
            remove_unneeded_artifacts(store, name, trials, rule, models_kept(self.study))
        except ArtifactStoreError as e:
            log.warning("old artifacts of study %r not removed yet: %s", self.study.study_name, e)

    def _fail(self, number: int, reason: str, ran_s: float | None = None) -> bool:
        """`ran_s`: how long it ran (wall_s, for the study's device-hours), if its worker did
        not record it."""
        trial_id = self._trial_id(number)
        try:
            if ran_s is not None:
                self.storage.set_trial_user_attr(trial_id, "wall_s", ran_s)
            self.storage.set_trial_user_attr(trial_id, "fail_reason", reason)
            self.storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            return False  # it finished meanwhile, or another worker failed it first
        self.beats.forget(number)
        log.warning("trial %d failed: %s", number, reason)
        return True

    def _queue_again(self, number: int, what: str) -> None:
        frozen = self._frozen(number)
        self.observer.trial_interrupted(frozen, str(frozen.user_attrs.get("fail_reason", what)))
        retry = retry_trial(self.study, frozen, self.max_retries)
        if retry is not None:
            log.warning("trial %d %s; queued again as trial %d", number, what, retry)

    def _frozen(self, number: int) -> FrozenTrial:
        return self.storage.get_trial(self._trial_id(number))

    def _trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)


def _time_until_silent(started: dt.datetime | None, silent_s: float) -> float | None:
    """A trial whose worker went silent ran from its start to its last heartbeat."""
    if started is None:
        return None
    return round(max(0.0, (dt.datetime.now() - started).total_seconds() - silent_s), 3)
