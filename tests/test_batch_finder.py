"""Batch finder and OOM recovery on the CPU, a simulated memory budget standing in for a GPU."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpo.trainer import batch_finder, loop
from hpo.trainer.batch_finder import (
    BatchFinder,
    BatchSearch,
    NoPhysicalBatchFits,
    batch_key,
    find_physical_batch_size,
    resolve_physical_batch,
    search_largest,
)
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.memory import (
    BUDGET_ENV,
    MemoryBudget,
    OutOfMemoryAtBatchOne,
    claim_memory_share,
    is_oom,
)
from hpo.trainer.memory_share import SHARE_ENV, memory_share
from hpo.trainer.model import load_tokenizer
from hpo.trainer.progress import Progress
from hpo.trainer.tasks import prepare_data
from tests.conftest import long_rows, write_csv
from tests.test_trainer import tiny_job

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


def test_a_worker_sharing_its_gpu_searches_within_its_share(
    long_prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = long_prepared
    peaks = {size: probe_peak(job, data.label_names, size) for size in (6, 7, 12, 13)}
    # The whole device fits exactly 12 examples; half of it fits no more than half of that.
    monkeypatch.setenv(BUDGET_ENV, str((peaks[12] + peaks[13]) // 2))
    alone = find_physical_batch_size(job, data.label_names, CPU)
    key_alone = batch_key(job, CPU, "fp32")
    monkeypatch.setenv(SHARE_ENV, "0.5")
    shared = find_physical_batch_size(job, data.label_names, CPU)
    assert alone.limit == 12 and shared.limit <= 6
    # A share is part of the cache key: a half-GPU result never serves a whole-GPU worker.
    key_shared = batch_key(job, CPU, "fp32")
    assert key_shared["memory_share"] == 0.5 and "memory_share" not in key_alone
    assert key_shared != key_alone


@pytest.mark.parametrize("value", ["0", "1.5", "-0.5", "half", "nan"])
def test_a_memory_share_outside_0_to_1_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHARE_ENV, value)
    with pytest.raises(ValueError, match=r"must be a number in \(0, 1\]"):
        memory_share()


@pytest.mark.parametrize(("device", "index"), [("cuda", 3), ("cuda:1", 1)])
def test_a_worker_sharing_a_gpu_caps_its_memory_on_its_device_by_index(
    device: str, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.cuda.set_per_process_memory_fraction refuses torch.device("cuda") (no index) with a
    ValueError; the H100 showed it (2026-11-26): every trial of `--workers-per-gpu 2` failed."""
    capped: list[tuple[float, Any]] = []

    def set_fraction(fraction: float, target: Any) -> None:
        if isinstance(target, torch.device) and target.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, got:{target}")
        capped.append((fraction, target))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setenv(SHARE_ENV, "0.5")
    claim_memory_share(torch.device(device))
    assert capped == [(0.5, index)]
    monkeypatch.setenv(SHARE_ENV, "1")  # alone on its GPU: no cap
    claim_memory_share(torch.device(device))
    assert len(capped) == 1


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
    run = Progress(segment_start=0.0)
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


class FakeCache:
    """The study's batch-size cache in a dict; `others_recorded` plays another worker that
    recorded a size while this one waited for the search lock."""

    def __init__(self, others_recorded: int | None = None) -> None:
        self.sizes: dict[str, int] = {}
        self.others_recorded = others_recorded
        self.searching_keys: list[str] = []

    @staticmethod
    def _hash(key: dict[str, Any]) -> str:
        return json.dumps(key, sort_keys=True, default=str)

    def get(self, key: dict[str, Any]) -> int | None:
        return self.sizes.get(self._hash(key))

    @contextlib.contextmanager
    def searching(self, key: dict[str, Any]) -> Iterator[None]:
        self.searching_keys.append(self._hash(key))
        if self.others_recorded is not None:
            self.sizes[self._hash(key)] = self.others_recorded
        yield

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        return self.sizes.setdefault(self._hash(key), physical_batch_size)


