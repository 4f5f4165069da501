"""Trials in the experiment tracker a team already uses (MLflow, TensorBoard, W&B), never in the
trials' way: the worker only hands plain values to a background thread per tracker
(hpo.tracking.background), which logs them with retries within tracking.patience. What could
not be logged is said once per trial and recorded in the study (`hpo status` counts it); a
tracker that is down, slow or refuses costs no training.

A worker's trackers are one observer of its trials (hpo.tracking.observer): `start` makes it
where the trials start, the worker hands it down, and `close` ends it after the trials."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import socket
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from hpo.config.schema import Config, MlflowTrackingConfig
from hpo.errors import ConfigError, HPOError
from hpo.storage.url import mask_text
from hpo.tracking.background import STUDY, BackgroundCalls
from hpo.tracking.events import StudyStart, TrialEnd, TrialInterrupted, TrialStart
from hpo.tracking.observer import NoObserver, TrialObserver

log = logging.getLogger(__name__)
MISSING_ATTR = "tracking_missing:"  # study user attr per trial: `tracking_missing:<number>`
# How long a worker that ends waits for its last calls to reach the trackers.
CLOSE_WAIT_S = 30.0
# What a trial records about itself (hpo.trial.training), logged at its end: parameters
# derived from the sampled ones, and metrics of the whole run.
DERIVED = ("physical_batch_size", "grad_accum_steps", "device_name", "precision")
FINAL = ("samples_per_s", "tokens_per_s", "peak_mem_bytes", "wall_s", "train_s")
EXTRAS = {
    "mlflow": ("mlflow", "hpo[mlflow]"),
    "tensorboard": ("tensorboard", "hpo[tensorboard]"),
    "wandb": ("wandb", "hpo[wandb]"),
}
# The retrain study's record of its plan (hpo.study.retrain.PLAN_ATTR; the study layer sits
# above this one): its runs are told apart from the search's in the trackers.
RETRAIN_PLAN_ATTR = "retrain_plan"


def resolve(config: Config, uri: str | None, flag: str = "--tracking") -> None:
    """`--tracking URI` and MLFLOW_TRACKING_URI into config.tracking.mlflow; raises one line
    when MLflow is asked for with no URI anywhere, or a tracker's extra is not installed."""
    tracking = config.tracking
    if uri is not None:
        if not uri.strip():
            raise ConfigError(
                [f"{flag}: got an empty URI; give the MLflow tracking URI"], "command line"
            )
        tracking.mlflow = dataclasses.replace(tracking.mlflow or MlflowTrackingConfig(), uri=uri)
    if tracking.mlflow is not None and tracking.mlflow.uri is None:
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if not env:
            raise ConfigError(
                [
                    "tracking.mlflow.uri: no URI; give one, pass --tracking URI or "
                    "set MLFLOW_TRACKING_URI"
                ]
            )
        tracking.mlflow.uri = env
    for name in asked(config):
        module, extra = EXTRAS[name]
        if not installed(module):
            raise HPOError(f"tracking.{name}: {module} is not installed; pip install '{extra}'")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def asked(config: Config) -> list[str]:
    tracking = config.tracking
    return [name for name in EXTRAS if getattr(tracking, name) is not None]


def start(config: Config, study: optuna.Study) -> TrialObserver:
    """The worker's observer of its trials: its trackers (tracking: in the config), the study's
    run begun; one that does nothing when the config asks for none."""
    if not asked(config):
        return NoObserver()
    tracking = Tracking(config, study.study_name)
    tracking.submit(STUDY, "the study's run", "start_study", study_start(config, study))
    return tracking


