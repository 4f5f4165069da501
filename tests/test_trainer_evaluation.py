"""Evaluations: when they happen (by arithmetic, for any number of epochs) and metrics that
follow each batch's own labels, whatever order the batches come in."""

from __future__ import annotations

import math
import tracemalloc
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpo.trainer import evaluation
from hpo.trainer.batching import Padding
from hpo.trainer.config import DataConfig, TrainingConfig
from hpo.trainer.data import TokenizedSplit
from hpo.trainer.evaluation import (
    Evaluator,
    evaluations_per_epoch,
    is_evaluation_step,
)
from hpo.trainer.loaders import LoaderSettings
from hpo.trainer.loop import Trainer
from hpo.trainer.model import load_tokenizer
from hpo.trainer.tasks import make_task, prepare_data
from tests.test_trainer import tiny_job

CPU = torch.device("cpu")


def listed_evaluation_steps(
    steps_per_epoch: int, evals_per_epoch: int, epochs: int, total_steps: int
) -> set[int]:
    """The schedule spelled out as a set: in every epoch, evaluation k after the step nearest
    k / evals_per_epoch of its steps (a half rounded up; step 0 is none), and the end."""
    steps = set()
    for epoch in range(epochs):
        for k in range(1, evals_per_epoch + 1):
            nearest = math.floor(Fraction(k * steps_per_epoch, evals_per_epoch) + Fraction(1, 2))
            if nearest > 0:
                steps.add(epoch * steps_per_epoch + nearest)
    return {step for step in steps if step <= total_steps} | {total_steps}


@pytest.mark.parametrize("steps_per_epoch", [1, 2, 3, 5, 7, 10, 19, 32])
@pytest.mark.parametrize("evals_per_epoch", [1, 2, 3, 4, 9, 40])
def test_evaluation_steps_follow_the_schedule(steps_per_epoch: int, evals_per_epoch: int) -> None:
    epochs = 3
    for total in (steps_per_epoch * epochs, steps_per_epoch * epochs - 1, steps_per_epoch + 1):
        if total < 1:
            continue
        found = {
            step
            for step in range(1, total + 1)
            if is_evaluation_step(step, steps_per_epoch, evals_per_epoch, total)
        }
        assert found == listed_evaluation_steps(steps_per_epoch, evals_per_epoch, epochs, total)
        whole_epoch = {step for step in found if step <= steps_per_epoch}
        if total >= 2 * steps_per_epoch:
            assert len(whole_epoch) == evaluations_per_epoch(steps_per_epoch, evals_per_epoch)


@pytest.mark.parametrize("evals_per_epoch", [2, 3, 4, 5])
def test_evaluations_fall_at_the_same_fraction_of_an_epoch_for_every_batch(
    evals_per_epoch: int,
) -> None:
    """Evaluation k follows the step nearest k / evals_per_epoch of the epoch for every batch
    size, within half a step of it, and every epoch with enough steps has evals_per_epoch of
    them. Issue 42: 150 examples, 4 evaluations an epoch: the first came at epoch 0.26 with
    batch 8 and 0.40 with batch 32 (now 0.26 and 0.20, the nearest its 5 steps allow)."""
    rows = 150
    for batch in (1, 4, 8, 16, 32, 37, 50):
        steps = math.ceil(rows / batch)
        if steps < evals_per_epoch:
            continue
        found = [
            s
            for s in range(1, steps + 1)
            if is_evaluation_step(s, steps, evals_per_epoch, 3 * steps)
        ]
        assert len(found) == evals_per_epoch, batch
        for k, step in enumerate(found, start=1):
            assert abs(step / steps - k / evals_per_epoch) <= 1 / (2 * steps) + 1e-12, (batch, k)

    def first_evaluation_epoch(batch: int) -> float:
        steps = math.ceil(rows / batch)
        first = next(s for s in range(1, steps + 1) if is_evaluation_step(s, steps, 4, 3 * steps))
        return first / steps

    assert round(first_evaluation_epoch(8), 2) == 0.26 and first_evaluation_epoch(32) == 0.2


def test_a_billion_epochs_cost_no_memory(easy_data: tuple[Path, Path]) -> None:
    base = tiny_job(*easy_data)
    data = prepare_data(base.data, load_tokenizer(base.model))
    Trainer(base, data)  # imports and one-time set-up, outside the measurement
    # A million epochs first: a structure per evaluation step fails there (at a few hundred MB),
    # before a billion would take tens of GB.
    for epochs in (10**6, 10**9):
        job = tiny_job(*easy_data, epochs=epochs, evals_per_epoch=3)
        tracemalloc.start()
        try:
            trainer = Trainer(job, data)
            last = trainer.total_steps
            steps = (last - 32, last - 21, last - 20, last)  # an epoch of 32: 11, 22, 32 in
            decisions = [trainer.is_evaluation_step(step) for step in steps]
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert last == 32 * epochs and decisions == [True, True, False, True]
        assert peak_bytes < 20 * 2**20, epochs


class FirstTokenIsTheClass(torch.nn.Module):
    """Predicts each example's class from its first token: right on every example."""

    def __init__(self, num_labels: int) -> None:
        super().__init__()
        self.num_labels = num_labels

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=5.0 * F.one_hot(input_ids[:, 0], self.num_labels).float())


def test_metrics_follow_the_labels_of_each_batch_in_any_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=60)
    lengths = rng.integers(1, 20, size=60)
    ids = np.concatenate(
        [[label] + [7] * (n - 1) for label, n in zip(labels, lengths, strict=True)]
    )
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    split = TokenizedSplit(ids.astype(np.int32), offsets, None, labels.astype(np.int64))
    # Batches in a random order, not the length order evaluation uses by default.
    order = rng.permutation(60)
    assert not np.array_equal(order, np.argsort(lengths, kind="stable"))
    monkeypatch.setattr(
        evaluation,
        "eval_batches",
        lambda _, size: [order[i : i + size] for i in range(0, 60, size)],
    )
    settings = LoaderSettings(
        pad_token_id=0, padding=Padding(), num_workers=0, pin_memory=False, seed=0
    )
    task = make_task("sequence_classification", DataConfig(), TrainingConfig())
    evaluator = Evaluator(split, task, ["a", "b", "c"], 8, settings, CPU, "fp32")
    metrics = evaluator(FirstTokenIsTheClass(3))
    assert metrics["accuracy"] == 1.0 and metrics["macro_f1"] == 1.0
    expected_loss = F.cross_entropy(torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([0])).item()
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-5)
