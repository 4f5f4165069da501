"""Turn the config's search space into Optuna suggestions and a trial's training settings."""

from __future__ import annotations

import dataclasses
from typing import Any

import optuna

from hpo.config.schema import ParamSpec
from trainer.config import TrainingConfig


def sample(trial: optuna.Trial, space: dict[str, ParamSpec]) -> dict[str, Any]:
    """One value per search-space parameter, suggested by the study's sampler."""
    return {name: suggest(trial, name, spec) for name, spec in space.items()}


def suggest(trial: optuna.Trial, name: str, spec: ParamSpec) -> Any:
    if spec.type == "categorical":
        return trial.suggest_categorical(name, list(spec.choices or []))
    if spec.low is None or spec.high is None:  # ParamSpec.problems reports it first
        raise ValueError(f"search_space.{name}: a {spec.type} parameter needs low and high")
    if spec.type == "int":
        step = int(spec.step) if spec.step is not None else 1
        return trial.suggest_int(name, int(spec.low), int(spec.high), step=step, log=spec.log)
    return trial.suggest_float(name, spec.low, spec.high, step=spec.step, log=spec.log)


def training_for_trial(base: TrainingConfig, params: dict[str, Any]) -> TrainingConfig:
    """The fixed training settings with the sampled hyperparameters applied."""
    return dataclasses.replace(base, **params)