@dataclasses.dataclass
class FakeSearch:
    chosen: int = 9
    calls: int = 0


@pytest.fixture
def search(monkeypatch: pytest.MonkeyPatch) -> FakeSearch:
    """Stands in for the batch search: finds `chosen` and counts its calls."""
    fake = FakeSearch()

    def find(job: TrainJob, labels: list[str], device: torch.device) -> BatchSearch:
        fake.calls += 1
        limit = fake.chosen + 1 if fake.chosen else 0
        return BatchSearch(limit, fake.chosen, 0.9, job.data.max_length)

    monkeypatch.setattr(batch_finder, "find_physical_batch_size", find)
    return fake


def test_a_configured_physical_batch_is_used_as_is(
    prepared: tuple[TrainJob, PreparedData], search: FakeSearch
) -> None:
    job, data = prepared
    cache = FakeCache()
    batch = resolve_physical_batch(job, data.label_names, CPU, cache)
    assert (batch.size, batch.source, batch.key, batch.search) == (4, "config", None, None)
    assert search.calls == 0 and cache.searching_keys == [] and cache.sizes == {}


def test_auto_searches_once_then_the_cache_answers(
    prepared: tuple[TrainJob, PreparedData], search: FakeSearch
) -> None:
    job, data = prepared
    job.training.physical_batch_size = "auto"
    cache = FakeCache()
    first = resolve_physical_batch(job, data.label_names, CPU, cache)
    assert (first.size, first.source) == (9, "search")
    assert first.key == batch_key(job, CPU, "fp32") and first.search is not None
    assert cache.get(first.key) == 9 and len(cache.searching_keys) == 1
    second = resolve_physical_batch(job, data.label_names, CPU, cache)
    assert (second.size, second.source, second.key) == (9, "cache", first.key)
    assert second.search is None and search.calls == 1  # one search in all


def test_a_size_recorded_while_waiting_for_the_search_lock_is_used(
    prepared: tuple[TrainJob, PreparedData], search: FakeSearch
) -> None:
    job, data = prepared
    job.training.physical_batch_size = "auto"
    batch = resolve_physical_batch(job, data.label_names, CPU, FakeCache(others_recorded=6))
    assert (batch.size, batch.source) == (6, "cache") and search.calls == 0


@pytest.mark.parametrize("where", ["search", "cache"])
def test_nothing_fits_is_an_oom_at_batch_one_wherever_it_was_found(
    prepared: tuple[TrainJob, PreparedData], search: FakeSearch, where: str
) -> None:
    job, data = prepared
    job.training.physical_batch_size = "auto"
    cache = FakeCache()
    if where == "cache":
        cache.record(batch_key(job, CPU, "fp32"), 0, {})
    search.chosen = 0  # not even one example fits
    with pytest.raises(NoPhysicalBatchFits, match="not even 1 example") as raised:
        resolve_physical_batch(job, data.label_names, CPU, cache)
    assert isinstance(raised.value, OutOfMemoryAtBatchOne)
    assert raised.value.batch.source == where and raised.value.batch.size == 0
    assert cache.get(batch_key(job, CPU, "fp32")) == 0  # later trials need not search again
    assert search.calls == (1 if where == "search" else 0)


def test_train_takes_its_physical_batch_from_the_same_resolver(
    prepared: tuple[TrainJob, PreparedData], search: FakeSearch
) -> None:
    job, data = prepared
    job.training.physical_batch_size = "auto"
    job.training.max_steps = 1
    result = loop.train(job, data)
    assert search.calls == 1 and result.batch_search is not None
    assert result.batch_search.chosen == 9
    # An effective batch of 8 below the found 9: one micro-batch of 8.
    assert (result.physical_batch_size, result.grad_accum_steps) == (8, 1)
