"""Sequence classification: one class per text or text pair; cross-entropy (with class weights
and label smoothing); accuracy, macro- and micro-F1, ROC AUC for two classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hpo.trainer.data import TokenizedSplit
from hpo.trainer.labels import encode_labels, label_vocabulary
from hpo.trainer.metrics import accuracy, binary_roc_auc, macro_f1, micro_f1
from hpo.trainer.tasks.base import Task, encode_texts


class SequenceClassification(Task):
    name = "sequence_classification"

    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]:
        return label_vocabulary(table[self.data.label_column], source, self.data.label_column)

    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit:
        labels = encode_labels(table[self.data.label_column], label_names, source)
        split = encode_texts(self.data, table, source, tokenizer)
        split.labels = labels
        return split

    def loss_sum(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        class_weights: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        return F.cross_entropy(
            logits.float(),
            labels,
            weight=class_weights,
            label_smoothing=label_smoothing,
            reduction="none",  # weighted, summed per example: not normalised by the weights
        ).sum()

    def class_weights(self, split: TokenizedSplit, label_names: list[str]) -> np.ndarray | None:
        weights = self.training.class_weights
        if weights is None:
            return None
        if weights == "balanced":
            assert split.labels is not None
            counts = np.bincount(split.labels, minlength=len(label_names))
            return len(split) / (len(label_names) * np.maximum(counts, 1))
        for key, _, rule in self.training.data_problems(label_names):
            raise ValueError(f"training.{key} {rule}")  # hpo run checks this up front
        return np.asarray(weights)

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        outputs = {"predictions": logits.argmax(dim=-1)}
        if logits.shape[-1] == 2:
            outputs["scores"] = logits.float().softmax(dim=-1)[:, 1]
        return outputs

    def metrics(
        self, outputs: dict[str, list[np.ndarray]], eval_loss: float, label_names: list[str]
    ) -> dict[str, float]:
        predicted = np.concatenate(outputs["predictions"])
        truth = np.concatenate(outputs["labels"])
        found = {
            "accuracy": accuracy(predicted, truth),
            "macro_f1": macro_f1(predicted, truth, len(label_names)),
            "micro_f1": micro_f1(predicted, truth),
            "eval_loss": eval_loss,
        }
        if "scores" in outputs:
            found["roc_auc"] = binary_roc_auc(np.concatenate(outputs["scores"]), truth)
        return found

    def chance_levels(self, split: TokenizedSplit, label_names: list[str]) -> dict[str, float]:
        labels = split.labels
        if labels is None or len(labels) == 0:
            return {}
        counts = np.bincount(labels, minlength=len(label_names))
        constant = np.full_like(labels, int(np.argmax(counts)))
        shares = counts[counts > 0] / len(labels)
        levels = {
            "accuracy": accuracy(constant, labels),
            "macro_f1": macro_f1(constant, labels, len(label_names)),
            "micro_f1": micro_f1(constant, labels),
            # the mean loss of answering the labels' frequencies: their entropy, in nats
            "eval_loss": float(-np.sum(shares * np.log(shares))),
        }
        if len(label_names) == 2:
            levels["roc_auc"] = 0.5
        return levels

    def worst_case_labels(self, size: int, length: int, num_labels: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long)


TASK = SequenceClassification
