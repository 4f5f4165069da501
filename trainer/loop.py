"""The training loop: exact gradient accumulation, AdamW with warmup and linear decay, periodic
evaluation through a callback that may stop the run, and a plain result with throughput figures.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from trainer import device as dev
from trainer.batch_finder import BatchSearch, find_physical_batch_size
from trainer.checkpoint import CheckpointStore, job_fingerprint, rng_state, set_rng_state
from trainer.config import TrainingConfig, TrainJob
from trainer.data import (
    BatchCollator,
    PreparedData,
    collate,
    eval_batches,
    plan_epoch,
    split_micro_batches,
)
from trainer.memory import OutOfMemoryAtBatchOne, is_oom, release_memory, simulated_budget
from trainer.metrics import accuracy, is_better, macro_f1
from trainer.model import build_model

log = logging.getLogger(__name__)

Status = Literal["completed", "stopped", "early_stopped", "diverged", "interrupted"]


@dataclass
class Evaluation:
    """One evaluation: its 1-based index (the same data seen in every trial) and its metrics."""

    index: int
    epoch: float
    optimizer_step: int
    metrics: dict[str, float]
    train_loss: float | None


# Return a reason to stop training after this evaluation, or None to go on.
OnEvaluation = Callable[[Evaluation], str | None]
# Polled between optimizer steps: True checkpoints the run and ends it as "interrupted".
ShouldStop = Callable[[], bool]
# Settings that change how a run is computed, not what it computes: a checkpoint stays valid.
_RESUMABLE_ACROSS = {"physical_batch_size", "eval_batch_size", "device", "num_workers",
                     "log_every_steps", "batch_search_start", "batch_search_max",
                     "batch_safety_margin"}  # fmt: skip


@dataclass
class TrainResult:
    status: Status
    stop_reason: str | None
    evaluations: list[Evaluation]
    best: Evaluation | None
    effective_batch_size: int
    physical_batch_size: int
    grad_accum_steps: int
    optimizer_steps: int
    samples_per_s: float
    tokens_per_s: float
    peak_mem_bytes: int
    wall_s: float
    train_s: float
    device_name: str
    precision: str
    optimizer: str
    metric: str
    oom_recoveries: int = 0
    batch_search: BatchSearch | None = None
    resumed_at_step: int | None = None
    checkpoint_errors: list[str] = field(default_factory=list)

    @property
    def curve(self) -> list[float]:
        return [e.metrics[self.metric] for e in self.evaluations]


@dataclass
class _LossMeter:
    """Sums the loss on the device; read only every logging interval (a host sync)."""

    total: torch.Tensor | None = None
    steps: int = 0
    history: list[float] = field(default_factory=list)

    def add(self, loss: torch.Tensor) -> None:
        self.total = loss if self.total is None else self.total + loss
        self.steps += 1

    def read(self) -> float | None:
        if self.total is None:
            return None
        value = float(self.total.item()) / self.steps
        self.total, self.steps = None, 0
        self.history.append(value)
        return value


@dataclass
class _Run:
    """Progress of one fit(): counters, evaluations so far, and why it stopped."""

    segment_start: float  # start of the current stretch of training, between evaluations
    step: int = 0
    samples: int = 0
    tokens: int = 0
    train_s: float = 0.0
    meter: _LossMeter = field(default_factory=_LossMeter)
    evaluations: list[Evaluation] = field(default_factory=list)
    best: Evaluation | None = None
    since_best: int = 0
    status: Status = "completed"
    reason: str | None = None

    def stop(self, status: Status, reason: str) -> None:
        self.status, self.reason = status, reason


def grad_accum_steps_for(effective_batch_size: int, physical_batch_size: int) -> int:
    """Micro-batches per optimizer step; an effective batch below the physical one is one step."""
    return max(1, math.ceil(effective_batch_size / physical_batch_size))


def make_optimizer(
    model: torch.nn.Module, cfg: TrainingConfig
) -> tuple[torch.optim.Optimizer, str]:
    """AdamW without decay on biases and norms; fused where this torch and device support it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    options: dict[str, Any] = {
        "lr": cfg.learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_epsilon,
    }
    try:
        return torch.optim.AdamW(groups, fused=True, **options), "adamw_fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **options), "adamw_foreach"


