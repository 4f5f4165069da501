"""Multi-label classification: any number of classes per text (topics of an article); one
sigmoid per class, binary cross-entropy; micro- and macro-F1 and subset accuracy at
`training.threshold`.

A row's labels are a list (JSONL, Parquet) or one text split on `data.label_separator` (CSV).
An empty list means "none of the labels", on purpose: such rows teach the model to predict
nothing. A missing cell (null, an absent key, an empty CSV cell) is refused, since an empty CSV
cell looks the same as a forgotten label.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hpo.trainer.data import TokenizedSplit
from hpo.trainer.errors import DataError
from hpo.trainer.tasks.base import Task, encode_texts, set_output_bias


class MultiLabelClassification(Task):
    name = "multi_label_classification"

    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]:
        column = self.data.label_column
        names = {name for row in self._label_lists(table, source) for name in row}
        if not names:
            raise DataError(
                f"{source}: no row of column {column!r} has a label; a multi-label classifier "
                "needs rows with labels: fill them in or set data.label_column"
            )
        if all(name.isdecimal() for name in names):  # integer labels rank as numbers: 2 before 10
            return sorted(names, key=int)
        return sorted(names)

    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit:
        index = {name: i for i, name in enumerate(label_names)}
        rows = self._label_lists(table, source)
        multi_hot = np.zeros((len(rows), len(label_names)), dtype=np.float32)
        for row, names in enumerate(rows):
            for name in names:
                if name not in index:
                    raise DataError(
                        f"{source}: row {row + 1} has the label {name!r}, which no training row "
                        f"has (training labels: {label_names[:10]}); fix the label or add "
                        "training examples of it"
                    )
                multi_hot[row, index[name]] = 1.0
        split = encode_texts(self.data, table, source, tokenizer)
        split.labels = multi_hot
        return split

    def _label_lists(self, table: dict[str, list[Any]], source: str) -> list[list[str]]:
        column, separator = self.data.label_column, self.data.label_separator
        return [
            row_labels(value, row, source, column, separator)
            for row, value in enumerate(table[column], start=1)
        ]

    def cache_parts(self) -> dict[str, Any]:
        return {"task": self.name, "label_separator": self.data.label_separator}

    def check_split(self, split: TokenizedSplit, source: str) -> None:
        if split.labels is not None and len(split.labels) and not split.labels.any():
            raise DataError(
                f"{source}: every row has an empty list of labels, so no F1 can be computed "
                "on it; evaluate on rows that have labels"
            )

    @classmethod
    def head_options(cls, label_names: list[str]) -> dict[str, Any]:
        return {**super().head_options(label_names), "problem_type": "multi_label_classification"}

    def prepare_model(self, model: torch.nn.Module, train: TokenizedSplit) -> None:
        # Each output starts at its label's share of the training rows (the log-odds of it), as
        # RetinaNet's prior does: training then spends no steps unlearning a 50% guess for
        # every label, which with rare labels is most of the early loss.
        if train.labels is not None and len(train.labels):
            share = np.clip(np.mean(train.labels, axis=0, dtype=np.float64), 1e-4, 1 - 1e-4)
            set_output_bias(model, np.log(share / (1 - share)))

    def loss_sum(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        class_weights: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        # Summed over the labels of each example and over the examples: the units are examples.
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"predictions": logits.float().sigmoid() >= self.training.threshold}

    def metrics(
        self, outputs: dict[str, list[np.ndarray]], eval_loss: float, label_names: list[str]
    ) -> dict[str, float]:
        predicted = np.concatenate(outputs["predictions"]).astype(bool)
        truth = np.concatenate(outputs["labels"]) > 0.5
        return {**multi_label_metrics(predicted, truth), "eval_loss": eval_loss}

    def chance_levels(self, split: TokenizedSplit, label_names: list[str]) -> dict[str, float]:
        """What answering every row alike scores on `split`: for each metric the best constant
        label set (so at least predicting nothing, and each label's majority); for the loss,
        each label's share of the rows as its probability."""
        if split.labels is None or len(split.labels) == 0:
            return {}
        truth = np.asarray(split.labels) > 0.5
        return {**best_constant_scores(truth), "eval_loss": constant_loss(truth)}

    def worst_case_labels(self, size: int, length: int, num_labels: int) -> torch.Tensor:
        return torch.zeros(size, num_labels, dtype=torch.float32)


def row_labels(value: Any, row: int, source: str, column: str, separator: str) -> list[str]:
    """The label names of one cell: a list, or a text split on `separator`; DataError naming
    the row for a missing cell, an empty CSV cell or a label that is no name."""
    where = f"{source}: row {row} of column {column!r}"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise DataError(
            f"{where} has no labels; give them (a list in JSONL or Parquet, names separated by "
            f"{separator!r} in CSV), [] for a row with none of the labels, or drop the row"
        )
    if isinstance(value, str):
        if not value.strip():
            raise DataError(
                f"{where} is empty; write its labels separated by {separator!r}. An empty CSV "
                "cell looks like a forgotten label: for a row with none of the labels, use "
                "JSONL or Parquet with an empty list []"
            )
        parts: list[Any] = value.split(separator)
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise DataError(
            f"{where} is {value!r}, not a list of labels; write a list (JSONL, Parquet) or names "
            f"separated by {separator!r}"
        )
    return [_label_name(part, where, value) for part in parts]


def _label_name(part: Any, where: str, cell: Any) -> str:
    if isinstance(part, str) and part.strip():
        return part.strip()
    if isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_)):
        return str(int(part))
    if isinstance(part, (float, np.floating)) and float(part).is_integer():
        return str(int(part))
    if isinstance(part, str):
        raise DataError(f"{where} has an empty label in {cell!r}; remove the extra separator")
    raise DataError(f"{where} has the label {part!r} in {cell!r}; a label is a name or an integer")


