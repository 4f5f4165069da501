"""What a trial across ranks starts again with after one rank ran out of memory where the
others cannot go on without it (a sharded step, a sharded evaluation): the run every rank
trains (TrialWork), at half the size that failed, from the last checkpoint the run wrote, else
from step 0. trainer.launch starts the ranks again on what these return.

    work = restarted_after_oom(work, error, saved=relay.saved_state, batch=relay.batch)
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from hpo.trainer.batch_finder import PhysicalBatch
from hpo.trainer.config import TrainingConfig, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.fsdp import ShardedEvaluationOutOfMemory, ShardedStepOutOfMemory
from hpo.trainer.memory import OutOfMemoryAtBatchOne
from hpo.trainer.rank_batch import RankBatchCache
from hpo.trainer.user_metrics import UserMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPlace:
    """Where rank 0 writes the run's checkpoints and every rank reads one to resume (a
    CheckpointStore without its callbacks, which stay in the launching process)."""

    directory: Path
    resume: bool
    interval_s: float


@dataclass
class TrialWork:
    """The run every rank trains: the leading host has it, and its rank 0 sends it to the
    ranks of the other hosts (a trial across hosts)."""

    job: TrainJob
    data: PreparedData
    metric: str | None
    user_metrics: UserMetrics | None
    checkpoints: CheckpointPlace | None
    oom_restarts: int = 0  # times every rank was started again, after an OOM on one of them
    # Once restarted: the batch of the first start (its cache key, found by a search or the
    # cache), at this start's size; the ranks train it rather than a batch set in the config.
    batch: PhysicalBatch | None = None


def restarted_after_oom(
    work: TrialWork,
    error: ShardedStepOutOfMemory,
    saved: bool,
    batch: PhysicalBatch | None = None,
    cache: RankBatchCache | None = None,
) -> TrialWork:
    """The run to start every rank on again after one ran out of memory in a sharded step (the
    others wait in a collective it never joins: the step cannot be redone in place): at half the
    physical batch, from the last checkpoint (`saved`: this run wrote one), else from step 0.
    At batch 1 `error` is raised: the run ends. Each restart halves: log2(batch) at most.
    `batch`: the one rank 0 trained; a searched or cached one is lowered in `cache`."""
    size = work.job.training.physical_batch_size  # "auto" at first: the ranks searched it
    if not isinstance(size, int) or error.physical_batch_size < size:
        size = error.physical_batch_size
    half = _halved(size, error)
    training = dataclasses.replace(work.job.training, physical_batch_size=half)
    first = work.batch or batch
    if first is not None:
        first = dataclasses.replace(first, size=half)
        if cache is not None and first.key is not None:  # as a DDP run's OOM recovery does
            cache.lower(first.key, first.size)  # the next trial starts from what fits
    return _restarted(work, training, saved, first, f"physical batch {half}", error)


def restarted_after_evaluation_oom(
    work: TrialWork,
    error: ShardedEvaluationOutOfMemory,
    saved: bool,
    batch: PhysicalBatch | None = None,
) -> TrialWork:
    """The run to start every rank on again after one ran out of memory in a sharded evaluation
    (the others wait in a gather it never joins): at the same physical batch (`batch`, rank 0's,
    unless already set) and half the evaluation batch, from the last checkpoint (`saved`: this
    run wrote one), else from step 0. Resuming is exact, so the steps trained again reach the
    same weights and the evaluation redone is the one that failed. At evaluation batch 1
    `error` is raised: the run ends."""
    half = _halved(error.eval_batch_size, error)
    training = dataclasses.replace(work.job.training, eval_batch_size=half)
    first = work.batch or batch
    return _restarted(work, training, saved, first, f"evaluation batch {half}", error)


def _halved(size: int, error: OutOfMemoryAtBatchOne) -> int:
    """Half of the `size` that ran out of memory; at 1, `error` is raised: the run ends."""
    if size <= 1:
        raise error
    return size // 2


def _restarted(
    work: TrialWork,
    training: TrainingConfig,
    saved: bool,
    batch: PhysicalBatch | None,
    what: str,
    error: OutOfMemoryAtBatchOne,
) -> TrialWork:
    """`work` with `training` and `batch`, resumed once a launch wrote a checkpoint (`saved`),
    one restart more; the restart logged (`what` it starts at)."""
    place = work.checkpoints
    if place is not None and saved:
        place = dataclasses.replace(place, resume=True)
    since = "the last checkpoint" if place is not None and place.resume else "step 0"
    # The text: a record kept (a test's log capture) must not hold the error's traceback, and
    # with it this start's rendezvous store (see follower_failures.rendezvous_let_go).
    log.warning("%s (%s, from %s)", str(error), what, since)
    job = dataclasses.replace(work.job, training=training)
    restarts = work.oom_restarts + 1
    return dataclasses.replace(work, job=job, checkpoints=place, oom_restarts=restarts, batch=batch)
