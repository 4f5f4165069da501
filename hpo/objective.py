"""One Optuna trial: sample, train, report each evaluation, prune weak or diverged runs, and
record what happened as trial user attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import optuna

from hpo import progress as live
from hpo.checkpoints import checkpoint_root, folder_name, prepare_trial_folder
from hpo.config import Config, StudyConfig
from hpo.logs import worker_label
from hpo.search_space import sample, training_for_trial
from hpo.stopping import Interrupted, StopRequest, TrialTimedOut
from hpo.trial_process import (
    TrialLike,
    TrialLimits,
    TrialProcess,
    TrialTarget,
    TrialValue,
    replace_after_this_trial,
    stop_reason,
    stop_requested,
)
from storage.batch_cache import BatchSizeCache
from storage.engine import create_engine
from storage.url import StorageURL
from trainer import device as dev
from trainer.batch_finder import (
    BatchSearch,
    NoPhysicalBatchFits,
    PhysicalBatch,
    resolve_physical_batch,
)
from trainer.checkpoint import CheckpointStore
from trainer.config import TrainJob
from trainer.data import PreparedData, with_eval_in_training
from trainer.loop import Evaluation, TrainResult, grad_accum_steps_for, train
from trainer.memory import OutOfMemoryAtBatchOne, memory_share
from trainer.model import load_tokenizer

log = logging.getLogger(__name__)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class TrialTask:
    """What one trial trains on; pickled into the trial process."""

    config: Config
    data: PreparedData
    storage_url: StorageURL
    params: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path | None = None  # this configuration's folder, shared by its retries
    resume: bool = False  # a retry: resume from the folder's checkpoint if there is one
    asked_at: float | None = None  # wall clock (time.time()) when the trial was created
    full_data: bool = False  # train on the evaluation split too (hpo retrain --full-data)


class Objective:
    """Callable for `study.optimize`: samples the trial's parameters in the worker, then trains
    in a child process (or in the worker with `study.trial_isolation: none`)."""

    def __init__(
        self,
        config: Config,
        data: PreparedData,
        storage_url: StorageURL,
        stop: StopRequest,
        target: TrialTarget | None = None,
    ) -> None:
        self.task = TrialTask(config, data, storage_url)
        self.stop = stop
        self.target: TrialTarget = target or train_trial
        self.trial_number: int | None = None
        self.trial_process = TrialProcess(self.target, self.task, stop, _limits(config.study))

    def __call__(
        self, trial: optuna.Trial, taken_over: threading.Event | None = None
    ) -> TrialValue:
        """The trial's value; raises TrialPruned, Interrupted, TakenOver (`taken_over` was set:
        another worker took the trial over) or the trial's error."""
        self.trial_number = trial.number
        study_config = self.task.config.study
        trial.set_user_attr("worker", worker_id())
        if worker_label() is not None:
            trial.set_user_attr("gpu", worker_label())
        if memory_share() < 1:  # one of several workers on its GPU
            trial.set_user_attr("memory_share", memory_share())
        changes: dict[str, Any] = {
            "params": sample(trial, self.task.config.search_space),
            "asked_at": _created_at(trial),
            "full_data": bool(trial.user_attrs.get("full_data")),
        }
        if study_config.checkpoints:
            changes["checkpoint_dir"] = _trial_folder(self.task.config, trial)
            changes["resume"] = "first_attempt" in trial.user_attrs
        try:
            if study_config.trial_isolation == "process":
                return self.trial_process.run(trial, changes, taken_over)
            return self.target(trial, dataclasses.replace(self.task, **changes))
        except TrialTimedOut as e:
            reason = f"timeout: {e}"
            trial.set_user_attr("prune_reason", reason)
            raise optuna.TrialPruned(reason) from e
        except Interrupted as e:
            self.mark_interrupted(trial, e.signal_name)
            raise

    def close(self) -> None:
        """Ends the trial process kept between trials, if any."""
        self.trial_process.close()

    @staticmethod
    def mark_interrupted(trial: optuna.Trial, signal_name: str) -> None:
        trial.set_user_attr("interrupted", signal_name)
        trial.set_user_attr("fail_reason", f"interrupted: the worker got {signal_name}")


