"""The physical batch of a run: configured, taken from a cache of earlier searches, or found by a
search for the largest that fits in device memory: worst-case probes (every sequence at
max_length, forward + backward + AdamW step, then an evaluation forward), grown geometrically
until the first failure, then bisected; the result is the limit times a safety margin.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import torch

from hpo.trainer import device as dev
from hpo.trainer.compiled import compile_model
from hpo.trainer.config import TrainJob
from hpo.trainer.memory import (
    OutOfMemoryAtBatchOne,
    budget_from_env,
    claim_memory_share,
    is_oom,
    memory_share,
    none_on_oom,
    release_memory,
    simulated_budget,
)
from hpo.trainer.model import build_model, model_fingerprint, vocab_size_of
from hpo.trainer.model_factory import logits_of
from hpo.trainer.step import make_optimizer, optimizer_step
from hpo.trainer.tasks import make_task

log = logging.getLogger(__name__)

# On the CPU nothing runs out of memory (short of swapping), so there is no limit to search.
CPU_PHYSICAL_BATCH_SIZE = 32


@dataclass
class Probe:
    size: int
    fits: bool
    peak_mem_bytes: int | None
    seconds: float
    # A search across ranks (trainer.sharded_batch): the rank whose peak this is, the one with
    # the least memory to spare.
    rank: int | None = None


@dataclass
class BatchSearch:
    """What the finder did and found; `chosen` is 0 when not even one example fits."""

    limit: int
    chosen: int
    margin: float
    max_length: int
    probes: list[Probe] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""

    def report(self) -> str:
        lines = [
            f"physical batch search at max_length {self.max_length}: {len(self.probes)} probes "
            f"in {self.seconds:.1f} s; limit {self.limit}, chosen {self.chosen} "
            f"(margin {self.margin})" + (f"; {self.note}" if self.note else "")
        ]
        for probe in self.probes:
            peak = f"{probe.peak_mem_bytes / 2**20:,.1f} MiB" if probe.peak_mem_bytes else "-"
            verdict = "fits" if probe.fits else "OOM"
            on = f" (rank {probe.rank})" if probe.rank is not None else ""
            lines.append(
                f"  batch {probe.size:>5}: {verdict:<4}  peak {peak:>12}{on}  {probe.seconds:.2f} s"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def search_largest(fits: Callable[[int], bool], start: int, upper_bound: int) -> int:
    """Largest size in [1, upper_bound] for which `fits` holds, assuming it is monotone:
    double from `start` until the first failure, then bisect. 0 if size 1 does not fit."""
    largest_fit, smallest_fail = 0, upper_bound + 1
    size = max(1, min(start, upper_bound))
    while size < smallest_fail:
        if fits(size):
            largest_fit = size
            if size == upper_bound:
                break
            size = min(size * 2, upper_bound)
        else:
            smallest_fail = size
            break
    while smallest_fail - largest_fit > 1 and smallest_fail <= upper_bound:
        middle = (largest_fit + smallest_fail) // 2
        if fits(middle):
            largest_fit = middle
        else:
            smallest_fail = middle
    return largest_fit


def batch_key(job: TrainJob, device: torch.device, precision: str) -> dict[str, Any]:
    """Everything that changes the memory a step needs; the cache key of a search."""
    cfg = job.training
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    key = {
        "model": model_fingerprint(job.model),
        "task": job.task,
        "max_length": job.data.max_length,
        "precision": precision,
        "gradient_checkpointing": job.gradient_checkpointing,
        "compile": job.model.compile_scope if job.model.compile else False,
        "attn_implementation": job.model.attn_implementation,
        "eval_batch_size": cfg.eval_batch_size or "2x",
        "device": dev.device_name(device) if device.type == "cuda" else "cpu",
        "device_total_memory": total,
        "simulated_budget": budget_from_env() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "search": [cfg.batch_search_start, cfg.batch_search_max, cfg.batch_safety_margin],
    }
    if job.model.dropout is not None:
        # A dropout of 0 stores no masks; any other stores the same ones, whatever its value.
        key["dropout_masks"] = job.model.dropout > 0
    adapter = job.model.adapter
    if adapter is not None:  # frozen weights need no gradients or AdamW state
        # What shapes the adapter's memory; alpha (a scale) and the dropout rate do not, and a
        # search over them must not search the batch again at every trial.
        key["peft"] = {
            "method": adapter.method,
            "r": adapter.r,
            "dropout": adapter.dropout > 0,
            "target_modules": adapter.target_modules,
        }
    if cfg.distributed is not None and cfg.world_size > 1:  # a rank's memory depends on them
        key["ranks"] = cfg.world_size
        key["strategy"] = cfg.distributed.strategy  # FSDP shards the weights over the ranks
    share = memory_share()
    if share < 1:  # a worker sharing its GPU (keys of a whole GPU stay as they were)
        key["memory_share"] = share
    return key


class BatchFinder:
    """Probes one model configuration on one device; each probe starts from a fresh copy."""

    def __init__(self, job: TrainJob, label_names: list[str], device: torch.device) -> None:
        self.job, self.cfg = job, job.training
        self.device = device
        claim_memory_share(device)
        self.precision = dev.resolve_precision(self.cfg.precision, device)
        # Built once on the CPU; every probe moves a deep copy, so the search changes nothing.
        self.task = make_task(job.task, job.data, job.training)
        self.num_labels = len(label_names)
        self.base_model = self._base_model(label_names)
        self.vocab_size = vocab_size_of(self.base_model, job.model)
        self.probes: list[Probe] = []

    def _base_model(self, label_names: list[str]) -> torch.nn.Module:
        """The model every probe copies, built once on the CPU."""
        return build_model(
            self.job.model,
            label_names,
            self.cfg.seed,
            task=self.job.task,
            gradient_checkpointing=self.job.gradient_checkpointing,
            job=self.job,
        )

    def run(self) -> BatchSearch:
        started = time.perf_counter()
        margin = self.cfg.batch_safety_margin
        max_length = self.job.data.max_length
        if self._unlimited():
            chosen = min(CPU_PHYSICAL_BATCH_SIZE, self.cfg.batch_search_max)
            return BatchSearch(chosen, chosen, margin, max_length, note="CPU: no memory limit")
        limit = search_largest(self.fits, self.cfg.batch_search_start, self.cfg.batch_search_max)
        chosen = max(1, math.floor(limit * margin)) if limit else 0
        search = BatchSearch(
            limit, chosen, margin, max_length, self.probes, time.perf_counter() - started
        )
        log.info("%s", search.report())
        return search

    def _unlimited(self) -> bool:
        """Whether there is no memory limit to search: a CPU without the test budget."""
        return self.device.type == "cpu" and budget_from_env() is None

    def fits(self, size: int) -> bool:
        """Whether a worst-case step of `size` examples fits; records the probe."""
        started = time.perf_counter()
        dev.reset_peak_memory(self.device)
        peak: int | None = None
        fits = True
        try:
            with simulated_budget(self.device) as budget:
                self._worst_case_step(size)
                peak = budget.peak_bytes if budget is not None else None
        except Exception as error:
            if not is_oom(error):
                raise
            fits = False
        if self.device.type == "cuda":  # read before release_memory resets it
            peak = int(torch.cuda.max_memory_allocated(self.device))
        release_memory(self.device)  # outside the except: the traceback holds the tensors
        self.probes.append(Probe(size, fits, peak, time.perf_counter() - started))
        return fits

    def _worst_case_step(self, size: int) -> None:
        model = self._fresh_model()
        forward = model
        if self.job.model.compile:
            forward = compile_model(model, self.job.model.compile_scope)
        optimizer, _ = make_optimizer(model, self.cfg)
        length = self.job.data.max_length
        labels = self.task.worst_case_labels(size, length, self.num_labels).to(self.device)
        # The first step allocates the AdamW state. The second accumulates two micro-batches,
        # so the second forward and backward run with the optimizer state and the first one's
        # gradients in memory, as every accumulated training step does (without the gradients,
        # a probe passed on an H100 at a size that training then could not run).
        for micro_batches in (1, 2):
            for _ in range(micro_batches):
                with dev.autocast(self.device, self.precision):
                    logits = logits_of(forward(**self._inputs(size)))
                loss = self.task.loss_sum(logits, labels) / self.task.units(labels)
                loss.backward()
                del logits
            optimizer_step(model, optimizer, self.cfg)
        eval_size = self.cfg.eval_batch_size or 2 * size
        eval_labels = self.task.worst_case_labels(eval_size, length, self.num_labels)
        model.eval()
        with torch.inference_mode():
            with dev.autocast(self.device, self.precision):
                logits = logits_of(forward(**self._inputs(eval_size)))
            # The evaluation's loss as well: for a causal LM, the float32 log-softmax of
            # [batch, max_length, vocabulary] logits needs as much memory again as the logits.
            self.task.loss_sum(logits, eval_labels.to(self.device))

    def _fresh_model(self) -> torch.nn.Module:
        model = copy.deepcopy(self.base_model)
        if self.device.type == "cpu":
            # deepcopy bypasses the allocator hooks; a clone is an allocation like any other.
            for tensor in (*model.parameters(), *model.buffers()):
                tensor.data = tensor.data.clone()
        return model.to(self.device).train()

    def _inputs(self, size: int) -> dict[str, torch.Tensor]:
        shape = (size, self.job.data.max_length)
        generator = torch.Generator().manual_seed(size)
        ids = torch.randint(0, self.vocab_size, shape, generator=generator)
        return {
            "input_ids": ids.to(self.device),
            "attention_mask": torch.ones(shape, dtype=torch.long, device=self.device),
        }


def find_physical_batch_size(
    job: TrainJob, label_names: list[str], device: torch.device | None = None
) -> BatchSearch:
    """Search the largest worst-case physical batch for `job` on `device` (default: its own)."""
    return BatchFinder(job, label_names, device or dev.resolve_device(job.training.device)).run()


PhysicalBatchSource = Literal["config", "search", "cache"]

# A search of `job`'s physical batch on a device: find_physical_batch_size, or a sharded run's
# search together with its other ranks (trainer.sharded_batch).
BatchSearcher = Callable[[TrainJob, list[str], torch.device], BatchSearch]


class BatchSizeLookup(Protocol):
    """Search results shared between runs; hpo keeps them in the study's database
    (storage.batch_cache.BatchSizeCache)."""

    def get(self, key: dict[str, Any]) -> int | None: ...

    def searching(self, key: dict[str, Any]) -> AbstractContextManager[None]:
        """Held while this process searches `key`, so that others wait for its result."""
        ...

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        """Store a search result unless one is there; returns the size stored."""
        ...


@dataclass
class PhysicalBatch:
    """The physical batch of a run and where it came from. `key` is the cache key of a size that
    was searched or cached (None when configured); `search` is set when this run searched."""

    size: int
    source: PhysicalBatchSource
    key: dict[str, Any] | None = None
    search: BatchSearch | None = None


class NoPhysicalBatchFits(OutOfMemoryAtBatchOne):
    """Not even one example fits, as `batch` (size 0) records a search or the cache found."""

    def __init__(self, message: str, batch: PhysicalBatch) -> None:
        super().__init__(message)
        self.batch = batch


def resolve_physical_batch(
    job: TrainJob,
    label_names: list[str],
    device: torch.device,
    cache: BatchSizeLookup | None = None,
    searcher: BatchSearcher | None = None,
) -> PhysicalBatch:
    """The one place that decides a run's physical batch: the configured size; for `auto`, the
    size `cache` holds, else a search by `searcher` (default: find_physical_batch_size),
    recorded in `cache`. Raises NoPhysicalBatchFits (an OutOfMemoryAtBatchOne) when not even
    one example fits."""
    configured = job.training.physical_batch_size
    if configured != "auto":
        return PhysicalBatch(configured, "config")
    key = batch_key(job, device, dev.resolve_precision(job.training.precision, device))
    search = searcher or find_physical_batch_size
    batch = _cached_or_searched(job, label_names, device, key, cache, search)
    if batch.size == 0:
        earlier = " (an earlier search found so)" if batch.source == "cache" else ""
        raise NoPhysicalBatchFits(
            f"not even 1 example at max_length {job.data.max_length} fits in memory{earlier}",
            batch,
        )
    return batch


def _cached_or_searched(
    job: TrainJob,
    label_names: list[str],
    device: torch.device,
    key: dict[str, Any],
    cache: BatchSizeLookup | None,
    searcher: BatchSearcher,
) -> PhysicalBatch:
    cached = cache.get(key) if cache is not None else None
    if cached is not None:
        return PhysicalBatch(cached, "cache", key)
    if cache is None:
        search = searcher(job, label_names, device)
        return PhysicalBatch(search.chosen, "search", key, search)
    with cache.searching(key):
        cached = cache.get(key)  # another worker may have searched while this one waited
        if cached is not None:
            return PhysicalBatch(cached, "cache", key)
        search = searcher(job, label_names, device)
        size = cache.record(key, search.chosen, search.as_dict())
        return PhysicalBatch(size, "search", key, search)


def search_step(
    step: Callable[[int], Any], device: torch.device, start: int, upper_bound: int, margin: float
) -> BatchSearch:
    """The largest batch at which `step(size)` (one training step of someone else's code: a
    forward, backward and optimizer step at that batch size) runs without an OOM, times
    `margin`. Any error but an OOM propagates; memory is freed after each failed probe."""
    started = time.perf_counter()
    search = BatchSearch(limit=0, chosen=0, margin=margin, max_length=0)

    def fits(size: int) -> bool:
        probe_started = time.perf_counter()
        ok = none_on_oom(lambda: step(size) or True) is not None
        if not ok:  # outside the except block: the error no longer holds the step's tensors
            release_memory(device)
        search.probes.append(Probe(size, ok, None, time.perf_counter() - probe_started))
        return ok

    search.limit = search_largest(fits, start, upper_bound)
    search.chosen = max(1, math.floor(search.limit * margin)) if search.limit else 0
    search.seconds = time.perf_counter() - started
    return search
