"""Stacking: a meta-learner fitted on the members' outputs (or embeddings, scaled and reduced by
PCA), tuned by cross-validation on the rows it is given; multi-label fits one per label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from hpo.ensemble.errors import EnsembleError
from hpo.ensemble.learners import Learner
from hpo.ensemble.scoring import check_stackable
from hpo.ensemble.skops_files import meta_learner_bytes, meta_learner_from_bytes

FeatureKind = Literal["predictions", "embedding"]
TUNING_FOLDS = 5
# The scikit-learn scorer that tunes a learner for each ensemble metric.
_SCORERS = {
    "accuracy": "accuracy",
    "macro_f1": "f1_macro",
    "micro_f1": "f1_micro",
    "rmse": "neg_root_mean_squared_error",
    "mse": "neg_mean_squared_error",
    "mae": "neg_mean_absolute_error",
    "r2": "r2",
}


@dataclass(frozen=True)
class FeatureSettings:
    """What the meta-learner reads: the members' predictions, or their mean-pooled embeddings;
    scaled (StandardScaler) and reduced to `pca_components` (PCA) when asked."""

    kind: FeatureKind = "predictions"
    scale: bool = False
    pca_components: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("predictions", "embedding"):
            raise EnsembleError(f"features {self.kind!r}: use predictions or embedding")
        if self.pca_components is not None and self.pca_components < 1:
            raise EnsembleError(f"pca {self.pca_components}: keep at least 1 component")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


PREDICTIONS = FeatureSettings()  # the default: members' outputs, unscaled


@dataclass
class StackedModel:
    """A fitted meta-learner (one per label for multi-label) over the named members."""

    task: str
    learner: str
    members: list[str]
    settings: FeatureSettings
    estimators: list[Any]
    num_outputs: int  # classes, labels, or 1 for regression
    params: list[dict[str, Any]] = field(default_factory=list)
    # The estimators as a skops file: made when first saved, or read from the ensemble cache
    # (the estimators, then empty, load from it only when the model predicts).
    skops_bytes: bytes | None = field(default=None, repr=False)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Probabilities [rows, classes or labels], or values [rows] for regression."""
        estimators = self.fitted_estimators()
        if self.task == "regression":
            return np.asarray(estimators[0].predict(features), dtype=np.float64)
        if self.task == "multi_label_classification":
            columns = [_class_outputs(e, features, 2)[:, 1] for e in estimators]
            return np.stack(columns, axis=1)
        return _class_outputs(estimators[0], features, self.num_outputs)

    def fitted_estimators(self) -> list[Any]:
        if not self.estimators and self.skops_bytes is not None:
            loaded = meta_learner_from_bytes(self.skops_bytes, f"meta-learner {self.learner}")
            self.estimators = list(loaded["estimators"])
        if not self.estimators:
            raise EnsembleError(self._not_kept())
        return self.estimators

    def skops_file(self) -> bytes:
        """The fitted estimators and their params as a skops file (never a pickle)."""
        if self.skops_bytes is None:
            if not self.estimators:
                raise EnsembleError(self._not_kept())
            self.skops_bytes = meta_learner_bytes(self.learner, self.estimators, self.params)
        return self.skops_bytes

    def _not_kept(self) -> str:
        return (
            f"meta-learner {self.learner} was read from the ensemble cache without its fit "
            "(stacking was not the choice); fit it again with evaluate_ensemble"
        )


def stack_features(predictions: Mapping[str, np.ndarray], members: Sequence[str]) -> np.ndarray:
    """The members' outputs side by side, one block of columns per member in `members` order."""
    columns = []
    for name in members:
        if name not in predictions:
            raise EnsembleError(f"member {name!r} has no predictions; predict with every member")
        block = np.asarray(predictions[name], dtype=np.float64)
        columns.append(block.reshape(len(block), -1))
    return np.concatenate(columns, axis=1)


def fit_stacked(
    task: str,
    learner: Learner,
    features: np.ndarray,
    labels: np.ndarray,
    metric: str,
    members: Sequence[str],
    settings: FeatureSettings = PREDICTIONS,
    num_outputs: int | None = None,
    seed: int = 0,
) -> StackedModel:
    """Fit `learner` on all of `features`, its grid point chosen by cross-validation on them."""
    check_stackable(task)
    labels = np.asarray(labels)
    if task == "multi_label_classification":
        targets = [labels[:, j].astype(int) for j in range(labels.shape[1])]
        outputs = labels.shape[1]
    elif task == "regression":
        targets, outputs = [labels.astype(np.float64)], 1
    else:
        targets = [labels.astype(int)]
        outputs = num_outputs or int(labels.max()) + 1
    from threadpoolctl import threadpool_limits  # installed with scikit-learn

    fitted, params = [], []
    # One thread per fit: a meta-learner's data is small, and OpenMP's threads (histogram
    # boosting's) cost more to start than they save; 10x slower on a busy 2-core host.
    with threadpool_limits(limits=1):
        for target in targets:
            estimator, chosen = _tuned(task, learner, features, target, metric, settings, seed)
            fitted.append(estimator)
            params.append(chosen)
    return StackedModel(task, learner.name, list(members), settings, fitted, outputs, params)


