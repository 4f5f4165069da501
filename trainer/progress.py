"""Progress of one training run: counters, the loss read once per logging interval, the
evaluations so far and why the run stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from hpo.trainer.evaluation import Evaluation

Status = Literal["completed", "stopped", "early_stopped", "diverged", "interrupted"]


@dataclass
class LossMeter:
    """Sums the loss on the device; read only every logging interval (a host sync)."""

    total: torch.Tensor | None = None
    steps: int = 0
    history: list[float] = field(default_factory=list)

    def add(self, loss: torch.Tensor) -> None:
        self.total = loss if self.total is None else self.total + loss
        self.steps += 1

    def read(self) -> float | None:
        if self.total is None:
            return None
        value = float(self.total.item()) / self.steps
        self.total, self.steps = None, 0
        self.history.append(value)
        return value


@dataclass
class Progress:
    """Progress of one fit(): counters, evaluations so far, and why it stopped."""

    segment_start: float  # start of the current stretch of training, between evaluations
    step: int = 0
    samples: int = 0
    tokens: int = 0
    train_s: float = 0.0
    eval_s: float = 0.0  # in evaluations (this attempt's)
    first_step_at: float | None = None  # wall clock (time.time()) after this attempt's 1st step
    meter: LossMeter = field(default_factory=LossMeter)
    evaluations: list[Evaluation] = field(default_factory=list)
    best: Evaluation | None = None
    since_best: int = 0
    status: Status = "completed"
    reason: str | None = None

    def stop(self, status: Status, reason: str) -> None:
        self.status, self.reason = status, reason
