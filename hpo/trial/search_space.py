"""Turn the config's search space into Optuna suggestions (define-by-run: a parameter whose
`when` does not hold is never suggested), and a trial's parameters into its training job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import optuna

from hpo.config import search_paths
from hpo.config.loader import function_params, model_location
from hpo.config.schema import Config, ParamSpec, applies, sampling_order
from hpo.trial.plugins import load_plugin, record_failure
from trainer.config import TrainJob

SpaceFunction = Callable[[optuna.Trial], Any]


class SearchSpaceError(Exception):
    """The define-by-run search space returned what hpo cannot train with (or exited)."""


class Sampler:
    """A trial's parameters: from the config's search space, or from the user's define-by-run
    function (`search_space: package.module:name`), imported once per worker."""

    def __init__(self, config: Config) -> None:
        self.config = config
        spec = config.search_space_function
        self.function = None if spec is None else load_plugin(spec, config.base_dir, "search_space")

    def __call__(self, trial: optuna.Trial) -> dict[str, Any]:
        if self.function is None:
            return sample(trial, self.config.search_space)
        return sample_function(trial, self.config, self.function)


def sample_function(trial: optuna.Trial, config: Config, function: SpaceFunction) -> dict[str, Any]:
    """The parameters the user's function returns for `trial`, checked as a YAML search space's
    would be. A function that raises fails the trial with its traceback kept (user attribute
    `traceback`, the worker's log); a wrong return is named in `fail_reason`."""
    spec = str(config.search_space_function)
    started = time.perf_counter()
    try:
        returned = function(trial)
    except optuna.TrialPruned:
        raise
    except (Exception, SystemExit) as e:
        record_failure(trial, spec, e, started, "the search space")
        if isinstance(e, SystemExit):  # sys.exit() in user code ends its trial, not the worker
            raise SearchSpaceError(f"{spec} raised SystemExit: {e}") from e
        raise
    try:
        params = function_params(config, returned, spec)
    except ValueError as e:
        trial.set_user_attr("fail_reason", str(e)[:1000])
        raise SearchSpaceError(str(e)) from None
    trial.set_user_attr("search_space", spec)
    trial.set_user_attr("params", params)  # what it trains with (the names Optuna keeps may differ)
    return params


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
