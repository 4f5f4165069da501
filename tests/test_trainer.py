"""The training loop: exact accumulation, stopping, divergence and the result it returns."""

from __future__ import annotations

import copy
import math
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpo.trainer import loaders, loop, step
from hpo.trainer.batching import BatchCollator, collate
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.loop import Evaluation, train
from hpo.trainer.model import build_model, load_tokenizer
from hpo.trainer.step import accumulate_gradients, grad_accum_steps_for, optimizer_step
from hpo.trainer.tasks import make_task, prepare_data
from tests.conftest import MINILM_TOKENIZER, TINY_BERT, easy_rows, loaded_by, write_csv


def tiny_job(train_file: Path, eval_file: Path, **training: object) -> TrainJob:
    settings = {
        "physical_batch_size": 4,
        "effective_batch_size": 8,
        "learning_rate": 3e-3,
        "epochs": 2,
        "evals_per_epoch": 2,
        "device": "cpu",
        **training,
    }
    return TrainJob(
        data=DataConfig(train_file=str(train_file), eval_file=str(eval_file), max_length=32),
        model=ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER),
        training=TrainingConfig(**settings),  # type: ignore[arg-type]
    )


@pytest.fixture
def prepared(easy_data: tuple[Path, Path]) -> tuple[TrainJob, PreparedData]:
    job = tiny_job(*easy_data)
    return job, prepare_data(job.data, load_tokenizer(job.model))


