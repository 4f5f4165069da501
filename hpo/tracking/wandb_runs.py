"""Trials in Weights & Biases through wandb's own client: a run per trial, grouped by study (W&B
has no nested runs: the group is the study), its id derived from the study and the trial's
first attempt so that a retry continues the same run. Every method runs on the background
thread of hpo.tracking.background; WANDB_MODE=offline writes the runs to disk instead."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hpo.config.schema import WANDB_FORBIDDEN, WandbTrackingConfig
from hpo.storage.url import mask_text
from hpo.tracking.background import GiveUp
from hpo.tracking.events import StudyStart, TrialEnd, TrialInterrupted, TrialStart

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
API_KEY = "WANDB_API_KEY"
# How a trial's run ends in W&B: a run has no "pruned" state, so a pruned trial finishes and
# says why (tag and summary), as MLflow's KILLED run does with its tags.
EXIT_CODE = {"complete": 0, "pruned": 0, "failed": 1}
# Store URIs W&B keeps a reference to (its artifact's add_reference), rather than a copy.
REFERENCE_SCHEMES = ("s3", "gs", "http", "https", "file")


def _key_kept_out(method: F) -> F:
    """An error of wandb's that quotes the API key (a URL with it, a request's headers) is
    raised again with the key replaced: what hpo says of a failed call never shows it."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
            key = os.environ.get(API_KEY, "")
            if len(key) < 8 or key not in said:
                raise
            raise RuntimeError(_without_key(said)) from None

    return call  # type: ignore[return-value]


def _without_key(text: str) -> str:
    """`text` with the API key (and any credentials of a URL) masked."""
    key = os.environ.get(API_KEY, "")
    return mask_text(text.replace(key, "***") if len(key) >= 8 else text)


def run_id(study: str, first_attempt: int) -> str:
    """The run of a study's trial (all its attempts): the same on every worker and host."""
    return hashlib.sha256(f"{study}\0{first_attempt}".encode()).hexdigest()[:24]


def project_name(study: str) -> str:
    """The default project, hpo-<study>, in the characters and length W&B takes."""
    escaped = re.escape(WANDB_FORBIDDEN)
    return re.sub(f"[{escaped}\\s]+", "_", f"hpo-{study}")[:128]


def wandb_settings(patience_s: float) -> Any:
    """Settings for hpo's runs: nothing written to the process' console or stdout (hpo's
    summary and --json go there), no code, git or system scan, and calls that give up within
    the patience (hpo retries them). A setting this wandb does not know is left out."""
    import wandb

    wanted: dict[str, Any] = {
        "console": "off",
        "silent": True,
        "quiet": True,
        "disable_git": True,
        "save_code": False,
        "disable_job_creation": True,
        "allow_val_change": True,  # a retry's other physical batch size
        "init_timeout": max(1.0, patience_s),
        "finish_timeout": max(1.0, patience_s),
        "x_save_requirements": False,
        "x_disable_stats": True,  # no system-metrics sampler beside the trial
        "x_disable_machine_info": True,
    }
    known = set(getattr(wandb.Settings, "model_fields", {}))
    return wandb.Settings(**{k: v for k, v in wanted.items() if not known or k in known})


