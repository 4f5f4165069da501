"""Classification metrics computed from predictions on the host: accuracy and macro-F1.

`METRIC_DIRECTIONS` says which way each metric improves.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Direction = Literal["maximize", "minimize"]
METRIC_DIRECTIONS: dict[str, Direction] = {
    "accuracy": "maximize",
    "macro_f1": "maximize",
    "eval_loss": "minimize",
}


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    if len(labels) == 0:
        return float("nan")
    return float(np.mean(predictions == labels))


def macro_f1(predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> float:
    """Unweighted mean of per-class F1 over classes present in labels or predictions."""
    scores = []
    for cls in range(num_labels):
        true_pos = np.sum((predictions == cls) & (labels == cls))
        false_pos = np.sum((predictions == cls) & (labels != cls))
        false_neg = np.sum((predictions != cls) & (labels == cls))
        if true_pos + false_pos + false_neg == 0:
            continue  # class absent from both: no evidence either way
        scores.append(2 * true_pos / (2 * true_pos + false_pos + false_neg))
    return float(np.mean(scores)) if scores else float("nan")


def is_better(candidate: float, best: float | None, metric: str) -> bool:
    if best is None:
        return True
    if METRIC_DIRECTIONS[metric] == "maximize":
        return candidate > best
    return candidate < best


def chance_levels(labels: np.ndarray, num_labels: int) -> dict[str, float]:
    """What a model that learned nothing scores on these labels: accuracy and macro-F1 of
    always answering the most common label, and the mean loss of answering the labels'
    frequencies (their entropy, in nats, as the evaluation's cross-entropy)."""
    if len(labels) == 0:
        return {}
    counts = np.bincount(labels, minlength=num_labels)
    constant = np.full_like(labels, int(np.argmax(counts)))
    shares = counts[counts > 0] / len(labels)
    return {
        "accuracy": accuracy(constant, labels),
        "macro_f1": macro_f1(constant, labels, num_labels),
        "eval_loss": float(-np.sum(shares * np.log(shares))),
    }