@pytest.mark.parametrize(("effective", "physical"), [(12, 4), (10, 4), (7, 3), (5, 8)])
def test_accumulated_step_equals_one_big_batch(
    prepared: tuple[TrainJob, PreparedData], effective: int, physical: int
) -> None:
    job, data = prepared
    # A large epsilon keeps the first Adam step (about lr * sign(g)) well-conditioned for
    # near-zero gradients, so the weights comparison measures accumulation, not rounding.
    cfg = TrainingConfig(
        label_smoothing=0.1, max_grad_norm=0.5, learning_rate=1e-2, adam_epsilon=1e-4
    )
    weights = torch.tensor([0.7, 1.6])
    model = build_model(job.model, data.label_names, seed=0).eval()  # eval: no dropout noise
    twin = copy.deepcopy(model)
    # Longest examples first, so micro-batches pad to different widths than the big batch.
    indices = np.argsort(-data.train.lengths)[:effective]
    steps = grad_accum_steps_for(effective, physical)
    assert steps == max(1, math.ceil(effective / physical))
    parts = [p for p in np.array_split(indices, steps) if len(p)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    micro = [collate(data.train, p, data.pad_token_id) for p in parts]
    whole = [collate(data.train, indices, data.pad_token_id)]
    assert len(micro) == (1 if effective < physical else steps)

    from contextlib import nullcontext

    task = make_task(job.task, job.data, cfg)

    results = []
    for net, batches in ((model, micro), (twin, whole)):
        optimizer, _ = step.make_optimizer(net, cfg)
        loss = accumulate_gradients(net, batches, cfg, nullcontext, task, weights)
        grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        optimizer_step(net, optimizer, cfg)
        results.append((loss, grads, [p.detach().clone() for p in net.parameters()]))
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_learns_and_reports(prepared: tuple[TrainJob, PreparedData]) -> None:
    job, data = prepared
    seen: list[Evaluation] = []
    result = train(job, data, lambda e: seen.append(e) or None)
    assert result.status == "completed"
    assert [e.index for e in seen] == [1, 2, 3, 4]
    assert result.curve == [e.metrics["accuracy"] for e in seen]
    assert result.best is not None and result.best.metrics["accuracy"] > 0.8
    assert result.optimizer_steps == 2 * math.ceil(len(data.train) / 8)
    assert result.grad_accum_steps == 2 and result.physical_batch_size == 4
    assert result.samples_per_s > 0 and result.tokens_per_s > result.samples_per_s
    assert result.precision == "fp32"  # auto on the CPU
    assert result.peak_mem_bytes > 0 and result.wall_s >= result.train_s > 0
    assert result.device_name.startswith("cpu")
    assert result.optimizer in ("adamw_fused", "adamw_foreach")


def test_callback_stops_training(prepared: tuple[TrainJob, PreparedData]) -> None:
    job, data = prepared
    result = train(job, data, lambda e: "enough" if e.index == 2 else None)
    assert result.status == "stopped" and result.stop_reason == "enough"
    assert len(result.evaluations) == 2


def test_non_finite_loss_is_reported_as_divergence(
    prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared
    from hpo.trainer.tasks.sequence_classification import SequenceClassification

    real = SequenceClassification.loss_sum

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        return real(*args, **kwargs) * float("nan")  # type: ignore[arg-type]

    monkeypatch.setattr(SequenceClassification, "loss_sum", poisoned)
    result = train(job, data)
    assert result.status == "diverged"
    assert result.stop_reason is not None and "non-finite training loss" in result.stop_reason
    # The time up to the divergence counts: throughput stays a real figure.
    assert result.train_s > 0 and 0 < result.samples_per_s < 1e6


def test_early_stopping(prepared: tuple[TrainJob, PreparedData]) -> None:
    job, data = prepared
    job.training.learning_rate = 1e-9  # nothing improves after the first evaluation
    job.training.early_stopping_patience = 1
    job.training.epochs = 3
    result = train(job, data)
    assert result.status == "early_stopped"
    assert len(result.evaluations) < 6


def test_effective_batch_below_physical_is_one_micro_batch(
    prepared: tuple[TrainJob, PreparedData],
) -> None:
    job, data = prepared
    job.training.effective_batch_size = 3
    job.training.max_steps = 3
    result = train(job, data)
    assert (result.physical_batch_size, result.grad_accum_steps) == (3, 1)
    assert result.optimizer_steps == 3


def test_balanced_class_weights_are_inverse_class_frequencies(tmp_path: Path) -> None:
    rows = easy_rows(64, 3)
    positive = [r for r in rows if r["label"] == "pos"]
    negative = [r for r in rows if r["label"] == "neg"]
    imbalanced = write_csv(tmp_path / "imbalanced.csv", positive + negative[:8])  # 32 to 8
    job = tiny_job(imbalanced, imbalanced, class_weights="balanced", max_steps=1)
    data = prepare_data(job.data, load_tokenizer(job.model))
    assert data.label_names == ["neg", "pos"]
    trainer = loop.Trainer(job, data)
    # n / (classes * count): 40 / (2 * 8) and 40 / (2 * 32); the rare class weighs 4x as much.
    expected_weights = torch.tensor([2.5, 0.625])
    assert trainer.class_weights is not None
    torch.testing.assert_close(trainer.class_weights, expected_weights)

    trainer.model.eval()  # no dropout: the loss below is computed twice
    batch = collate(data.train, np.arange(len(data.train)), data.pad_token_id)
    labels = batch["labels"]
    with torch.no_grad():
        # A head that favours the common class, as training on such data would: the rare class
        # then has the larger losses, which the weights scale up.
        trainer.model.get_parameter("classifier.bias").copy_(torch.tensor([0.0, 2.0]))
        logits = trainer.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    per_sample = F.cross_entropy(logits, labels, reduction="none")
    weighted = (expected_weights[labels] * per_sample).sum() / len(labels)
    unweighted = per_sample.mean()
    assert not torch.isclose(weighted, unweighted, rtol=0.05)
    step_loss = trainer._try_step([batch])  # the trainer's own step, with its weights
    assert step_loss is not None
    torch.testing.assert_close(step_loss, weighted, rtol=1e-5, atol=1e-6)


class _RecordingCollator(BatchCollator):
    """Appends which process padded each batch, and of which split (by its size), to a file."""

    log_file: Path

    def __getitem__(self, indices: Any) -> dict[str, torch.Tensor]:
        with self.log_file.open("a") as out:
            out.write(f"{len(self.split)} {os.getpid()}\n")
        return super().__getitem__(indices)


def test_the_same_worker_processes_serve_every_epoch_and_evaluation(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared  # 2 epochs of 32 steps of 2 micro-batches; 4 evaluations of 8 batches
    job.training.num_workers = 1
    monkeypatch.setattr(_RecordingCollator, "log_file", tmp_path / "batches.log", raising=False)
    monkeypatch.setattr(loaders, "BatchCollator", _RecordingCollator)
    result = loop.Trainer(job, data).fit()
    assert result.status == "completed" and len(result.evaluations) == 4
    served: dict[int, list[int]] = {len(data.train): [], len(data.eval): []}
    for line in (tmp_path / "batches.log").read_text().splitlines():
        size, pid = map(int, line.split())
        served[size].append(pid)
    train_pids, eval_pids = served[len(data.train)], served[len(data.eval)]
    assert len(train_pids) >= 2 * 32 * 2 and len(eval_pids) >= 4 * 8
    # One worker process padded both epochs, one other every evaluation: none was restarted.
    assert len(set(train_pids)) == 1 and len(set(eval_pids)) == 1
    assert not {os.getpid()} & (set(train_pids) | set(eval_pids))
    assert set(train_pids) != set(eval_pids)


@pytest.mark.parametrize(
    ("model_change", "training_change"),
    [({"gradient_checkpointing": True}, {}), ({}, {"precision": "bf16"})],
    ids=["gradient-checkpointing", "bf16-autocast"],
)
def test_optional_modes_train(
    prepared: tuple[TrainJob, PreparedData], model_change: dict, training_change: dict
) -> None:
    job, data = prepared
    for key, value in model_change.items():
        setattr(job.model, key, value)
    for key, value in {"max_steps": 3, **training_change}.items():
        setattr(job.training, key, value)
    result = train(job, data)
    assert result.status == "completed" and result.optimizer_steps == 3
    assert result.precision == training_change.get("precision", "fp32")
    assert math.isfinite(result.evaluations[-1].metrics["eval_loss"])


def test_trainer_does_not_import_optuna() -> None:
    code = (
        "import hpo.trainer.loop, hpo.trainer.token_cache, hpo.trainer.model, hpo.trainer.metrics"
    )
    assert loaded_by(code, ("optuna",)) == []


# A DataLoader worker handing a batch's tensor over as a file descriptor (resource_sharer's
# serving thread), and a training process that leaves mid-handshake (a reset).
HANDED_OVER = """
import os, select, socket, struct, sys, threading
from multiprocessing import resource_sharer
from hpo.trainer import loaders

if sys.argv[1] == "worker":
    loaders.leave_stop_signals_to_the_trainer(0)
told = threading.Event()
hook = sys.excepthook


def telling(*args):  # outside whatever hook is installed: says the serving thread reported
    try:
        hook(*args)
    finally:
        told.set()


sys.excepthook = telling
read, _ = os.pipe()
resource_sharer.DupFd(read)
client = socket.socket(socket.AF_UNIX)
client.connect(resource_sharer._resource_sharer._address)
assert select.select([client], [], [], 30)[0]  # the challenge sent, unread
client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
client.close()
assert told.wait(30)  # the serving thread met the reset and reported it (or kept quiet)
sys.excepthook = hook
try:
    1 / 0
except ZeroDivisionError:
    sys.excepthook(*sys.exc_info())  # any other error is still told
"""


def test_a_loader_worker_is_quiet_when_the_training_process_leaves_mid_handover() -> None:
    """Seen in CI at a SIGTERM to the whole group: a traceback from a DataLoader worker's
    resource_sharer thread (ConnectionResetError). Without the hook the same script prints it."""
    import subprocess
    import sys

    def stderr(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", HANDED_OVER, mode], capture_output=True, text=True, timeout=60
        )
        return done.stderr

    plain, worker = stderr("plain"), stderr("worker")
    assert "resource_sharer.py" in plain and "ConnectionResetError" in plain, plain
    assert "resource_sharer.py" not in worker and "ConnectionResetError" not in worker, worker
    assert "ZeroDivisionError" in worker and "ZeroDivisionError" in plain


def _report_signals(conn: Any) -> None:
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    before = signal.SIGTERM in blocked and signal.SIGINT in blocked
    loaders.leave_stop_signals_to_the_trainer(0)
    after = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    conn.send(
        (
            before,
            signal.SIGTERM in after or signal.SIGINT in after,
            signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
        )
    )


@pytest.mark.skipif(loaders.LOADER_CONTEXT is None, reason="fork: Linux")
def test_a_loader_worker_is_forked_deaf_to_stop_signals_until_it_ignores_them() -> None:
    """Between its fork and worker_init_fn a loader worker would run the training process's
    own SIGTERM handler (hpo's trial process: exit at once): both stop signals are blocked
    for the fork, in the worker until they are ignored, in this process not a moment longer."""
    import multiprocessing

    assert loaders.LOADER_CONTEXT is not None
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    parent, child = multiprocessing.Pipe()
    process = loaders.LOADER_CONTEXT.Process(target=_report_signals, args=(child,))
    process.start()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert parent.poll(30) and parent.recv() == (True, False, True)
    process.join(30)
    assert process.exitcode == 0


def test_the_progress_after_an_evaluation_carries_its_value(
    prepared: tuple[TrainJob, PreparedData],
) -> None:
    """Issue 42: the progress at an evaluation step went out before the evaluation, so the
    live line showed the previous evaluation's value at a trial's end."""
    job, data = prepared
    sent: list[dict[str, Any]] = []
    result = train(job, data, on_progress=sent.append)
    assert len(result.evaluations) == 4
    for evaluation in result.evaluations:  # at its step, the progress shows its value
        at_step = [p["metric"] for p in sent if p["step"] == evaluation.optimizer_step]
        assert at_step == [("accuracy", evaluation.metrics["accuracy"])], at_step
    assert sent[-1]["metric"] == ("accuracy", result.evaluations[-1].metrics["accuracy"])
    assert all(p["samples_per_s"] is None or p["samples_per_s"] > 0 for p in sent)
