"""How an ensemble's outputs are scored: the task's own metric names (trainer.tasks) on
probabilities (classification, multi-label) or values (regression), and which way is better.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hpo.ensemble.errors import EnsembleError
from hpo.trainer.metrics import Direction, accuracy, macro_f1, micro_f1
from hpo.trainer.tasks import TASKS

# The tasks whose members give one output per row, which a meta-learner can stack.
STACKABLE_TASKS = ("sequence_classification", "multi_label_classification", "regression")
# The metrics an ensemble is chosen by, per task (the task's names; its default first).
ENSEMBLE_METRICS: dict[str, tuple[str, ...]] = {
    "sequence_classification": ("accuracy", "macro_f1", "micro_f1"),
    "multi_label_classification": ("micro_f1", "macro_f1", "subset_accuracy"),
    "regression": ("rmse", "r2", "mse", "mae"),
}
# A multi-label member says a label when its probability is at least this.
MULTI_LABEL_THRESHOLD = 0.5


def check_stackable(task: str) -> None:
    """Refuse, in one line, a task whose members cannot be stacked."""
    if task == "causal_lm":
        raise EnsembleError(
            "causal_lm: a language model gives no per-row prediction to stack; "
            "average the members' weights instead (uniform_soup or greedy_soup)"
        )
    if task == "token_classification":
        raise EnsembleError(
            "token_classification: members are combined by averaging their token "
            "probabilities (average_token_probabilities), not by a meta-learner"
        )
    if task not in STACKABLE_TASKS:
        known = ", ".join(STACKABLE_TASKS)
        raise EnsembleError(f"task {task!r} cannot be stacked; stacking knows {known}")


def metric_for(task: str, metric: str | None) -> str:
    """The metric an ensemble of `task` is chosen by: `metric`, or the task's default."""
    check_stackable(task)
    allowed = ENSEMBLE_METRICS[task]
    if metric is None:
        return allowed[0]
    if metric not in allowed:
        raise EnsembleError(
            f"metric {metric!r} cannot score a {task} ensemble; use one of {', '.join(allowed)}"
        )
    return metric


def direction_of(task: str, metric: str) -> Direction:
    return TASKS[task].metrics[metric]


def is_better(candidate: float, best: float, direction: Direction) -> bool:
    """Strictly better; NaN never is."""
    if np.isnan(candidate):
        return False
    if np.isnan(best):
        return True
    return candidate > best if direction == "maximize" else candidate < best


def score(task: str, metric: str, outputs: np.ndarray, labels: np.ndarray) -> float:
    """`metric` of outputs (probabilities [rows, classes] or [rows, labels]; values [rows])."""
    if task == "sequence_classification":
        predicted = np.asarray(outputs).argmax(axis=1)
        truth = np.asarray(labels).astype(int)
        if metric == "macro_f1":
            return macro_f1(predicted, truth, int(outputs.shape[1]))
        return micro_f1(predicted, truth) if metric == "micro_f1" else accuracy(predicted, truth)
    # These task modules load torch: imported when scored, not when an ensemble is read back.
    if task == "multi_label_classification":
        from hpo.trainer.tasks.multi_label import multi_label_metrics

        decided = np.asarray(outputs) >= MULTI_LABEL_THRESHOLD
        return multi_label_metrics(decided, np.asarray(labels).astype(bool))[metric]
    from hpo.trainer.tasks.regression import regression_metrics

    values = np.asarray(outputs, dtype=np.float64).reshape(-1)
    return regression_metrics(values, np.asarray(labels, dtype=np.float64))[metric]


def check_predictions(
    task: str, predictions: Mapping[str, np.ndarray], labels: np.ndarray, split: str
) -> None:
    """Refuse members whose predictions on `split` do not fit the task or each other."""
    if not predictions:
        raise EnsembleError("no members: an ensemble needs at least one member's predictions")
    rows = len(labels)
    shapes = {name: np.shape(p) for name, p in predictions.items()}
    for name, shape in shapes.items():
        if not shape or shape[0] != rows:
            raise EnsembleError(
                f"member {name!r}: {shape[0] if shape else 0} predictions on the {split} split "
                f"for {rows} labelled rows; predict every row of the same file"
            )
    wanted_dims = 1 if task == "regression" else 2
    first_name, first = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if len(shape) != wanted_dims and not (task == "regression" and shape[1:] == (1,)):
            raise EnsembleError(
                f"member {name!r}: predictions of shape {shape} on the {split} split; a {task} "
                f"member gives {'a value' if wanted_dims == 1 else 'a probability per class'} "
                "per row"
            )
        if shape != first:
            raise EnsembleError(
                f"member {name!r}: predictions of shape {shape}, member {first_name!r} {first}; "
                "members must predict the same classes"
            )


def average(predictions: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """The weighted mean of members' outputs (soft voting when every weight is equal)."""
    total = float(sum(weights.values()))
    blended = sum(
        np.asarray(predictions[name], dtype=np.float64) * (w / total)
        for name, w in weights.items()
        if w > 0
    )
    return np.asarray(blended)


def average_token_probabilities(members: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Token classification: per example, the mean of the members' [tokens, tags]
    probabilities (the members must share one tokenizer, so their tokens line up)."""
    if not members:
        raise EnsembleError("no members: an ensemble needs at least one member's predictions")
    examples = len(members[0])
    for index, member in enumerate(members):
        if len(member) != examples:
            raise EnsembleError(
                f"member {index}: {len(member)} examples, member 0 {examples}; "
                "predict the same file with every member"
            )
    averaged = []
    for row in range(examples):
        shapes = {np.shape(member[row]) for member in members}
        if len(shapes) != 1:
            raise EnsembleError(
                f"example {row}: members give token probabilities of shapes {sorted(shapes)}; "
                "members must share one tokenizer and one tag set"
            )
        averaged.append(np.mean([np.asarray(m[row], dtype=np.float64) for m in members], axis=0))
    return averaged
