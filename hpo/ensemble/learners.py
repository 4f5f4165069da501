"""The meta-learners stacking may use, each a scikit-learn estimator and a small grid tuned by
cross-validation. scikit-learn (and XGBoost or LightGBM, when installed) load on first use.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpo.ensemble.errors import EnsembleError, require_stacking
from hpo.ensemble.scoring import check_stackable

CLASSIFIER_LEARNERS = (
    "logistic_regression",
    "linear_svm",
    "random_forest",
    "hist_gradient_boosting",
    "xgboost",
    "lightgbm",
)
REGRESSION_LEARNERS = ("ridge",)
DEFAULT_LEARNER = {"regression": "ridge"}  # other tasks: logistic_regression
ALL = "all"  # as a learner's name: every learner available for the task, chosen by CV
# The extras a learner needs beyond scikit-learn: the module, and what to install.
_OPTIONAL = {"xgboost": "xgboost", "lightgbm": "lightgbm"}


@dataclass(frozen=True)
class Learner:
    """A meta-learner: its name, how to make it unfitted (from a seed), and its grid (keys are
    the estimator's parameters)."""

    name: str
    make: Callable[[int], Any]
    grid: dict[str, list[Any]] = field(default_factory=dict)


def available_learners(task: str) -> list[str]:
    """The learners this host can fit for `task` (XGBoost and LightGBM only when installed)."""
    check_stackable(task)
    names = REGRESSION_LEARNERS if task == "regression" else CLASSIFIER_LEARNERS
    return [n for n in names if n not in _OPTIONAL or importlib.util.find_spec(_OPTIONAL[n])]


def default_learner(task: str) -> str:
    check_stackable(task)
    return DEFAULT_LEARNER.get(task, "logistic_regression")


def resolve_learners(task: str, chosen: Sequence[str | Learner] | None) -> list[Learner]:
    """The learners named (or given); "all": every one available for the task; none named:
    the task's default only (logistic regression, ridge for regression)."""
    require_stacking("stacking")
    available = available_learners(task)
    if chosen is None or (not isinstance(chosen, str) and len(chosen) == 0):
        chosen = [default_learner(task)]
    elif isinstance(chosen, str):
        chosen = [chosen]
    if ALL in chosen:
        chosen = [*available, *(c for c in chosen if isinstance(c, Learner))]
    learners: list[Learner] = []
    for item in chosen:
        if isinstance(item, Learner):
            learners.append(item)
            continue
        if item in _OPTIONAL and item not in available:
            raise EnsembleError(
                f"meta-learner {item!r} needs the {_OPTIONAL[item]} package; "
                f"pip install {_OPTIONAL[item]}, or choose one of {', '.join(available)}"
            )
        if item not in available:
            raise EnsembleError(
                f"meta-learner {item!r} cannot stack a {task} ensemble; "
                f"choose one of {', '.join(available)}, or {ALL}"
            )
        if item not in (lr.name for lr in learners):  # named twice: fitted once
            learners.append(learner(item))
    return learners


def learner(name: str) -> Learner:
    """The built-in learner `name`, with its grid."""
    return Learner(name, _MAKERS[name], _GRIDS.get(name, {}))


def _logistic_regression(seed: int) -> Any:
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=2000, random_state=seed)


def _linear_svm(seed: int) -> Any:
    from sklearn.svm import LinearSVC

    return LinearSVC(random_state=seed, max_iter=5000)


def _random_forest(seed: int) -> Any:
    from sklearn.ensemble import RandomForestClassifier

    return RandomForestClassifier(n_estimators=100, random_state=seed, n_jobs=1)


def _hist_gradient_boosting(seed: int) -> Any:
    from sklearn.ensemble import HistGradientBoostingClassifier

    return HistGradientBoostingClassifier(max_iter=100, random_state=seed)


def _xgboost(seed: int) -> Any:
    from xgboost import XGBClassifier

    return XGBClassifier(n_estimators=100, random_state=seed, n_jobs=1)


def _lightgbm(seed: int) -> Any:
    from lightgbm import LGBMClassifier

    return LGBMClassifier(n_estimators=100, random_state=seed, n_jobs=1, verbose=-1)


def _ridge(seed: int) -> Any:
    from sklearn.linear_model import Ridge

    return Ridge()


_MAKERS: dict[str, Callable[[int], Any]] = {
    "logistic_regression": _logistic_regression,
    "linear_svm": _linear_svm,
    "random_forest": _random_forest,
    "hist_gradient_boosting": _hist_gradient_boosting,
    "xgboost": _xgboost,
    "lightgbm": _lightgbm,
    "ridge": _ridge,
}
# Small grids: the evaluation split is small, and each point costs a cross-validation.
_GRIDS: dict[str, dict[str, list[Any]]] = {
    "logistic_regression": {"C": [0.01, 0.1, 1.0, 10.0]},
    "linear_svm": {"C": [0.01, 0.1, 1.0]},
    "random_forest": {"min_samples_leaf": [1, 5]},
    "hist_gradient_boosting": {"learning_rate": [0.05, 0.2]},
    "xgboost": {"max_depth": [2, 4]},
    "lightgbm": {"num_leaves": [7, 31]},
    "ridge": {"alpha": [0.01, 0.1, 1.0, 10.0, 100.0]},
}
