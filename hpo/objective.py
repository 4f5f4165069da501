"""One Optuna trial: sample, train, report each evaluation, prune weak or diverged runs, and
record what happened as trial user attributes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any

import optuna

from hpo.config import Config
from hpo.search_space import sample, training_for_trial
from storage.batch_cache import BatchSizeCache
from trainer import device as dev
from trainer.batch_finder import BatchSearch, batch_key, find_physical_batch_size
from trainer.config import TrainJob
from trainer.data import PreparedData
from trainer.loop import Evaluation, TrainResult, grad_accum_steps_for, train
from trainer.memory import OutOfMemoryAtBatchOne

log = logging.getLogger(__name__)
WORKER = f"{socket.gethostname()}:{os.getpid()}"


class Objective:
    """Callable for `study.optimize`; the tokenized data is shared by every trial of the worker."""

    def __init__(self, config: Config, data: PreparedData, batch_cache: BatchSizeCache) -> None:
        self.config = config
        self.data = data
        self.metric = config.study.metric
        self.batch_cache = batch_cache

    def __call__(self, trial: optuna.Trial) -> float:
        started = time.perf_counter()
        trial.set_user_attr("worker", WORKER)
        params = sample(trial, self.config.search_space)
        training = training_for_trial(self.config.training, params)
        job = TrainJob(data=self.config.data, model=self.config.model, training=training)
        try:
            key = self._resolve_physical_batch(trial, job)
            result = train(job, self.data, self._reporter(trial), self.metric)
        except OutOfMemoryAtBatchOne as e:
            reason = f"oom: {e}"
            trial.set_user_attr("prune_reason", reason)
            trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
            raise optuna.TrialPruned(reason) from e
        except Exception as e:
            trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}"[:1000])
            trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
            raise
        record_result(trial, result)
        if result.oom_recoveries and key is not None:
            self.batch_cache.lower(key, result.physical_batch_size)
        return self._value(trial, result)

    def _resolve_physical_batch(self, trial: optuna.Trial, job: TrainJob) -> dict[str, Any] | None:
        """Set job.training.physical_batch_size from the config, the study's cache or a search;
        returns the cache key when the size is found rather than configured."""
        training = job.training
        key = None
        if training.physical_batch_size == "auto":
            device = dev.resolve_device(training.device)
            key = batch_key(job, device, dev.resolve_precision(training.precision, device))
            training.physical_batch_size = self._cached_or_searched(trial, job, key, device)
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
        self, trial: optuna.Trial, job: TrainJob, key: dict[str, Any], device: Any
    ) -> int:
        cache = self.batch_cache
        cached = cache.get(key)
        if cached is None:
            with cache.searching(key):
                cached = cache.get(key)  # another worker may have searched while we waited
                if cached is None:
                    search = find_physical_batch_size(job, self.data.label_names, device)
                    log.info("%s", search.report())
                    trial.set_user_attr("batch_size_source", "search")
                    trial.set_user_attr("batch_search", search_summary(search))
                    return cache.record(key, search.chosen, search.as_dict())
        trial.set_user_attr("batch_size_source", "cache")
        return cached

    def _reporter(self, trial: optuna.Trial) -> Any:
        def on_evaluation(evaluation: Evaluation) -> str | None:
            value = evaluation.metrics[self.metric]
            trial.report(value, evaluation.index)
            log.info(
                "trial %d evaluation %d (epoch %.2f): %s",
                trial.number,
                evaluation.index,
                evaluation.epoch,
                ", ".join(f"{k}={v:.4f}" for k, v in evaluation.metrics.items()),
            )
            if trial.should_prune():
                return f"pruned at evaluation {evaluation.index} with {self.metric}={value:.4f}"
            return None

        return on_evaluation

    def _value(self, trial: optuna.Trial, result: TrainResult) -> float:
        if result.status == "stopped":
            trial.set_user_attr("prune_reason", result.stop_reason)
            raise optuna.TrialPruned(result.stop_reason)
        if result.status == "diverged" or result.best is None:
            reason = f"diverged: {result.stop_reason or 'no evaluation'}"
            trial.set_user_attr("prune_reason", reason)
            raise optuna.TrialPruned(reason)
        return result.best.metrics[self.metric]


def search_summary(search: BatchSearch) -> dict[str, Any]:
    return {
        "limit": search.limit,
        "chosen": search.chosen,
        "probes": [[p.size, p.fits] for p in search.probes],
        "seconds": round(search.seconds, 2),
    }


def record_result(trial: optuna.Trial, result: TrainResult) -> None:
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