def _created_at(trial: optuna.Trial) -> float:
    """When the trial was created (Optuna stores the local time of the worker that asked)."""
    start = trial.datetime_start
    return start.timestamp() if start is not None else time.time()


def _trial_folder(config: Config, trial: optuna.Trial) -> Path | None:
    """The configuration's checkpoint folder, created with hpo's markers. A disk that refuses,
    or a folder there that is not hpo's, is not fatal: the trial trains without checkpoints and
    records why."""
    root = checkpoint_root(config, trial.study.study_name)
    try:
        return prepare_trial_folder(root, trial.study.study_name, folder_name(trial))
    except OSError as e:
        reason = f"no checkpoints for this trial: {e}"
        log.warning("trial %d: %s", trial.number, reason)
        trial.set_user_attr("checkpoint_error", reason[:500])
        return None


def _limits(study_config: StudyConfig) -> TrialLimits:
    return TrialLimits(study_config.stop_timeout, study_config.trial_timeout)


def train_trial(trial: TrialLike, task: TrialTask) -> TrialValue:
    """Find the physical batch, train with the trial's parameters, report each evaluation and
    return the best value (one per objective); an OOM at batch 1 or a divergence prunes, any
    other error fails."""
    started, began_at = time.perf_counter(), time.time()
    objectives = task.config.study.objectives
    metric = task.config.study.primary_metric
    training = training_for_trial(task.config.training, task.params)
    job = TrainJob(data=task.config.data, model=task.config.model, training=training)
    cache = batch_cache_for(task.storage_url, task.config.study.database_patience)
    store = None
    if task.checkpoint_dir is not None:
        interval = task.config.study.checkpoint_interval
        store = CheckpointStore(task.checkpoint_dir, resume=task.resume, interval_s=interval)
    try:
        key = _resolve_physical_batch(trial, job, cache, task.data)
        batch_at = time.time()
        # Optuna's pruning (report, should_prune) serves a single objective only.
        reporter = (
            pruning_reporter(trial, metric) if len(objectives) == 1 else _log_evaluation(trial)
        )
        should_stop = _stop_check(started, task.config.study.trial_timeout)
        data = with_eval_in_training(task.data) if task.full_data else task.data
        result = train(job, data, reporter, metric, store, should_stop=should_stop,
                       on_progress=_progress_sender(trial, task.config.study.n_trials))  # fmt: skip
    except OutOfMemoryAtBatchOne as e:
        replace_after_this_trial("out of memory at batch 1")
        reason = f"oom: {e}"
        trial.set_user_attr("prune_reason", reason)
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise optuna.TrialPruned(reason) from e
    except Exception as e:
        trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}"[:1000])
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise
    if result.status == "interrupted":
        if store is not None:  # it checkpointed on the way out: say what that cost
            _record_checkpoint_cost(trial, store)
        _raise_stopped(started, task.config.study.trial_timeout)
    record_result(trial, result)
    if result.first_step_at is not None and task.asked_at is not None:
        # Trial created to its first optimizer step: process start, data, model, batch size.
        trial.set_user_attr("startup_s", round(result.first_step_at - task.asked_at, 3))
        if result.fit_started_at is not None:
            parts = _startup_parts(task.asked_at, began_at, batch_at, result)
            trial.set_user_attr("startup_parts", parts)
    if store is not None:
        _record_checkpoints(trial, store, result, task)
    if result.oom_recoveries and key is not None:
        cache.lower(key, result.physical_batch_size)
    return _value(trial, result, objectives)


