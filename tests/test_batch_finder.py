"""Batch finder and OOM recovery on the CPU, a simulated memory budget standing in for a GPU."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import long_rows, write_csv
from tests.test_trainer import tiny_job
from trainer import loop
from trainer.batch_finder import BatchFinder, find_physical_batch_size, search_largest
from trainer.config import TrainJob
from trainer.data import PreparedData, prepare_data
from trainer.memory import BUDGET_ENV, MemoryBudget, OutOfMemoryAtBatchOne, is_oom
from trainer.model import load_tokenizer

CPU = torch.device("cpu")


@pytest.fixture
def prepared(easy_data: tuple[Path, Path]) -> tuple[TrainJob, PreparedData]:
    job = tiny_job(*easy_data)
    job.model.config = {
        **(job.model.config or {}),
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return job, prepare_data(job.data, load_tokenizer(job.model))


@pytest.fixture
def long_prepared(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
    """Long sequences and eager attention: activations, not weights, decide what fits."""
    rows = long_rows(48)
    train_file = write_csv(tmp_path / "long.csv", rows)
    job = tiny_job(train_file, train_file, physical_batch_size=8, effective_batch_size=8)
    job.data.max_length = 256
    job.model.attn_implementation = "eager"
    job.model.config = {**(job.model.config or {}), "max_position_embeddings": 256}
    job.training.batch_search_start = 2
    job.training.batch_search_max = 16
    return job, prepare_data(job.data, load_tokenizer(job.model))


def probe_peak(job: TrainJob, labels: list[str], size: int) -> int:
    """Peak bytes of one worst-case probe, measured with an unlimited budget."""
    finder = BatchFinder(job, labels, CPU)
    with MemoryBudget(1 << 62) as budget:
        finder._worst_case_step(size)
    return budget.peak_bytes


def test_oom_predicate() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_oom(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_oom(ValueError("out of memory"))


def test_search_largest_is_exact_and_logarithmic() -> None:
    for limit in (0, 1, 7, 8, 9, 100, 255, 256):
        calls: list[int] = []

        def fits(size: int, limit: int = limit, calls: list[int] = calls) -> bool:
            calls.append(size)
            return size <= limit

        assert search_largest(fits, start=8, upper_bound=256) == limit
        assert len(calls) <= 2 * math.log2(256)


def test_finder_returns_floor_of_limit_times_margin(
    long_prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = long_prepared
    peaks = {size: probe_peak(job, data.label_names, size) for size in range(1, 17)}
    assert all(peaks[n] < peaks[n + 1] for n in range(1, 16))
    for limit in (1, 5, 11, 16):
        # Halfway to the next size's peak: exactly `limit` examples fit.
        budget = (peaks[limit] + peaks.get(limit + 1, peaks[limit] * 2)) // 2
        monkeypatch.setenv(BUDGET_ENV, str(budget))
        search = find_physical_batch_size(job, data.label_names, CPU)
        assert search.limit == limit
        assert search.chosen == max(1, math.floor(limit * 0.9))
        assert len(search.probes) <= 2 * math.log2(16)
        assert all(p.fits == (p.size <= limit) for p in search.probes)
        assert f"limit {limit}, chosen {search.chosen}" in search.report()


def test_probes_leave_no_memory_behind(
    long_prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = long_prepared
    monkeypatch.setenv(BUDGET_ENV, str(probe_peak(job, data.label_names, 6)))
    import gc

    with MemoryBudget(1 << 62) as outside:
        search = find_physical_batch_size(job, data.label_names, CPU)
        assert any(not p.fits for p in search.probes)  # some probes failed mid-step
        del search
        gc.collect()
        outside.collect()
    assert outside.peak_bytes > 0
    assert outside.current_bytes == 0


def test_not_even_one_example_fits(
    prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared
    monkeypatch.setenv(BUDGET_ENV, "1000")
    search = find_physical_batch_size(job, data.label_names, CPU)
    assert (search.limit, search.chosen) == (0, 0)
    job.training.physical_batch_size = "auto"
    with pytest.raises(OutOfMemoryAtBatchOne):
        loop.train(job, data)


def weights_after(job: TrainJob, data: PreparedData, steps: int) -> tuple[list[torch.Tensor], int]:
    trainer = loop.Trainer(job, data)
    run = loop._Run(segment_start=0.0)
    for count, (indices, micro_batches) in enumerate(trainer._steps(0)):
        if count == steps:
            break
        trainer._train_step(run, indices, micro_batches)
    return [p.detach().clone() for p in trainer.model.parameters()], trainer.oom_recoveries


def test_injected_oom_redoes_the_same_step(
    prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared
    job.training.physical_batch_size = 8
    job.training.effective_batch_size = 8
    reference, recoveries = weights_after(copy.deepcopy(job), data, steps=3)
    assert recoveries == 0

    real = loop.accumulate_gradients
    failures = []

    def oom_on_big_batches(model, micro_batches, *args, **kwargs):  # type: ignore[no-untyped-def]
        if max(len(mb["labels"]) for mb in micro_batches) > 2 and len(failures) < 2:
            failures.append(1)
            real(model, micro_batches[:1], *args, **kwargs)  # leaves partial gradients behind
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(model, micro_batches, *args, **kwargs)

    monkeypatch.setattr(loop, "accumulate_gradients", oom_on_big_batches)
    recovered, recoveries = weights_after(job, data, steps=3)
    assert recoveries == 2  # 8 -> 4 -> 2 examples per micro-batch, 4 micro-batches
    for a, b in zip(reference, recovered, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_training_under_a_budget_recovers_and_finishes(
    long_prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = long_prepared
    job.training.eval_batch_size = 1
    job.training.max_steps = 4
    peaks = [training_peak(job, data, physical) for physical in (2, 4)]
    monkeypatch.setenv(BUDGET_ENV, str((peaks[0] + peaks[1]) // 2))  # 2 fits, 4 does not
    result = loop.train(job, data)
    assert result.status == "completed" and result.optimizer_steps == 4
    assert (result.physical_batch_size, result.grad_accum_steps) == (2, 4)
    assert result.oom_recoveries == 2 and result.effective_batch_size == 8


def training_peak(
    job: TrainJob, data: PreparedData, physical: int, effective: int | None = None
) -> int:
    """Peak bytes of two real training steps at a physical batch, with an unlimited budget."""
    training = dataclasses.replace(job.training, physical_batch_size=physical, max_steps=2)
    if effective is not None:
        training.effective_batch_size = effective
    with MemoryBudget(1 << 62) as budget:
        loop.train(dataclasses.replace(job, training=training), data)
    return budget.peak_bytes


def test_a_non_oom_error_is_not_swallowed(
    prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared
    job.training.max_steps = 2

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(loop, "accumulate_gradients", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        loop.train(job, data)
