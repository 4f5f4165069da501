"""Trials across ranks (training.distributed, DDP) on the CPU over gloo: the same loss curve as
one process at the same effective batch, resume across a stop, a rank killed, an OOM on one rank,
and the refusals (a world size that does not divide the batch, more GPUs than a worker has)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hpo.commands.launcher import gpu_groups, select_gpus
from hpo.errors import ConfigError
from hpo.trainer.batch_finder import find_physical_batch_size
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import DistributedSettings, TrainingConfig, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.distributed import BUCKET_MB_ENV
from hpo.trainer.launch import RankFailed, train_distributed
from hpo.trainer.loop import train
from hpo.trainer.memory import BUDGET_ENV, BUDGET_RANK_ENV, OPTIMIZER_OOM_ENV, MemoryBudget
from hpo.trainer.model import load_tokenizer
from hpo.trainer.result import TrainResult
from hpo.trainer.tasks import prepare_data
from tests.conftest import (
    MINILM_TOKENIZER,
    TINY_BERT,
    easy_rows,
    long_rows,
    run_hpo,
    start_hpo,
    study_exists,
    tiny_config,
    write_config,
    write_csv,
)
from tests.test_batch_finder import probe_peak
from tests.test_trainer import tiny_job


def across(job: TrainJob, ranks: int, **training: Any) -> TrainJob:
    """`job` on `ranks` ranks, with `training` settings changed."""
    settings = dataclasses.replace(job.training, distributed=DistributedSettings(ranks), **training)
    return dataclasses.replace(job, training=settings)


def small_job(tmp_path: Path, **training: Any) -> tuple[TrainJob, PreparedData]:
    """62 examples in steps of 12: the epoch's last step has 2, so a third rank has none;
    `training` settings beside these."""
    folder = tmp_path / "data"
    folder.mkdir()
    train_file = write_csv(folder / "train.csv", easy_rows(62, 1))
    eval_file = write_csv(folder / "eval.csv", easy_rows(16, 2))
    settings = {"epochs": 2, **training}
    job = tiny_job(
        train_file,
        eval_file,
        seed=3,
        effective_batch_size=12,
        physical_batch_size=2,
        evals_per_epoch=3,
        log_every_steps=1,
        **settings,
    )
    job.model.dropout = 0.0  # one process draws other dropout masks than several ranks
    return job, prepare_data(job.data, load_tokenizer(job.model))


@pytest.fixture
def small(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
    return small_job(tmp_path)


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


def test_shared_evaluation_gives_exactly_the_one_process_metrics(
    small: tuple[TrainJob, PreparedData],
) -> None:
    """3 ranks each evaluate a share of 6 evaluation batches (16 rows in 3s: the last batch is
    short), gathered in the one-process order: the same metrics, to the last bit. With the
    learning rate at 0 every evaluation sees the initial weights, so only evaluation differs."""
    job, data = small
    job = across(job, 1, learning_rate=0.0, eval_batch_size=3, max_steps=4, evals_per_epoch=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: a CPU matmul's sums depend on the thread count
    try:
        one = train(
            dataclasses.replace(job, training=dataclasses.replace(job.training, distributed=None)),
            data,
        )
    finally:
        torch.set_num_threads(threads)
    several = train_distributed(across(job, 3), data)
    assert [e.metrics for e in several.evaluations] == [e.metrics for e in one.evaluations]
    assert len(one.evaluations) == 2 and set(one.evaluations[0].metrics) >= {
        "eval_loss",
        "accuracy",
    }


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
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if int(parent) == os.getpid() and state != "Z":  # a zombie is dead, not yet reaped
            found.append(int(name))
    return sorted(found)


def ranks_gone(before: set[int], deadline_s: float = 30.0) -> list[int]:
    """This process's live children not in `before` (what earlier tests in this process left
    running, such as a multiprocessing fork server) once they are gone, or those still there
    at the deadline: a rank that ended may still be exiting when the launcher returns."""
    deadline = time.monotonic() + deadline_s
    while (alive := sorted(set(child_pids()) - before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_a_rank_killed_mid_step_fails_the_run_with_its_reason_and_the_retry_resumes(
    small: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    job, data = small
    job = across(job, 2, epochs=1)
    killed: list[int] = []
    before = set(child_pids())  # other tests' processes, in this process (a pytest-xdist worker)

    def kill_a_rank(progress: dict[str, Any]) -> None:
        if progress["step"] >= 3 and not killed:  # past the checkpoint of evaluation 1
            killed.append(sorted(set(child_pids()) - before)[-1])  # the rank started last: 1
            os.kill(killed[0], signal.SIGKILL)

    folder = tmp_path / "checkpoints"
    said = r"rank \d \(pid \d+\) (was killed by SIGKILL|ended without an error of its own)"
    with pytest.raises(RankFailed, match=said) as failed:
        train_distributed(job, data, checkpoints=CheckpointStore(folder), on_progress=kill_a_rank)
    assert f"pid {killed[0]}" in str(failed.value)
    retry = train_distributed(job, data, checkpoints=CheckpointStore(folder, resume=True))
    assert retry.status == "completed" and retry.resumed_at_step == 2
    assert ranks_gone(before) == []  # no rank left behind


@pytest.fixture
def long_job(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
    return long_job_in(tmp_path)


def long_job_in(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
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
    # The peaks differ by 0.1 MB (the optimizer step's peak is close to the backward's), and a
    # rank's gradient buckets move its peak by as much: summed one parameter at a time, a rank
    # needs what one process does.
    monkeypatch.setenv(BUCKET_MB_ENV, "0")
    result = train_distributed(across(job, 2), data)
    # Rank 0 (whose result this is) had memory to spare: it stepped down with rank 1.
    assert (result.physical_batch_size, result.grad_accum_steps) == (2, 4)
    assert result.oom_recoveries == 1 and result.status == "completed"
    assert_same_curve(reference, result)


def test_an_oom_in_one_ranks_optimizer_step_steps_every_rank_down_together(
    long_job: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 runs out of memory reserving its optimizer step's memory (the test hook) on step
    2, after every rank's backward: no weight changed on any rank, so all redo the step at half
    the micro-batch and the curve is the one-process curve."""
    job, data = long_job
    reference = train(job, data)
    monkeypatch.setenv(OPTIMIZER_OOM_ENV, "2")
    monkeypatch.setenv(BUDGET_RANK_ENV, "1")
    result = train_distributed(across(job, 2), data)
    assert (result.physical_batch_size, result.grad_accum_steps) == (2, 4)
    assert result.oom_recoveries == 1 and result.status == "completed"
    assert_same_curve(reference, result)


