"""A trial across hosts without a shared folder, resumed: each host's ranks see their own trial
folder, and only the main rank's holds the checkpoint (it fetched it from the artifact store) or
a follower's holds an older one. Every rank must resume from the main rank's checkpoint (DDP) or
every rank start over (FSDP, whose shares a follower lacks): never ranks at different steps."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.distributed import DistributedTrainer, RankGroup
from hpo.trainer.fsdp import ShardedTrainer
from hpo.trainer.launch import train_distributed
from hpo.trainer.loop import train
from hpo.trainer.result import TrainResult
from tests.test_distributed import across, assert_same_curve, free_port, small_job
from tests.test_fsdp import sharded


def _rank(
    rank: int, port: int, job: TrainJob, data: PreparedData, folders: list[Path], out: Path
) -> None:
    """One rank, as trainer.launch runs it, but resuming from its own host's folder."""
    torch.set_num_threads(1)  # as train_distributed gives each of 2 ranks on this 2-core host
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=len(folders),
        timeout=timedelta(seconds=60),  # ranks out of step wait in a collective: fail, not hang
    )
    try:
        group = RankGroup(rank, len(folders), torch.device("cpu"))
        fsdp = job.training.distributed is not None and job.training.distributed.strategy == "fsdp"
        trainer = (ShardedTrainer if fsdp else DistributedTrainer)(job, data, group)
        result = trainer.fit(checkpoints=CheckpointStore(folders[rank], resume=True))
        if group.is_main:
            out.write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def resumed_on_hosts(job: TrainJob, data: PreparedData, folders: list[Path]) -> TrainResult:
    """The run resumed by one rank per "host", rank r reading `folders[r]`; rank 0's result."""
    out = folders[0].parent / "result.pickle"
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, device="cpu"))
    mp.spawn(_rank, args=(free_port(), job, data, folders, out), nprocs=len(folders))
    result: TrainResult = pickle.loads(out.read_bytes())
    return result


def one_process(job: TrainJob, data: PreparedData) -> TrainResult:
    """The unstopped run, in this process: its curve is the ranks' (test_distributed, test_fsdp)."""
    alone = dataclasses.replace(job.training, distributed=None)
    return train(dataclasses.replace(job, training=alone), data)


def stopped_after(steps: int) -> Callable[[], bool]:
    """A should_stop that asks to stop once `steps` more steps without an evaluation ran: it
    is asked before the first step, then after each step that does not evaluate."""
    asked: list[int] = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) == steps + 1

    return should_stop


def checkpoints_at_1_and_5(job: TrainJob, data: PreparedData, tmp_path: Path) -> tuple[Path, Path]:
    """The main host's folder with the checkpoint at step 5, and a copy of it at step 1 (the
    follower's, written when it was the main host of an earlier attempt)."""
    main, older = tmp_path / "host-0", tmp_path / "older"
    first = train_distributed(
        job, data, checkpoints=CheckpointStore(main), should_stop=stopped_after(1)
    )
    assert (first.status, first.optimizer_steps) == ("interrupted", 1)
    shutil.copytree(main, older)
    # Steps 2 to 5: asked before step 2 and after step 3 (2 and 4 evaluate), stopped after 5.
    later = CheckpointStore(main, resume=True)
    second = train_distributed(job, data, checkpoints=later, should_stop=stopped_after(2))
    assert (second.resumed_at_step, second.status) == (1, "interrupted")
    return main, older


def test_ddp_ranks_resume_from_the_main_ranks_checkpoint_whatever_their_folder_holds(
    tmp_path: Path,
) -> None:
    """Rank 1's folder has no checkpoint, or one of step 1: it receives rank 0's (step 5), and
    the run ends as one that was never stopped (whose curve is one process's)."""
    job, data = small_job(tmp_path)
    job = across(job, 2, epochs=1)
    whole = one_process(job, data)
    main, older = checkpoints_at_1_and_5(job, data, tmp_path)
    shutil.copytree(main, tmp_path / "host-0-again")  # the resume below goes on writing there
    empty = tmp_path / "host-1"
    empty.mkdir()
    for folders in ([main, empty], [tmp_path / "host-0-again", older]):
        resumed = resumed_on_hosts(job, data, folders)
        assert resumed.status == "completed" and resumed.resumed_at_step == 5, folders[1]
        assert resumed.optimizer_steps == whole.optimizer_steps
        assert_same_curve(whole, resumed)


def test_fsdp_ranks_all_start_over_when_a_follower_lacks_the_main_ranks_shares(
    tmp_path: Path,
) -> None:
    """Rank 1's folder holds the complete sharded checkpoint of step 1, rank 0's the one of
    step 5: rank 1 cannot load step 5's shares, so every rank starts over (rather than rank 0
    at step 5 and rank 1 at step 1), and the run is a fresh one's."""
    job, data = small_job(tmp_path, epochs=1, max_grad_norm=0.5)
    job = sharded(job, 2)
    whole = one_process(job, data)
    main, older = checkpoints_at_1_and_5(job, data, tmp_path)
    assert [p.name for p in older.glob("sharded-state.*")] == ["sharded-state.1"]
    resumed = resumed_on_hosts(job, data, [main, older])
    assert resumed.status == "completed" and resumed.resumed_at_step is None
    assert resumed.optimizer_steps == whole.optimizer_steps
    assert_same_curve(whole, resumed)
