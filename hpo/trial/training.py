"""A trial's training, run in the worker's trial process (or in the worker with
`study.trial_isolation: none`): find the physical batch, train, report each evaluation, prune
weak or diverged runs and record what happened as trial user attributes. The one module of the
worker's trial path that needs torch and transformers (hpo.trial.objective does not)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

import optuna

from hpo import live
from hpo.config.schema import Config
from hpo.config.search_paths import with_params
from hpo.plugins.loading import first_user_frame, load_plugin, load_user_code, record_failure
from hpo.plugins.protocols import TrialLike
from hpo.stopping import HandBack, Interrupted, TrialTimedOut
from hpo.storage.artifacts import ArtifactStore, ArtifactStoreError
from hpo.trainer import device as dev
from hpo.trainer.batch_finder import (
    BatchSearch,
    BatchSizeLookup,
    NoPhysicalBatchFits,
    PhysicalBatch,
    resolve_physical_batch,
)
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData, with_eval_in_training
from hpo.trainer.inference import job_settings, save_settings
from hpo.trainer.launch import RankFailed, train_distributed
from hpo.trainer.loop import Evaluation, TrainResult, grad_accum_steps_for, train
from hpo.trainer.memory import OutOfMemoryAtBatchOne
from hpo.trainer.model import load_tokenizer
from hpo.trainer.model_factory import ModelFactoryError
from hpo.trainer.tasks import METRIC_DIRECTIONS, task_class
from hpo.trainer.user_metrics import MetricsFunctionError, UserMetrics
from hpo.trial import cpu_share
from hpo.trial.child import replace_after_this_trial, stop_reason, stop_requested
from hpo.trial.folders import trial_folder_maker
from hpo.trial.objective_pruning import SPEED_ATTR
from hpo.trial.protocol import ADAPTER_ATTR, TrialValue
from hpo.trial.task import TrialTask, batch_cache, data_for
from hpo.trial.uploads import BackgroundUploader, fetch_resume_state

log = logging.getLogger(__name__)


def train_trial(trial: TrialLike, task: TrialTask) -> TrialValue:
    """Find the physical batch, train with the trial's parameters, report each evaluation and
    return the best value (one per objective); an OOM at batch 1 or a divergence prunes, any
    other error fails."""
    started, began_at = time.perf_counter(), time.time()
    objectives = task.config.study.objectives
    metric = task.config.study.primary_metric
    job = with_params(task.config, task.params)
    load_user_code(task.config)  # the task class and model factory, for the trainer to find
    user_metrics = user_metrics_of(task.config)
    take_cpu_share(trial, task, job.training.device)
    cache = batch_cache(trial, task)
    store, uploader = None, None
    if task.checkpoint_dir is not None:
        interval = task.config.study.checkpoint_interval
        remake = trial_folder_maker(task.study_name) if task.study_name else None
        store = CheckpointStore(
            task.checkpoint_dir, resume=task.resume, interval_s=interval, make_directory=remake
        )
        uploader = start_uploader(trial, task, store)
    try:
        prepared = data_for(task, job)
        ranks = job.training.world_size
        # A run across ranks finds its batch on its ranks' devices (trainer.rank_batch).
        key = _resolve_physical_batch(trial, job, cache, prepared) if ranks == 1 else None
        batch_at = time.time()
        sender = EvaluationSender(trial, job.training.effective_batch_size, job.training.device)
        # With several objectives, only study.pruner.objective's (if named) is pruned on.
        pruned_metric = task.config.study.pruned_metric
        # Throughput an objective too: the pruner compares the trial with trials as fast.
        speed = (lambda: sender.samples_per_s) if "samples_per_s" in objectives[1:] else None
        reporter = (
            pruning_reporter(trial, pruned_metric, sender, speed)
            if pruned_metric is not None
            else _log_evaluation(trial, sender)
        )
        clock = TrainingClock(task.config.study.trial_timeout)
        data = with_eval_in_training(prepared) if task.full_data else prepared
        # Across ranks, the main rank asks the study's cache itself (keyed by the world size).
        across = {} if ranks == 1 else {"batch_cache": cache}
        result = (train if ranks == 1 else train_distributed)(
            job,
            data,
            reporter,
            metric,
            store,
            should_stop=clock.should_stop,
            on_progress=_progress_sender(trial, sender),
            user_metrics=user_metrics,
            **across,
        )
    except MetricsFunctionError as e:
        give_up_uploads(uploader, task)
        _record_user_failure(trial, str(task.config.metrics), e, started, "the metrics function")
        raise
    except OutOfMemoryAtBatchOne as e:
        give_up_uploads(uploader, task)
        replace_after_this_trial("out of memory at batch 1")
        reason = f"oom: {e}"
        trial.set_user_attr("prune_reason", reason)
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise optuna.TrialPruned(reason) from e
    except RankFailed as e:
        # Not the configuration's fault (a rank killed, a GPU lost): failed with the reason,
        # queued again, and the retry resumes from the last checkpoint.
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        if store is not None:
            hand_over(trial, task, store, uploader)
        raise HandBack(f"a rank failed: {e}") from e
    except ModelFactoryError as e:
        give_up_uploads(uploader, task)
        _record_user_failure(trial, str(task.config.model.factory), e, started, "the model factory")
        raise
    except Exception as e:
        give_up_uploads(uploader, task)
        user = first_user_frame(e, task.config)
        if user is not None:  # raised in the user's task class or model: their traceback kept
            record_failure(trial, user[0], e, started, "your code", user_frames=user[1])
        else:
            trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}"[:1000])
            trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise
    if result.status == "interrupted":  # stopped, or past its timeout: its time counts too
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        if store is not None:  # it checkpointed on the way out: upload it, say what that cost
            hand_over(trial, task, store, uploader)
        raise_stopped(clock)
    record_result(trial, result)
    if ranks > 1:  # its batch: the study's cache, or the ranks' search (the smallest wins)
        trial.set_user_attr("ranks", ranks)
        trial.set_user_attr("batch_size_source", result.batch_source or "config")
    # Each trial says whether it trained an adapter: a search may turn LoRA on and off.
    trial.set_user_attr(ADAPTER_ATTR, job.model.adapter_record())
    if result.first_step_at is not None and task.asked_at is not None:
        # Trial created to its first optimizer step: process start, data, model, batch size.
        trial.set_user_attr("startup_s", round(result.first_step_at - task.asked_at, 3))
        if result.fit_started_at is not None:
            parts = _startup_parts(task.asked_at, began_at, batch_at, result)
            trial.set_user_attr("startup_parts", parts)
    if store is not None:
        _record_checkpoints(trial, store, result, task, uploader)
    if result.oom_recoveries and key is not None:
        cache.lower(key, result.physical_batch_size)
    return _value(trial, result, objectives)


def _record_user_failure(
    trial: TrialLike, spec: str, error: Exception, started: float, what: str
) -> None:
    """A plug-in's error wrapped by the trainer: the user's function raised (its traceback is
    kept), or returned what hpo cannot use (hpo's frames: the reason alone)."""
    if error.__cause__ is not None:
        record_failure(trial, spec, error.__cause__, started, what)
    else:
        trial.set_user_attr("fail_reason", str(error)[:1000])
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))


