"""One Optuna trial from the worker's side: sample its parameters, have it trained (in the trial
process, or in the worker with `study.trial_isolation: none`) and turn how it ended into Optuna's
terms. Imports no torch: the training itself is hpo.trial.training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from hpo.config.schema import Config, StudyConfig
from hpo.logs import worker_label
from hpo.stopping import Interrupted, StopRequest, TrialTimedOut
from hpo.storage.artifacts import ArtifactTarget
from hpo.storage.batch_cache import BatchCacheRequests, BatchSizeCache
from hpo.storage.url import StorageURL
from hpo.tracking.observer import NoObserver, TrialObserver
from hpo.trainer.memory_share import memory_share
from hpo.trial import objective_pruning
from hpo.trial.folders import (
    checkpoint_root,
    folder_name,
    prepare_trial_folder,
    study_folder_name,
)
from hpo.trial.fork_start import fork_server_preload
from hpo.trial.process import TrialLimits, TrialProcess
from hpo.trial.protocol import TrialTarget, TrialValue
from hpo.trial.search_space import Sampler
from hpo.trial.task import TrialTask, batch_cache_for, remember_worker_cache

if TYPE_CHECKING:
    from hpo.trainer.data import PreparedData

log = logging.getLogger(__name__)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


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
        batch_cache: BatchSizeCache | None = None,
        prepared: dict[str, PreparedData] | None = None,
    ) -> None:
        """`batch_cache`: on the worker's own storage engine (hpo run passes it), so that the
        worker holds no more connections than its pool; else one on an engine of its own.
        `prepared`: the data of the search's other model choices (hpo.trial.task.data_for)."""
        self.task = TrialTask(config, data, storage_url, prepared=dict(prepared or {}))
        self.sample = Sampler(config, stop)  # `search_space: package.module:name` imported here
        self.stop = stop
        self.folder = os.getcwd()  # the worker's, put back if the user's code changes it
        # Whether this worker runs hpo's own training rather than a target of its own (a test's,
        # a benchmark's): only such trials share the host's cores when they run on the CPU.
        self.trains = target is None
        if target is None and config.training.entrypoint is not None:
            from hpo.trial.own_function import train_with_entrypoint  # the user's own function

            target = train_with_entrypoint
        elif target is None:
            # torch and transformers, imported only by a worker that trains (a light worker
            # with a target of its own, bench/many_workers.py, imports neither).
            from hpo.trial.training import train_trial

            target = train_trial
        self.target: TrialTarget = target
        # Set by run_trials while this worker is registered as one of the host's CPU workers.
        self.cpu_worker: Path | None = None
        self.trial_number: int | None = None
        cache = batch_cache or batch_cache_for(storage_url, config.study.database_patience)
        remember_worker_cache(storage_url, cache)  # for trials in the worker (isolation none)
        preload = fork_server_preload(config.training.entrypoint is not None)
        self.trial_process = TrialProcess(
            self.target, self.task, stop, _limits(config.study), BatchCacheRequests(cache), preload
        )
        self.observer: TrialObserver = NoObserver()

    def observe(self, observer: TrialObserver) -> None:
        """Tell `observer` (the worker's trackers) of each trial: its start and evaluations."""
        self.observer = observer
        self.trial_process.observer = observer

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
        params = self.sample(trial)
        self.undo_process_changes()  # the search-space function ran in this process
        changes: dict[str, Any] = {
            "params": params,
            "asked_at": _created_at(trial),
            "full_data": bool(trial.user_attrs.get("full_data")),
            "cpu_worker": self.cpu_worker,
        }
        self.observer.trial_started(trial, changes["params"])
        if study_config.checkpoints:
            changes["checkpoint_dir"] = _trial_folder(self.task.config, trial)
            changes["study_name"] = trial.study.study_name
            changes["resume"] = "first_attempt" in trial.user_attrs
            changes["artifacts"] = artifact_target(study_config, trial)
        try:
            if study_config.trial_isolation == "process":
                return self.trial_process.run(trial, changes, taken_over)
            try:
                in_worker = InWorkerTrial(trial, self.observer)
                return self.target(in_worker, dataclasses.replace(self.task, **changes))
            finally:
                self.undo_process_changes()  # the user's code trained in this process
        except TrialTimedOut as e:
            reason = f"timeout: {e}"
            trial.set_user_attr("prune_reason", reason)
            raise optuna.TrialPruned(reason) from e
        except Interrupted as e:
            self.mark_interrupted(trial, e.signal_name)
            raise

    def undo_process_changes(self) -> None:
        """What the user's code (a search-space function, a trial trained in the worker)
        changed of the worker and the worker relies on: its working folder (relative paths:
        the checkpoint folder, a file store) and its stop signals' handlers."""
        with contextlib.suppress(OSError):  # the folder is gone: nothing to go back to
            if os.getcwd() != self.folder:
                log.warning("the user's code changed the working folder; back to %s", self.folder)
                os.chdir(self.folder)
        if (
            threading.current_thread() is threading.main_thread()
            and self.stop.installed
            and (
                signal.getsignal(signal.SIGTERM) != self.stop.handler
                or signal.getsignal(signal.SIGINT) != self.stop.handler
            )
        ):
            log.warning(
                "the user's code replaced the worker's SIGINT or SIGTERM handler; hpo's are back"
            )
            self.stop.install()

    def trains_on_cpu(self) -> bool:
        """Whether this worker's trials train on the CPU: they then share the host's cores."""
        device = self.task.config.training.device
        if not self.trains or device not in ("auto", "cpu"):
            return False
        import torch  # imported already by a worker that trains

        return device == "cpu" or not torch.cuda.is_available()

    def close(self) -> None:
        """Ends the trial process kept between trials, if any."""
        self.trial_process.close()

    @staticmethod
    def mark_interrupted(trial: optuna.Trial, signal_name: str) -> None:
        trial.set_user_attr("interrupted", signal_name)
        trial.set_user_attr("fail_reason", f"interrupted: the worker got {signal_name}")


class InWorkerTrial:
    """An optuna.Trial trained in the worker itself (study.trial_isolation: none): its
    evaluations go to the worker's observer, as a trial process's come over its pipe
    (ChildTrial.send_evaluation); everything else is the trial's own."""

    def __init__(self, trial: optuna.Trial, observer: TrialObserver) -> None:
        self.trial = trial
        self.observer = observer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trial, name)

    @property
    def number(self) -> int:
        return self.trial.number

    def set_user_attr(self, key: str, value: Any) -> None:
        self.trial.set_user_attr(key, value)

    def report(self, value: float, step: int) -> None:
        objective_pruning.report(self.trial, value, step)

    def should_prune(self) -> bool:
        return objective_pruning.should_prune(self.trial)

    def send_evaluation(self, report: dict[str, Any]) -> None:
        self.observer.evaluation(self.trial.number, report)


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


def artifact_target(study_config: StudyConfig, trial: optuna.Trial) -> ArtifactTarget | None:
    """Where the trial's checkpoints go besides its local folder, if the study has a store."""
    if study_config.artifact_store is None:
        return None
    study = study_folder_name(trial.study.study_name)
    return ArtifactTarget(study_config.artifact_store, study, folder_name(trial))


def _limits(study_config: StudyConfig) -> TrialLimits:
    # A trial process that stays stopped (kill -STOP, a debugger) for the grace period is
    # treated like a dead worker's trial: killed, and its trial queued again.
    return TrialLimits(
        study_config.stop_timeout, study_config.trial_timeout, study_config.grace_period_s
    )
