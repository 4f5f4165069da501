"""A training run across several ranks (`training.distributed`), started by torch's elastic
launcher (`torch.distributed.launcher.api.elastic_launch`, what `torchrun` runs) on this host:
NCCL on GPUs, gloo on the CPU. The launching process keeps the run's callbacks (pruning,
progress, stop requests, uploads) and serves them to rank 0 over a pipe (trainer.rank_relay).

    result = train_distributed(job, data, on_evaluation=report)  # job.training.distributed set
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hpo.trainer import device as dev
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.distributed import DistributedTrainer, RankGroup
from hpo.trainer.errors import DeviceError
from hpo.trainer.follower_failures import rendezvous_let_go, told_across_hosts
from hpo.trainer.fsdp import (
    ShardedEvaluationOutOfMemory,
    ShardedStepOutOfMemory,
    ShardedTrainer,
)
from hpo.trainer.loop import OnEvaluation, OnProgress, ShouldStop
from hpo.trainer.memory import OutOfMemoryAtBatchOne, simulated_budget
from hpo.trainer.nodes import FirstHostWord, NodePlace, ask_first_host, node_place
from hpo.trainer.rank_batch import RankBatchCache, agreed_physical_batch
from hpo.trainer.rank_failures import RankFailed, RankWords, cause, last_words
from hpo.trainer.rank_relay import LaunchRelay, RankRelay, say
from hpo.trainer.restarts import (
    CheckpointPlace,
    TrialWork,
    restarted_after_evaluation_oom,
    restarted_after_oom,
)
from hpo.trainer.result import TrainResult
from hpo.trainer.user_metrics import UserMetrics

log = logging.getLogger(__name__)

# How long a collective may wait for a slow rank before it fails: the others wait while the
# main rank reports, prunes and writes a checkpoint, which can take minutes. A rank that dies
# is noticed by the launcher at once, whatever this says.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
# Across hosts: how long the first host's rendezvous waits for the others to join (seconds).
RDZV_JOIN_TIMEOUT_S = int(os.environ.get("HPO_RDZV_JOIN_TIMEOUT_S", "600"))
# A host that follows ends once no trial started for this long (seconds) and the first host
# said nothing: it is gone (killed, its host lost). Once its worker ends, it says so at once.
FOLLOW_IDLE_S = float(os.environ.get("HPO_FOLLOW_IDLE_S", "600"))
# How often a host that follows asks the first whether its worker ended, between trials (seconds).
FOLLOW_ASK_S = 1.0
# How often the launching process looks at rank 0's pipe (seconds).
RELAY_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


class _NoChildThreadWarning(logging.Filter):
    """torch warns that a launcher in a thread cannot register signal handlers: on purpose here
    (see _Launch), and the ranks end with this process (_die_with_the_launcher)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running on a child thread" not in record.getMessage()