class WandbRuns:
    def __init__(self, config: WandbTrackingConfig, patience_s: float) -> None:
        self.config = config
        self.patience_s = patience_s
        self.settings: Any = None
        self.study = ""
        self.project = ""
        self.group = ""
        self.job_type = "trial"
        self.study_config: dict[str, Any] = {}
        self.directions: dict[str, str] = {}  # objective -> maximize / minimize
        self.runs: dict[int, Any] = {}  # trial number -> its open wandb run
        self.best: dict[int, dict[str, float]] = {}  # trial number -> objective -> best value

    # -- the study --------------------------------------------------------------------------

    @_key_kept_out
    def start_study(self, start: StudyStart) -> None:
        """What every trial's run shares: project, group, job type and the study's settings."""
        self.settings = wandb_settings(self.patience_s)
        searched = start.retrain_of or start.study
        self.study = start.study
        self.project = (
            self.config.project or os.environ.get("WANDB_PROJECT") or project_name(searched)
        )
        self.group = self.config.group or searched
        self.job_type = "retrain" if start.retrain_of else "trial"
        self.study_config = {f"hpo.{key}": value for key, value in start.params.items()}
        self.study_config["hpo.study"] = start.study
        if start.retrain_of:
            self.study_config["hpo.retrain_of"] = start.retrain_of
        objectives = str(start.params.get("objectives", "")).split(",")
        directions = str(start.params.get("directions", "")).split(",")
        self.directions = dict(zip(objectives, directions, strict=False))

    # -- trials -----------------------------------------------------------------------------

    @_key_kept_out
    def start_trial(self, start: TrialStart) -> None:
        """The trial's run (a retry's: its first attempt's, continued where W&B can)."""
        import wandb

        config = {
            **start.params,
            **self.study_config,
            "hpo.trial": start.number,
            "hpo.first_attempt": start.first_attempt,
            "hpo.worker": start.worker,
            "hpo.host": start.host,
        }
        if start.first_attempt != start.number:
            config["hpo.retried_as"] = start.number
        self.runs[start.number] = wandb.init(
            project=self.project,
            entity=self.config.entity,
            group=self.group,
            job_type=self.job_type,
            name=f"trial {start.first_attempt}",
            id=run_id(self.study, start.first_attempt),
            resume="allow",
            reinit="create_new",  # hpo's runs leave wandb.run (the user's) alone
            config=config,
            tags=["hpo", self.job_type],
            settings=self.settings,
        )
        self.best[start.number] = {}

    @_key_kept_out
    def evaluation(self, number: int, step: int, metrics: dict[str, float]) -> None:
        run = self._run(number)
        run.log(metrics, step=step)
        best = self.best.setdefault(number, {})
        for name, direction in self.directions.items():
            if name in metrics:
                value = metrics[name]
                better = max if direction == "maximize" else min
                best[name] = better(best.get(name, value), value)

    @_key_kept_out
    def end_trial(self, end: TrialEnd) -> None:
        """Derived parameters into the config, the end's metrics at the last step, how it
        ended (summary and tag), the best model as an artifact where asked; the run closed."""
        run = self._run(end.number)
        if end.derived:
            run.config.update(end.derived, allow_val_change=True)
        if end.metrics:
            run.log(end.metrics, step=end.samples)
        summary: dict[str, Any] = {"hpo.state": end.state}
        summary.update({f"best/{k}": v for k, v in self.best.pop(end.number, {}).items()})
        if end.reason:
            summary[f"hpo.{end.state}_reason"] = end.reason[:5000]
        if end.best_model is not None:
            summary["hpo.best_model"] = end.best_model
        run.summary.update(summary)
        run.tags = (*run.tags, end.state)
        if self.config.log_model and end.best_model is not None and end.state == "complete":
            try:
                self._log_model(run, end)
            except Exception as e:  # the store's or wandb's trouble: the run still ends
                said = _without_key(f"{type(e).__name__}: {e}")
                log.warning("trial %d's best model is not in W&B: %s", end.number, said[:300])
        del self.runs[end.number]
        run.finish(exit_code=EXIT_CODE[end.state])

    @_key_kept_out
    def interrupt_trial(self, end: TrialInterrupted) -> None:
        """This worker's trial handed back: its run ends failed, saying why, until the retry
        continues it. Another worker's trial has no run open here: nothing to do."""
        run = self.runs.pop(end.number, None)
        self.best.pop(end.number, None)
        if run is None:
            return
        run.summary.update({"hpo.state": "interrupted", "hpo.interrupted_reason": end.reason})
        run.tags = (*run.tags, "interrupted")
        run.finish(exit_code=1)

    @_key_kept_out
    def close(self) -> None:
        """Runs still open when the worker ends (their trials' ends never came) end failed."""
        for number in list(self.runs):
            self.runs.pop(number).finish(exit_code=1)

    # -- helpers ----------------------------------------------------------------------------

    def _run(self, number: int) -> Any:
        if number not in self.runs:
            raise GiveUp("the trial's run could not be created")
        return self.runs[number]

    def _log_model(self, run: Any, end: TrialEnd) -> None:
        """The best model, type model, named after the run: a local folder's files copied, a
        store URI kept as a reference (not a second copy)."""
        import wandb

        where = str(end.best_model)
        artifact = wandb.Artifact(
            f"model-{run.id}", type="model", metadata={"trial": end.number, "source": where}
        )
        if where.split("://", 1)[0] in REFERENCE_SCHEMES and "://" in where:
            artifact.add_reference(where, checksum=False)
        elif Path(where).is_dir():
            artifact.add_dir(where)
        else:
            return  # a folder gone since (a kept-models limit removed it): nothing to copy
        run.log_artifact(artifact, aliases=["best", f"trial-{end.number}"])
