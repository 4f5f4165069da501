"""Evaluations of a training run: when they happen, what one records, and the metrics over the
evaluation split, with the batch halved and the pass restarted after an out-of-memory error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class BatchOutputs:
    """What one evaluation batch leaves for the metrics: its loss summed over its counted units
    (on the device until the end), the units, and the task's outputs (on the host)."""

    loss_sum: torch.Tensor
    units: torch.Tensor | int
    outputs: dict[str, Any]

    def to_host(self) -> BatchOutputs:
        outputs = {name: _on_host(value) for name, value in self.outputs.items()}
        units = self.units.cpu() if isinstance(self.units, torch.Tensor) else self.units
        return BatchOutputs(self.loss_sum.cpu(), units, outputs)


def _on_host(value: Any) -> np.ndarray:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def batch_outputs(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    task: Task,
    non_blocking: bool = False,
    keep_logits: bool = False,
) -> list[BatchOutputs]:
    """Each batch's outputs, in the order the batches come (each carries its own labels).
    Nothing is read back to the host here: one host sync per evaluation, at the metrics."""
    found = []
    with torch.inference_mode():
        for batch in batches:
            host_labels = batch["labels"]
            inputs = to_device(batch, device, non_blocking)
            target = inputs.pop("labels")
            with dev.autocast(device, precision):
                logits, target = task.logits(model, inputs, target)
            outputs: dict[str, Any] = dict(task.eval_outputs(logits, target))
            if keep_logits:
                outputs[USER_LOGITS] = logits.float().reshape(len(target), -1)
            outputs["labels"] = host_labels
            found.append(BatchOutputs(task.loss_sum(logits, target), task.units(target), outputs))
    return found


def metrics_of(
    found: list[BatchOutputs],
    device: torch.device,
    task: Task,
    label_names: list[str],
    user_metrics: UserMetrics | None = None,
) -> dict[str, float]:
    """The task's metrics and mean loss over batches' outputs, summed in their order (the same
    order gives the same float sums, bit for bit, on whichever ranks the batches ran)."""
    loss_sum = torch.zeros((), device=device)
    units: torch.Tensor | int = 0
    kept: dict[str, list[Any]] = {"labels": []}
    for batch in found:
        loss_sum += batch.loss_sum.to(device)
        units = units + batch.units
        for name, value in batch.outputs.items():
            kept.setdefault(name, []).append(value)
    outputs = {name: [_on_host(v) for v in values] for name, values in kept.items()}
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
    """The task's metrics and mean loss of `model` over `batches`, in whatever order they come.
    `user_metrics` adds the user's (the logits kept too)."""
    keep = user_metrics is not None
    found = batch_outputs(model, batches, device, precision, task, non_blocking, keep)
    return metrics_of(found, device, task, label_names, user_metrics)


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
        share: tuple[int, int] = (0, 1),
    ) -> None:
        """`share`: (rank, ranks): this rank evaluates batches rank, rank + ranks, ... of the
        whole split's (trainer.distributed gathers them); (0, 1): all of them."""
        self.split, self.task, self.label_names = split, task, label_names
        self.user_metrics, self.share = user_metrics, share
        self.loaders, self.device, self.precision = loaders, device, precision
        self.oom_recoveries = 0
        self.use_batch_size(batch_size)

    def use_batch_size(self, batch_size: int) -> None:
        """A new loader (and worker processes) for batches of `batch_size`, in length order."""
        self.batch_size = batch_size
        batches = eval_batches(self.split.lengths, batch_size)
        self.batch_count = len(batches)  # of the whole split
        rank, ranks = self.share
        self.loader = self.loaders.build(self.split, batches[rank::ranks])

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        while True:
            metrics = none_on_oom(lambda: self.once(model))
            if metrics is not None:
                return metrics
            self.halve_after_oom()

    def halve_after_oom(self) -> None:
        """Free the failed pass's memory and halve the batch for the next pass."""
        release_memory(self.device)
        if self.batch_size == 1:
            raise OutOfMemoryAtBatchOne("out of memory in evaluation at batch 1")
        self.use_batch_size(self.batch_size // 2)
        self.oom_recoveries += 1
        log.warning("out of memory in evaluation: batch now %d", self.batch_size)

    def share_outputs(self, model: torch.nn.Module) -> list[BatchOutputs]:
        """This share's batch outputs, on the host (to be gathered)."""
        model.eval()
        try:
            keep = self.user_metrics is not None
            pin = self.loaders.pin_memory
            found = batch_outputs(
                model, self.loader, self.device, self.precision, self.task, pin, keep
            )
            return [batch.to_host() for batch in found]
        finally:
            model.train()

    def once(self, model: torch.nn.Module) -> dict[str, float]:
        """One pass at the current batch; an OOM is raised (a sharded run's is not redone in
        place: see fsdp.ShardedEvaluationOutOfMemory)."""
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
