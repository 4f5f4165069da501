"""Pruning that does not act on noise: Optuna's median/percentile rule with a margin."""

from __future__ import annotations

import math

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState


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
        completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        step = trial.last_step
        if not completed or len(completed) < self.n_startup_trials:
            return False
        if step is None or step < self.n_warmup_steps:
            return False
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
