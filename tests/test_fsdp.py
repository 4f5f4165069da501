"""Sharded trials (training.distributed.strategy fsdp, FSDP2) on the CPU over gloo: the same loss
curve as one process at the same effective batch, each rank holding its share of the weights,
rank 0 alone building the model whole (the others on the meta device: a causal LM's tied head
and rotary buffers included), resume across a stop from sharded checkpoints (on another host,
through the artifact store), LoRA with a sharded frozen base, the batch finder on the sharded
model, every rank started again at half the batch after one rank's OOM in a step (at half the
evaluation batch after one in an evaluation; a follower's error told to the first host:
test_distributed has the restart of every host), and the config."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import multiprocessing
import os
import pickle
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from hpo.storage.artifacts import ArtifactStore, ArtifactTarget
from hpo.storage.artifacts.local import FileBackend
from hpo.trainer.batch_finder import BatchSearch, PhysicalBatch, search_largest
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import (
    DistributedSettings,
    ModelConfig,
    PeftSettings,
    TrainingConfig,
    TrainJob,
)
from hpo.trainer.data import PreparedData
from hpo.trainer.errors import ModelError
from hpo.trainer.evaluation import Evaluation
from hpo.trainer.files import drop_resume_state
from hpo.trainer.fsdp import (
    ShardedEvaluationOutOfMemory,
    ShardedStepOutOfMemory,
    match_rank0_layout,
    shard_model,
)
from hpo.trainer.launch import train_distributed
from hpo.trainer.loop import train
from hpo.trainer.memory import (
    BUDGET_ENV,
    BUDGET_RANK_ENV,
    SHARDED_EVAL_OOM_ENV,
    SHARDED_OOM_ENV,
    MemoryBudget,
    OutOfMemoryAtBatchOne,
)
from hpo.trainer.model import load_tokenizer
from hpo.trainer.restarts import (
    CheckpointPlace,
    TrialWork,
    restarted_after_evaluation_oom,
    restarted_after_oom,
)
from hpo.trainer.sharded_batch import predicted_peak
from hpo.trainer.step import loss_scaler, make_optimizer, optimizer_step
from hpo.trainer.tasks import prepare_data
from hpo.trial.uploads import BackgroundUploader, fetch_resume_state
from tests.conftest import MINILM_TOKENIZER, TINY_BERT, tiny_config, write_csv
from tests.test_causal_lm import TINY_LLAMA, clm_job, instruct_rows
from tests.test_distributed import (
    DictBatchCache,
    assert_same_curve,
    free_port,
    long_job_in,
    small_job,
)


def sharded(job: TrainJob, ranks: int, **training: Any) -> TrainJob:
    """`job` sharded over `ranks` ranks, with `training` settings changed."""
    settings = DistributedSettings(ranks, "fsdp")
    return dataclasses.replace(
        job, training=dataclasses.replace(job.training, distributed=settings, **training)
    )


@pytest.fixture
def small(tmp_path: Path) -> tuple[TrainJob, PreparedData]:
    """test_distributed's small job in one epoch, clipped: the norm is over every rank's
    sharded gradients."""
    return small_job(tmp_path, epochs=1, max_grad_norm=0.5)


def test_the_loss_curve_is_the_one_process_curve(small: tuple[TrainJob, PreparedData]) -> None:
    """3 ranks: shards padded unevenly, and a rank with no example in the last step (2 ranks:
    the resume test below)."""
    job, data = small
    ranks = 3
    one = train(job, data)
    several = train_distributed(sharded(job, ranks), data)
    assert several.status == "completed" and several.optimizer_steps == one.optimizer_steps
    assert_same_curve(one, several)
    # Weights and AdamW's two moments, 12 bytes a parameter in all: each rank holds its share.
    whole_bytes = 12 * one.total_params
    assert several.rank_state_bytes == pytest.approx(whole_bytes / ranks, rel=0.01)


def test_a_run_stopped_on_one_host_and_resumed_on_another_ends_as_one_that_was_not(
    small: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    """The stopped run's state goes to the artifact store with every rank's share (DCP); a
    retry in a fresh trial folder (another host: host a's folder is gone) fetches it and
    resumes. The kept model is a plain full model, the one a one-process run keeps."""
    job, data = small
    one_folder = tmp_path / "one"
    one = train(job, data, checkpoints=CheckpointStore(one_folder))
    job = sharded(job, 2)
    asked: list[int] = []

    def stop_after_step_5() -> bool:  # asked before step 1, then after each step that does
        asked.append(1)  # not evaluate (evaluations after steps 2, 4 and 6)
        return len(asked) == 4

    store = ArtifactStore("file://store", FileBackend(tmp_path / "store"))
    target = ArtifactTarget("file://store", "s-0123456789ab", "trial-0")
    uploader = BackgroundUploader(store, target)
    host_a = CheckpointStore(tmp_path / "a" / target.folder, on_saved=uploader.submit)
    first = train_distributed(job, data, checkpoints=host_a, should_stop=stop_after_step_5)
    assert (first.status, first.optimizer_steps) == ("interrupted", 5)
    assert uploader.close(timeout_s=30), uploader.stats.errors
    assert [p.name for p in host_a.directory.glob("sharded-state.*")] == ["sharded-state.5"]
    drop_resume_state(host_a.directory)  # what hpo does once the trial's end is recorded
    assert not list(host_a.directory.glob("sharded-state.*"))
    assert not list(host_a.directory.glob(".upload-stage-*"))
    shutil.rmtree(host_a.directory)

    host_b = CheckpointStore(tmp_path / "b" / target.folder, resume=True)
    host_b.directory.mkdir(parents=True)
    assert fetch_resume_state(store, target, host_b), host_b.errors
    assert [p.name for p in host_b.directory.glob("sharded-state.*")] == ["sharded-state.5"]
    resumed = train_distributed(job, data, checkpoints=host_b)
    assert resumed.status == "completed" and resumed.resumed_at_step == 5
    assert_same_curve(one, resumed)  # the 2-rank curve, across the stop and the move
    assert resumed.rank_state_bytes == pytest.approx(12 * one.total_params / 2, rel=0.01)
    kept, reference = (
        load_file(f / "best-model" / "model.safetensors") for f in (host_b.directory, one_folder)
    )
    assert kept.keys() == reference.keys()
    assert all(torch.allclose(kept[k], reference[k], atol=1e-4) for k in kept)
    config = json.loads((host_b.directory / "best-model" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]  # hpo predict reads it


@pytest.fixture(scope="module")
def tiny_pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT saved as a pretrained model folder: LoRA adapts saved weights."""
    from transformers import AutoConfig, AutoModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    settings = dict(TINY_BERT)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    return folder


def test_lora_shards_the_frozen_base_and_trains_the_adapter_alone(
    small: tuple[TrainJob, PreparedData], tiny_pretrained: Path, tmp_path: Path
) -> None:
    """Stopped after step 5 and resumed: the checkpoint holds the adapter and head with their
    AdamW state, not the frozen base, and the curve is the one-process LoRA curve."""
    job, data = small
    model = ModelConfig(
        name_or_path=str(tiny_pretrained),
        tokenizer=MINILM_TOKENIZER,
        peft=PeftSettings(r=4, dropout=0.0),
        dropout=0.0,
    )
    job = dataclasses.replace(job, model=model)
    one = train(job, data)
    folder = tmp_path / "checkpoints"
    asked: list[int] = []
    first = train_distributed(
        sharded(job, 2),
        data,
        checkpoints=CheckpointStore(folder),
        should_stop=lambda: asked.append(1) or len(asked) == 4,  # after step 5, as above
    )
    assert first.status == "interrupted"
    shares = [f.stat().st_size for f in (folder / "sharded-state.5").rglob("*") if f.is_file()]
    assert 0 < sum(shares) < 4 * one.total_params // 10  # the base's fp32 weights: not there
    resumed = train_distributed(sharded(job, 2), data, checkpoints=CheckpointStore(folder, True))
    assert resumed.resumed_at_step == 5
    assert resumed.trainable_params == one.trainable_params < resumed.total_params // 10
    assert_same_curve(one, resumed)  # a base that trained would draw another curve
    kept = load_file(folder / "best-model" / "adapter_model.safetensors")
    assert kept and all("lora_" in k or "classifier" in k for k in kept)


def test_the_config_accepts_fsdp_with_a_set_or_searched_physical_batch(
    easy_data: tuple[Path, Path],
) -> None:
    from hpo.config.loader import parse_config

    training = {"physical_batch_size": 4, "distributed": {"strategy": "fsdp"}}
    config = parse_config(tiny_config(*easy_data, training=training), easy_data[0].parent)
    assert config.training.distributed == DistributedSettings(2, "fsdp")
    fsdp = DistributedSettings(2, "fsdp")
    assert fsdp.problems() == []
    accepted = TrainingConfig(effective_batch_size=8, physical_batch_size=2, distributed=fsdp)
    assert accepted.problems() == []
    searched = TrainingConfig(effective_batch_size=8, distributed=fsdp)  # physical: auto
    assert searched.physical_batch_size == "auto" and searched.problems() == []
    refused = TrainingConfig(effective_batch_size=9, distributed=fsdp)  # 2 ranks: equal shares
    assert [key for key, _, _ in refused.problems()] == ["effective_batch_size"]


def test_an_oom_on_one_rank_starts_every_rank_again_at_half_the_batch(
    small: tuple[TrainJob, PreparedData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 runs out of memory in step 5 (the test hook, after its first micro-batch: rank 0
    goes on into the next gather, which rank 1 never joins). A sharded step cannot be redone in
    place: every rank ends, and all start again from the checkpoint of step 4 at half the
    physical batch and twice the accumulation. The curve is the one-process curve. The batch
    was `auto`, found in the study's cache: the cache is lowered for the next trial, and the
    result still says the cache found it."""
    job, data = small
    one = train(job, data)
    monkeypatch.setenv(SHARDED_OOM_ENV, "5")
    monkeypatch.setenv(BUDGET_RANK_ENV, "1")
    store = CheckpointStore(tmp_path / "checkpoints")  # a fresh trial's: resume not asked
    cache = CachedBatch(2)  # an earlier trial's search found 2
    auto = sharded(job, 2, physical_batch_size="auto")
    result = train_distributed(auto, data, checkpoints=store, batch_cache=cache)
    assert result.status == "completed" and result.optimizer_steps == one.optimizer_steps
    assert result.resumed_at_step == 4  # the last checkpoint before the OOM
    assert (result.physical_batch_size, result.grad_accum_steps) == (1, 6)  # was (2, 3)
    assert result.oom_recoveries == 1 and result.batch_source == "cache"
    assert cache.size == 1 and cache.lowered  # at the restart, and as the run ended
    assert all((key["ranks"], key["strategy"]) == (2, "fsdp") for key in cache.lowered)
    assert_same_curve(one, result)


def test_an_oom_in_an_evaluation_on_one_rank_redoes_it_at_half_the_evaluation_batch(
    small: tuple[TrainJob, PreparedData],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1 runs out of memory as evaluation 2 (after step 4) starts (the test hook: rank 0
    goes on into the first batch's gather, which rank 1 never joins). Every rank ends, and all
    start again from the checkpoint of step 2 at the same physical batch and half the
    evaluation batch (4, then 2): steps 3 and 4 are trained again to the same weights, and
    every evaluation reported, the one redone included, is the one-process run's."""
    job, data = small
    one = train(job, data)
    monkeypatch.setenv(SHARDED_EVAL_OOM_ENV, "2")
    monkeypatch.setenv(BUDGET_RANK_ENV, "1")
    store = CheckpointStore(tmp_path / "checkpoints")
    reported: dict[int, dict[str, float]] = {}  # by index: a restart reports the restored again

    def report(evaluation: Evaluation) -> None:
        reported[evaluation.index] = evaluation.metrics

    result = train_distributed(sharded(job, 2), data, on_evaluation=report, checkpoints=store)
    assert result.status == "completed" and result.optimizer_steps == one.optimizer_steps
    assert result.resumed_at_step == 2 and result.oom_recoveries == 1
    assert (result.physical_batch_size, result.grad_accum_steps) == (2, 3)  # as before the OOM
    assert "evaluation batch 4: every rank starts again" in caplog.text
    # The state saved after the evaluation redone (step 4) holds the halved evaluation batch.
    assert torch.load(store.state_path, weights_only=True)["eval_batch_size"] == 2
    assert_same_curve(one, result)
    assert sorted(reported) == [e.index for e in one.evaluations]
    for expected in one.evaluations:
        assert reported[expected.index] == pytest.approx(expected.metrics, abs=1e-4)


class CachedBatch(DictBatchCache):
    """The study's cache holding `size` for any key; it keeps the keys it was lowered for."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.lowered = size, list[dict[str, Any]]()

    def get(self, key: dict[str, Any]) -> int | None:
        return self.size

    def lower(self, key: dict[str, Any], physical_batch_size: int) -> None:
        self.lowered.append(key)
        self.size = min(self.size, physical_batch_size)


def test_a_sharded_oom_restarts_at_half_the_batch_and_ends_the_run_at_batch_one(
    small: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    """What the launching process does with a rank's ShardedStepOutOfMemory: start again at
    half the batch (the smaller of the set one and the rank's), resuming only a checkpoint this
    run wrote; at batch 1 the error ends the run (pruned as out of memory, the rank named)."""
    job, data = small
    place = CheckpointPlace(tmp_path, resume=False, interval_s=0.0)
    work = TrialWork(sharded(job, 2, physical_batch_size=4), data, None, None, place)
    oom = ShardedStepOutOfMemory("out of memory on rank 1 in a sharded step at physical batch 4", 4)
    sent = pickle.loads(pickle.dumps(oom))  # as it crosses the rank's pipe
    assert (str(sent), sent.physical_batch_size) == (str(oom), 4)
    again = restarted_after_oom(work, sent, saved=False)
    assert again.job.training.physical_batch_size == 2 and again.oom_restarts == 1
    assert again.checkpoints == place  # nothing written yet: from step 0
    assert again.batch is None  # rank 0 said no batch: the restart's is set, as it was
    auto = dataclasses.replace(work, job=sharded(job, 2, physical_batch_size="auto"))
    key, search = {"ranks": 2, "strategy": "fsdp"}, BatchSearch(8, 8, 0.0, 16)
    cache = CachedBatch(8)
    searched = PhysicalBatch(8, "search", key, search)  # what rank 0 said it trained
    resumed = restarted_after_oom(auto, ShardedStepOutOfMemory("at 8", 8), True, searched, cache)
    assert resumed.job.training.physical_batch_size == 4  # the searched batch, halved
    assert resumed.checkpoints is not None and resumed.checkpoints.resume
    # Still found by the search, and lowered in the cache as a DDP OOM recovery lowers it.
    assert resumed.batch == PhysicalBatch(4, "search", key, search)
    assert (cache.lowered, cache.size) == ([key], 4)
    # The restarted rank 0 says nothing new: the first start's batch is kept, halved again.
    twice = restarted_after_oom(resumed, ShardedStepOutOfMemory("at 4", 4), True, None, cache)
    assert twice.batch == PhysicalBatch(2, "search", key, search) and cache.size == 2
    configured = PhysicalBatch(4, "config")  # no key: nothing to lower
    restarted_after_oom(work, sent, False, configured, cache)
    assert cache.size == 2 and len(cache.lowered) == 2
    last = ShardedStepOutOfMemory("out of memory on rank 1 ... at physical batch 1", 1)
    with pytest.raises(OutOfMemoryAtBatchOne, match="on rank 1"):
        restarted_after_oom(again, last, saved=True)


class BuildRecorder:
    """hpo.trainer.loop.build_model, recording on each rank (the ranks are forked: each writes
    a file of its own) how many bytes each call allocated at its peak and where the model's
    weights were left."""

    def __init__(self, folder: Path, build: Callable[..., torch.nn.Module]) -> None:
        self.folder, self.build = folder, build

    def __call__(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        with MemoryBudget(sys.maxsize) as budget:
            model = self.build(*args, **kwargs)
        devices = sorted({p.device.type for p in model.parameters()})
        record = {"peak_bytes": budget.peak_bytes, "devices": devices}
        with (self.folder / f"rank-{os.environ.get('RANK', 'one')}.jsonl").open("a") as out:
            out.write(json.dumps(record) + "\n")
        return model

    def builds(self, rank: int) -> list[dict[str, Any]]:
        lines = (self.folder / f"rank-{rank}.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def test_a_sharded_evaluation_oom_restarts_at_half_the_evaluation_batch_and_ends_at_one(
    small: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    """What the launching process does with a rank's ShardedEvaluationOutOfMemory: start again
    at the physical batch rank 0 trained and half the failed evaluation batch, resuming only a
    checkpoint a launch wrote; at evaluation batch 1 the error ends the run."""
    job, data = small
    place = CheckpointPlace(tmp_path, resume=False, interval_s=0.0)
    work = TrialWork(sharded(job, 2, physical_batch_size="auto"), data, None, None, place)
    oom = ShardedEvaluationOutOfMemory("out of memory on rank 1 ... at evaluation batch 8", 8)
    sent = pickle.loads(pickle.dumps(oom))  # as it crosses the rank's pipe
    assert (str(sent), sent.eval_batch_size) == (str(oom), 8)
    searched = PhysicalBatch(4, "search", {"ranks": 2}, BatchSearch(4, 4, 0.0, 8))
    again = restarted_after_evaluation_oom(work, sent, False, searched)
    assert (again.job.training.eval_batch_size, again.oom_restarts) == (4, 1)
    assert again.batch == searched  # trained again at the batch found, not searched again
    assert again.checkpoints == place  # nothing written yet: from step 0
    twice = restarted_after_evaluation_oom(again, ShardedEvaluationOutOfMemory("4", 4), True)
    assert (twice.job.training.eval_batch_size, twice.oom_restarts) == (2, 2)
    assert twice.batch == searched and twice.checkpoints is not None and twice.checkpoints.resume
    last = ShardedEvaluationOutOfMemory("out of memory on rank 1 ... at evaluation batch 1", 1)
    with pytest.raises(OutOfMemoryAtBatchOne, match="on rank 1"):
        restarted_after_evaluation_oom(twice, last, saved=True)


def test_the_ranks_search_the_sharded_batch_together_and_the_worst_rank_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long sequences (activations decide what fits); rank 1 alone has a budget, which it meets
    at about 24 examples (rank 0 alone would take the bound, 48). Every probe is made by both
    ranks on the sharded model: the verdicts are rank 1's, the search is the one rank 1's peaks
    alone make, and the run trains at the agreed size within rank 1's budget. Rank 1 never
    builds the model whole: its probes allocate their shares of a model on the meta device."""
    import hpo.trainer.batch_finder
    import hpo.trainer.sharded_batch

    builds = tmp_path / "builds"
    builds.mkdir()
    recorder = BuildRecorder(builds, hpo.trainer.batch_finder.build_model)
    for module in (hpo.trainer.batch_finder, hpo.trainer.sharded_batch):
        monkeypatch.setattr(module, "build_model", recorder)  # the search's builds alone
    job, data = long_job_in(tmp_path)
    budget = 100 * 2**20  # rank 1's peak: about 85 MiB at 16 examples, 110 at 32
    monkeypatch.setenv(BUDGET_ENV, str(budget))
    monkeypatch.setenv(BUDGET_RANK_ENV, "1")
    start, bound = 16, 48
    settings = {"batch_search_start": start, "batch_search_max": bound, "max_steps": 1}
    cache = DictBatchCache()
    result = train_distributed(
        sharded(job, 2, physical_batch_size="auto", **settings), data, batch_cache=cache
    )
    assert result.status == "completed" and result.optimizer_steps == 1
    search = result.batch_search
    assert result.batch_source == "search" and search is not None
    assert {p.rank for p in search.probes} == {1}  # the rank with the least to spare
    peaks = {p.size: p.peak_mem_bytes or 0 for p in search.probes}
    alone = search_largest(lambda size: peaks[size] <= budget, start, bound)
    assert search.limit == alone < bound
    assert search.chosen == math.floor(alone * job.training.batch_safety_margin)
    assert result.physical_batch_size == min(search.chosen, job.training.effective_batch_size)
    ((key, size),) = zip(cache.keys, cache.sizes.values(), strict=True)
    assert (key["ranks"], key["strategy"], size) == (2, "fsdp", search.chosen)
    assert [b["devices"] for b in recorder.builds(1)] == [["meta"]]
    assert [b["devices"] for b in recorder.builds(0)] == [["meta"], ["cpu"]]


def test_a_gpu_probe_is_predicted_from_the_probes_below_it() -> None:
    """A sharded probe on a GPU is skipped when its predicted peak passes the memory (a real
    OOM inside a collective cannot be agreed): from two probes, on their line; from one, in
    proportion (over, never under, since the weights do not grow with the batch)."""
    assert predicted_peak({}, 8) is None
    assert predicted_peak({4: 100}, 8) == 200
    assert predicted_peak({4: 100, 8: 140, 32: 999}, 16) == 220


def test_rank_0_alone_builds_the_whole_model_and_the_curve_is_the_one_process_curve(
    small: tuple[TrainJob, PreparedData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 builds BERT on the meta device (no byte of weights allocated) and receives its
    share of rank 0's weights and of its position_ids buffer (not in a state dict): every rank
    trains the weights one process would have, as the curve shows."""
    job, data = small
    job = sharded(job, 2, max_steps=4)
    one = train(
        dataclasses.replace(job, training=dataclasses.replace(job.training, distributed=None)), data
    )
    import hpo.trainer.loop

    recorder = BuildRecorder(tmp_path, hpo.trainer.loop.build_model)
    monkeypatch.setattr(hpo.trainer.loop, "build_model", recorder)
    several = train_distributed(job, data)
    assert several.status == "completed" and several.optimizer_steps == one.optimizer_steps == 4
    assert_same_curve(one, several)
    whole_bytes = 4 * one.total_params  # fp32
    assert [b["devices"] for b in recorder.builds(1)] == [["meta"]]
    assert all(b["peak_bytes"] < whole_bytes / 100 for b in recorder.builds(1))
    assert [b["devices"] for b in recorder.builds(0)] == [["meta"], ["cpu"]]
    assert recorder.builds(0)[1]["peak_bytes"] >= whole_bytes


def test_a_causal_lm_with_tied_embeddings_and_rotary_buffers_trains_as_one_process(
    tmp_path: Path,
) -> None:
    """A Llama whose output layer is its input embeddings and whose rotary inv_freq is a
    buffer no state dict holds: rank 1 builds it on the meta device, gets rank 0's weights
    and buffers, and keeps the head tied (an untied copy would learn another curve)."""
    rows = write_csv(tmp_path / "train.csv", instruct_rows(40, seed=1))
    evaluation = write_csv(tmp_path / "eval.csv", instruct_rows(8, seed=2))
    job = clm_job(rows, evaluation)
    job.model.config = {**dict(TINY_LLAMA), "tie_word_embeddings": True}
    job.model.dropout = 0.0
    training = dataclasses.replace(
        job.training,
        seed=3,
        effective_batch_size=8,
        physical_batch_size=2,
        max_steps=4,
        evals_per_epoch=2,
        log_every_steps=1,
    )
    job = dataclasses.replace(job, training=training)
    data = prepare_data(job.data, load_tokenizer(job.model), "causal_lm", job.training)
    one = train(job, data)
    several = train_distributed(sharded(job, 2), data)
    assert several.status == "completed" and several.optimizer_steps == one.optimizer_steps == 4
    assert several.total_params == one.total_params  # the tied weight counted once
    assert_same_curve(one, several)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A process group of this process alone (rank 0), for what rank 0 sends itself."""
    store = dist.FileStore(str(tmp_path / "group"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_meta_model_takes_rank_0s_dtypes_and_another_shape_is_one_error(
    one_rank: None,
) -> None:
    """A checkpoint may keep a layer in another dtype than its config says: the model built on
    the meta device takes rank 0's (free there), so every rank's shards agree. A layer of
    another shape cannot be mended: a ModelError names it, on every rank."""
    whole = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    whole[1].to(torch.bfloat16)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))
    match_rank0_layout(model, whole)
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(
        ModelError, match=r"at 1\.bias \(\[5\] torch.float32 here, \[2\] torch.bfloat16 on rank 0\)"
    ):
        match_rank0_layout(other, whole)


def test_a_rank_of_a_host_that_follows_leaves_its_error_for_the_first_hosts_ranks() -> None:
    """Through a real store: a follower's sharded OOMs come back whole on the first host, in
    place of the lost peer its ranks saw; another error as RankFailed naming the rank. The first
    host's own errors, a lost peer without a word, a word of another start, a word that is not
    JSON and a trial on one host are left as they are."""
    import torch.distributed as dist

    from hpo.trainer.follower_failures import peer_word, told_across_hosts, word_key
    from hpo.trainer.rank_failures import RankFailed

    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    server = dist.TCPStore("127.0.0.1", port, is_master=True)
    lost = RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    assert told_across_hosts(lost, endpoint, 0, True, 0) is lost  # no word yet
    step = ShardedStepOutOfMemory("out of memory on rank 1 ... at physical batch 4", 4)
    assert told_across_hosts(step, endpoint, 0, False, 1) is step  # reported on its host too
    told = told_across_hosts(lost, endpoint, 0, True, 0)
    assert type(told) is ShardedStepOutOfMemory and told.physical_batch_size == 4
    assert str(told) == str(step)
    own = ValueError("the first host's own")
    assert told_across_hosts(own, endpoint, 0, True, 0) is own
    assert told_across_hosts(lost, endpoint, 1, True, 0) is lost  # a start after the restart
    assert told_across_hosts(lost, None, 0, True, 0) is lost  # one host: nothing to ask
    evaluation = ShardedEvaluationOutOfMemory("out of memory ... at evaluation batch 8", 8)
    told_across_hosts(evaluation, endpoint, 1, False, 1)
    again = peer_word(endpoint, 1)
    assert isinstance(again, ShardedEvaluationOutOfMemory) and again.eval_batch_size == 8
    told_across_hosts(KeyError("labels"), endpoint, 2, False, 3)
    other = peer_word(endpoint, 2)
    assert isinstance(other, RankFailed) and not isinstance(other, OutOfMemoryAtBatchOne)
    assert str(other) == "rank 3 (on a host that follows): KeyError: 'labels'"
    told_across_hosts(lost, endpoint, 3, False, 1)  # a lost peer is no cause of its own
    assert peer_word(endpoint, 3) is None
    server.set(word_key(4), b"\x80not json")
    assert peer_word(endpoint, 4) is None


def _step_with_an_inf_on_rank_1(rank: int, folder: str) -> None:
    """One rank of test_an_inf_in_one_ranks_shard_skips_the_fp16_step_on_every_rank: two
    steps of a fully_shard'ed model with the trainer's loss scaler and AdamW, an inf in rank
    1's shard of one gradient in the first; what it saw is written to `folder`/<rank>.json."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{folder}/group", 2), rank=rank, world_size=2
    )
    try:
        torch.manual_seed(0)  # the same weights on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        shard_model(model, 2, torch.device("cpu"), "fp16")
        cfg = TrainingConfig(learning_rate=0.1, max_grad_norm=1.0)
        optimizer, _ = make_optimizer(model, cfg)
        scaler = loss_scaler("cpu")
        seen: dict[str, Any] = {}
        for step in ("inf", "finite"):
            scaler.scale(model(torch.full((3, 4), rank + 1.0)).sum()).backward()
            if step == "inf" and rank == 1:
                grad = model[0].weight.grad
                assert isinstance(grad, DTensor)
                grad.to_local().view(-1)[0] = float("inf")  # in rank 1's shard alone
            before = [p.to_local().clone() for p in model.parameters()]
            optimizer_step(model, optimizer, cfg, scaler)
            after = [p.to_local() for p in model.parameters()]
            seen[step] = {
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                "scale": scaler.get_scale(),
            }
        buffer = io.BytesIO()
        torch.save(scaler.state_dict(), buffer)  # as a checkpoint's state keeps it
        buffer.seek(0)
        again = loss_scaler("cpu")
        again.load_state_dict(torch.load(buffer, weights_only=True))
        seen["restored_scale"] = again.get_scale()
        Path(folder, f"{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def test_an_inf_in_one_ranks_shard_skips_the_fp16_step_on_every_rank(tmp_path: Path) -> None:
    """fp16 on 2 ranks: an inf in one rank's shard of one gradient, and every rank skips the
    step (its weights as they were) and halves the scale; the next, finite step is taken on
    every rank at that scale, which a checkpoint's scaler state restores. A scaler that looked
    at its own shard alone would step on rank 0: the shards of one weight would then part."""
    context = multiprocessing.get_context("fork")  # no re-import: a few seconds in all
    ranks = [
        context.Process(target=_step_with_an_inf_on_rank_1, args=(rank, str(tmp_path)))
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0]
    first = 2.0**16  # GradScaler's initial scale
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["inf"] == {"unchanged": True, "scale": first / 2}, f"rank {rank}"
        assert seen["finite"] == {"unchanged": False, "scale": first / 2}, f"rank {rank}"
        assert seen["restored_scale"] == first / 2
