"""The physical batch search of a sharded run (`strategy: fsdp`): every rank probes the same batch
at the same time on its share of a sharded copy of the model, and the ranks agree on each
verdict, so the rank with the least memory decides and none is left waiting in a collective.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpo.trainer import device as dev
from hpo.trainer.batch_finder import BatchFinder, BatchSearch, BatchSearcher, Probe
from hpo.trainer.config import TrainJob
from hpo.trainer.distributed import RankGroup
from hpo.trainer.fsdp import match_rank0_layout, shard_model
from hpo.trainer.memory import (
    MemoryBudget,
    OutOfMemoryAtBatchOne,
    budget_from_env,
    is_oom,
    memory_share,
    release_memory,
)
from hpo.trainer.model import build_model

# On a GPU, a probe whose peak this rank's earlier probes predict past this part of its memory
# is not run: it counts as out of memory on every rank. A real OOM inside a probe cannot be
# agreed (see ShardedProbeOutOfMemory), so the search stays clear of the edge rather than
# stepping over it; the safety margin is taken below the limit found as in any search.
GPU_PROBE_HEADROOM = 0.9


class ShardedProbeOutOfMemory(OutOfMemoryAtBatchOne):
    """A rank really ran out of memory inside a sharded probe (on a GPU). As in a sharded step
    (fsdp.ShardedStepOutOfMemory), the error comes from inside the forward or backward, where
    the other ranks already wait in a gather or scatter that this rank never joins: the search
    cannot go on, and the launcher ends the ranks. On the CPU (the test budget) a probe never
    raises: each rank measures its peak and compares it with its budget after the step."""


def predicted_peak(peaks: dict[int, int], size: int) -> int | None:
    """The peak bytes of a probe at `size`, from this rank's earlier probes below it (`peaks`:
    size -> peak): on the line through the two largest; from one, in proportion to the batch
    (an overestimate: the weights and optimizer state do not grow with it); None from none."""
    below = sorted(s for s in peaks if s < size)
    if not below:
        return None
    if len(below) == 1:
        return peaks[below[0]] * size // below[0]
    small, large = below[-2], below[-1]
    per_example = (peaks[large] - peaks[small]) / (large - small)
    return math.ceil(peaks[large] + per_example * (size - large))


def tightest_rank(reports: list[tuple[int | None, int | None]]) -> int:
    """The rank with the least memory to spare in a probe (`reports`: each rank's peak and
    limit, None for none); the first on a tie."""

    def spare(rank: int) -> float:
        peak, limit = reports[rank]
        return (math.inf if limit is None else limit) - (peak or 0)

    return min(range(len(reports)), key=spare)


class ShardedBatchFinder(BatchFinder):
    """BatchFinder's search (worst-case probes, doubling then bisection, the safety margin) on
    a copy of the model sharded over `group` as fsdp.ShardedTrainer shards it. Every rank makes
    every probe with the others (each forward and backward gathers and scatters with all), then
    the ranks agree: a size fits when it fits on every rank, so every rank takes the same next
    size and ends with the same result."""

    def __init__(self, job: TrainJob, label_names: list[str], group: RankGroup) -> None:
        # A sharded run is not compiled (see ShardedTrainer), so neither is its probe.
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, compile=False))
        self.group = group  # first: the base class builds the model, which reads it
        self.buffers: dict[str, torch.Tensor] = {}  # rank 0's, by name (see _base_model)
        super().__init__(job, label_names, group.device)
        self.own_peaks: dict[int, int] = {}  # this rank's measured probes: size -> peak bytes

    def _base_model(self, label_names: list[str]) -> torch.nn.Module:
        """The model's shapes alone (the meta device) on every rank: a probe measures memory,
        which the weights' values do not change. Its buffers must be right (position ids index
        an embedding): rank 0 builds the model whole once, as a one-GPU search does, and sends
        them; no other rank ever holds the whole model."""
        meta = torch.device("meta")
        shapes = build_model(
            self.job.model,
            label_names,
            self.cfg.seed,
            meta,
            self.job.task,
            gradient_checkpointing=self.job.gradient_checkpointing,
            job=self.job,
        ).to(meta)
        whole = super()._base_model(label_names) if self.group.rank == 0 else None
        match_rank0_layout(shapes, whole)
        sent: list[Any] = [dict(whole.named_buffers()) if whole is not None else None]
        dist.broadcast_object_list(sent, src=0)
        self.buffers = sent[0]
        return shapes

    def _unlimited(self) -> bool:
        """Agreed over the ranks: the CPU test budget may hold on one rank alone, and a search
        runs on every rank or on none."""
        return self.device.type == "cpu" and not self.group.any(budget_from_env() is not None)

    def fits(self, size: int) -> bool:
        """Whether a worst-case step of `size` examples fits on every rank; records the probe
        with the peak of the rank that had the least to spare (the same record on every
        rank). A rank's probe never fails between two collectives: it measures its peak, and
        the ranks compare theirs with their limits after the step, together."""
        started = time.perf_counter()
        limit = self._limit_bytes()
        predicted = predicted_peak(self.own_peaks, size) if self.device.type == "cuda" else None
        beyond = bool(predicted and limit and predicted > GPU_PROBE_HEADROOM * limit)
        peak = None if self.group.any(beyond) else self._probe_peak(size)
        if peak is not None:
            self.own_peaks[size] = peak
        reports: list[tuple[int | None, int | None]] = self.group.gather((peak, limit))
        fits = all(p is not None and (cap is None or p <= cap) for p, cap in reports)
        rank = tightest_rank(reports)
        seconds = time.perf_counter() - started
        self.probes.append(Probe(size, fits, reports[rank][0], seconds, rank))
        return fits

    def _limit_bytes(self) -> int | None:
        """This rank's memory: its GPU's share (claim_memory_share caps it there), or the CPU
        test budget (None: no limit)."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            return int(total * memory_share())
        return budget_from_env()

    def _probe_peak(self, size: int) -> int:
        """This rank's peak bytes in a worst-case step of `size` examples on its share."""
        dev.reset_peak_memory(self.device)
        try:
            peak = self._measured_step(size)
        except Exception as error:
            if not is_oom(error):
                raise
            raise ShardedProbeOutOfMemory(
                f"out of memory on rank {self.group.rank} in a sharded batch-size probe at "
                f"{size} examples: the other ranks wait in its collectives, so the search "
                "cannot go on; set a number for training.physical_batch_size or a lower "
                "training.batch_search_max"
            ) from error
        release_memory(self.device)
        return peak

    def _measured_step(self, size: int) -> int:
        if self.device.type == "cuda":
            self._worst_case_step(size)
            return int(torch.cuda.max_memory_allocated(self.device))
        # Counted against no limit, so nothing is raised inside a collective; the test budget
        # is compared with the peak after the step (see fits).
        with MemoryBudget(sys.maxsize) as counter:
            self._worst_case_step(size)
        return counter.peak_bytes

    def _fresh_model(self) -> torch.nn.Module:
        """A fresh copy, sharded as the trainer shards it: each rank allocates its share alone,
        filled with small noise (the values change no memory), and takes rank 0's buffers."""
        model = copy.deepcopy(self.base_model)
        shard_model(model, self.group.world_size, self.device, self.precision)
        model.to_empty(device=self.device)
        with torch.no_grad():
            for param in model.parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                local.normal_(0.0, 0.02)
            for name, buffer in model.named_buffers():
                buffer.copy_(self.buffers[name])
        return model.train()


def sharded_searcher(group: RankGroup) -> BatchSearcher:
    """resolve_physical_batch's search for a sharded run: every rank of `group` together."""

    def search(job: TrainJob, label_names: list[str], device: torch.device) -> BatchSearch:
        return ShardedBatchFinder(job, label_names, group).run()

    return search
