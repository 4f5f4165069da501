"""The physical batch of a run across ranks, decided as a one-GPU run's is (batch_finder's
resolve_physical_batch: the configured size, the study's cache, else a search), with the ranks
agreeing at each turn: the main rank asks the cache, every rank searches on its own device and
the smallest size wins, which the main rank records. A sharded run's ranks search together, on
the sharded model (trainer.sharded_batch), and agree after each probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from hpo.trainer.batch_finder import (
    BatchSizeLookup,
    NoPhysicalBatchFits,
    PhysicalBatch,
    resolve_physical_batch,
)
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.distributed import RankGroup
from hpo.trainer.memory import OutOfMemoryAtBatchOne
from hpo.trainer.sharded_batch import sharded_searcher


class RankBatchCache(Protocol):
    """The study's batch-size cache as the main rank reaches it (over its launcher's pipe)."""

    def get(self, key: dict[str, Any]) -> int | None: ...

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        """Store a search result unless one is there; returns the size stored."""
        ...

    def lower(self, key: dict[str, Any], physical_batch_size: int) -> None: ...


class AgreedCache(BatchSizeLookup):
    """The cache as every rank sees it: the main rank's answer (it alone holds `study_cache`;
    None: no cache), and a search recorded as the smallest size any rank found. Every rank
    makes the same calls in the same order (resolve_physical_batch's), so the collectives
    match."""

    def __init__(self, group: RankGroup, study_cache: RankBatchCache | None) -> None:
        self.group, self.study_cache = group, study_cache

    def get(self, key: dict[str, Any]) -> int | None:
        found = self.study_cache.get(key) if self.study_cache is not None else None
        size: int | None = self.group.from_main(found)
        return size

    @contextlib.contextmanager
    def searching(self, key: dict[str, Any]) -> Iterator[None]:
        yield  # two trials searching at once both search; the cache keeps the first result

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        agreed = self.group.min(physical_batch_size)
        if self.study_cache is not None:
            self.study_cache.record(key, agreed, search)
        return agreed


def agreed_physical_batch(
    job: TrainJob, data: PreparedData, group: RankGroup, study_cache: RankBatchCache | None
) -> PhysicalBatch:
    """The physical batch every rank trains with (see the module). Raises
    OutOfMemoryAtBatchOne on every rank when one example does not fit on some rank."""
    settings = job.training.distributed
    sharded = settings is not None and settings.strategy == "fsdp"
    searcher = sharded_searcher(group) if sharded else None  # else each rank's own search
    try:
        return resolve_physical_batch(
            job, data.label_names, group.device, AgreedCache(group, study_cache), searcher
        )
    except NoPhysicalBatchFits as e:
        raise OutOfMemoryAtBatchOne(
            f"not even 1 example at max_length {job.data.max_length} fits in memory on every "
            f"one of the {group.world_size} ranks"
        ) from e
