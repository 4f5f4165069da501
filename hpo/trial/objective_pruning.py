"""Pruning a study of several objectives on one of them (`study.pruner.objective`), while its
Pareto front still uses all of them.

Optuna's Trial.report and Trial.should_prune refuse a study of several objectives
(optuna/optuna#3450). So the pruned objective's evaluations are stored with the trial (a
system attribute, through the storage's public API), and the pruner judges the trial in a
single-objective in-memory mirror of the study: the same trials and numbers, those values as
their intermediate values, each complete trial valued by the pruned objective alone. Every
Optuna pruner then works unchanged. A pruned trial is told PRUNED in the real study and has no
values, so it is never on the front.

With throughput (samples_per_s) among the objectives, a trial is compared only with the
trials at least as fast as it trains so far (within study.throughput_tolerance; a complete
trial by its samples/s, another by its speed so far): a fast trial, weaker on the pruned
objective than slower ones, is a trade-off the front keeps, not a weak trial. The fastest
trials are thus never pruned; a trial weak among the trials as fast as it is cannot be on the
front but by noise. Measured in bench/search_multiobjective.py.

The values are not kept as the real trials' intermediate values: Optuna 5.0's TPE ranks a
pruned trial of a study of several objectives by its last intermediate value through
`study.direction`, which such a study refuses, so the next trial's sampling would fail (a test
holds this).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import optuna
from optuna.storages import BaseStorage, InMemoryStorage
from optuna.trial import FrozenTrial, TrialState


class ObjectivePruner(optuna.pruners.BasePruner):
    """`pruner` (built from study.pruner as for one objective) judging objective `index` of a
    study of several. `storage` is the study's: the values and the pruner's own records
    (successive halving's rungs) are written there. `throughput`: the index of samples_per_s
    among the objectives and the tolerance of its noise (a fraction), to compare a trial only
    with trials at least as fast; None: with every complete trial."""

    def __init__(
        self,
        pruner: optuna.pruners.BasePruner,
        index: int,
        storage: BaseStorage,
        throughput: tuple[int, float] | None = None,
    ) -> None:
        self.pruner, self.index, self.storage = pruner, index, storage
        self.throughput = throughput

    def report(self, study: optuna.Study, number: int, value: float, step: int) -> None:
        """What trial.report does for one objective: the value at `step` (the first one stays,
        as Optuna keeps it)."""
        trial_id = self._trial_id(study, number)
        reported = self.storage.get_trial_system_attrs(trial_id).get(VALUES_ATTR, [])
        if all(int(s) != step for s, _ in reported):
            pairs = [*reported, [int(step), float(value)]]
            self.storage.set_trial_system_attr(trial_id, VALUES_ATTR, pairs)

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.judge(study, trial.number)

    def judge(self, study: optuna.Study, number: int) -> bool:
        """Whether trial `number` should stop, by its values reported so far."""
        mirror = mirror_study(study, self.index, self._compared_with(study, number))
        judged = mirror.get_trials(deepcopy=False)[number]
        before = dict(judged.system_attrs)
        pruned = self.pruner.prune(mirror, judged)
        after = mirror.get_trials(deepcopy=False)[number].system_attrs
        changed = {k: v for k, v in after.items() if before.get(k, _ABSENT) != v}
        if changed:  # e.g. successive halving's rung values, which later trials compare with
            trial_id = self._trial_id(study, number)
            for key, value in changed.items():
                self.storage.set_trial_system_attr(trial_id, key, value)
        return bool(pruned)

    def reason(self, number: int) -> str | None:
        """Why the trial was pruned, from a pruner that says so (hpo.study's ExplainedPruner)."""
        reason = getattr(self.pruner, "reason", None)
        said = reason(number) if callable(reason) else None
        if said is not None and self.throughput is not None:
            said += " (of the trials at least as fast in samples/s)"
        return said

    def _compared_with(
        self, study: optuna.Study, number: int
    ) -> Callable[[FrozenTrial], bool] | None:
        """Which trials the trial is judged against: with throughput an objective, those at
        least as fast as it trains so far (none while that is unknown): complete ones by their
        samples/s, others (successive halving compares with them too) by theirs so far."""
        if self.throughput is None:
            return None
        column, tolerance = self.throughput
        speed = _speed(study.get_trials(deepcopy=False)[number], column)
        least = math.inf if speed is None else speed * (1 - tolerance)

        def compared(trial: FrozenTrial) -> bool:
            other = _speed(trial, column)
            return trial.number == number or (other is not None and other >= least)

        return compared

    def _trial_id(self, study: optuna.Study, number: int) -> int:
        study_id = self.storage.get_study_id_from_name(study.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)


_ABSENT = object()
# The trial system attribute that holds the pruned objective's values: [[step, value], ...].
VALUES_ATTR = "hpo:pruned_objective_values"
# The trial user attribute that holds its samples/s so far, at its latest evaluation.
SPEED_ATTR = "samples_per_s_so_far"


def _speed(trial: FrozenTrial, column: int) -> float | None:
    """A trial's samples/s: a complete one's objective, else its speed so far (None: unknown)."""
    if trial.state == TrialState.COMPLETE and trial.values is not None:
        return float(trial.values[column])
    speed = trial.user_attrs.get(SPEED_ATTR)
    return float(speed) if isinstance(speed, (int, float)) else None


def reported_values(trial: FrozenTrial) -> dict[int, float]:
    """The pruned objective's values the trial reported, by step (a study of several)."""
    return {int(step): float(value) for step, value in trial.system_attrs.get(VALUES_ATTR, [])}


def mirror_study(
    study: optuna.Study, index: int, compared: Callable[[FrozenTrial], bool] | None = None
) -> optuna.Study:
    """`study` as a single-objective study of its objective `index`, in memory: every trial
    (so the numbers match, and Hyperband's brackets, which hash the study name and the number,
    too), complete ones valued by that objective, its reported values their intermediate
    values. A trial that `compared` refuses is there as a blank failed one: no pruner counts
    it."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created" each time
    try:
        mirror = optuna.create_study(
            storage=InMemoryStorage(),
            study_name=study.study_name,
            direction=study.directions[index],
        )
    finally:
        optuna.logging.set_verbosity(verbosity)
    trials = study.get_trials(deepcopy=False)
    if any(t.number != i for i, t in enumerate(trials)):
        raise RuntimeError(f"study {study.study_name!r}: trial numbers are not 0, 1, 2...")
    mirror.add_trials([_one_objective(t, index, compared) for t in trials])
    return mirror


def _one_objective(
    trial: FrozenTrial, index: int, compared: Callable[[FrozenTrial], bool] | None
) -> FrozenTrial:
    """The trial valued by objective `index` alone (a complete trial has every value)."""
    if compared is not None and not compared(trial):
        return optuna.trial.create_trial(state=TrialState.FAIL)
    complete = trial.state == TrialState.COMPLETE and trial.values is not None
    return optuna.trial.create_trial(
        state=trial.state,
        value=trial.values[index] if complete and trial.values is not None else None,
        params=trial.params,
        distributions=trial.distributions,
        system_attrs={k: v for k, v in trial.system_attrs.items() if k != VALUES_ATTR},
        intermediate_values={**trial.intermediate_values, **reported_values(trial)},
    )


def report(trial: optuna.Trial, value: float, step: int) -> None:
    """trial.report for an optuna.Trial of any study: of several objectives, through the study's
    ObjectivePruner (hpo.study.join builds one when study.pruner.objective is set)."""
    pruner = trial.study.pruner
    if isinstance(pruner, ObjectivePruner):
        pruner.report(trial.study, trial.number, value, step)
    else:
        trial.report(value, step)


def should_prune(trial: optuna.Trial) -> bool:
    """trial.should_prune for an optuna.Trial of any study (see report)."""
    pruner = trial.study.pruner
    if isinstance(pruner, ObjectivePruner):
        return pruner.judge(trial.study, trial.number)
    return trial.should_prune()