def multi_label_metrics(predicted: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """micro_f1, macro_f1 and subset_accuracy of boolean [examples, labels] arrays. Macro-F1
    averages the labels that occur in the truth or the predictions (a label absent from both
    has no F1), as scikit-learn does with zero_division=nan."""
    true_pos = (predicted & truth).sum(axis=0)
    decisions = predicted.sum(axis=0) + truth.sum(axis=0)  # 2 TP + FP + FN, per label
    seen = decisions > 0
    subset_accuracy = float(np.mean(np.all(predicted == truth, axis=1)))
    if not seen.any():  # nothing true, nothing predicted: no F1 (check_split refuses such data)
        return {"micro_f1": math.nan, "macro_f1": math.nan, "subset_accuracy": subset_accuracy}
    return {
        "micro_f1": float(2 * true_pos.sum() / decisions.sum()),
        "macro_f1": float(np.mean(2 * true_pos[seen] / decisions[seen])),
        "subset_accuracy": subset_accuracy,
    }


def best_constant_scores(truth: np.ndarray) -> dict[str, float]:
    """The best micro-F1, macro-F1 and subset accuracy that one label set predicted for every
    row reaches on `truth` (each metric its own best set)."""
    rows = len(truth)
    counts = truth.sum(axis=0)
    # Micro-F1 of predicting the k most frequent labels: 2 TP / (k rows + positives), where TP
    # is their count; for a given k no other k labels do better, so the best k is the best set.
    top = np.sort(counts)[::-1]
    micro = max(2 * top[:k].sum() / (k * rows + counts.sum()) for k in range(len(top) + 1))
    # Macro-F1: each label that occurs, always predicted (F1 2p / (1 + p) > 0 = never).
    present = counts[counts > 0] / rows
    sets = Counter(row.tobytes() for row in truth)
    return {
        "micro_f1": float(micro),
        "macro_f1": float(np.mean(2 * present / (1 + present))),
        "subset_accuracy": max(sets.values()) / rows,  # the most common label set
    }


def constant_loss(truth: np.ndarray) -> float:
    """Mean loss (BCE summed over labels, per example, in nats) of answering each label's share
    of the rows as its probability: the sum of the labels' binary entropies."""
    share = truth.mean(axis=0)
    share = share[(share > 0) & (share < 1)]
    return float(-np.sum(share * np.log(share) + (1 - share) * np.log(1 - share)))


TASK = MultiLabelClassification
