"""Evaluations of a training run: when they happen, what one records, and the metrics over the
evaluation split, with the batch halved and the pass restarted after an out-of-memory error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from hpo.trainer import device as dev
from hpo.trainer.batching import eval_batches
from hpo.trainer.data import TokenizedSplit
from hpo.trainer.loaders import LoaderSettings, to_device
from hpo.trainer.memory import OutOfMemoryAtBatchOne, none_on_oom, release_memory
from hpo.trainer.tasks.base import Task
from hpo.trainer.user_metrics import UserMetrics

log = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """One evaluation: its 1-based index (the same data seen in every trial) and its metrics."""

    index: int
    epoch: float
    optimizer_step: int
    metrics: dict[str, float]
    train_loss: float | None


def is_evaluation_step(
    step: int, steps_per_epoch: int, evals_per_epoch: int, total_steps: int
) -> bool:
    """Whether an evaluation follows optimizer step `step` (1-based): the last step of the run,
    and evaluation k of `evals_per_epoch` in every epoch, which follows the step nearest
    k / evals_per_epoch of the epoch's steps (a half rounded up). An epoch's steps are
    shuffled, its one short step among them, so that fraction of its steps is the fraction of
    its examples trained on, to within one batch: trials of every batch size evaluate at the
    same fractions of an epoch, as closely as their steps allow (the pruner compares them at
    the same evaluation number).

    Decided by arithmetic, never from a list of steps: 10**9 epochs must cost no memory."""
    if step == total_steps:
        return True
    if not 0 < step < total_steps:
        return False
    within = step % steps_per_epoch
    if within == 0:  # k = evals_per_epoch: the end of an epoch
        return True
    # Evaluation k follows step round(k * s / p) = floor((2ks + p) / 2p), which is `within`
    # exactly when (2 * within - 1) * p <= 2ks < (2 * within + 1) * p; the smallest k with
    # the left side is the only candidate.
    s, p = steps_per_epoch, evals_per_epoch
    k = -(-(2 * within - 1) * p // (2 * s))  # ceil
    return k <= p and 2 * k * s < (2 * within + 1) * p


def evaluations_per_epoch(steps_per_epoch: int, evals_per_epoch: int) -> int:
    """How many evaluations a whole epoch has: evals_per_epoch, or one per step when it has
    fewer steps than that (several evenly spaced points fall on one step)."""
    return min(steps_per_epoch, evals_per_epoch)


def evaluate_batches(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    task: Task,
    label_names: list[str],
    non_blocking: bool = False,
    user_metrics: UserMetrics | None = None,
) -> dict[str, float]:
    """The task's metrics and mean loss of `model` over `batches`, in whatever order they come:
    each batch carries its own labels. What the metrics need stays on the device until the
    end: one host sync per evaluation. `user_metrics` adds the user's (the logits kept too)."""
    kept: dict[str, list[torch.Tensor]] = {"labels": []}
    loss_sum = torch.zeros((), device=device)
    units: torch.Tensor | int = 0
    with torch.inference_mode():
        for batch in batches:
            host_labels = batch["labels"]
            inputs = to_device(batch, device, non_blocking)
            target = inputs.pop("labels")
            with dev.autocast(device, precision):
                logits, target = task.logits(model, inputs, target)
            loss_sum += task.loss_sum(logits, target)
            units = units + task.units(target)
            for name, value in task.eval_outputs(logits, target).items():
                kept.setdefault(name, []).append(value)
            if user_metrics is not None:
                kept.setdefault(USER_LOGITS, []).append(logits.float().reshape(len(target), -1))
            kept["labels"].append(host_labels)
    outputs = {name: [t.cpu().numpy() for t in values] for name, values in kept.items()}
    count = int(units.item()) if isinstance(units, torch.Tensor) else units
    eval_loss = float(loss_sum.item()) / count if count else float("nan")
    metrics = task.metrics(outputs, eval_loss, label_names)
    if user_metrics is not None:
        logits_seen = outputs.get(USER_LOGITS, [])
        labels = np.concatenate(outputs["labels"]) if outputs["labels"] else np.zeros(0)
        width = logits_seen[0].shape[1] if logits_seen else 0
        all_logits = np.concatenate(logits_seen) if logits_seen else np.zeros((0, width))
        metrics.update(user_metrics(all_logits, labels, metrics))
    return metrics


USER_LOGITS = "user_metrics_logits"  # kept for the user's metrics function only


class Evaluator:
    """Metrics on the evaluation split; an OOM halves the evaluation batch and starts over."""

    def __init__(
        self,
        split: TokenizedSplit,
        task: Task,
        label_names: list[str],
        batch_size: int,
        loaders: LoaderSettings,
        device: torch.device,
        precision: str,
        user_metrics: UserMetrics | None = None,
    ) -> None:
        self.split, self.task, self.label_names = split, task, label_names
        self.user_metrics = user_metrics
        self.loaders, self.device, self.precision = loaders, device, precision
        self.oom_recoveries = 0
        self.use_batch_size(batch_size)

    def use_batch_size(self, batch_size: int) -> None:
        """A new loader (and worker processes) for batches of `batch_size`, in length order."""
        self.batch_size = batch_size
        self.loader = self.loaders.build(self.split, eval_batches(self.split.lengths, batch_size))

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        while True:
            metrics = none_on_oom(lambda: self._evaluate_once(model))
            if metrics is not None:
                return metrics
            release_memory(self.device)
            if self.batch_size == 1:
                raise OutOfMemoryAtBatchOne("out of memory in evaluation at batch 1")
            self.use_batch_size(self.batch_size // 2)
            self.oom_recoveries += 1
            log.warning("out of memory in evaluation: batch now %d", self.batch_size)

    def _evaluate_once(self, model: torch.nn.Module) -> dict[str, float]:
        model.eval()
        try:
            return evaluate_batches(
                model,
                self.loader,
                self.device,
                self.precision,
                self.task,
                self.label_names,
                non_blocking=self.loaders.pin_memory,
                user_metrics=self.user_metrics,
            )
        finally:
            model.train()