class _TracebackAsText(logging.Filter):
    """A rank's failure logged by torch's launcher keeps its traceback as text, not as the
    traceback object: a record kept by a handler (a test's log capture) would otherwise hold the
    launcher's frames, and with them the rendezvous store a restart across hosts needs gone
    (see follower_failures.rendezvous_let_go)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_text = record.exc_text or logging.Formatter().formatException(
                record.exc_info
            )
            record.exc_info = None
        return True


_launcher_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
_launcher_log.addFilter(_NoChildThreadWarning())
_launcher_log.addFilter(_TracebackAsText())


@dataclass
class RankJob:
    """What every rank is started with; it pickles (a spawned rank receives it)."""

    work: TrialWork | None  # None on a host that follows: the run comes from the main rank
    device: str  # training.device
    cpu_threads: int  # each rank's share of this process's CPU threads
    # Each rank's line to the launching process (by local rank): it says its pid when it
    # starts and how it ended (its error, or done); local rank 0's on the leading host, the
    # main rank, also carries the run's callbacks.
    conns: list[Connection]
    # A trial across hosts: its rendezvous, where a rank of a host that follows leaves its error
    # for the first host's ranks (trainer.follower_failures). None: one host.
    endpoint: str | None = None


def train_distributed(
    job: TrainJob,
    data: PreparedData,
    on_evaluation: OnEvaluation | None = None,
    metric: str | None = None,
    checkpoints: CheckpointStore | None = None,
    should_stop: ShouldStop | None = None,
    on_progress: OnProgress | None = None,
    user_metrics: UserMetrics | None = None,
    batch_cache: RankBatchCache | None = None,
) -> TrainResult:
    """hpo.trainer.loop.train across `job.training.world_size` ranks: the same arguments and
    result (rank 0's); `batch_cache`: the study's, for `physical_batch_size: auto`. A sharded
    step's OOM starts every rank again at half the batch (restarted_after_oom), a sharded
    evaluation's at half the evaluation batch (restarted_after_evaluation_oom). Raises
    OutOfMemoryAtBatchOne when one example fits on no rank, rank 0's
    own error when it raised, and RankFailed when another rank ended the run."""
    local_ranks = job.training.ranks_per_node
    device = dev.resolve_device(job.training.device)
    _check_gpus(device, local_ranks)
    nodes = _node_place(job)
    if nodes is not None and not nodes.leads:
        raise DeviceError(
            f"this host is node {nodes.node_rank} of a trial across hosts: only node 0 runs "
            "trials, the others follow them (hpo run does, given the same config)"
        )
    place = None
    if checkpoints is not None:
        place = CheckpointPlace(checkpoints.directory, checkpoints.resume, checkpoints.interval_s)
    work = TrialWork(job, data, metric, user_metrics, place)
    oom: OutOfMemoryAtBatchOne | None = None  # the last start's, when it starts again
    while True:
        pipes = [multiprocessing.Pipe() for _ in range(local_ranks)]
        callbacks = (on_evaluation, should_stop, on_progress, checkpoints, batch_cache)
        relay = LaunchRelay(pipes[0][0], *callbacks)
        # After the last start's relay is let go: what it said holds that start's frames.
        if nodes is not None and oom is not None and not rendezvous_let_go(nodes.endpoint):
            raise oom
        try:
            return _launch_once(work, device, nodes, pipes, relay)
        except ShardedStepOutOfMemory as e:
            work = restarted_after_oom(work, e, relay.saved_state, relay.batch, batch_cache)
            oom = e.with_traceback(None)  # its traceback holds this start's frames
        except ShardedEvaluationOutOfMemory as e:
            work = restarted_after_evaluation_oom(work, e, relay.saved_state, relay.batch)
            oom = e.with_traceback(None)


def _launch_once(
    work: TrialWork,
    device: torch.device,
    nodes: NodePlace | None,
    pipes: list[tuple[Connection, Connection]],
    relay: LaunchRelay,
) -> TrainResult:
    """The ranks started once (one a pipe), `relay` serving rank 0; rank 0's result."""
    here, there = [pipe[0] for pipe in pipes], [pipe[1] for pipe in pipes]
    threads = max(1, torch.get_num_threads() // len(pipes))
    endpoint = nodes.endpoint if nodes is not None else None
    rank_job = RankJob(work, str(work.job.training.device), threads, there, endpoint)
    # The launcher's error files, read once the ranks are down; gone with the run.
    with tempfile.TemporaryDirectory(prefix="hpo-ranks-") as logs:
        launch = _Launch(_launch_config(len(pipes), device, Path(logs), nodes), rank_job)
        launch.start()
        while launch.is_alive():
            relay.serve(RELAY_POLL_S)
        relay.serve(0)  # anything rank 0 sent just before it ended
    words = [relay.words, *(last_words(conn) for conn in here[1:])]
    for conn in (*here, *there):
        conn.close()
    return launch.result(words)


def _node_place(job: TrainJob) -> NodePlace | None:
    """This host's place in a trial across hosts; None for a trial on one host."""
    settings = job.training.distributed
    return node_place(settings.nodes) if settings is not None and settings.nodes > 1 else None


@dataclass(frozen=True)
class Followed:
    """How a host that follows ended: the trials it trained, and the first host's exit code
    once its worker said it ended (None: a stop here, or no word within the idle limit)."""

    trials: int
    first_host_exit: int | None
    quiet_s: float = 0.0  # how long no trial had come when it ended


class _FirstHostEnded:
    """Whether the first host said its worker ended; asked at most every FOLLOW_ASK_S."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.asked_at = endpoint, -FOLLOW_ASK_S
        self.word = FirstHostWord(listening=False)

    def __call__(self) -> bool:
        if self.word.exit_code is None and time.monotonic() - self.asked_at >= FOLLOW_ASK_S:
            self.word = ask_first_host(self.endpoint)
            self.asked_at = time.monotonic()
        return self.word.exit_code is not None

    def ask_again(self) -> None:
        """The next call asks (a trial just ended: what listens now is news)."""
        self.asked_at = -FOLLOW_ASK_S


def follow_trials(
    ranks_per_node: int,
    device_name: str,
    nodes: NodePlace,
    stopping: Callable[[], bool],
    idle_s: float = FOLLOW_IDLE_S,
) -> Followed:
    """A host that follows (node rank above 0): this host's ranks join each trial that the
    first host starts, until `stopping()`, the first host says its worker ended (both checked
    between trials, and while waiting for one) or no trial came for `idle_s` after the last
    (the first host gone; before the first trial it may still be preparing the data:
    RDZV_JOIN_TIMEOUT_S). A trial that failed is the first host's to report; it counts as
    followed (it came)."""
    device = dev.resolve_device(device_name)
    _check_gpus(device, ranks_per_node)
    followed, last_at = 0, time.monotonic()
    ended = _FirstHostEnded(nodes.endpoint)

    def done() -> bool:
        waited = time.monotonic() - last_at
        limit_s = idle_s if followed else max(idle_s, RDZV_JOIN_TIMEOUT_S)
        return stopping() or ended() or waited > limit_s

    while not done():
        if not ended.word.listening:  # no trial's rendezvous yet: nothing to join
            time.sleep(RELAY_POLL_S)
        elif _follow_one(ranks_per_node, device, device_name, nodes, done):
            followed, last_at = followed + 1, time.monotonic()
            ended.ask_again()
    return Followed(followed, ended.word.exit_code, time.monotonic() - last_at)


def _follow_one(
    local_ranks: int,
    device: torch.device,
    device_name: str,
    nodes: NodePlace,
    stopping: Callable[[], bool],
) -> int:
    """One trial's ranks on this host: 1 once they joined it (trained, or failed: the first
    host's to report), 0 when none came (the rendezvous closed, timed out, or a stop while
    waiting)."""
    # The last trial's launcher, left in reference cycles, collected here rather than in a
    # forked rank: there a finalizer can wait forever on a lock another thread of this process
    # held at the fork (measured: a rank of the second start stuck "Garbage-collecting").
    gc.collect()
    pipes = [multiprocessing.Pipe() for _ in range(local_ranks)]
    here, there = [pipe[0] for pipe in pipes], [pipe[1] for pipe in pipes]
    threads = max(1, torch.get_num_threads() // local_ranks)
    with tempfile.TemporaryDirectory(prefix="hpo-ranks-") as logs:
        config = _launch_config(local_ranks, device, Path(logs), nodes)
        launch = _Launch(config, RankJob(None, device_name, threads, there, nodes.endpoint))
        launch.start()
        started = False
        while launch.is_alive():
            launch.join(RELAY_POLL_S)
            started = started or any(conn.poll(0) for conn in here)
            if not started and stopping():
                return 0  # only waiting: the launcher's thread ends with this process
    words = [last_words(conn) for conn in here]
    for conn in (*here, *there):
        conn.close()
    if launch.failure is None:
        return 1
    if any(w.pid is not None for w in words):
        log.warning("a trial followed failed: %s", cause(words, launch.failure))
        return 1  # it came: the first host was there
    # The last trial's rendezvous, closed; or no trial within the join timeout.
    log.debug("no trial to follow yet: %s", launch.failure)
    time.sleep(1.0)
    return 0


def _check_gpus(device: torch.device, local_ranks: int) -> None:
    if device.type == "cuda" and torch.cuda.device_count() < local_ranks:
        raise DeviceError(
            f"training.distributed.gpus_per_trial is {local_ranks} but this process sees "
            f"{torch.cuda.device_count()} GPUs; give each worker that many (hpo run --gpus)"
        )


def _launch_config(
    local_ranks: int, device: torch.device, logs: Path, nodes: NodePlace | None = None
) -> LaunchConfig:
    """`local_ranks` ranks on this host, no restart (a failed run is the trial's to retry,
    from its checkpoint). One host: a rendezvous on a free local port. Several: the one the
    first host serves at `nodes.endpoint`, which every host of the trial joins. Ranks are forked
    on the CPU (fast, and this process holds no CUDA context); spawned for GPUs, as torchrun
    does."""
    count = nodes.nodes if nodes is not None else 1
    return LaunchConfig(
        min_nodes=count,
        max_nodes=count,
        nproc_per_node=local_ranks,
        # One name for every trial across hosts (the hosts that follow cannot learn a new one):
        # each trial's rendezvous lives in a store of its own, served by its trial process.
        run_id="hpo-trial" if nodes is not None else f"hpo-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=nodes.endpoint if nodes is not None else "127.0.0.1:0",
        rdzv_configs=_rendezvous_settings(nodes),
        local_addr=nodes.local_addr if nodes is not None else None,
        max_restarts=0,
        monitor_interval=0.1,
        start_method="fork" if device.type == "cpu" else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(logs)),
    )


def _rendezvous_settings(nodes: NodePlace | None) -> dict[str, Any]:
    """Across hosts, the first serves the rendezvous and waits RDZV_JOIN_TIMEOUT_S for the
    others (they may still be finishing the last trial, or loading torch)."""
    if nodes is None:
        return {}
    return {"is_host": nodes.leads, "join_timeout": RDZV_JOIN_TIMEOUT_S}


class _Launch(threading.Thread):
    """torch's elastic launcher, run in a thread: it then leaves this process's signal handlers
    alone (a SIGTERM to a trial process checkpoints the run; in the main thread the launcher
    would take SIGTERM to kill the ranks at once), and the main thread serves rank 0."""

    def __init__(self, config: LaunchConfig, rank_job: RankJob) -> None:
        super().__init__(name="hpo-elastic-launch", daemon=True)
        self.config, self.rank_job = config, rank_job
        self.results: dict[int, Any] | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.results = elastic_launch(self.config, rank_main)(self.rank_job)
        except BaseException as e:  # noqa: BLE001 (handed to the launching thread whole)
            self.failure = e

    def result(self, words: list[RankWords]) -> TrainResult:
        """Rank 0's result; or why the run ended (see _cause)."""
        failure = self.failure
        if failure is not None or words[0].error is not None:
            raise cause(words, failure)
        # The main rank's (local rank 0 here); the others return None.
        found = [r for r in (self.results or {}).values() if isinstance(r, TrainResult)]
        if not found:
            raise RankFailed("rank 0 returned no result")
        return found[0]


@record
def rank_main(rank_job: RankJob) -> TrainResult | None:
    """One rank: join the trial's process group (the launcher set RANK, WORLD_SIZE and the
    rendezvous address), train, and return rank 0's result."""
    _die_with_the_launcher()
    # A Ctrl-C is the worker's to handle; a SIGTERM from the launcher ends a rank at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = dev.resolve_device(rank_job.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(rank_job.cpu_threads)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    conn = rank_job.conns[int(os.environ["LOCAL_RANK"])]
    say(conn, "started", os.getpid())
    work: TrialWork | None = None
    try:
        work, main = _shared_work(rank_job, rank)
        group = RankGroup(rank, world_size, device, main)
        relay = RankRelay(conn) if group.is_main else None
        result = _train_rank(work, group, relay)
    except Exception as e:
        # Before the process group goes: a peer's word is left before its connections close.
        launch = work.oom_restarts if work is not None else -1
        leads = rank_job.work is not None
        told = told_across_hosts(e, rank_job.endpoint, launch, leads, rank)
        say(conn, "error", told)
        if told is e:
            raise
        raise told from e
    finally:
        dist.destroy_process_group()
    say(conn, "ended")
    return result


def _shared_work(rank_job: RankJob, rank: int) -> tuple[TrialWork, int]:
    """The run, on every rank, and the main rank: local rank 0 of the leading host (the one
    with the work and the line to the trial process), which sends the work to the ranks of the
    hosts that follow. On one host, rank 0, and nothing sent."""
    leads = rank_job.work is not None and os.environ["LOCAL_RANK"] == "0"
    main = RankGroup.leading_rank(leads)
    box = [rank_job.work if rank == main else None]
    if int(os.environ["LOCAL_WORLD_SIZE"]) < int(os.environ["WORLD_SIZE"]):
        dist.broadcast_object_list(box, src=main)
    work = box[0] if box[0] is not None else rank_job.work
    if work is None:
        raise RankFailed("the leading host sent no run")
    return work, main


def _train_rank(work: TrialWork, group: RankGroup, relay: RankRelay | None) -> TrainResult | None:
    job, data = work.job, work.data
    training = dataclasses.replace(job.training, device=str(group.device))
    job = dataclasses.replace(job, training=training)
    batch = work.batch  # set once restarted after an OOM (see TrialWork)
    if batch is None:
        batch = agreed_physical_batch(job, data, group, relay)
        if relay is not None:
            relay.physical_batch(batch)
    size = batch.size
    job = dataclasses.replace(job, training=dataclasses.replace(training, physical_batch_size=size))
    store = _rank_store(work.checkpoints, relay)
    with simulated_budget(group.device):
        sharded = training.distributed is not None and training.distributed.strategy == "fsdp"
        kind = ShardedTrainer if sharded else DistributedTrainer
        trainer = kind(job, data, group, work.metric, work.user_metrics)
        if isinstance(trainer, ShardedTrainer) and work.oom_restarts:
            trainer.restarted_after_oom(work.oom_restarts)
        if relay is not None:
            trainer.on_progress = relay.progress
            log.info(
                "training on %d ranks of %s, %s; effective batch %d = %d x %d micro-batches x %d",
                group.world_size,
                dev.device_name(trainer.device),
                trainer.precision,
                trainer.cfg.effective_batch_size,
                trainer.physical_batch_size,
                trainer.grad_accum_steps,
                group.world_size,
            )
        fit_started_at = time.time()
        on_evaluation = relay.on_evaluation if relay is not None else None
        should_stop = relay.should_stop if relay is not None else None
        result = trainer.fit(on_evaluation, store, should_stop)
    result.fit_started_at = fit_started_at
    result.batch_search, result.batch_source = batch.search, batch.source
    if relay is not None and batch.key is not None and result.oom_recoveries:
        relay.lower(batch.key, result.physical_batch_size)  # what fits, for the next trial
    return result if group.is_main else None


def _rank_store(place: CheckpointPlace | None, relay: RankRelay | None) -> CheckpointStore | None:
    """The run's checkpoints as this rank sees them: every rank reads one to resume, rank 0
    writes them and tells the launching process of each."""
    if place is None:
        return None
    store = CheckpointStore(place.directory, place.resume, place.interval_s)
    if relay is not None:
        store.on_saved = lambda kind, path: relay.saved(kind, path, store.seconds)
    return store


def _die_with_the_launcher() -> None:
    """A rank ends when the thread that launched it does (the trial process killed): left
    running, it would hold its GPU and wait on its peers for COLLECTIVE_TIMEOUT."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
