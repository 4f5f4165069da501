"""Turn the config's search space into Optuna suggestions (define-by-run: a parameter whose
`when` does not hold is never suggested), and a trial's parameters into its training job.
"""

from __future__ import annotations

from typing import Any

import optuna

from hpo.config import search_paths
from hpo.config.loader import model_location
from hpo.config.schema import Config, ParamSpec, applies, sampling_order
from trainer.config import TrainJob


def sample(trial: optuna.Trial, space: dict[str, ParamSpec]) -> dict[str, Any]:
    """One value per parameter that applies to this trial, suggested by the study's sampler:
    the parameters a `when` names first, then each conditional one only where it holds."""
    params: dict[str, Any] = {}
    for name in sampling_order(space):
        if applies(space[name], params):
            params[name] = suggest(trial, name, space[name])
    return params


def suggest(trial: optuna.Trial, name: str, spec: ParamSpec) -> Any:
    if spec.type == "categorical":
        return trial.suggest_categorical(name, list(spec.choices or []))
    if spec.low is None or spec.high is None:  # ParamSpec.problems reports it first
        raise ValueError(f"search_space.{name}: a {spec.type} parameter needs low and high")
    if spec.type == "int":
        step = int(spec.step) if spec.step is not None else 1
        return trial.suggest_int(name, int(spec.low), int(spec.high), step=step, log=spec.log)
    return trial.suggest_float(name, spec.low, spec.high, step=spec.step, log=spec.log)


def job_for_trial(config: Config, params: dict[str, Any]) -> TrainJob:
    """The trainer's input for a trial: the config's model, data and training settings with the
    trial's parameters applied (each to the field search_paths names). The trial's training,
    the batch-size cache key and retrain's runs all come from here."""
    changes: dict[str, dict[str, Any]] = {section: {} for section in search_paths.SECTIONS}
    for name, value in params.items():
        section, field = search_paths.field_of(name)
        changes[section][field] = value
    model_changes = changes["model"]
    if isinstance(model_changes.get("name_or_path"), str):
        model_changes["name_or_path"] = model_location(model_changes["name_or_path"],
                                                       config.base_dir)  # fmt: skip
    sections = {name: getattr(config, name) for name in search_paths.SECTIONS}
    for section, fields in changes.items():
        for field, value in fields.items():
            sections[section] = search_paths.with_value(sections[section], section, field, value)
    return TrainJob(sections["data"], sections["model"], sections["training"], config.task)