def user_metrics_of(config: Config) -> UserMetrics | None:
    """The user's metrics function (`metrics: package.module:name`), imported in the trial
    process, with the directions of the study's metrics that are its own."""
    if config.metrics is None:
        return None
    function = load_plugin(config.metrics, config.base_dir, "metrics")
    study = config.study
    own = {
        name: way
        for name, way in zip(study.objectives, study.resolved_directions, strict=True)
        if name not in METRIC_DIRECTIONS
    }
    return UserMetrics(function, config.metrics, own)


def take_cpu_share(trial: TrialLike, task: TrialTask, device: str) -> None:
    """On the CPU: the trial's share of the host's cores, taken anew at each trial (a worker
    that started or ended since changes it; see hpo.trial.cpu_share), and the threads it trains with
    recorded beside its samples_per_s."""
    if dev.resolve_device(device).type != "cpu":
        return
    share = cpu_share.trial_share(task.cpu_worker) if task.cpu_worker is not None else None
    if share is not None:
        dev.use_cpu_share(share.threads, share.host_threads, share.why())
        trial.set_user_attr("cpu_workers", share.workers)
    trial.set_user_attr("cpu_threads", dev.cpu_threads())


def start_uploader(
    trial: TrialLike, task: TrialTask, store: CheckpointStore
) -> BackgroundUploader | None:
    """With an artifact store: a retry gets the stored state first, unless its folder holds
    the newest (see fetch_resume_state); then each checkpoint written goes there in the
    background."""
    if task.artifacts is None:
        return None
    try:
        artifacts = ArtifactStore(task.artifacts.url)
    except ArtifactStoreError as e:
        store.errors.append(f"no artifact store: {e}"[:500])
        return None
    if task.resume and fetch_resume_state(artifacts, task.artifacts, store):
        uri = artifacts.uri(task.artifacts.study, task.artifacts.folder, "state")
        trial.set_user_attr("resumed_from", uri)
    uploader = BackgroundUploader(artifacts, task.artifacts)
    store.on_saved = uploader.submit
    return uploader


