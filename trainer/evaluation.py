"""Evaluations of a training run: when they happen, what one records, and the metrics over the
evaluation split, with the batch halved and the pass restarted after an out-of-memory error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer import device as dev
from trainer.data import TokenizedSplit, eval_batches
from trainer.loaders import LoaderSettings, to_device
from trainer.memory import OutOfMemoryAtBatchOne, none_on_oom, release_memory
from trainer.metrics import accuracy, macro_f1

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
    and the k-th of `evals_per_epoch` evenly spaced points of every epoch, which comes after
    ceil(k * steps_per_epoch / evals_per_epoch) of the epoch's steps.

    Decided by arithmetic, never from a list of steps: 10**9 epochs must cost no memory."""
    if step == total_steps:
        return True
    if not 0 < step < total_steps:
        return False
    within = step % steps_per_epoch
    if within == 0:  # k = evals_per_epoch: the end of an epoch
        return True
    # Some k has ceil(k * s / p) == within exactly when (within - 1) * p < k * s <= within * p;
    # the largest k with k * s <= within * p is the only candidate.
    k = within * evals_per_epoch // steps_per_epoch
    return k * steps_per_epoch > (within - 1) * evals_per_epoch


def evaluate_batches(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    num_labels: int,
    non_blocking: bool = False,
) -> dict[str, float]:
    """Accuracy, macro-F1 and mean loss of `model` over `batches`, in whatever order they come:
    each batch carries its own labels."""
    predictions: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    loss_sum = torch.zeros((), device=device)
    with torch.inference_mode():
        for batch in batches:
            host_labels = batch["labels"]
            inputs = to_device(batch, device, non_blocking)
            target = inputs.pop("labels")
            with dev.autocast(device, precision):
                logits = model(**inputs).logits.float()
            loss_sum += F.cross_entropy(logits, target, reduction="sum")
            predictions.append(logits.argmax(dim=-1))
            labels.append(host_labels)
    predicted = torch.cat(predictions).cpu().numpy()  # one host sync per evaluation
    truth = torch.cat(labels).numpy()
    return {
        "accuracy": accuracy(predicted, truth),
        "macro_f1": macro_f1(predicted, truth, num_labels),
        "eval_loss": float(loss_sum.item()) / len(truth),
    }


class Evaluator:
    """Metrics on the evaluation split; an OOM halves the evaluation batch and starts over."""

    def __init__(
        self,
        split: TokenizedSplit,
        num_labels: int,
        batch_size: int,
        loaders: LoaderSettings,
        device: torch.device,
        precision: str,
    ) -> None:
        self.split, self.num_labels = split, num_labels
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
                self.num_labels,
                non_blocking=self.loaders.pin_memory,
            )
        finally:
            model.train()