class Tracking:
    """One worker's trackers, each with its background thread: a TrialObserver."""

    def __init__(self, config: Config, study: str) -> None:
        self.trackers: list[tuple[BackgroundCalls, Any]] = []
        self.samples: dict[int, int] = {}  # trial -> samples trained at its last evaluation
        patience = config.tracking.patience
        if config.tracking.mlflow is not None:
            from hpo.tracking.mlflow_runs import MlflowRuns

            mlflow = config.tracking.mlflow
            runs = MlflowRuns(mlflow.uri or "", mlflow.experiment or f"hpo-{study}", patience)
            self.trackers.append((BackgroundCalls("MLflow", patience), runs))
        if config.tracking.tensorboard is not None:
            from hpo.tracking.tensorboard_files import TensorboardFiles

            folder = os.path.join(config.base_dir or ".", config.tracking.tensorboard.dir)
            files = TensorboardFiles(folder, study, config.study.objectives)
            self.trackers.append((BackgroundCalls("TensorBoard", patience), files))
        if config.tracking.wandb is not None:
            from hpo.tracking.wandb_runs import WandbRuns

            wandb = WandbRuns(config.tracking.wandb, patience)
            self.trackers.append((BackgroundCalls("W&B", patience), wandb))

    def submit(self, trial: int, what: str, method: str, *args: Any) -> None:
        for calls, tracker in self.trackers:
            calls.submit(trial, what, _bound(getattr(tracker, method), *args))

    def record_missing(self, study: optuna.Study) -> None:
        """The trials a tracker gave up on since the last call, in the study (for hpo status)."""
        for calls, _ in self.trackers:
            for number, reason in calls.take_unreported().items():
                try:
                    study.set_user_attr(f"{MISSING_ATTR}{number}", f"{calls.tracker}: {reason}")
                except Exception as e:  # the database's own trouble is said by its own code
                    log.debug("could not record trial %d's tracking gap: %s", number, e)

    def close(self, study: optuna.Study | None) -> None:
        """Let the last calls reach the trackers (a bounded wait), then record what is
        missing."""
        for calls, tracker in self.trackers:
            calls.submit(STUDY, "closing", tracker.close)
            calls.close(min(CLOSE_WAIT_S, calls.patience_s))
        if study is not None:
            self.record_missing(study)

    def trial_started(self, trial: optuna.Trial, params: dict[str, Any]) -> None:
        first = trial.user_attrs.get("first_attempt", trial.number)
        host = socket.gethostname()
        worker = f"{host}:{os.getpid()}"
        start = TrialStart(trial.number, int(first), dict(params), worker, host)
        self.submit(trial.number, "its start", "start_trial", start)

    def evaluation(self, number: int, report: dict[str, Any]) -> None:
        """One evaluation, as hpo.trial.training sends it: `samples` trained so far and
        `metrics`."""
        samples = int(report.get("samples", 0))
        self.samples[number] = samples
        metrics = {k: float(v) for k, v in report.get("metrics", {}).items() if v is not None}
        what = f"evaluation {report.get('index')}"
        self.submit(number, what, "evaluation", number, samples, metrics)

    def trial_ended(self, trial: optuna.Trial, state: str, reason: str | None = None) -> None:
        """The trial's end (complete, pruned or failed), with what it recorded about itself."""
        attrs = trial.user_attrs
        derived: dict[str, Any] = {key: attrs[key] for key in DERIVED if key in attrs}
        final = {k: float(attrs[k]) for k in FINAL if isinstance(attrs.get(k), int | float)}
        best = attrs.get("best_model_uri") or (
            attrs.get("best_model") if state == "complete" else None
        )
        samples = self.samples.pop(trial.number, 0)
        reason = mask_text(reason) if reason else None
        end = TrialEnd(trial.number, state, reason, samples, final, derived, best)
        self.submit(trial.number, "its end", "end_trial", end)
        self.record_missing(trial.study)

    def trial_interrupted(self, trial: FrozenTrial, reason: str) -> None:
        """A trial failed for a reason not its own and handed back (this worker was stopped, or
        another worker died with it): its run ends KILLED until a retry goes on with it."""
        first = int(trial.user_attrs.get("first_attempt", trial.number))
        interrupted = TrialInterrupted(trial.number, first, mask_text(reason))
        self.submit(trial.number, "its interruption", "interrupt_trial", interrupted)


def missing_trials(study_attrs: dict[str, Any]) -> dict[int, str]:
    """The trials a tracker is missing, from the study's user attrs."""
    found = {}
    for key, reason in study_attrs.items():
        if key.startswith(MISSING_ATTR) and key[len(MISSING_ATTR) :].isdigit():
            found[int(key[len(MISSING_ATTR) :])] = str(reason)
    return found


def study_start(config: Config, study: optuna.Study) -> StudyStart:
    whole = json.loads(mask_text(json.dumps(dataclasses.asdict(config), default=str)))
    sampler, pruner = config.study.sampler, config.study.pruner
    params = {
        "sampler": sampler.type,
        "pruner": pruner.type,
        "objectives": ",".join(config.study.objectives),
        "directions": ",".join(d.name.lower() for d in study.directions),
        "n_trials": config.study.n_trials,
        "model": config.model.name_or_path,
        "task": config.task,
    }
    params.update(
        {
            f"sampler.{k}": v
            for k, v in dataclasses.asdict(sampler).items()
            if v is not None and k != "type"
        }
    )
    params.update(
        {
            f"pruner.{k}": v
            for k, v in dataclasses.asdict(pruner).items()
            if v is not None and k != "type"
        }
    )
    plan = study.user_attrs.get(RETRAIN_PLAN_ATTR)
    source = plan.get("source") if isinstance(plan, dict) else None
    space = whole.get("search_space", {})
    return StudyStart(study.study_name, params, whole, space, str(source) if source else None)


def _bound(method: Any, *args: Any) -> Any:
    def call() -> None:
        method(*args)

    return call
