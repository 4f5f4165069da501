"""Regression: one number per text or text pair (a review's score, a similarity); one output,
mean squared error; mse, rmse, mae, Pearson and Spearman correlation, R² against the targets.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hpo.trainer.data import TokenizedSplit
from hpo.trainer.errors import DataError
from hpo.trainer.metrics import mean_ranks
from hpo.trainer.tasks.base import Task, encode_texts, missing_target, set_output_bias


class Regression(Task):
    name = "regression"

    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]:
        return []  # one unnamed output

    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit:
        column = self.data.label_column
        targets = target_numbers(table[column], source, column)
        split = encode_texts(self.data, table, source, tokenizer)
        split.labels = targets
        return split

    def check_split(self, split: TokenizedSplit, source: str) -> None:
        targets = split.labels
        if targets is not None and len(targets) and np.all(targets == targets[0]):
            column = self.data.label_column
            raise DataError(
                f"{source}: every row of column {column!r} has the target {targets[0]:g}; a "
                "regression learns and is scored on targets that vary (correlations and R² of "
                "a constant are undefined): add other examples or set data.label_column"
            )

    @classmethod
    def head_options(cls, label_names: list[str]) -> dict[str, Any]:
        # No id2label: transformers derives num_labels from it, and {} would make it 0.
        return {"num_labels": 1, "problem_type": "regression"}

    def prepare_model(self, model: torch.nn.Module, train: TokenizedSplit) -> None:
        # The output starts at the training mean: otherwise a head that starts near 0 must
        # first reach, say, 3 on a 1 to 5 scale, and on the way the encoder's saturated
        # activations learn to emit a constant (measured: stuck at the mean for many epochs).
        if train.labels is not None and len(train.labels):
            set_output_bias(model, np.array([np.mean(train.labels, dtype=np.float64)]))

    def loss_sum(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        class_weights: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        return F.mse_loss(logits.reshape(-1).float(), labels.float(), reduction="sum")

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"predictions": logits.reshape(-1).float()}

    def metrics(
        self, outputs: dict[str, list[np.ndarray]], eval_loss: float, label_names: list[str]
    ) -> dict[str, float]:
        predicted = np.concatenate(outputs["predictions"]).astype(np.float64)
        truth = np.concatenate(outputs["labels"]).astype(np.float64)
        return {**regression_metrics(predicted, truth), "eval_loss": eval_loss}

    def chance_levels(self, split: TokenizedSplit, label_names: list[str]) -> dict[str, float]:
        """The best constant answer on `split` itself: its mean (mse, rmse, r2, eval_loss) and
        its median (mae). No constant, the training mean included, does better on it; a
        constant has no correlation with the targets (pearson, spearman: 0)."""
        if split.labels is None or len(split.labels) == 0:
            return {}
        truth = np.asarray(split.labels, dtype=np.float64)
        mse = float(np.mean((truth - truth.mean()) ** 2))
        return {
            "mse": mse,
            "rmse": math.sqrt(mse),
            "mae": float(np.mean(np.abs(truth - np.median(truth)))),
            "pearson": 0.0,
            "spearman": 0.0,
            "r2": 0.0,
            "eval_loss": mse,
        }

    def worst_case_labels(self, size: int, length: int, num_labels: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.float32)


def target_numbers(values: list[Any], source: str, column: str) -> np.ndarray:
    """Every row's target as float32; DataError naming the first row that holds no finite
    number (a gap, NaN, infinity, text, true/false)."""
    return np.array(
        [target_number(value, row, source, column) for row, value in enumerate(values, start=1)],
        dtype=np.float32,
    )


def target_number(value: Any, row: int, source: str, column: str) -> float:
    where = f"{source}: row {row} of column {column!r}"
    if missing_target(value):
        raise DataError(f"{where} has no target; fill in a number or drop the row")
    number = _as_number(value)
    if number is None:
        raise DataError(
            f"{where} is {value!r}, not a number; a regression target is one number per row "
            "(such as 3 or 4.5): fix the row or drop it"
        )
    if not math.isfinite(number):
        raise DataError(f"{where} is {value!r}, not a finite number; fix the row or drop it")
    if abs(number) > float(np.finfo(np.float32).max):
        raise DataError(
            f"{where} is {value!r}, beyond what float32 holds (about 3.4e38); rescale the targets"
        )
    return number


def _as_number(value: Any) -> float | None:
    """A real number from a number or its text (CSV cells are text); None for anything else."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return float(value)
        except OverflowError:  # an integer past float's range
            return math.inf
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
        except OverflowError:
            return math.inf
    return None


def regression_metrics(predicted: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """mse, rmse, mae, pearson, spearman and r2 of `predicted` against `truth` (float64). A
    correlation or R² that a constant makes undefined (no variance) is NaN."""
    if len(truth) == 0:
        return dict.fromkeys(("mse", "rmse", "mae", "pearson", "spearman", "r2"), math.nan)
    errors = predicted - truth
    mse = float(np.mean(errors**2))
    variance = float(np.mean((truth - truth.mean()) ** 2))
    return {
        "mse": mse,
        "rmse": math.sqrt(mse),
        "mae": float(np.mean(np.abs(errors))),
        "pearson": correlation(predicted, truth),
        "spearman": correlation(mean_ranks(predicted), mean_ranks(truth)),
        "r2": 1.0 - mse / variance if variance > 0 else math.nan,
    }


def correlation(first: np.ndarray, second: np.ndarray) -> float:
    """Pearson's r; NaN when either side does not vary."""
    a, b = first - first.mean(), second - second.mean()
    scale = math.sqrt(float(np.dot(a, a)) * float(np.dot(b, b)))
    return float(np.dot(a, b)) / scale if scale > 0 else math.nan


TASK = Regression
