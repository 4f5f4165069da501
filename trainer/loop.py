"""The training loop: exact gradient accumulation, AdamW with warmup and linear decay, periodic
evaluation through a callback that may stop the run, and a plain result with throughput figures.

Its parts live beside it: trainer.step (one optimizer step), trainer.loaders (DataLoaders),
trainer.evaluation, trainer.resume (what a checkpoint holds) and trainer.batch_finder.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hpo.trainer import device as dev
from hpo.trainer.batch_finder import resolve_physical_batch
from hpo.trainer.batching import collate, plan_epoch, split_micro_batches
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.compiled import compile_model, compile_stats
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.evaluation import Evaluation, Evaluator, is_evaluation_step
from hpo.trainer.loaders import (
    LoaderSettings,
    PlanSampler,
    num_workers_for,
    padding_for,
    to_device,
)
from hpo.trainer.memory import (
    OutOfMemoryAtBatchOne,
    claim_memory_share,
    none_on_oom,
    release_memory,
    simulated_budget,
)
from hpo.trainer.metrics import Direction, is_better
from hpo.trainer.model import build_model
from hpo.trainer.peft_adapters import best_weights, parameter_counts
from hpo.trainer.progress import Progress
from hpo.trainer.result import TrainResult
from hpo.trainer.resume import (
    BatchSizes,
    TrainingParts,
    restore_training,
    run_fingerprint,
    training_state,
)
from hpo.trainer.step import (
    accumulate_gradients,
    allocate_grads,
    grad_accum_steps_for,
    loss_scaler,
    lr_schedule,
    make_optimizer,
    optimizer_step,
)
from hpo.trainer.tasks import make_task
from hpo.trainer.user_metrics import MetricsFunctionError, UserMetrics

__all__ = [
    "Evaluation",
    "OnEvaluation",
    "OnProgress",
    "ShouldStop",
    "TrainResult",
    "Trainer",
    "grad_accum_steps_for",
    "train",
]

log = logging.getLogger(__name__)

# Return a reason to stop training after this evaluation, or None to go on.
OnEvaluation = Callable[[Evaluation], str | None]
# Called at each logging interval with where the run is: epoch, step, samples/s, loss, the last
# evaluation's metric and the seconds left (for a live progress line; it must be cheap).
OnProgress = Callable[[dict[str, Any]], None]
# Polled between optimizer steps: True checkpoints the run and ends it as "interrupted".
ShouldStop = Callable[[], bool]


class Trainer:
    """One training run of one hyperparameter setting."""

    def __init__(
        self,
        job: TrainJob,
        data: PreparedData,
        metric: str | None = None,
        user_metrics: UserMetrics | None = None,
    ) -> None:
        """`user_metrics`: the user's metrics function, whose names (with their directions) the
        study may optimise besides the task's."""
        self.job, self.cfg, self.data = job, job.training, data
        if data.task != job.task:
            raise ValueError(f"data prepared for the task {data.task}, the job is {job.task}")
        self.task = make_task(job.task, job.data, job.training)
        self.user_metrics = user_metrics
        self.metric, self.direction = self._metric_and_direction(metric)
        self.device = dev.resolve_device(self.cfg.device)
        claim_memory_share(self.device)
        self.compiled_before = compile_stats()
        self.precision = dev.resolve_precision(self.cfg.precision, self.device)
        dev.configure_backends(self.device, self.cfg.tf32)
        self._use_physical_batch(min(self._physical_batch_size(), self.cfg.effective_batch_size))
        self.step_oom_recoveries = 0  # the evaluator counts its own
        self.on_progress: OnProgress | None = None
        self.unsaved_best: dict[str, torch.Tensor] | None = None  # see _save_best_model
        self.steps_per_epoch = math.ceil(len(data.train) / self.cfg.effective_batch_size)
        self.total_steps = self.steps_per_epoch * self.cfg.epochs
        if self.cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, self.cfg.max_steps)
        self._build_model_and_optimizer()
        self.class_weights = self._class_weights()
        self.pin = self.device.type == "cuda"
        self.padding = padding_for(self.device, job.model.compile, job.data.max_length)
        self.loaders = LoaderSettings(
            data.pad_token_id,
            self.padding,
            num_workers_for(self.cfg.num_workers),
            self.pin,
            self.cfg.seed,
        )
        # Built once so that worker processes persist across epochs and evaluations.
        self.train_sampler = PlanSampler()
        self.train_loader = self.loaders.build(data.train, self.train_sampler)
        self.evaluator = self._evaluator()

    def _evaluator(self) -> Evaluator:
        eval_batch_size = self.cfg.eval_batch_size or 2 * self.physical_batch_size
        data = self.data
        return Evaluator(
            data.eval,
            self.task,
            data.label_names,
            eval_batch_size,
            self.loaders,
            self.device,
            self.precision,
            self.user_metrics,
            self._evaluation_share(),
        )

    def _evaluation_share(self) -> tuple[int, int]:
        """(rank, ranks) of the evaluation batches this process evaluates: all of them here."""
        return 0, 1

    def _metric_and_direction(self, metric: str | None) -> tuple[str, Direction]:
        """The metric that picks the best evaluation (the task's default, else the study's),
        among the task's and the user's metrics, with its direction."""
        chosen = metric or self.task.info.default_metric
        user = self.user_metrics.directions if self.user_metrics else {}
        directions = {**self.task.info.metrics, **user}
        if chosen not in directions:
            raise ValueError(
                f"the task {self.job.task} has no metric {chosen}; its metrics: "
                f"{', '.join(self.task.info.metrics)}"
            )
        return chosen, directions[chosen]

    def _fresh_model(self, device: torch.device) -> torch.nn.Module:
        """The trial's model, initialised from the trial's seed, its head fitted to the
        training targets: built on `device` from a config (on the meta device: its shapes
        alone), on the CPU when loaded or built by a factory."""
        torch.manual_seed(self.cfg.seed)
        model = build_model(
            self.job.model,
            self.data.label_names,
            self.cfg.seed,
            device,
            self.job.task,
            gradient_checkpointing=self.job.gradient_checkpointing,
            job=self.job,
        )
        self.task.prepare_model(model, self.data.train)
        return model

    def _build_model_and_optimizer(self) -> None:
        self.model = self._fresh_model(self.device).to(self.device)
        self.trainable_params, self.total_params = parameter_counts(self.model)
        self.forward_model: torch.nn.Module = self.model
        model_cfg = self.job.model
        self.graphed = model_cfg.compile and model_cfg.cuda_graphs and self.device.type == "cuda"
        if model_cfg.compile:
            self.forward_model = compile_model(self.model, model_cfg.compile_scope, self.graphed)
        if self.graphed:
            allocate_grads(self.model)
        self._make_optimizer()

    def _make_optimizer(self) -> None:
        """The optimizer, the learning-rate schedule and the fp16 loss scaler for self.model."""
        self.optimizer, self.optimizer_name = make_optimizer(self.model, self.cfg)
        warmup = round(self.cfg.warmup_ratio * self.total_steps)
        self.scheduler = lr_schedule(self.optimizer, self.cfg.lr_schedule, warmup, self.total_steps)
        use_scaler = self.precision == "fp16" and self.device.type == "cuda"
        self.scaler = loss_scaler("cuda") if use_scaler else None

    def _physical_batch_size(self) -> int:
        if self.cfg.physical_batch_size == "auto":
            raise ValueError("resolve physical_batch_size 'auto' first: see train()")
        return self.cfg.physical_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.evaluator.batch_size

    @property
    def oom_recoveries(self) -> int:
        return self.step_oom_recoveries + self.evaluator.oom_recoveries

    def _class_weights(self) -> torch.Tensor | None:
        values = self.task.class_weights(self.data.train, self.data.label_names)
        if values is None:
            return None
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _autocast(self) -> Any:
        return dev.autocast(self.device, self.precision)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_device(batch, self.device, self.pin)

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
        """Metrics on the evaluation split; an OOM halves the evaluation batch and starts over.
        A model compiled whole into CUDA graphs evaluates uncompiled: a graph's outputs are
        overwritten by its next replay, and evaluation keeps every batch's outputs."""
        return self.evaluator(self._evaluation_model())

    def _evaluation_model(self) -> torch.nn.Module:
        graphed_whole = self.graphed and self.forward_model is not self.model
        return self.model if graphed_whole else self.forward_model

    def is_evaluation_step(self, step: int) -> bool:
        return is_evaluation_step(
            step, self.steps_per_epoch, self.cfg.evals_per_epoch, self.total_steps
        )

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
        run = Progress(segment_start=time.perf_counter())
        resumed_at = self._resume(run, checkpoints, on_evaluation)
        epoch, skip = divmod(run.step, self.steps_per_epoch)
        if should_stop is not None and should_stop():  # nothing trained yet: nothing to save
            run.stop("interrupted", f"stop requested before step {run.step + 1}")
        while run.step < self.total_steps and run.status == "completed":
            for indices, micro_batches in self._steps(epoch, skip):
                self._train_step(run, indices, micro_batches)
                at_evaluation = self.is_evaluation_step(run.step)
                if run.step % self.cfg.log_every_steps == 0 or at_evaluation:
                    # At an evaluation, the progress goes out after it, with its value.
                    self._check_loss(run, send_progress=not at_evaluation)
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
        return run_fingerprint(self.job, self.data.label_names, len(self.data.train))

    def _parts(self) -> TrainingParts:
        return TrainingParts(self.model, self.optimizer, self.scheduler, self.scaler)

    def _save_best_model(self, checkpoints: CheckpointStore | None) -> None:
        """Write the best evaluation's weights if they changed since the last write."""
        if checkpoints is not None and self.unsaved_best is not None:
            checkpoints.save_best_model(self.model, self.unsaved_best)
            self.unsaved_best = None

    def _checkpoint(self, run: Progress, checkpoints: CheckpointStore | None) -> None:
        if checkpoints is None:
            return
        self._save_best_model(checkpoints)  # first: the state names this best evaluation
        run.meter.read()  # the partial loss goes to the history, which is saved
        sizes = BatchSizes(self.physical_batch_size, self.eval_batch_size, self.oom_recoveries)
        train_s = run.train_s + self._elapsed_since(run.segment_start)
        state = training_state(self.fingerprint(), self._parts(), sizes, run, train_s)
        checkpoints.save_state({**state, **self._extra_state()})

    def _resume(
        self,
        run: Progress,
        checkpoints: CheckpointStore | None,
        on_evaluation: OnEvaluation | None,
    ) -> int | None:
        """Load a saved state of this job into the run; the restored evaluations are reported
        again (to a new trial of a retried one). Returns the step it resumes at."""
        state = self._load_state(checkpoints)
        if state is None or checkpoints is None:
            return None
        sizes = restore_training(state, self._parts(), run)
        self._restored(state)
        self._resumed(run, sizes, checkpoints, on_evaluation)
        run.segment_start = time.perf_counter()
        return run.step

    def _load_state(self, checkpoints: CheckpointStore | None) -> dict[str, Any] | None:
        """The saved state to resume from (trainer.distributed: the main rank's, on all)."""
        return checkpoints.load_state(self.fingerprint()) if checkpoints else None

    def _resumed(
        self,
        run: Progress,
        sizes: BatchSizes,
        checkpoints: CheckpointStore,
        on_evaluation: OnEvaluation | None,
    ) -> None:
        """The restored run's batch sizes in use, its evaluations reported again."""
        self._use_physical_batch(sizes.physical_batch_size)
        if sizes.eval_batch_size != self.evaluator.batch_size:
            self.evaluator.use_batch_size(sizes.eval_batch_size)
        self.step_oom_recoveries, self.evaluator.oom_recoveries = sizes.oom_recoveries, 0
        log.info("resumed from %s at step %d", checkpoints.state_path, run.step)
        for evaluation in run.evaluations:
            stop = on_evaluation(evaluation) if on_evaluation else None
            if stop is not None:
                run.stop("stopped", stop)
                break

    def _extra_state(self) -> dict[str, Any]:
        """What a subclass adds to each saved state (trainer.distributed: every rank's RNG)."""
        return {}

    def _restored(self, state: dict[str, Any]) -> None:
        """Called with a state just loaded, for what `_extra_state` added."""

    # -- training steps and out-of-memory recovery ---------------------------------------------

    def _train_step(
        self, run: Progress, indices: np.ndarray, micro_batches: list[dict[str, torch.Tensor]]
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
        if run.first_step_at is None:
            run.first_step_at = time.time()
        run.step += 1
        run.samples += len(indices)
        run.tokens += int(self.data.train.lengths[indices].sum())  # real tokens, from the host

    def _try_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """The step's loss, or None when it ran out of memory (any other error propagates)."""
        return none_on_oom(lambda: self._step(micro_batches))

    def _step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        loss = accumulate_gradients(
            self.forward_model,
            micro_batches,
            self.cfg,
            self._autocast,
            self.task,
            self.class_weights,
            self.scaler,
            cuda_graphs=self.graphed,
        )
        optimizer_step(self.model, self.optimizer, self.cfg, self.scaler, keep_grads=self.graphed)
        return loss

    def _recover_from_oom(self) -> None:
        """Drop the partial accumulation and free memory; halve the micro-batch, so the same
        optimizer step is redone with twice the accumulation and the same effective batch."""
        self.optimizer.zero_grad(set_to_none=not self.graphed)
        release_memory(self.device)
        if self.physical_batch_size == 1:
            raise OutOfMemoryAtBatchOne(
                f"out of memory at physical batch 1 after {self.oom_recoveries} recoveries"
            )
        self._use_physical_batch(self.physical_batch_size // 2)
        self.step_oom_recoveries += 1
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
            self._to_device(collate(self.data.train, part, self.data.pad_token_id, self.padding))
            for part in parts
        ]

    # -- losses, evaluations and the result ----------------------------------------------------

    def _check_loss(self, run: Progress, send_progress: bool = True) -> None:
        value = run.meter.read()  # the one host sync of a logging interval
        if value is None:
            return
        if not math.isfinite(value):
            run.stop("diverged", f"non-finite training loss ({value}) at step {run.step}")
            return
        log.debug("step %d/%d loss %.4f", run.step, self.total_steps, value)
        if send_progress and self.on_progress is not None:
            self.on_progress(self._progress(run, value))

    def _progress(
        self, run: Progress, loss: float | None, trained_s: float | None = None
    ) -> dict[str, Any]:
        """`trained_s`: the seconds trained so far, when not the time since the current
        stretch of training began (an evaluation has just counted them)."""
        if trained_s is None:  # no device sync: reading the loss just now did it
            trained_s = run.train_s + time.perf_counter() - run.segment_start
        rate = run.samples / trained_s if trained_s > 0 and run.samples else None
        left_samples = (self.total_steps - run.step) * self.cfg.effective_batch_size
        last = run.evaluations[-1].metrics.get(self.metric) if run.evaluations else None
        return {
            "epoch": run.step / self.steps_per_epoch,
            "epochs": self.cfg.epochs,
            "step": run.step,
            "total_steps": self.total_steps,
            "samples_per_s": rate,
            "loss": loss,
            "metric": (self.metric, last) if last is not None else None,
            "seconds_left": left_samples / rate if rate else None,
        }

    def _evaluate(
        self,
        run: Progress,
        on_evaluation: OnEvaluation | None,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        run.train_s += self._elapsed_since(run.segment_start)
        evaluating = time.perf_counter()
        metrics = self.evaluate()
        run.eval_s += self._elapsed_since(evaluating)
        evaluation = Evaluation(
            index=len(run.evaluations) + 1,
            epoch=run.step / self.steps_per_epoch,
            optimizer_step=run.step,
            metrics=metrics,
            train_loss=run.meter.history[-1] if run.meter.history else None,
        )
        run.evaluations.append(evaluation)
        if self.on_progress is not None:  # the progress shows this evaluation's value at once
            self.on_progress(self._progress(run, evaluation.train_loss, trained_s=run.train_s))
        self._decide_after(run, evaluation, on_evaluation)
        if checkpoints is not None:
            if run.best is evaluation:  # kept in host memory until a checkpoint or the end
                self.unsaved_best = best_weights(self.model)
            going_on = run.status == "completed" and run.step < self.total_steps
            if going_on and checkpoints.state_due():
                self._checkpoint(run, checkpoints)
        run.segment_start = time.perf_counter()  # reporting, pruning, saving: not training

    def _decide_after(
        self, run: Progress, evaluation: Evaluation, on_evaluation: OnEvaluation | None
    ) -> None:
        if not math.isfinite(evaluation.metrics["eval_loss"]):
            run.stop("diverged", f"non-finite evaluation loss at step {run.step}")
            return
        value = evaluation.metrics.get(self.metric)
        if value is None:  # the user's metrics function did not return the study's metric
            spec = self.user_metrics.spec if self.user_metrics else "the task"
            raise MetricsFunctionError(
                f"{spec}: no {self.metric!r} among the metrics "
                f"({', '.join(evaluation.metrics)}); study.metric names "
                "it"
            )
        if is_better(value, run.best.metrics[self.metric] if run.best else None, self.direction):
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

    def _result(self, run: Progress, started: float) -> TrainResult:
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
            eval_s=run.eval_s,
            first_step_at=run.first_step_at,
            device_name=dev.device_name(self.device),
            precision=self.precision,
            optimizer=self.optimizer_name,
            metric=self.metric,
            oom_recoveries=self.oom_recoveries,
            trainable_params=self.trainable_params,
            total_params=self.total_params,
            compiled=compile_stats() - self.compiled_before if self.job.model.compile else None,
        )


def train(
    job: TrainJob,
    data: PreparedData,
    on_evaluation: OnEvaluation | None = None,
    metric: str | None = None,
    checkpoints: CheckpointStore | None = None,
    should_stop: ShouldStop | None = None,
    on_progress: OnProgress | None = None,
    user_metrics: UserMetrics | None = None,
) -> TrainResult:
    """Fine-tune one model with `job`'s settings on prepared data; see TrainResult and
    Trainer.fit. Raises OutOfMemoryAtBatchOne when even one example does not fit."""
    device = dev.resolve_device(job.training.device)
    batch = resolve_physical_batch(job, data.label_names, device)
    training = dataclasses.replace(job.training, physical_batch_size=batch.size)
    job = dataclasses.replace(job, training=training)
    with simulated_budget(device):
        trainer = Trainer(job, data, metric, user_metrics)
        trainer.on_progress = on_progress
        log.info(
            "training on %s, %s, %s; effective batch %d = %d x %d micro-batches",
            dev.device_name(trainer.device),
            trainer.precision,
            trainer.optimizer_name,
            trainer.cfg.effective_batch_size,
            trainer.physical_batch_size,
            trainer.grad_accum_steps,
        )
        fit_started_at = time.time()
        result = trainer.fit(on_evaluation, checkpoints, should_stop)
    result.fit_started_at = fit_started_at
    result.batch_search = batch.search
    return result