def linear_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def step_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    step_samples: int,
    cfg: TrainingConfig,
    class_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Summed loss over the micro-batch divided by the samples of the whole optimizer step, so
    accumulated micro-batches give exactly the gradient of the step's mean loss."""
    per_sample = F.cross_entropy(
        logits.float(),
        labels,
        weight=class_weights,
        label_smoothing=cfg.label_smoothing,
        reduction="none",
    )
    return per_sample.sum() / step_samples


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    cfg: TrainingConfig,
    autocast: Callable[[], Any],
    class_weights: torch.Tensor | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Forward and backward every micro-batch of one optimizer step; returns the step's loss."""
    step_samples = sum(len(mb["labels"]) for mb in micro_batches)
    total = torch.zeros((), device=micro_batches[0]["labels"].device)
    for batch in micro_batches:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with autocast():
            logits = model(**inputs).logits
        loss = step_loss(logits, labels, step_samples, cfg, class_weights)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    return total


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainingConfig,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    if scaler is not None:
        scaler.unscale_(optimizer)
    if cfg.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _PlanSampler:
    """The current epoch's micro-batches, read afresh at every pass over the loader."""

    def __init__(self) -> None:
        self.micro_batches: list[np.ndarray] = []

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


LOADER_START_METHOD = "fork" if sys.platform == "linux" else None


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers ignore a Ctrl-C or SIGTERM sent to the whole process group (a
    terminal, Slurm, systemd): the training process checkpoints first and then ends them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Trainer:
    """One training run of one hyperparameter setting."""

    def __init__(self, job: TrainJob, data: PreparedData, metric: str = "accuracy") -> None:
        self.job, self.cfg, self.data, self.metric = job, job.training, data, metric
        self.device = dev.resolve_device(self.cfg.device)
        self.precision = dev.resolve_precision(self.cfg.precision, self.device)
        dev.configure_backends(self.device, self.cfg.tf32)
        self.physical_batch_size = min(self._physical_batch_size(), self.cfg.effective_batch_size)
        self.grad_accum_steps = grad_accum_steps_for(
            self.cfg.effective_batch_size, self.physical_batch_size
        )
        self.oom_recoveries = 0
        self.unsaved_best: dict[str, torch.Tensor] | None = None  # see _save_best_model
        self.eval_batch_size = self.cfg.eval_batch_size or 2 * self.physical_batch_size
        self.steps_per_epoch = math.ceil(len(data.train) / self.cfg.effective_batch_size)
        self.total_steps = self.steps_per_epoch * self.cfg.epochs
        if self.cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, self.cfg.max_steps)
        self.eval_steps = self._evaluation_steps()
        torch.manual_seed(self.cfg.seed)
        self.model = build_model(job.model, data.label_names, self.cfg.seed).to(self.device)
        self.forward_model: torch.nn.Module = self.model
        if job.model.compile:
            self.forward_model = torch.compile(self.model)  # type: ignore[assignment]
        self.optimizer, self.optimizer_name = make_optimizer(self.model, self.cfg)
        warmup = round(self.cfg.warmup_ratio * self.total_steps)
        self.scheduler = linear_schedule(self.optimizer, warmup, self.total_steps)
        use_scaler = self.precision == "fp16" and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        self.class_weights = self._class_weights()
        self.pin = self.device.type == "cuda"
        # Pad to tensor-core friendly widths on CUDA; to few shapes when compiling.
        self.pad_multiple = 32 if job.model.compile else (8 if self.device.type == "cuda" else 1)
        # Built once so that worker processes persist across epochs and evaluations.
        self.train_sampler = _PlanSampler()
        self.train_loader = self._loader(self.train_sampler, "train")
        self.eval_loader = self._loader(
            eval_batches(data.eval.lengths, self.eval_batch_size), "eval"
        )

    def _physical_batch_size(self) -> int:
        if self.cfg.physical_batch_size == "auto":
            raise ValueError("resolve physical_batch_size 'auto' first: see train()")
        return self.cfg.physical_batch_size

    def _evaluation_steps(self) -> set[int]:
        per_epoch = self.cfg.evals_per_epoch
        steps = {
            epoch * self.steps_per_epoch + math.ceil(k * self.steps_per_epoch / per_epoch)
            for epoch in range(self.cfg.epochs)
            for k in range(1, per_epoch + 1)
        }
        return {s for s in steps if s <= self.total_steps} | {self.total_steps}

    def _class_weights(self) -> torch.Tensor | None:
        weights = self.cfg.class_weights
        if weights is None:
            return None
        if weights == "balanced":
            counts = np.bincount(self.data.train.labels, minlength=self.data.num_labels)
            values = len(self.data.train) / (self.data.num_labels * np.maximum(counts, 1))
        else:
            if len(weights) != self.data.num_labels:
                raise ValueError(
                    f"training.class_weights has {len(weights)} weights for "
                    f"{self.data.num_labels} labels {self.data.label_names}"
                )
            values = np.asarray(weights)
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _autocast(self) -> Any:
        return dev.autocast(self.device, self.precision)

    def _loader(self, batches: Iterable[np.ndarray], split: str) -> torch.utils.data.DataLoader:
        collator = BatchCollator(
            getattr(self.data, split), self.data.pad_token_id, self.pad_multiple
        )
        workers = self._num_workers()
        return torch.utils.data.DataLoader(
            collator,
            sampler=batches,
            batch_size=None,
            num_workers=workers,
            pin_memory=self.pin,
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers else None,
            # Forked from this process, whatever start method the caller's multiprocessing
            # uses: nothing to pickle, and no dependence on a fork server that a signal to the
            # whole process group may have stopped.
            multiprocessing_context=LOADER_START_METHOD if workers else None,
            worker_init_fn=_leave_stop_signals_to_the_trainer if workers else None,
            # Its own generator: starting an epoch must not draw from the global RNG that
            # dropout uses, or a resumed run would see other dropout masks than the original.
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )

    def _num_workers(self) -> int:
        if self.cfg.num_workers is not None:
            return self.cfg.num_workers
        # Padding pre-tokenized ids is cheap; on the CPU extra processes only steal compute.
        if self.device.type != "cuda":
            return 0
        return max(1, min(4, (os.cpu_count() or 2) // max(1, torch.cuda.device_count()) - 1))

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=self.pin) for k, v in batch.items()}

    def _steps(
        self, epoch: int, skip: int = 0
    ) -> Iterator[tuple[np.ndarray, list[dict[str, torch.Tensor]]]]:
        """Each optimizer step's example indices and its micro-batches, on the device, from step
        `skip` of the epoch on (a resumed run)."""
        plan = plan_epoch(
            self.data.train.lengths,
            self.cfg.effective_batch_size,
            self.grad_accum_steps,
            self.cfg.seed,
            epoch,
        )[skip:]
        self.train_sampler.micro_batches = [mb for step in plan for mb in step]
        micro_batches = iter(self.train_loader)
        for step in plan:
            yield np.concatenate(step), [self._to_device(next(micro_batches)) for _ in step]

    def evaluate(self) -> dict[str, float]:
        """Metrics on the evaluation split; an OOM halves the evaluation batch and starts over."""
        while True:
            metrics = self._try_evaluate()
            if metrics is not None:
                return metrics
            release_memory(self.device)
            if self.eval_batch_size == 1:
                raise OutOfMemoryAtBatchOne("out of memory in evaluation at batch 1")
            self.eval_batch_size //= 2
            self.eval_loader = self._loader(
                eval_batches(self.data.eval.lengths, self.eval_batch_size), "eval"
            )
            self.oom_recoveries += 1
            log.warning("out of memory in evaluation: batch now %d", self.eval_batch_size)

    def _try_evaluate(self) -> dict[str, float] | None:
        try:
            return self._evaluate_once()
        except Exception as error:
            if not is_oom(error):
                raise
            return None
        finally:
            self.forward_model.train()

    def _evaluate_once(self) -> dict[str, float]:
        self.forward_model.eval()
        lengths = self.data.eval.lengths
        predictions, loss_sum = [], torch.zeros((), device=self.device)
        with torch.inference_mode():
            for batch in self.eval_loader:
                batch = self._to_device(batch)
                labels = batch.pop("labels")
                with self._autocast():
                    logits = self.forward_model(**batch).logits.float()
                loss_sum += F.cross_entropy(logits, labels, reduction="sum")
                predictions.append(logits.argmax(dim=-1))
        predicted = torch.cat(predictions).cpu().numpy()  # one host sync per evaluation
        order = np.argsort(lengths, kind="stable")
        labels_in_order = self.data.eval.labels[order]
        return {
            "accuracy": accuracy(predicted, labels_in_order),
            "macro_f1": macro_f1(predicted, labels_in_order, self.data.num_labels),
            "eval_loss": float(loss_sum.item()) / len(lengths),
        }

    def fit(
        self,
        on_evaluation: OnEvaluation | None = None,
        checkpoints: CheckpointStore | None = None,
        should_stop: ShouldStop | None = None,
    ) -> TrainResult:
        """Train to the end, an early stop or a stop request; with `checkpoints`, save at every
        evaluation and on a stop request, and resume from a saved state of the same job."""
        started = time.perf_counter()
        dev.reset_peak_memory(self.device)
        self.forward_model.train()
        run = _Run(segment_start=time.perf_counter())
        resumed_at = self._resume(run, checkpoints, on_evaluation)
        epoch, skip = divmod(run.step, self.steps_per_epoch)
        if should_stop is not None and should_stop():  # nothing trained yet: nothing to save
            run.stop("interrupted", f"stop requested before step {run.step + 1}")
        while run.step < self.total_steps and run.status == "completed":
            for indices, micro_batches in self._steps(epoch, skip):
                self._train_step(run, indices, micro_batches)
                at_evaluation = run.step in self.eval_steps
                if run.step % self.cfg.log_every_steps == 0 or at_evaluation:
                    self._check_loss(run)
                if at_evaluation and run.status == "completed":
                    self._evaluate(run, on_evaluation, checkpoints)
                elif should_stop is not None and should_stop() and run.step < self.total_steps:
                    self._checkpoint(run, checkpoints)
                    run.stop("interrupted", f"stop requested at step {run.step}")
                if run.status != "completed" or run.step >= self.total_steps:
                    break
            epoch, skip = epoch + 1, 0
        run.train_s += self._elapsed_since(run.segment_start)  # since the last evaluation
        self._save_best_model(checkpoints)
        result = self._result(run, started)
        result.resumed_at_step = resumed_at
        result.checkpoint_errors = list(checkpoints.errors) if checkpoints else []
        return result

    # -- checkpoints ---------------------------------------------------------------------------

    def fingerprint(self) -> str:
        training = {
            k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in _RESUMABLE_ACROSS
        }
        return job_fingerprint(
            {
                "training": training,
                "model": dataclasses.asdict(self.job.model),
                "data": dataclasses.asdict(self.job.data),
                "labels": self.data.label_names,
                "examples": len(self.data.train),
            }
        )

    def _save_best_model(self, checkpoints: CheckpointStore | None) -> None:
        """Write the best evaluation's weights if they changed since the last write."""
        if checkpoints is not None and self.unsaved_best is not None:
            checkpoints.save_best_model(self.model, self.unsaved_best)
            self.unsaved_best = None

    def _checkpoint(self, run: _Run, checkpoints: CheckpointStore | None) -> None:
        if checkpoints is None:
            return
        self._save_best_model(checkpoints)  # first: the state names this best evaluation
        run.meter.read()  # the partial loss goes to the history, which is saved
        state = {
            "fingerprint": self.fingerprint(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "physical_batch_size": self.physical_batch_size,
            "eval_batch_size": self.eval_batch_size,
            "oom_recoveries": self.oom_recoveries,
            "run": {
                "step": run.step,
                "samples": run.samples,
                "tokens": run.tokens,
                "train_s": run.train_s + self._elapsed_since(run.segment_start),
                "evaluations": [dataclasses.asdict(e) for e in run.evaluations],
                "best_index": run.best.index if run.best else None,
                "since_best": run.since_best,
                "loss_history": run.meter.history,
            },
            "rng": rng_state(),
        }
        checkpoints.save_state(state)

    def _resume(
        self,
        run: _Run,
        checkpoints: CheckpointStore | None,
        on_evaluation: OnEvaluation | None,
    ) -> int | None:
        """Load a saved state of this job into the run; the restored evaluations are reported
        again (to a new trial of a retried one). Returns the step it resumes at."""
        state = checkpoints.load_state(self.fingerprint()) if checkpoints else None
        if state is None or checkpoints is None:
            return None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._use_physical_batch(state["physical_batch_size"])
        self.eval_batch_size, self.oom_recoveries = (
            state["eval_batch_size"],
            state["oom_recoveries"],
        )
        saved = state["run"]
        run.step, run.samples, run.tokens = saved["step"], saved["samples"], saved["tokens"]
        run.train_s, run.since_best = saved["train_s"], saved["since_best"]
        run.meter.history = list(saved["loss_history"])
        run.evaluations = [Evaluation(**e) for e in saved["evaluations"]]
        run.best = next((e for e in run.evaluations if e.index == saved["best_index"]), None)
        set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", checkpoints.state_path, run.step)
        for evaluation in run.evaluations:
            stop = on_evaluation(evaluation) if on_evaluation else None
            if stop is not None:
                run.stop("stopped", stop)
                break
        run.segment_start = time.perf_counter()
        return run.step

    def _train_step(
        self, run: _Run, indices: np.ndarray, micro_batches: list[dict[str, torch.Tensor]]
    ) -> None:
        """One optimizer step; an OOM halves the micro-batch and redoes the same step."""
        while True:
            if max(len(mb["labels"]) for mb in micro_batches) > self.physical_batch_size:
                micro_batches = self._split_step(indices)  # planned before an OOM recovery
            loss = self._try_step(micro_batches)
            if loss is not None:
                break
            self._recover_from_oom()  # outside the except: the traceback held the step's tensors
        self.scheduler.step()
        run.meter.add(loss)
        run.step += 1
        run.samples += len(indices)
        run.tokens += int(self.data.train.lengths[indices].sum())  # real tokens, from the host

    def _try_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """The step's loss, or None when it ran out of memory (any other error propagates)."""
        try:
            loss = accumulate_gradients(
                self.forward_model,
                micro_batches,
                self.cfg,
                self._autocast,
                self.class_weights,
                self.scaler,
            )
            optimizer_step(self.model, self.optimizer, self.cfg, self.scaler)
            return loss
        except Exception as error:
            if not is_oom(error):
                raise
            return None

    def _recover_from_oom(self) -> None:
        """Drop the partial accumulation and free memory; halve the micro-batch, so the same
        optimizer step is redone with twice the accumulation and the same effective batch."""
        self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.device)
        if self.physical_batch_size == 1:
            raise OutOfMemoryAtBatchOne(
                f"out of memory at physical batch 1 after {self.oom_recoveries} recoveries"
            )
        self._use_physical_batch(self.physical_batch_size // 2)
        self.oom_recoveries += 1
        log.warning(
            "out of memory: physical batch now %d x %d accumulation steps",
            self.physical_batch_size,
            self.grad_accum_steps,
        )

    def _use_physical_batch(self, physical_batch_size: int) -> None:
        self.physical_batch_size = physical_batch_size
        self.grad_accum_steps = grad_accum_steps_for(
            self.cfg.effective_batch_size, physical_batch_size
        )

    def _split_step(self, indices: np.ndarray) -> list[dict[str, torch.Tensor]]:
        parts = split_micro_batches(
            indices, grad_accum_steps_for(len(indices), self.physical_batch_size)
        )
        return [
            self._to_device(
                collate(self.data.train, part, self.data.pad_token_id, self.pad_multiple)
            )
            for part in parts
        ]

    def _check_loss(self, run: _Run) -> None:
        value = run.meter.read()  # the one host sync of a logging interval
        if value is None:
            return
        if not math.isfinite(value):
            run.stop("diverged", f"non-finite training loss ({value}) at step {run.step}")
            return
        log.debug("step %d/%d loss %.4f", run.step, self.total_steps, value)

    def _evaluate(
        self,
        run: _Run,
        on_evaluation: OnEvaluation | None,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        run.train_s += self._elapsed_since(run.segment_start)
        evaluation = Evaluation(
            index=len(run.evaluations) + 1,
            epoch=run.step / self.steps_per_epoch,
            optimizer_step=run.step,
            metrics=self.evaluate(),
            train_loss=run.meter.history[-1] if run.meter.history else None,
        )
        run.evaluations.append(evaluation)
        self._decide_after(run, evaluation, on_evaluation)
        if checkpoints is not None:
            if run.best is evaluation:  # kept in host memory until a checkpoint or the end
                self.unsaved_best = {
                    k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
                }
            going_on = run.status == "completed" and run.step < self.total_steps
            if going_on and checkpoints.state_due():
                self._checkpoint(run, checkpoints)
        run.segment_start = time.perf_counter()  # reporting, pruning, saving: not training

    def _decide_after(
        self, run: _Run, evaluation: Evaluation, on_evaluation: OnEvaluation | None
    ) -> None:
        if not math.isfinite(evaluation.metrics["eval_loss"]):
            run.stop("diverged", f"non-finite evaluation loss at step {run.step}")
            return
        value = evaluation.metrics[self.metric]
        if is_better(value, run.best.metrics[self.metric] if run.best else None, self.metric):
            run.best, run.since_best = evaluation, 0
        else:
            run.since_best += 1
        stop = on_evaluation(evaluation) if on_evaluation else None
        patience = self.cfg.early_stopping_patience
        if stop is not None:
            run.stop("stopped", stop)
        elif patience is not None and run.since_best >= patience:
            run.stop("early_stopped", f"no improvement in {self.metric} for {patience} evaluations")

    def _elapsed_since(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _result(self, run: _Run, started: float) -> TrainResult:
        train_s = max(run.train_s, 1e-9)
        return TrainResult(
            status=run.status,
            stop_reason=run.reason,
            evaluations=run.evaluations,
            best=run.best,
            effective_batch_size=self.cfg.effective_batch_size,
            physical_batch_size=self.physical_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            optimizer_steps=run.step,
            samples_per_s=run.samples / train_s,
            tokens_per_s=run.tokens / train_s,
            peak_mem_bytes=dev.peak_memory_bytes(self.device),
            wall_s=time.perf_counter() - started,
            train_s=run.train_s,
            device_name=dev.device_name(self.device),
            precision=self.precision,
            optimizer=self.optimizer_name,
            metric=self.metric,
            oom_recoveries=self.oom_recoveries,
        )


def train(
    job: TrainJob,
    data: PreparedData,
    on_evaluation: OnEvaluation | None = None,
    metric: str = "accuracy",
    checkpoints: CheckpointStore | None = None,
    should_stop: ShouldStop | None = None,
) -> TrainResult:
    """Fine-tune one model with `job`'s settings on prepared data; see TrainResult and
    Trainer.fit. Raises OutOfMemoryAtBatchOne when even one example does not fit."""
    device = dev.resolve_device(job.training.device)
    search = None
    if job.training.physical_batch_size == "auto":
        search = find_physical_batch_size(job, data.label_names, device)
        if search.chosen == 0:
            raise OutOfMemoryAtBatchOne(
                f"not even 1 example at max_length {job.data.max_length} fits in memory"
            )
        training = dataclasses.replace(job.training, physical_batch_size=search.chosen)
        job = dataclasses.replace(job, training=training)
    with simulated_budget(device):
        trainer = Trainer(job, data, metric)
        log.info(
            "training on %s, %s, %s; effective batch %d = %d x %d micro-batches",
            dev.device_name(trainer.device),
            trainer.precision,
            trainer.optimizer_name,
            trainer.cfg.effective_batch_size,
            trainer.physical_batch_size,
            trainer.grad_accum_steps,
        )
        result = trainer.fit(on_evaluation, checkpoints, should_stop)
    result.batch_search = search
    return result
