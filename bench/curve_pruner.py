"""A learning-curve rule for the search-efficiency replay (issue 47): the median rule judged on
the running average of a trial's curve, as Syne Tune's median stopping rule judges, with hpo's
margin, warm-up and startup trials (when to judge: hpo.study.pruners.judged_by, as hpo's rule).
Bench-only: search_efficiency.py's strategies use it.
"""

from __future__ import annotations

import math
import statistics

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial

from hpo.study.pruners import judged_by


def running_mean(values: dict[int, float], step: int) -> float:
    """The average of a curve's values up to and including `step` (NaN ones left out; NaN when
    none is left)."""
    seen = [v for s, v in values.items() if s <= step and not math.isnan(v)]
    return statistics.fmean(seen) if seen else math.nan


class RunningMedianPruner(optuna.pruners.BasePruner):
    """Prunes a trial whose running average up to its last evaluation is worse, by more than
    `margin`, than the median of the complete trials' running averages up to that evaluation;
    judged once `n_startup_trials` trials are complete and from evaluation `n_warmup_steps` on
    (hpo's MarginPruner, with each value replaced by its curve's running average). A trial
    whose every value is NaN (diverged) is pruned."""

    def __init__(self, n_startup_trials: int, n_warmup_steps: int, margin: float) -> None:
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps
        self.margin = margin

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        judged = judged_by(study, trial, self.n_startup_trials, self.n_warmup_steps)
        if judged is None:
            return False
        completed, step = judged
        mine = running_mean(trial.intermediate_values, step)
        if math.isnan(mine):
            return True
        others = [
            running_mean(t.intermediate_values, step)
            for t in completed
            if step in t.intermediate_values
        ]
        others = [v for v in others if not math.isnan(v)]
        if not others:
            return False
        median = statistics.median(others)
        if study.direction == StudyDirection.MAXIMIZE:
            return mine < median - self.margin
        return mine > median + self.margin