def _tuned(
    task: str,
    learner: Learner,
    features: np.ndarray,
    target: np.ndarray,
    metric: str,
    settings: FeatureSettings,
    seed: int,
) -> tuple[Any, dict[str, Any]]:
    """The pipeline fitted on all rows at the grid point cross-validation liked best."""
    from sklearn.dummy import DummyClassifier
    from sklearn.model_selection import GridSearchCV

    is_classifier = task != "regression"
    if is_classifier and len(np.unique(target)) < 2:
        # One class in every row (a label never seen): nothing to learn, its rate is the answer.
        return DummyClassifier(strategy="prior").fit(features, target), {}
    splits = tuning_folds(task, target, seed)
    inner_rows = min((len(fit) for fit, _ in splits), default=len(target))
    pipeline = _pipeline(learner, settings, features.shape[1], inner_rows, seed)
    grid = {f"learner__{key}": values for key, values in learner.grid.items()}
    if not splits or not grid or all(len(v) == 1 for v in grid.values()):
        return pipeline.fit(features, target), {}
    search = GridSearchCV(
        pipeline, grid, scoring=_scorer(task, metric), cv=splits, error_score=np.nan
    )
    search.fit(features, target)
    chosen = {k.removeprefix("learner__"): v for k, v in search.best_params_.items()}
    return search.best_estimator_, chosen


def _pipeline(
    learner: Learner, settings: FeatureSettings, columns: int, rows: int, seed: int
) -> Any:
    from sklearn.decomposition import PCA
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    steps: list[tuple[str, Any]] = []
    if settings.scale:
        steps.append(("scale", StandardScaler()))
    if settings.pca_components is not None:
        # PCA keeps at most as many components as the rows and columns it is fitted on.
        components = max(1, min(settings.pca_components, columns, rows - 1))
        steps.append(("pca", PCA(n_components=components, random_state=seed)))
    steps.append(("learner", learner.make(seed)))
    return Pipeline(steps)


def _scorer(task: str, metric: str) -> Any:
    if task != "multi_label_classification":
        return _SCORERS[metric]
    from sklearn.metrics import f1_score, make_scorer

    # A label's fold with no positive row, none predicted, is right: F1 1, not 0 and a warning.
    return make_scorer(f1_score, zero_division=1.0)


def tuning_folds(task: str, target: np.ndarray, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The folds a learner's grid is tuned on. For classes, every training fold holds two
    classes at least: stratified whenever each class has 2 rows (a class of fewer rows than
    folds then falls one row per fold), and a fold whose other rows hold one class only (its
    class of a single row held out, often a multi-label label's only positive) left out: no
    learner fits on one class, and any would predict that class there, the same for every grid
    point. Empty when no fold is left: the learner is fitted untuned."""
    import warnings

    from sklearn.model_selection import KFold, StratifiedKFold

    folds = max(2, min(TUNING_FOLDS, len(target) // 2))
    if len(target) < folds:
        return []
    if task == "regression":
        return list(KFold(n_splits=folds, shuffle=True, random_state=seed).split(target))
    _, counts = np.unique(target, return_counts=True)
    splitter: Any = KFold(n_splits=folds, shuffle=True, random_state=seed)
    if counts.min() >= 2 and counts.max() >= folds:  # (else StratifiedKFold refuses)
        splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    with warnings.catch_warnings():  # "the least populated class has only N members": known
        warnings.filterwarnings("ignore", category=UserWarning, module="sklearn")
        splits = list(splitter.split(np.zeros(len(target)), target))
    return [(fit, held) for fit, held in splits if len(np.unique(target[fit])) >= 2]


def fold_splitter(task: str, target: np.ndarray, folds: int, seed: int) -> Any:
    """K folds, stratified by class where every class has K rows (else plain K-fold)."""
    from sklearn.model_selection import KFold, StratifiedKFold

    folds = max(2, min(folds, len(target) // 2))
    if task != "regression":
        _, counts = np.unique(target, return_counts=True)
        if counts.min() >= folds:
            return StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    return KFold(n_splits=folds, shuffle=True, random_state=seed)


def _class_outputs(estimator: Any, features: np.ndarray, num_classes: int) -> np.ndarray:
    """[rows, num_classes] probabilities; a learner that gives only margins (a linear SVM) is
    softmaxed; classes a learner never saw get 0."""
    if hasattr(estimator, "predict_proba"):
        raw = np.asarray(estimator.predict_proba(features), dtype=np.float64)
    else:
        margins = np.asarray(estimator.decision_function(features), dtype=np.float64)
        if margins.ndim == 1:  # binary: one margin, for the second class
            margins = np.stack([-margins / 2, margins / 2], axis=1)
        margins -= margins.max(axis=1, keepdims=True)
        raw = np.exp(margins) / np.exp(margins).sum(axis=1, keepdims=True)
    outputs = np.zeros((len(features), num_classes))
    classes = np.asarray(estimator.classes_).astype(int)
    outputs[:, classes] = raw
    return outputs
