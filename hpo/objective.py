"""One Optuna trial: sample, train, report each evaluation, prune weak or diverged runs, and
record what happened as trial user attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from hpo.checkpoints import checkpoint_root, folder_name
from hpo.config import Config
from hpo.logs import worker_label
from hpo.search_space import sample, training_for_trial
from hpo.stopping import Interrupted, StopRequest
from hpo.trial_process import TrialLike, TrialTarget, run_in_child, stop_requested
from storage.batch_cache import BatchSizeCache
from storage.engine import create_engine
from storage.url import StorageURL
from trainer import device as dev
from trainer.batch_finder import BatchSearch, batch_key, find_physical_batch_size
from trainer.checkpoint import CheckpointStore
from trainer.config import TrainJob
from trainer.data import PreparedData
from trainer.loop import Evaluation, TrainResult, grad_accum_steps_for, train
from trainer.memory import OutOfMemoryAtBatchOne
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

    def __call__(self, trial: optuna.Trial) -> float:
        self.trial_number = trial.number
        study_config = self.task.config.study
        trial.set_user_attr("worker", worker_id())
        if worker_label() is not None:
            trial.set_user_attr("gpu", worker_label())
        task = dataclasses.replace(self.task, params=sample(trial, self.task.config.search_space))
        if study_config.checkpoints:
            root = checkpoint_root(self.task.config, trial.study.study_name)
            task.checkpoint_dir = root / folder_name(trial)
            task.resume = "first_attempt" in trial.user_attrs
        try:
            if study_config.trial_isolation == "process":
                return run_in_child(trial, self.target, task, self.stop, study_config.stop_timeout)
            return self.target(trial, task)
        except Interrupted as e:
            trial.set_user_attr("interrupted", e.signal_name)
            trial.set_user_attr("fail_reason", f"interrupted: the worker got {e.signal_name}")
            raise


def train_trial(trial: TrialLike, task: TrialTask) -> float:
    """Find the physical batch, train with the trial's parameters, report each evaluation and
    return the best value; an OOM at batch 1 or a divergence prunes, any other error fails."""
    started = time.perf_counter()
    metric = task.config.study.metric
    training = training_for_trial(task.config.training, task.params)
    job = TrainJob(data=task.config.data, model=task.config.model, training=training)
    cache = batch_cache_for(task.storage_url, task.config.study.database_patience)
    store = None
    if task.checkpoint_dir is not None:
        interval = task.config.study.checkpoint_interval
        store = CheckpointStore(task.checkpoint_dir, resume=task.resume, interval_s=interval)
    try:
        key = _resolve_physical_batch(trial, job, cache, task.data)
        reporter = _reporter(trial, metric)
        result = train(job, task.data, reporter, metric, store, should_stop=stop_requested)
    except OutOfMemoryAtBatchOne as e:
        reason = f"oom: {e}"
        trial.set_user_attr("prune_reason", reason)
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise optuna.TrialPruned(reason) from e
    except Exception as e:
        trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}"[:1000])
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise
    if result.status == "interrupted":
        raise Interrupted("SIGTERM")  # checkpointed: the retry resumes from here
    record_result(trial, result)
    if store is not None:
        _record_checkpoints(trial, store, result, task)
    if result.oom_recoveries and key is not None:
        cache.lower(key, result.physical_batch_size)
    return _value(trial, result, metric)


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
    """Set job.training.physical_batch_size from the config, the study's cache or a search;
    returns the cache key when the size is found rather than configured."""
    training = job.training
    key = None
    if training.physical_batch_size == "auto":
        device = dev.resolve_device(training.device)
        key = batch_key(job, device, dev.resolve_precision(training.precision, device))
        training.physical_batch_size = _cached_or_searched(trial, job, key, device, cache, data)
    else:
        trial.set_user_attr("batch_size_source", "config")
    if training.physical_batch_size == 0:
        raise OutOfMemoryAtBatchOne("the batch finder found that not even 1 example fits")
    physical = min(training.physical_batch_size, training.effective_batch_size)
    trial.set_user_attr("physical_batch_size", physical)
    trial.set_user_attr(
        "grad_accum_steps", grad_accum_steps_for(training.effective_batch_size, physical)
    )
    return key


def _cached_or_searched(
    trial: TrialLike,
    job: TrainJob,
    key: dict[str, Any],
    device: Any,
    cache: BatchSizeCache,
    data: PreparedData,
) -> int:
    cached = cache.get(key)
    if cached is None:
        with cache.searching(key):
            cached = cache.get(key)  # another worker may have searched while we waited
            if cached is None:
                search = find_physical_batch_size(job, data.label_names, device)
                log.info("%s", search.report())
                trial.set_user_attr("batch_size_source", "search")
                trial.set_user_attr("batch_search", search_summary(search))
                return cache.record(key, search.chosen, search.as_dict())
    trial.set_user_attr("batch_size_source", "cache")
    return cached


def _reporter(trial: TrialLike, metric: str) -> Any:
    def on_evaluation(evaluation: Evaluation) -> str | None:
        value = evaluation.metrics[metric]
        trial.report(value, evaluation.index)
        log.info(
            "trial %d evaluation %d (epoch %.2f): %s",
            trial.number,
            evaluation.index,
            evaluation.epoch,
            ", ".join(f"{k}={v:.4f}" for k, v in evaluation.metrics.items()),
        )
        if trial.should_prune():
            return f"pruner: {metric}={value:.4f} at evaluation {evaluation.index}"
        return None

    return on_evaluation


def _value(trial: TrialLike, result: TrainResult, metric: str) -> float:
    if result.status == "stopped":
        trial.set_user_attr("prune_reason", result.stop_reason)
        raise optuna.TrialPruned(result.stop_reason)
    if result.status == "diverged" or result.best is None:
        reason = f"diverged: {result.stop_reason or 'no evaluation'}"
        trial.set_user_attr("prune_reason", reason)
        raise optuna.TrialPruned(reason)
    return result.best.metrics[metric]


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
        "curve": [round(v, 6) for v in result.curve],
        "oom_recoveries": result.oom_recoveries,
    }
    if result.batch_search is not None:
        attrs["batch_search"] = search_summary(result.batch_search)
    if result.best is not None:
        attrs["best_evaluation"] = dataclasses.asdict(result.best)
    if result.status == "early_stopped":
        attrs["stop_reason"] = result.stop_reason
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
