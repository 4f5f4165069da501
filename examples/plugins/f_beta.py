"""A metrics plug-in (`metrics: f_beta:f2`): the evaluation's logits and labels in (numpy,
a row per example), named numbers out, added to the task's metrics at every evaluation."""

import numpy as np


def f2(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """F-beta with beta 2 for label id 1 (the second label name in sorted order: `positive` in
    data/demo): recall weighs four times as much as precision."""
    predicted = logits.argmax(axis=1)
    hits = float(np.sum((predicted == 1) & (labels == 1)))
    precision = hits / max(1, int(np.sum(predicted == 1)))
    recall = hits / max(1, int(np.sum(labels == 1)))
    if precision + recall == 0:
        return {"f2": 0.0, "recall": recall}
    return {"f2": 5 * precision * recall / (4 * precision + recall), "recall": recall}
