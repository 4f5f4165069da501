"""Pruning that does not act on noise (Optuna's median/percentile rule with a margin), and a
pruner that says why it stops a trial.
"""

from __future__ import annotations

import math

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.config.schema import PrunerConfig
from hpo.numbers import number_text


def judged_by(
    study: optuna.Study, trial: FrozenTrial, n_startup_trials: int, n_warmup_steps: int
) -> tuple[list[FrozenTrial], int] | None:
    """The complete trials a median-style rule judges `trial` by, and its last step; None
    while it judges nothing (fewer than `n_startup_trials` complete, or the trial's last step
    before `n_warmup_steps`)."""
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    step = trial.last_step
    if not completed or len(completed) < n_startup_trials:
        return None
    if step is None or step < n_warmup_steps:
        return None
    return completed, step


class MarginPruner(optuna.pruners.BasePruner):
    """Optuna's percentile rule (the trial's best value so far against the given percentile of
    the completed trials' values at the same evaluation), except that a trial is pruned only
    when it is worse than that threshold by more than `margin`, in the metric's units.

    Early in fine-tuning many runs sit at chance level before their metric jumps; the median
    of such runs differs from any one of them by evaluation noise alone, and the plain rule
    prunes on that noise. With `margin: 0` this rule is Optuna's PercentilePruner (a test
    holds them equal)."""

    def __init__(
        self, percentile: float, n_startup_trials: int, n_warmup_steps: int, margin: float
    ) -> None:
        self.percentile = percentile
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps
        self.margin = margin

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        judged = judged_by(study, trial, self.n_startup_trials, self.n_warmup_steps)
        if judged is None:
            return False
        completed, step = judged
        values = [v for v in trial.intermediate_values.values() if not math.isnan(v)]
        if not values:
            return True  # nothing but NaN: a diverged run
        others = [t.intermediate_values.get(step, math.nan) for t in completed]
        others = [v for v in others if not math.isnan(v)]
        if not others:
            return False
        maximize = study.direction == StudyDirection.MAXIMIZE
        percentile = 100 - self.percentile if maximize else self.percentile
        threshold = float(np.percentile(np.asarray(others, dtype=float), percentile))
        if maximize:
            return max(values) < threshold - self.margin
        return min(values) > threshold + self.margin


class ExplainedPruner(optuna.pruners.BasePruner):
    """The study's pruner (`pruner`, built from `cfg`), which also says why it stops a trial:
    which rule, the trial's value, and what it was compared with, from the very trials it
    judged by. `reason(number)` hands the reason over once, to the worker that records how
    the trial ended. `step_word`: what a reported step is ("evaluation" for hpo's trainer,
    "step" for a training function's ctx.report)."""

    def __init__(
        self, pruner: optuna.pruners.BasePruner, cfg: PrunerConfig, metric: str, step_word: str
    ) -> None:
        self.pruner, self.cfg, self.metric, self.step_word = pruner, cfg, metric, step_word
        self._reasons: dict[int, str] = {}

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        pruned = self.pruner.prune(study, trial)
        if pruned:
            self._reasons[trial.number] = prune_explanation(
                self.cfg, study, trial, self.metric, self.step_word
            )
        return pruned

    def reason(self, number: int) -> str | None:
        return self._reasons.pop(number, None)


def prune_explanation(
    cfg: PrunerConfig, study: optuna.Study, trial: FrozenTrial, metric: str, step_word: str
) -> str:
    """Why `cfg`'s pruner stops `trial` at its last reported step, e.g. `median pruner:
    evaluation 2's accuracy 0.51 below the median 0.78 of 5 complete trials at that
    evaluation`."""
    maximize = study.direction == StudyDirection.MAXIMIZE
    step = trial.last_step
    values = {s: v for s, v in sorted(trial.intermediate_values.items()) if not math.isnan(v)}
    name = f"{cfg.type.replace('_', ' ')} pruner"
    if step is None or not values:
        return f"{name}: {metric} is NaN at every {step_word} so far (diverged)"
    here = f"{step_word} {step}'s {metric} {number_text(trial.intermediate_values[step])}"
    if cfg.type in ("median", "percentile"):
        text = f"{name}: {_below_others(cfg, study, values, step, maximize, here, step_word)}"
    elif cfg.type in ("successive_halving", "hyperband"):
        among = "its bracket's trials" if cfg.type == "hyperband" else "the trials"
        text = (
            f"{name}: {here} not in the best 1/{cfg.reduction_factor} of {among} that "
            f"reached {step_word} {step}"
        )
    else:  # none: only patience prunes
        text = f"patience {cfg.patience}: {here}"
    if cfg.patience is not None:
        text += _no_progress(cfg.patience, values, maximize, metric, step_word)
    return text


def _below_others(
    cfg: PrunerConfig,
    study: optuna.Study,
    values: dict[int, float],
    step: int,
    maximize: bool,
    here: str,
    step_word: str,
) -> str:
    """The median or percentile rule: the trial's best so far against the complete trials'
    values at the same step (as MarginPruner and Optuna's PercentilePruner compute it)."""
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    others = [t.intermediate_values.get(step, math.nan) for t in completed]
    others = [v for v in others if not math.isnan(v)]
    percentile = 50.0 if cfg.type == "median" else cfg.percentile
    best = max(values.values()) if maximize else min(values.values())
    mine = here
    if best != values.get(step):
        mine = f"best so far {number_text(best)} ({here})"
    side = "below" if maximize else "above"
    if not others:
        return f"{mine}, no complete trial reported {step_word} {step}"
    threshold = float(np.percentile(others, 100 - percentile if maximize else percentile))
    mark = "the median" if cfg.type == "median" else f"the top-{percentile:g}% mark"
    margin = f" by more than the margin {number_text(cfg.margin)}" if cfg.margin > 0 else ""
    trials = "1 complete trial" if len(others) == 1 else f"{len(others)} complete trials"
    return f"{mine} {side} {mark} {number_text(threshold)} of {trials} at that {step_word}{margin}"


def _no_progress(
    patience: int, values: dict[int, float], maximize: bool, metric: str, step_word: str
) -> str:
    """Optuna's PatientPruner's condition: the last patience + 1 values no better than the
    best before them."""
    ordered = list(values.values())
    before, last = ordered[: -patience - 1], ordered[-patience - 1 :]
    if not before:
        return ""
    best = max(before) if maximize else min(before)
    if len(last) == 1:
        return f"; and its {metric} no better than {number_text(best)}, its best before it"
    return (
        f"; and its {metric} in its last {len(last)} {step_word}s no better than "
        f"{number_text(best)}, its best before them"
    )
