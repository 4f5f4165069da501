"""The config's tracking section: MLflow, TensorBoard and Weights & Biases, and how long a
tracker call may take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class MlflowTrackingConfig:
    """tracking.mlflow: a parent run per study, a nested run per trial."""

    uri: str | None = _doc(
        "The MLflow tracking URI (http://host:5000, a folder, sqlite:///file.db); left out: "
        "MLFLOW_TRACKING_URI; `hpo run --tracking URI` overrides both."
    )
    experiment: str | None = _doc("The MLflow experiment; left out: hpo-<study name>.")


@dataclass
class TensorboardTrackingConfig:
    """tracking.tensorboard: event files per trial under one folder per study."""

    dir: str = _doc("The folder of the event files (a folder per study below it).", "tensorboard")


WANDB_FORBIDDEN = "/\\#?%:"  # what W&B refuses in a project's name


@dataclass
class WandbTrackingConfig:
    """tracking.wandb: a Weights & Biases run per trial, grouped by study."""

    project: str | None = _doc(
        "The W&B project; left out: WANDB_PROJECT, else hpo-<study name> (a retrain's: the "
        "searched study's)."
    )
    entity: str | None = _doc(
        "The W&B team or user the runs belong to; left out: WANDB_ENTITY, else the API key's "
        "default entity."
    )
    group: str | None = _doc(
        "The runs' group; left out: the study's name (a retrain's: the searched study's)."
    )
    log_model: bool = _doc(
        "Log each complete trial's best model as a W&B artifact (type model; a store URI "
        "such as s3://... as a reference, not a second copy).",
        False,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        named = {k: getattr(self, k) for k in ("project", "entity", "group")}
        empty = [k for k, v in named.items() if v is not None and not v.strip()]
        found: list[tuple[str, Any, str]] = [(k, named[k], "must not be empty") for k in empty]
        project = self.project or ""
        if len(project) > 128 or any(c in project for c in WANDB_FORBIDDEN):
            rule = f"W&B takes at most 128 characters and none of {WANDB_FORBIDDEN}"
            found.append(("project", project, rule))
        return found


@dataclass
class TrackingConfig:
    """Where trials are logged besides the study's database (never in the trials' way)."""

    mlflow: MlflowTrackingConfig | None = _doc("Log to MLflow (needs `pip install hpo[mlflow]`).")
    tensorboard: TensorboardTrackingConfig | None = _doc(
        "Write TensorBoard event files (needs `pip install hpo[tensorboard]`)."
    )
    wandb: WandbTrackingConfig | None = _doc(
        "Log to Weights & Biases (needs `pip install hpo[wandb]`; WANDB_MODE=offline writes "
        "the runs to disk for `wandb sync`)."
    )
    patience: float = _doc(
        "Seconds one tracker call may take, its retries included, before what it logs is "
        "given up (the trial is never kept waiting for it).",
        30.0,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        if self.patience <= 0:
            return [("patience", self.patience, "must be more than 0")]
        return []