def _startup_parts(
    asked_at: float, began_at: float, batch_at: float, result: TrainResult
) -> dict[str, float]:
    """Where startup_s went: `dispatch_s` from the trial's creation to its code running (a new
    trial process, or the job handed to a kept one), `batch_s` the physical batch size (the
    study's cache, or a search), `setup_s` the model, optimizer and loaders, `first_step_s` the
    first optimizer step (kernels loaded on first use)."""
    first_step_at, fit_started_at = result.first_step_at or 0.0, result.fit_started_at or 0.0
    return {
        "dispatch_s": round(began_at - asked_at, 3),
        "batch_s": round(batch_at - began_at, 3),
        "setup_s": round(fit_started_at - batch_at, 3),
        "first_step_s": round(first_step_at - fit_started_at, 3),
    }


def _stop_check(started: float, trial_timeout: float | None) -> Callable[[], bool]:
    """Asked between optimizer steps: stop for the worker (SIGTERM) or past the trial timeout."""
    if trial_timeout is None:
        return stop_requested
    return lambda: stop_requested() or time.perf_counter() - started > trial_timeout


def _raise_stopped(started: float, trial_timeout: float | None) -> NoReturn:
    """The run checkpointed and stopped: past its timeout it is pruned, with that reason;
    otherwise its worker is stopping, and the retry resumes from the checkpoint."""
    elapsed = time.perf_counter() - started
    if trial_timeout is not None and elapsed > trial_timeout and not stop_requested():
        raise TrialTimedOut(f"stopped after {elapsed:.0f} s, past study.trial_timeout "
                            f"({trial_timeout:g} s)")  # fmt: skip
    raise Interrupted(stop_reason())


def _record_checkpoints(
    trial: TrialLike, store: CheckpointStore, result: TrainResult, task: TrialTask
) -> None:
    """The run is over: its resume state goes; its best model stays, with the tokenizer, until
    a better trial's does (see hpo.checkpoints)."""
    store.drop_state()
    if result.resumed_at_step is not None:
        trial.set_user_attr("resumed_at_step", result.resumed_at_step)
    if store.best_model_path.is_dir() and store.save_tokenizer(load_tokenizer(task.config.model)):
        trial.set_user_attr("best_model", str(store.best_model_path))
    _record_checkpoint_cost(trial, store)


def _record_checkpoint_cost(trial: TrialLike, store: CheckpointStore) -> None:
    if store.errors:
        trial.set_user_attr("checkpoint_error", store.errors[-1][:500])
    trial.set_user_attr("checkpoint_s", round(store.seconds, 3))


@functools.cache
def batch_cache_for(storage_url: StorageURL, patience_s: float) -> BatchSizeCache:
    """One engine per process for the study's batch-size cache."""
    return BatchSizeCache(create_engine(storage_url, patience_s))


def _resolve_physical_batch(
    trial: TrialLike, job: TrainJob, cache: BatchSizeCache, data: PreparedData
) -> dict[str, Any] | None:
    """Set job.training.physical_batch_size from the config, the study's cache or a search (the
    trainer decides which) and record where it came from; returns the cache key when the size
    is found rather than configured."""
    device = dev.resolve_device(job.training.device)
    try:
        batch = resolve_physical_batch(job, data.label_names, device, cache)
    except NoPhysicalBatchFits as e:
        _record_batch_source(trial, e.batch)
        raise
    _record_batch_source(trial, batch)
    training = job.training
    training.physical_batch_size = batch.size
    physical = min(batch.size, training.effective_batch_size)
    trial.set_user_attr("physical_batch_size", physical)
    trial.set_user_attr(
        "grad_accum_steps", grad_accum_steps_for(training.effective_batch_size, physical)
    )
    return batch.key


def _record_batch_source(trial: TrialLike, batch: PhysicalBatch) -> None:
    trial.set_user_attr("batch_size_source", batch.source)
    if batch.search is not None:
        trial.set_user_attr("batch_search", search_summary(batch.search))


