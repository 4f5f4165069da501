"""The user's metrics function (`metrics: package.module:name` in hpo's config): called at every
evaluation with the model's logits and the labels, its named values added to the task's own.

What it receives, as numpy arrays aligned row by row (one row per evaluation example, in the
evaluation's batch order, not the file's):
- `logits`: float32, the model's raw outputs, shape [examples, outputs] (the classes'
  logits; regression: one column; multi-label: one per label, before the sigmoid);
- `labels`: what the task encodes as the target: class ids (int), numbers (float) or multi-hot
  rows (float 0/1).
Tasks with a target per token (token classification, causal LM) are not supported.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpo.trainer.metrics import Direction

# The tasks whose evaluation has one target per example.
EXAMPLE_TASKS = ("sequence_classification", "regression", "multi_label_classification")


class MetricsFunctionError(Exception):
    """The user's metrics function raised (its error is the cause) or returned what is not a
    dict of named numbers."""


@dataclass(frozen=True)
class UserMetrics:
    function: Callable[[np.ndarray, np.ndarray], Any]
    spec: str  # `package.module:name`, for messages
    directions: dict[str, Direction] = field(default_factory=dict)  # the study's names of it

    def __call__(
        self, logits: np.ndarray, labels: np.ndarray, known: dict[str, float]
    ) -> dict[str, float]:
        """The function's values, checked: a dict of text names to real numbers, none of them
        a name the task already has (`known`)."""
        try:
            returned = self.function(logits, labels)
        except Exception as e:
            raise MetricsFunctionError(f"{self.spec} raised {type(e).__name__}: {e}") from e
        return checked(returned, self.spec, known)


def checked(returned: Any, spec: str, known: dict[str, float]) -> dict[str, float]:
    if not isinstance(returned, dict):
        raise MetricsFunctionError(
            f"{spec} returned {type(returned).__name__}; expected a dict "
            "of metric name to number, e.g. {'f2': 0.75}"
        )
    values: dict[str, float] = {}
    for name, value in returned.items():
        if not isinstance(name, str) or not name:
            raise MetricsFunctionError(f"{spec} returned the key {name!r}; a metric's name is text")
        if name in known:
            taken = ", ".join(known)
            raise MetricsFunctionError(
                f"{spec} returned {name!r}, a metric the task has "
                f"already ({taken}); name yours otherwise"
            )
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise MetricsFunctionError(
                f"{spec} returned {name!r}: {type(value).__name__} {value!r}; expected a number"
            )
        values[name] = float(value)
    return values
