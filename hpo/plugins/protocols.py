"""The typed seams between hpo and the user's code: what training code may ask of a trial
(TrialLike), and the shapes of the plug-ins a config names (a metrics function, a
define-by-run search space). Light on purpose: no torch, numpy or Optuna at import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import optuna


class TrialLike(Protocol):
    """What training code needs of a trial; an optuna.Trial, or ChildTrial inside the child."""

    @property
    def number(self) -> int: ...

    def set_user_attr(self, key: str, value: Any) -> None: ...

    def report(self, value: float, step: int) -> None: ...

    def should_prune(self) -> bool: ...


# `metrics: module:name`: the evaluation's logits and labels in (numpy, a row per example),
# named numbers out, added to the task's metrics at every evaluation.
MetricsFunction = Callable[["np.ndarray", "np.ndarray"], Mapping[str, float]]

# `search_space: module:name`: Optuna's trial in, the trial's parameters out (by the names a
# YAML search space takes).
SearchSpaceFunction = Callable[["optuna.Trial"], Mapping[str, Any]]
