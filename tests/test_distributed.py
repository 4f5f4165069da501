"""Trials across ranks (training.distributed, DDP) on the CPU over gloo: the same loss curve as
one process at the same effective batch, resume across a stop, a rank killed, an OOM on one rank,
and the refusals (a world size that does not divide the batch, more GPUs than a worker has)."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    easy_rows,
    long_rows,
    write_csv,
)
from tests.test_trainer import tiny_job
from trainer.checkpoint import CheckpointStore
from trainer.config import DistributedSettings, TrainJob
from trainer.data import PreparedData
from trainer.launch import RankFailed, train_distributed
from trainer.loop import train
from trainer.memory import BUDGET_ENV, BUDGET_RANK_ENV, MemoryBudget
from trainer.model import load_tokenizer
from trainer.result import TrainResult
from trainer.tasks import prepare_data


def across(job: TrainJob, ranks: int, **training: Any) -> TrainJob:
    """`job` on `ranks` ranks, with `training` settings changed."""
    settings = dataclasses.replace(job.training, distributed=DistributedSettings(ranks), **training)
    return dataclasses.replace(job, training=settings)


@pytest.fixture
def small(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
    """62 examples in steps of 12: the epoch's last step has 2, so a third rank has none."""
    folder = tmp_path / "data"
    folder.mkdir()
    train_file = write_csv(folder / "train.csv", easy_rows(62, 1))
    eval_file = write_csv(folder / "eval.csv", easy_rows(16, 2))
    job = tiny_job(
        train_file,
        eval_file,
        seed=3,
        effective_batch_size=12,
        physical_batch_size=2,
        epochs=2,
        evals_per_epoch=3,
        log_every_steps=1,
    )
    job.model.dropout = 0.0  # one process draws other dropout masks than several ranks
    return job, prepare_data(job.data, load_tokenizer(job.model))


def curve(result: TrainResult) -> list[float]:
    """The training loss and the evaluation loss at each evaluation, in a row."""
    return [v for e in result.evaluations for v in (e.train_loss or 0.0, e.metrics["eval_loss"])]


def assert_same_curve(a: TrainResult, b: TrainResult) -> None:
    assert len(a.evaluations) == len(b.evaluations) > 0
    assert curve(a) == pytest.approx(curve(b), abs=1e-4)


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_loss_curve_is_the_one_process_curve(
    small: tuple[TrainJob, PreparedData], ranks: int
) -> None:
    job, data = small
    one = train(job, data)
    several = train_distributed(across(job, ranks), data)
    assert several.status == "completed"
    assert several.effective_batch_size == 12 and several.optimizer_steps == one.optimizer_steps
    assert several.grad_accum_steps == -(-12 // ranks // 2)  # the share of a rank, in 2s
    assert_same_curve(one, several)


def test_a_run_stopped_and_resumed_ends_as_one_that_was_not(
    small: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    job, data = small
    job = across(job, 2, epochs=1)
    whole = train_distributed(job, data)
    asked: list[int] = []

    def stop_after_step_5() -> bool:  # asked before step 1, then after each step that does
        asked.append(1)  # not evaluate (evaluations after steps 2, 4 and 6)
        return len(asked) == 4

    folder = tmp_path / "checkpoints"
    first = train_distributed(
        job, data, checkpoints=CheckpointStore(folder), should_stop=stop_after_step_5
    )
    assert (first.status, first.optimizer_steps) == ("interrupted", 5)
    resumed = train_distributed(job, data, checkpoints=CheckpointStore(folder, resume=True))
    assert resumed.status == "completed" and resumed.resumed_at_step == 5
    assert resumed.optimizer_steps == whole.optimizer_steps
    assert_same_curve(whole, resumed)


def child_pids() -> list[int]:
    """This process's children (the ranks: forked by the launcher's thread), oldest first."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.append(int(name))
    return sorted(found)


def test_a_rank_killed_mid_step_fails_the_run_with_its_reason_and_the_retry_resumes(
    small: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    job, data = small
    job = across(job, 2, epochs=1)
    killed: list[int] = []

    def kill_a_rank(progress: dict[str, Any]) -> None:
        if progress["step"] >= 3 and not killed:  # past the checkpoint of evaluation 1
            killed.append(child_pids()[-1])  # the rank started last: rank 1
            os.kill(killed[0], signal.SIGKILL)

    folder = tmp_path / "checkpoints"
    with pytest.raises(RankFailed, match=r"rank \d \(pid \d+\) was killed by SIGKILL") as failed:
        train_distributed(job, data, checkpoints=CheckpointStore(folder), on_progress=kill_a_rank)
    assert f"pid {killed[0]}" in str(failed.value)
    retry = train_distributed(job, data, checkpoints=CheckpointStore(folder, resume=True))
    assert retry.status == "completed" and retry.resumed_at_step == 2
    assert child_pids() == []  # no rank left behind


@pytest.fixture
def long_job(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
    """Long sequences and eager attention: activations, not weights, decide what fits. Each
    rank's share of a step (8) accumulates at 4 and at 2, so the peak grows with the batch."""
    train_file = write_csv(tmp_path / "long.csv", long_rows(32))
    eval_file = write_csv(tmp_path / "long-eval.csv", long_rows(4))
    job = tiny_job(
        train_file, eval_file, seed=3, physical_batch_size=4, effective_batch_size=16, epochs=1
    )
    job.model.dropout = 0.0
    job.data.max_length = 256
    job.model.attn_implementation = "eager"
    job.model.config = {**(job.model.config or {}), "max_position_embeddings": 256}
    job.training.eval_batch_size = 1
    job.training.evals_per_epoch = 2
    return job, prepare_data(job.data, load_tokenizer(job.model))


def training_peak(job: TrainJob, data: PreparedData, physical: int) -> int:
    """Peak bytes of one process training a rank's share (half the step) at a physical batch."""
    share = job.training.effective_batch_size // 2
    training = dataclasses.replace(
        job.training, physical_batch_size=physical, effective_batch_size=share
    )
    with MemoryBudget(1 << 62) as budget:
        train(dataclasses.replace(job, training=training), data)
    return budget.peak_bytes


def test_an_oom_on_one_rank_steps_every_rank_down_together(
    long_job: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = long_job
    reference = train(job, data)
    peaks = [training_peak(job, data, physical) for physical in (2, 4)]
    monkeypatch.setenv(BUDGET_ENV, str((peaks[0] + peaks[1]) // 2))  # 2 fits, 4 does not
    monkeypatch.setenv(BUDGET_RANK_ENV, "1")  # on rank 1 alone
    result = train_distributed(across(job, 2), data)
    # Rank 0 (whose result this is) had memory to spare: it stepped down with rank 1.
    assert (result.physical_batch_size, result.grad_accum_steps) == (2, 4)
    assert result.oom_recoveries == 1 and result.status == "completed"
    assert_same_curve(reference, result)