def _progress_sender(trial: TrialLike, budget: int | None) -> Callable[[dict[str, Any]], None]:
    """Where the loop's progress goes: over the pipe to the worker's live line from a trial
    process, or straight to it when the trial runs in the worker."""
    send = getattr(trial, "send_progress", None)

    def on_progress(progress: dict[str, Any]) -> None:
        progress["budget"] = budget
        if send is not None:
            send(progress)
        else:
            live.trial_progress(trial.number, progress)

    return on_progress


def pruning_reporter(trial: TrialLike, metric: str) -> Any:
    """Called with each evaluation: reports the metric to the study and says why the trial is
    pruned, or None. The search-efficiency benchmark replays stored curves through it."""
    log_evaluation = _log_evaluation(trial)

    def on_evaluation(evaluation: Evaluation) -> str | None:
        value = evaluation.metrics[metric]
        trial.report(value, evaluation.index)
        log_evaluation(evaluation)
        if trial.should_prune():
            return f"pruner: {metric}={value:.4f} at evaluation {evaluation.index}"
        return None

    return on_evaluation


def _log_evaluation(trial: TrialLike) -> Callable[[Evaluation], None]:
    def on_evaluation(evaluation: Evaluation) -> None:
        log.info(
            "trial %d evaluation %d (epoch %.2f): %s",
            trial.number,
            evaluation.index,
            evaluation.epoch,
            ", ".join(f"{k}={v:.4f}" for k, v in evaluation.metrics.items()),
        )

    return on_evaluation


def _value(trial: TrialLike, result: TrainResult, objectives: list[str]) -> TrialValue:
    """The best evaluation's value (by the first objective); with several objectives, that
    evaluation's value of each, and the trial's samples/s for `samples_per_s`."""
    if result.status == "stopped":
        trial.set_user_attr("prune_reason", result.stop_reason)
        raise optuna.TrialPruned(result.stop_reason)
    if result.status == "diverged" or result.best is None:
        reason = f"diverged: {result.stop_reason or 'no evaluation'}"
        trial.set_user_attr("prune_reason", reason)
        raise optuna.TrialPruned(reason)
    metrics = {**result.best.metrics, "samples_per_s": result.samples_per_s}
    values = [float(metrics[name]) for name in objectives]
    return values[0] if len(values) == 1 else values


def search_summary(search: BatchSearch) -> dict[str, Any]:
    return {
        "limit": search.limit,
        "chosen": search.chosen,
        "probes": [[p.size, p.fits] for p in search.probes],
        "seconds": round(search.seconds, 2),
    }


def record_result(trial: TrialLike, result: TrainResult) -> None:
    """Everything a user compares trials by, stored with the trial."""
    attrs: dict[str, Any] = {
        "status": result.status,
        "physical_batch_size": result.physical_batch_size,
        "grad_accum_steps": result.grad_accum_steps,
        "optimizer_steps": result.optimizer_steps,
        "samples_per_s": round(result.samples_per_s, 2),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "peak_mem_bytes": result.peak_mem_bytes,
        "device_name": result.device_name,
        "precision": result.precision,
        "optimizer": result.optimizer,
        "wall_s": round(result.wall_s, 3),
        "train_s": round(result.train_s, 3),
        "eval_s": round(result.eval_s, 3),
        "curve": [round(v, 6) for v in result.curve],
        "oom_recoveries": result.oom_recoveries,
    }
    if result.batch_search is not None:
        attrs["batch_search"] = search_summary(result.batch_search)
    if result.compiled is not None:  # 0 graphs: every shape ran on an earlier trial's kernels
        attrs["compile_graphs"] = result.compiled.graphs
        attrs["compile_s"] = round(result.compiled.seconds, 3)
    if result.best is not None:
        attrs["best_evaluation"] = dataclasses.asdict(result.best)
    if result.status == "early_stopped":
        attrs["stop_reason"] = result.stop_reason
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