def test_an_oom_midway_through_one_ranks_update_fails_every_rank_naming_it(
    small: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the reservation, an OOM inside rank 1's update (its weights half updated) cannot
    be redone: every rank fails together, with the reason, rather than hang or go on apart."""
    from hpo.trainer import distributed

    job, data = small
    real_step = distributed.optimizer_step

    def update_failing_on_rank_1(*args: Any, **kwargs: Any) -> None:
        if os.environ.get("RANK") == "1":  # the ranks are forked: they inherit this patch
            raise torch.OutOfMemoryError("CUDA out of memory (test: inside the update)")
        real_step(*args, **kwargs)

    monkeypatch.setattr(distributed, "optimizer_step", update_failing_on_rank_1)
    with pytest.raises(distributed.OptimizerStepOutOfMemory, match="step on rank 1, after"):
        train_distributed(across(job, 2, max_steps=2), data)


def test_the_worst_rank_decides_the_physical_batch(
    long_job: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = long_job
    job.training.physical_batch_size = "auto"
    job.training.batch_search_start = 2
    job.training.batch_search_max = 8
    job.training.max_steps = 1
    peaks = [probe_peak(job, data.label_names, size) for size in (2, 4)]
    monkeypatch.setenv(BUDGET_ENV, str(sum(peaks) // 2))  # a probe at 2 fits, at 4 not
    alone = find_physical_batch_size(job, data.label_names).chosen  # what the budget allows
    assert 0 < alone < 8
    monkeypatch.setenv(BUDGET_RANK_ENV, "1")  # only rank 1 is short of memory
    result = train_distributed(across(job, 2), data)
    assert result.physical_batch_size == alone  # rank 0 alone would have taken 8 (its bound)


class DictBatchCache:
    """The study's batch-size cache as the main rank sees it, in a dict."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.keys: list[dict[str, Any]] = []

    def get(self, key: dict[str, Any]) -> int | None:
        return self.sizes.get(repr(sorted(key.items())))

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        self.keys.append(key)
        return self.sizes.setdefault(repr(sorted(key.items())), physical_batch_size)

    def lower(self, key: dict[str, Any], physical_batch_size: int) -> None:
        self.sizes[repr(sorted(key.items()))] = physical_batch_size


def test_the_agreed_batch_is_cached_for_the_next_trial_at_the_same_world_size(
    long_job: tuple[TrainJob, PreparedData],
) -> None:
    job, data = long_job
    job.training.physical_batch_size = "auto"
    job.training.batch_search_start = 2
    job.training.batch_search_max = 4
    job.training.max_steps = 1
    cache = DictBatchCache()
    first = train_distributed(across(job, 2), data, batch_cache=cache)
    assert first.batch_source == "search" and first.batch_search is not None
    (key,) = cache.keys
    assert (key["ranks"], key["strategy"]) == (2, "ddp")  # one GPU's key, and the world's
    again = train_distributed(across(job, 2), data, batch_cache=cache)
    assert (again.batch_source, again.batch_search) == ("cache", None)
    assert again.physical_batch_size == first.physical_batch_size
    cache.lower(key, 1)  # as after an OOM recovery: the next trial takes the lowered size
    assert train_distributed(across(job, 2), data, batch_cache=cache).physical_batch_size == 1


def test_distributed_settings_are_checked() -> None:
    refused = TrainingConfig(effective_batch_size=30, distributed=DistributedSettings(4))
    assert [key for key, _, _ in refused.problems()] == ["effective_batch_size"]
    assert "multiple of distributed.gpus_per_trial (4)" in refused.problems()[0][2]
    assert (
        TrainingConfig(effective_batch_size=32, distributed=DistributedSettings(4)).problems() == []
    )
    assert [k for k, _, _ in DistributedSettings(0).problems()] == ["gpus_per_trial"]
    assert DistributedSettings(2, "fsdp").problems() == []  # tests/test_fsdp.py trains it
    assert TrainingConfig().world_size == 1


@pytest.mark.parametrize(
    ("training", "space", "expected"),
    [
        ({"distributed": {"gpus_per_trial": 3}}, None, "training.effective_batch_size: must be "),
        (
            {"effective_batch_size": 6, "distributed": {"gpus_per_trial": 3}},
            {"type": "categorical", "choices": [6, 8]},
            "search_space.effective_batch_size: value 8 must be a multiple of",
        ),
    ],
)
def test_a_world_size_that_does_not_divide_the_batch_is_one_line_and_exit_2(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    training: dict[str, Any],
    space: dict[str, Any] | None,
    expected: str,
) -> None:
    raw = tiny_config(*easy_data, training=training)
    if space is not None:
        raw["search_space"]["effective_batch_size"] = space
    config = write_config(tmp_path / "c.yaml", raw)
    database = tmp_path / "s.db"
    done = run_hpo(
        "run",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        f"sqlite:///{database}",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and expected in done.stderr
    assert not database.exists()  # nothing written


def test_workers_own_gpus_per_trial_of_the_gpus_given() -> None:
    eight = [str(i) for i in range(8)]
    assert gpu_groups(select_gpus("auto", eight), 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_groups(select_gpus("0,1,2,3", eight), 2) == ["0,1", "2,3"]
    assert gpu_groups(select_gpus("0,1,2", eight), 2) == ["0,1"]  # GPU 2 idle, and logged
    assert gpu_groups(["0", "1"], 1) == ["0", "1"]
    with pytest.raises(ConfigError, match="--gpus: 1 GPU .0. for trials of 2"):
        gpu_groups(select_gpus("0", eight), 2)


class _RecordingTrial:
    def __init__(self) -> None:
        self.user_attrs: dict[str, Any] = {}

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value


def test_a_trial_whose_rank_failed_is_handed_back_with_the_reason() -> None:
    """The trial process says "handed_back" (training.py turns RankFailed into HandBack): the
    worker records the reason and queues the trial again (hpo.study.loop.run_trial)."""
    from hpo.stopping import HandBack, StopRequest
    from hpo.trial.process import _result

    trial = _RecordingTrial()
    reason = "a rank failed: rank 1 (pid 7) was killed by SIGKILL"
    with pytest.raises(HandBack, match="killed by SIGKILL"):
        _result(trial, ("handed_back", reason), 0, StopRequest())  # type: ignore[arg-type]
    assert trial.user_attrs["fail_reason"] == reason


def test_a_token_task_divides_by_the_counted_tokens_of_every_rank(tmp_path: Path) -> None:
    """Token classification: each rank holds a different number of counted tokens, and the
    step's loss is the sum over every rank's tokens divided by all of them, as in one process."""
    from hpo.trainer.config import ModelConfig
    from tests.test_token_classification import TASK, data_config, ner_rows, write_jsonl

    train_file = write_jsonl(tmp_path / "train.jsonl", ner_rows(40, 1))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", ner_rows(12, 2))
    training = TrainingConfig(
        effective_batch_size=8,
        physical_batch_size=2,
        learning_rate=3e-3,
        max_steps=4,
        evals_per_epoch=2,
        log_every_steps=1,
        device="cpu",
        seed=3,
    )
    model = ModelConfig(
        config={**TINY_BERT, "hidden_dropout_prob": 0.0}, tokenizer=MINILM_TOKENIZER
    )
    model.dropout = 0.0
    job = TrainJob(data_config(train_file, eval_file), model, training, task=TASK)
    data = prepare_data(job.data, load_tokenizer(job.model, TASK), TASK)
    assert_same_curve(train(job, data), train_distributed(across(job, 2), data))


def test_the_reason_names_the_rank_that_ended_the_run() -> None:
    """Why a run ended, from what each rank said of itself: its own error first (rank 0's as
    raised), then a rank that died without a word; a collective that failed for want of a
    peer is never the reason."""
    from hpo.trainer.memory import OutOfMemoryAtBatchOne
    from hpo.trainer.rank_failures import RankWords, cause

    lost = RuntimeError("Connection reset by peer")
    killed = [RankWords(10, True, lost), RankWords(11)]  # rank 1 said nothing more
    assert str(cause(killed, None)).startswith("rank 1 (pid 11) ended without an error")
    own = [RankWords(10), RankWords(11, True, ValueError("bad row 7"))]  # rank 0 then stopped
    assert str(cause(own, None)) == "rank 1 (pid 11): ValueError: bad row 7"
    oom = OutOfMemoryAtBatchOne("not even 1 example")
    assert cause([RankWords(10, True, oom), RankWords(11, True, oom)], None) is oom


@pytest.mark.slow
def test_a_worker_stopped_mid_trial_hands_it_back_and_the_retry_resumes(tmp_path: Path) -> None:
    """SIGTERM to `hpo run` while a trial trains on 2 ranks: rank 0 hears the stop (through its
    launching trial process), every rank stops at the same step, rank 0 checkpoints, the trial
    is queued again, and the next `hpo run` resumes it: with --gpus 0,1,2,3 and 2 per trial,
    as one of 2 workers that each own 2 GPUs (fake GPUs: CPU ranks over gloo)."""
    train_file = write_csv(tmp_path / "train.csv", easy_rows(256, 1))
    eval_file = write_csv(tmp_path / "eval.csv", easy_rows(16, 2))
    training = {"distributed": {"gpus_per_trial": 2}, "effective_batch_size": 8, "epochs": 6}
    raw = tiny_config(train_file, eval_file, study={"n_trials": 1}, training=training)
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 's.db'}"
    args = ("run", "--study", "s", "--config", str(config), "--storage", url)
    worker = start_hpo(*args, cwd=tmp_path)
    reported = False  # the trial trains once it reported an evaluation
    deadline = time.monotonic() + 180
    while not reported and time.monotonic() < deadline and worker.poll() is None:
        if study_exists(url, "s"):
            trials = optuna.load_study(study_name="s", storage=url).get_trials()
            reported = any(t.intermediate_values for t in trials)
        time.sleep(0.2)
    assert reported, worker.communicate()[1][-3000:] if worker.poll() is not None else "no report"
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=120) == 0, worker.communicate()[1][-3000:]
    fake_gpus = {"HPO_TEST_FAKE_GPUS": "4"}
    resumed = run_hpo(*args, "--gpus", "0,1,2,3", cwd=tmp_path, env=fake_gpus)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "started 2 workers: GPUs 0,1, 2,3" in resumed.stderr
    first, retry = optuna.load_study(study_name="s", storage=url).get_trials()
    assert first.state == TrialState.FAIL and "SIGTERM" in first.user_attrs["fail_reason"]
    assert first.user_attrs["checkpoint_s"] > 0
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_at_step"] > 0
    assert retry.user_attrs["ranks"] == 2 and retry.user_attrs["gpu"] in {"gpu0+1", "gpu2+3"}
    assert retry.user_attrs["batch_size_source"] == "config"


def test_the_default_space_fitted_to_small_data_keeps_batches_the_ranks_divide(
    easy_data: tuple[Path, Path],
) -> None:
    from hpo.config.data_size import fit_default_space
    from hpo.config.loader import parse_config

    raw = tiny_config(*easy_data, training={"distributed": {"gpus_per_trial": 2}})
    del raw["search_space"]["effective_batch_size"]  # hpo's default choices, fitted to the data
    config = parse_config(raw, easy_data[0].parent)
    assert fit_default_space(config, 40) is not None  # 4 steps an epoch at most: 1, 2 and 4
    assert config.search_space["effective_batch_size"].choices == [2, 4]


def test_more_gpus_per_trial_than_a_worker_is_given_is_one_line_and_exit_2(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data, training={"distributed": {"gpus_per_trial": 2}})
    config = write_config(tmp_path / "c.yaml", raw)
    database = tmp_path / "s.db"
    args = ("run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}")
    done = run_hpo(*args, "--gpus", "0", cwd=tmp_path, env={"HPO_TEST_FAKE_GPUS": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "hpo: error: command line: --gpus: 1 GPU (0) for trials of 2 "
        "(training.distributed.gpus_per_trial): give at least 2 GPUs, or lower gpus_per_trial"
    ]
    assert not database.exists()


def test_a_cuda_worker_that_sees_too_few_gpus_is_refused_before_any_trial(
    easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.commands import launcher, run
    from hpo.commands.requests import RunRequest
    from hpo.config.loader import parse_config

    raw = tiny_config(*easy_data, training={"device": "cuda", "distributed": {}})
    config = parse_config(raw, easy_data[0].parent)
    monkeypatch.delenv(launcher.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0"])
    with pytest.raises(ConfigError, match="2 GPUs per trial, but this worker sees 1"):
        run._check_gpus_per_trial(config, [], None, RunRequest("s"))
    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0", "1"])
    run._check_gpus_per_trial(config, [], None, RunRequest("s"))  # enough


# srun on a 2-node allocation, on this host: one task per "node", each told its node by
# SLURM_NODEID as srun tells it; a SIGTERM goes to both. It writes each node's pid to
# $FAKE_LOG/pids and, as each ends, "node exit-code seconds-since-epoch" to $FAKE_LOG/ended.
FAKE_SRUN_NODES = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
declare -A node_of
pids=()
for node in 0 1; do
  # $FAKE_NODE1_OOM_AT_STEP: node 1's ranks alone run out of memory in that sharded step.
  oom_at=""; [[ $node == 1 ]] && oom_at="${FAKE_NODE1_OOM_AT_STEP:-}"
  SLURM_NODEID=$node SLURM_JOB_NUM_NODES=2 HPO_TEST_SHARDED_OOM_AT_STEP="$oom_at" "$@" \
    2> "$FAKE_LOG/node$node.err" &
  pids+=($!)
  node_of[$!]=$node
  echo "$node $!" >> "$FAKE_LOG/pids"
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
while (( ${#node_of[@]} )); do
  ended=""
  until [[ -n "$ended" ]]; do wait -n -p ended "${!node_of[@]}"; code=$?; done
  echo "${node_of[$ended]} $code $(date +%s.%N)" >> "$FAKE_LOG/ended"
  unset "node_of[$ended]"
  [[ $code == 0 ]] || status=$code
done
exit "$status"
"""


def start_two_nodes(tmp_path: Path, raw: dict[str, Any], **env: str) -> Any:
    """deploy/slurm/hpo-workers.sbatch on study "n" with config `raw`, its two "nodes" on this
    host (the fake srun) in a session of their own, `env` added."""
    import subprocess
    import sys

    from tests.conftest import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN_NODES)
    (bin_dir / "hpo").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -m hpo "$@"\n')
    for name in ("srun", "hpo"):
        (bin_dir / name).chmod(0o755)
    config = write_config(tmp_path / "c.yaml", raw)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "FAKE_LOG": str(tmp_path),
        "HPO_STORAGE": f"sqlite:///{tmp_path / 'n.db'}",
        "HPO_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "HPO_NODE_ADDR": "127.0.0.1",
        **env,
    }
    sbatch = REPO / "deploy" / "slurm" / "hpo-workers.sbatch"
    return subprocess.Popen(
        ["bash", str(sbatch), "n", str(config)], env=env, cwd=tmp_path, start_new_session=True
    )


def run_two_nodes(
    tmp_path: Path, raw: dict[str, Any], **env: str
) -> tuple[int, list[str], list[str]]:
    """start_two_nodes, waited for (4 minutes at most), then the whole fake job killed, whatever
    became of it: its exit code, each node's stderr, and each one's last 3,000 characters."""
    job_script = start_two_nodes(tmp_path, raw, **env)
    try:
        returncode = job_script.wait(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job_script.pid, signal.SIGKILL)
    full = [(tmp_path / f"node{i}.err").read_text() for i in (0, 1)]
    return returncode, full, [text[-3000:] for text in full]


def one_trial_config(easy_data: tuple[Path, Path], training: dict[str, Any]) -> dict[str, Any]:
    """A study of one trial at one learning rate, without dropout (the same masks as one
    process), trained as `training` says."""
    space = {"learning_rate": {"type": "categorical", "choices": [3e-3]}}
    raw = tiny_config(*easy_data, study={"n_trials": 1}, search_space=space, training=training)
    raw["model"]["config"]["hidden_dropout_prob"] = 0.0
    raw["model"]["config"]["attention_probs_dropout_prob"] = 0.0
    return raw


def one_process_run(
    raw: dict[str, Any], tmp_path: Path, trial: optuna.trial.FrozenTrial
) -> TrainResult:
    """`trial` of config `raw` trained again by one process, as the ranks should have."""
    from hpo.config.loader import parse_config
    from hpo.config.search_paths import with_params

    job = with_params(parse_config(raw, tmp_path), trial.params)
    job.training.distributed = None
    return train(job, prepare_data(job.data, load_tokenizer(job.model)))


def ended_nodes(tmp_path: Path) -> dict[int, tuple[int, float]]:
    """Each node's exit code and when it ended, as the fake srun wrote them."""
    rows = (line.split() for line in (tmp_path / "ended").read_text().splitlines())
    return {int(node): (int(code), float(at)) for node, code, at in rows}


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_the_slurm_recipe_trains_a_trial_across_two_nodes_as_one_process_would(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    """deploy/slurm/hpo-workers.sbatch on 2 "nodes" of this host (a fake srun): node 0's
    `hpo run` trains the trial on 1 rank, node 1's follows it with 1 more (one rendezvous on
    127.0.0.1, gloo); the trial's losses are those of one process at the same batch."""
    training = {"max_steps": 4, "distributed": {"gpus_per_trial": 1, "nodes": 2}}
    raw = one_trial_config(easy_data, training)
    # Only node 0's last word can end node 1 in time: its idle limit is far longer.
    returncode, full, logs = run_two_nodes(tmp_path, raw, HPO_FOLLOW_IDLE_S="300")
    assert returncode == 0, logs
    assert "following the trials of the first host" in full[1] and "followed 1 trials" in full[1]
    assert "the first host's worker ended (exit code 0)" in logs[1], logs
    assert "told 1 of 1 following hosts that the worker ended" in logs[0], logs
    ended = ended_nodes(tmp_path)
    assert ended[0][0] == ended[1][0] == 0 and abs(ended[1][1] - ended[0][1]) < 10, ended
    url = f"sqlite:///{tmp_path / 'n.db'}"
    (trial,) = optuna.load_study(study_name="n", storage=url).get_trials()
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["ranks"] == 2, logs
    one = one_process_run(raw, tmp_path, trial)
    best = trial.user_attrs["best_evaluation"]
    assert trial.user_attrs["curve"] == pytest.approx(one.curve, abs=1e-4)
    assert best["metrics"]["eval_loss"] == pytest.approx(one.best.metrics["eval_loss"], abs=1e-4)
    assert best["train_loss"] == pytest.approx(one.best.train_loss, abs=1e-4)


@pytest.mark.slow
def test_an_oom_on_a_host_that_follows_starts_the_ranks_of_every_host_again(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    """The Slurm recipe on 2 "nodes" (the fake srun), an fsdp trial of one rank on each; node
    1's rank runs out of memory in step 3. Its line to a launching process ends on node 1, so
    it leaves its error in the trial's rendezvous store; node 0's rank, which then loses its
    peer, raises that error, and node 0's trial process starts the ranks of both hosts again
    at half the physical batch, which node 1 follows as a second trial. The trial completes
    with the one-process curve. (Without collecting the last start's garbage before forking,
    node 1's new rank hung in the garbage collector.)"""
    distributed = {"gpus_per_trial": 1, "nodes": 2, "strategy": "fsdp"}
    training = {"max_steps": 4, "physical_batch_size": 4, "distributed": distributed}
    raw = one_trial_config(easy_data, training)
    env = {"HPO_FOLLOW_IDLE_S": "300", "FAKE_NODE1_OOM_AT_STEP": "3"}
    returncode, full, logs = run_two_nodes(tmp_path, raw, **env)
    assert returncode == 0, logs
    assert "a trial followed failed: out of memory on rank" in full[1], logs
    assert "followed 2 trials" in full[1], logs  # the first start, and the one after the OOM
    assert "every rank starts again at half the batch (physical batch 2" in full[0], logs
    url = f"sqlite:///{tmp_path / 'n.db'}"
    (trial,) = optuna.load_study(study_name="n", storage=url).get_trials()
    attrs = trial.user_attrs
    assert trial.state == TrialState.COMPLETE, logs
    assert (attrs["ranks"], attrs["oom_recoveries"], attrs["physical_batch_size"]) == (2, 1, 2)
    one = one_process_run(raw, tmp_path, trial)
    assert attrs["curve"] == pytest.approx(one.curve, abs=1e-4)


def test_hosts_that_follow_hear_the_first_hosts_last_word_and_end_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first host's last word at the rendezvous port: each host that follows hears its exit
    code and answers, and the first stops serving once all did; nothing listening, or a
    listener that says nothing (a trial's rendezvous), is no word."""
    import socket
    import threading

    from hpo.trainer import launch
    from hpo.trainer.nodes import FirstHostWord, NodePlace, ask_first_host, tell_the_end

    endpoint = f"127.0.0.1:{free_port()}"
    assert ask_first_host(endpoint).listening is False
    with socket.create_server(("127.0.0.1", int(endpoint.split(":")[1]))):
        assert ask_first_host(endpoint) == FirstHostWord(listening=True, exit_code=None)
    told: list[int] = []
    first = NodePlace(3, 0, endpoint, None)
    serving = threading.Thread(target=lambda: told.append(tell_the_end(first, 3, wait_s=30)))
    serving.start()
    started = time.monotonic()
    followed = launch.follow_trials(1, "cpu", NodePlace(3, 1, endpoint, None), lambda: False)
    assert (followed.trials, followed.first_host_exit) == (0, 3)
    assert ask_first_host(endpoint).exit_code == 3  # the third host
    serving.join(timeout=10)
    assert told == [2] and time.monotonic() - started < 10  # not the 30 s it would wait
    # No word and no trial: the first host is gone; the idle limit ends the host that follows.
    monkeypatch.setattr(launch, "RDZV_JOIN_TIMEOUT_S", 0)
    alone = NodePlace(2, 1, f"127.0.0.1:{free_port()}", None)
    gone = launch.follow_trials(1, "cpu", alone, lambda: False, idle_s=0.5)
    assert (gone.trials, gone.first_host_exit) == (0, None) and gone.quiet_s > 0.5


def test_a_host_follows_only_as_the_one_worker_of_a_later_node(
    easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.commands.follow import following_place
    from hpo.config.loader import parse_config

    raw = tiny_config(*easy_data, training={"distributed": {"gpus_per_trial": 1, "nodes": 2}})
    config = parse_config(raw, easy_data[0].parent)
    monkeypatch.setenv("HPO_RDZV_ENDPOINT", "10.0.0.5:29500")
    monkeypatch.setenv("HPO_NODE_RANK", "0")
    assert following_place(config, []) is None  # the first host runs the trials
    monkeypatch.setenv("HPO_NODE_RANK", "1")
    assert following_place(config, ["0"]).node_rank == 1  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="runs one worker per host"):
        following_place(config, ["0", "1"])
    config.training.distributed = None
    assert following_place(config, ["0", "1"]) is None  # one host per trial: nothing to follow


def test_each_host_finds_its_place_from_slurm_kubernetes_or_hpo_variables() -> None:
    from hpo.trainer.errors import DeviceError
    from hpo.trainer.nodes import first_host, node_place

    slurm = {"SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]"}
    place = node_place(4, slurm)
    assert (place.node_rank, place.endpoint, place.leads) == (1, "gpu07:29400", False)
    indexed_job = {"JOB_COMPLETION_INDEX": "0", "MASTER_ADDR": "hpo-0.hpo", "MASTER_PORT": "23456"}
    assert node_place(2, indexed_job).endpoint == "hpo-0.hpo:23456"
    own = {**slurm, "HPO_NODE_RANK": "0", "HPO_RDZV_ENDPOINT": "10.0.0.5:29500"}
    assert (node_place(2, own).node_rank, node_place(2, own).endpoint) == (0, "10.0.0.5:29500")
    assert first_host("gpu[007-009,012],cpu1") == "gpu007"
    assert first_host("rack[1-2]-n[3,5],x") == "rack1-n3" and first_host("a1,b2") == "a1"
    with pytest.raises(DeviceError, match="this Slurm job has 4 nodes; sbatch --nodes=8"):
        node_place(8, slurm)
    with pytest.raises(DeviceError, match="set HPO_NODE_RANK"):
        node_place(2, {})
    with pytest.raises(DeviceError, match="set HPO_RDZV_ENDPOINT=host:port"):
        node_place(2, {"HPO_NODE_RANK": "1"})
    assert [k for k, _, _ in DistributedSettings(2, nodes=0).problems()] == ["nodes"]
    assert TrainingConfig(distributed=DistributedSettings(2, nodes=3)).world_size == 6
    refused = TrainingConfig(effective_batch_size=8, distributed=DistributedSettings(2, nodes=3))
    assert "multiple of distributed.nodes x gpus_per_trial (6)" in refused.problems()[0][2]
