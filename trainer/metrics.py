"""Metrics computed on the host from one evaluation's predictions, shared by the tasks:
accuracy, F1 (macro and micro), ROC AUC, and which way a metric improves.

Each task's own metrics, and their directions, are in `hpo.trainer.tasks`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Direction = Literal["maximize", "minimize"]


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


def micro_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """F1 over every (example, class) decision pooled. With one class per example and one
    prediction each, every miss is one false positive and one false negative: it equals
    accuracy (as scikit-learn's f1_score(average="micro") does)."""
    return accuracy(predictions, labels)


def binary_roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of `scores` for the positive class (label 1): the chance that a
    random positive scores above a random negative, ties counting half (Mann-Whitney U).
    NaN when one class is absent."""
    positive = labels == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = mean_ranks(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def mean_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks of `values` from 1, tied values sharing the mean of their ranks; all NaN if one
    value is NaN. What scipy.stats.rankdata gives, in numpy alone: importing scipy.stats cost
    each trial process a second or two of CPU at its first evaluation."""
    values = np.asarray(values)
    if values.dtype.kind in "fc" and np.isnan(values).any():
        return np.full(len(values), np.nan)
    if len(values) == 0:
        return np.zeros(0)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.concatenate(([True], ordered[1:] != ordered[:-1]))  # where each tie begins
    bounds = np.concatenate((np.flatnonzero(starts), [len(values)]))
    # A tie at sorted places s..e-1 holds ranks s+1..e: their mean is (s + 1 + e) / 2.
    tie_means = (bounds[:-1] + bounds[1:] + 1) / 2
    ranks = np.empty(len(values))
    ranks[order] = tie_means[np.cumsum(starts) - 1]
    return ranks


def is_better(candidate: float, best: float | None, direction: Direction) -> bool:
    if best is None:
        return True
    if direction == "maximize":
        return candidate > best
    return candidate < best