def give_up_uploads(uploader: BackgroundUploader | None, task: TrialTask) -> None:
    """A trial that fails or is pruned is not retried: its state is not needed elsewhere; an
    upload already in flight is let finish (the worker's cleanup then removes it whole)."""
    if uploader is not None:
        uploader.abandon(wait_s=last_upload_wait_s(task))


def last_upload_wait_s(task: TrialTask) -> float:
    """How long a trial that ends early waits for an upload: within half of study.stop_timeout
    (after it the worker kills the process), and no longer than the store's patience."""
    study = task.config.study
    return min(study.artifact_patience, study.stop_timeout / 2)


def hand_over(
    trial: TrialLike, task: TrialTask, store: CheckpointStore, uploader: BackgroundUploader | None
) -> None:
    """A stopped trial's last checkpoint goes to the store before the process ends (within
    half of study.stop_timeout: after it the worker kills the process), for the retry."""
    if uploader is not None:
        done = uploader.close(timeout_s=last_upload_wait_s(task))
        record_uploads(trial, store, uploader, done)
    record_checkpoint_cost(trial, store)


def record_uploads(
    trial: TrialLike, store: CheckpointStore, uploader: BackgroundUploader, done: bool
) -> None:
    """Seconds the uploads took, and failures: the reason (checkpoint_error) when something
    never reached the store; only a count (upload_retries) when retries got it there."""
    if not done:
        store.errors.extend(uploader.stats.errors)
    if uploader.stats.errors:
        trial.set_user_attr("upload_retries", len(uploader.stats.errors))
    trial.set_user_attr("upload_s", round(uploader.stats.upload_s, 3))


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


class TrainingClock:
    """study.trial_timeout counts training only, as its help says: from the loop's first stop
    check (training starts), not the trial process's start, the model or the batch search."""

    def __init__(self, trial_timeout: float | None) -> None:
        self.trial_timeout = trial_timeout
        self.started: float | None = None

    def should_stop(self) -> bool:
        """Asked between optimizer steps: stop for the worker (SIGTERM) or past the timeout."""
        if self.started is None:
            self.started = time.perf_counter()
        return stop_requested() or self.timed_out()

    def elapsed_s(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started

    def timed_out(self) -> bool:
        return self.trial_timeout is not None and self.elapsed_s() > self.trial_timeout


def raise_stopped(clock: TrainingClock) -> NoReturn:
    """The run checkpointed and stopped: past its timeout it is pruned, with that reason;
    otherwise its worker is stopping, and the retry resumes from the checkpoint."""
    if clock.timed_out() and not stop_requested():
        raise TrialTimedOut(
            f"stopped after {clock.elapsed_s():.0f} s of training, past "
            f"study.trial_timeout ({clock.trial_timeout:g} s)"
        )
    raise Interrupted(stop_reason())


def _record_checkpoints(
    trial: TrialLike,
    store: CheckpointStore,
    result: TrainResult,
    task: TrialTask,
    uploader: BackgroundUploader | None,
) -> None:
    """The run is over: its best model stays, with the tokenizer, until a better trial's does
    (see hpo.trial.folders). With a store, the best model goes there (its URI recorded once it is
    there whole). Its resume state stays, here and in the store, until the worker has recorded
    the trial's end (hpo.study.loop.run_trial drops it then, and the worker's cleanup the stored
    one): a worker killed in between leaves a trial that resumes from it, not from scratch."""
    if uploader is not None:
        uploader.discard("state")  # the run is over: the state already stored will do to resume
    store.drop_old_versions()
    if result.resumed_at_step is not None:
        trial.set_user_attr("resumed_at_step", result.resumed_at_step)
    has_model = store.best_model_path.is_dir()
    job = with_params(task.config, task.params)  # the trial's model choice
    tokenizer = task_class(job.task).tokenizer_to_save(load_tokenizer(job.model, job.task))
    if has_model and store.save_tokenizer(tokenizer):
        save_settings(store.best_model_path, job_settings(job))  # what hpo predict reads
        trial.set_user_attr("best_model", str(store.best_model_path))
    if uploader is not None and not _completes(result):
        give_up_uploads(uploader, task)  # pruned: its model is never the best
        record_uploads(trial, store, uploader, done=True)
    elif uploader is not None:
        if has_model:
            uploader.submit("best-model", store.best_model_path)  # now with its tokenizer
        done = uploader.close(timeout_s=task.config.study.artifact_patience)
        if done and has_model:  # `hpo best` names it, and fetches it
            target = uploader.target
            uri = uploader.store.uri(target.study, target.folder, "best-model")
            trial.set_user_attr("best_model_uri", uri)
        record_uploads(trial, store, uploader, done)
    record_checkpoint_cost(trial, store)


def _completes(result: TrainResult) -> bool:
    """Whether the trial ends COMPLETE (see _value): stopped by the pruner or diverged, it is
    pruned."""
    return result.status not in ("stopped", "diverged") and result.best is not None


def record_checkpoint_cost(trial: TrialLike, store: CheckpointStore) -> None:
    if store.errors:
        trial.set_user_attr("checkpoint_error", store.errors[-1][:500])
    trial.set_user_attr("checkpoint_s", round(store.seconds, 3))


def _resolve_physical_batch(
    trial: TrialLike, job: TrainJob, cache: BatchSizeLookup, data: PreparedData
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


def _progress_sender(
    trial: TrialLike, evaluations: EvaluationSender | None = None
) -> Callable[[dict[str, Any]], None]:
    """Where the loop's progress goes: over the pipe to the worker's live line from a trial
    process, or straight to it when the trial runs in the worker."""
    send = getattr(trial, "send_progress", None)

    def on_progress(progress: dict[str, Any]) -> None:
        if evaluations is not None:
            evaluations.samples_per_s = progress.get("samples_per_s")
        if send is not None:
            send(progress)
        else:
            live.trial_progress(trial.number, progress)

    return on_progress


class EvaluationSender:
    """Each evaluation to the worker's trackers (hpo.tracking): the samples trained so far (the
    step a tracker plots it at), its metrics, the throughput of the last progress and the
    device's peak memory. Over the pipe from a trial process; straight there in the worker."""

    def __init__(self, trial: TrialLike, effective_batch_size: int, device: str) -> None:
        self.send = getattr(trial, "send_evaluation", None)
        self.number = trial.number
        self.effective_batch_size = effective_batch_size
        self.device = dev.resolve_device(device)
        self.samples_per_s: float | None = None  # set by the progress sender

    def __call__(self, evaluation: Evaluation) -> None:
        metrics: dict[str, float | None] = {
            **evaluation.metrics,
            "epoch": evaluation.epoch,
            "train_loss": evaluation.train_loss,
            "samples_per_s": self.samples_per_s,
        }
        metrics["peak_mem_bytes"] = dev.peak_memory_bytes(self.device)  # the CPU: peak RSS
        report = {
            "index": evaluation.index,
            "metrics": metrics,
            "samples": evaluation.optimizer_step * self.effective_batch_size,
        }
        if self.send is not None:
            self.send(report)


def pruning_reporter(
    trial: TrialLike,
    metric: str,
    sender: Callable[[Evaluation], None] | None = None,
    speed: Callable[[], float | None] | None = None,
) -> Any:
    """Called with each evaluation: reports the metric to the study and says why the trial is
    pruned, or None. `speed`: the trial's samples/s so far, recorded for a pruner of several
    objectives (hpo.trial.objective_pruning). The search-efficiency benchmarks replay stored
    curves through it."""
    log_evaluation = _log_evaluation(trial, sender)

    def on_evaluation(evaluation: Evaluation) -> str | None:
        value = evaluation.metrics[metric]
        samples_per_s = speed() if speed is not None else None
        if samples_per_s is not None:
            trial.set_user_attr(SPEED_ATTR, round(samples_per_s, 2))
        trial.report(value, evaluation.index)
        log_evaluation(evaluation)
        if trial.should_prune():
            return f"pruner: {metric}={value:.4f} at evaluation {evaluation.index}"
        return None

    return on_evaluation


def _log_evaluation(
    trial: TrialLike, sender: Callable[[Evaluation], None] | None = None
) -> Callable[[Evaluation], None]:
    def on_evaluation(evaluation: Evaluation) -> None:
        if sender is not None:
            sender(evaluation)
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
    missing = [name for name in objectives if name not in metrics]
    if missing:  # a metric the user's metrics function did not return
        raise MetricsFunctionError(
            f"no {', '.join(missing)} among the metrics of the best "
            f"evaluation ({', '.join(metrics)}); study.metric names "
            "them"
        )
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
        # Where in training each came (the pruner compares trials at the same evaluation).
        "evaluation_epochs": [round(e.epoch, 4) for e in result.evaluations],
        "oom_recoveries": result.oom_recoveries,
        "trainable_params": result.trainable_params,  # a LoRA run's adapter and head
        "total_params": result.total_params,
    }
    if result.batch_search is not None:
        attrs["batch_search"] = search_summary(result.batch_search)
    if result.compiled is not None:  # 0 graphs: every shape ran on an earlier trial's kernels
        attrs["compile_graphs"] = result.compiled.graphs
        attrs["compile_s"] = round(result.compiled.seconds, 3)
    if result.best is not None:
        attrs["best_evaluation"] = dataclasses.asdict(result.best)
    if result.rank_state_bytes is not None:  # a sharded run's: what each rank holds
        attrs["rank_state_bytes"] = result.rank_state_bytes
    if result.status == "early_stopped":
        attrs["stop_reason"] = result.stop_reason
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
