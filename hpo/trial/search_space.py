"""Turn the config's search space into Optuna suggestions (define-by-run: a parameter whose
`when` does not hold is never suggested), and a trial's parameters into its training job.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import optuna

from hpo.config import search_paths
from hpo.config.loader import function_params, model_location
from hpo.config.schema import Config, ParamSpec, applies, sampling_order
from hpo.plugins.loading import load_plugin, record_failure
from hpo.stopping import Interrupted, StopRequest
from trainer.config import TrainJob

SpaceFunction = Callable[[optuna.Trial], Any]


POLL_S = 0.2  # how often the worker looks up from a search-space function that runs long


class SearchSpaceError(Exception):
    """The define-by-run search space returned what hpo cannot train with (or exited)."""


class SearchSpaceTimedOut(SearchSpaceError):
    """The define-by-run search space did not return within study.trial_timeout."""


class Sampler:
    """A trial's parameters: from the config's search space, or from the user's define-by-run
    function (`search_space: package.module:name`), imported once per worker. `stop`: the
    worker's, so that a stop request is heard while that function runs."""

    def __init__(self, config: Config, stop: StopRequest | None = None) -> None:
        self.config = config
        self.stop = stop
        spec = config.search_space_function
        self.function = None if spec is None else load_plugin(spec, config.base_dir, "search_space")

    def __call__(self, trial: optuna.Trial) -> dict[str, Any]:
        if self.function is None:
            return sample(trial, self.config.search_space)
        return sample_function(trial, self.config, self.function, self.stop)


def sample_function(
    trial: optuna.Trial, config: Config, function: SpaceFunction, stop: StopRequest | None = None
) -> dict[str, Any]:
    """The parameters the user's function returns for `trial`, checked as a YAML search space's
    would be. A function that raises fails the trial with its traceback kept (user attribute
    `traceback`, the worker's log); a wrong return is named in `fail_reason`; one still running
    after study.trial_timeout fails the trial with reason "timeout" (see _call_bounded)."""
    spec = str(config.search_space_function)
    started = time.perf_counter()
    try:
        returned = _call_bounded(function, trial, config.study.trial_timeout, stop)
    except optuna.TrialPruned:
        raise
    except _StillRunning as late:
        limit = config.study.trial_timeout
        reason = (
            f"timeout: the search space {spec} did not return within {limit:g} s "
            "(study.trial_timeout); it is left running in a thread of the worker"
        )
        trial.set_user_attr("fail_reason", reason)
        trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
        raise SearchSpaceTimedOut(reason) from late
    except (Exception, SystemExit) as e:
        record_failure(trial, spec, e, started, "the search space", _user_frames(e))
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


class _StillRunning(Exception):
    """The user's function was still running at its deadline."""


def _call_bounded(
    function: SpaceFunction, trial: optuna.Trial, limit_s: float | None, stop: StopRequest | None
) -> Any:
    """`function(trial)`, in a thread of its own, waited for at most `limit_s` seconds (None:
    for as long as it takes) and only until the worker is asked to stop (Interrupted).

    The function runs in the worker, before any trial process exists, and Python cannot end a
    thread: one stuck past its deadline (a loop, a lock, a network call) is left running, as a
    daemon thread that ends with the worker, and the trial fails (_StillRunning). The worker
    goes on; the abandoned call can do no harm to the study, since Optuna refuses every
    suggestion or attribute on a trial that has ended. What the function raises (SystemExit
    included) is raised here as it is; a thread of its own also keeps it from replacing the
    worker's signal handlers (signal.signal refuses outside the main thread)."""
    done: dict[str, Any] = {}
    thread = threading.Thread(
        target=_call_into,
        args=(function, trial, done),
        name=f"hpo-search-space-{trial.number}",
        daemon=True,
    )
    thread.start()
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while thread.is_alive():
        thread.join(POLL_S)
        if stop is not None and stop.signal_name is not None and thread.is_alive():
            raise Interrupted(stop.signal_name)
        if deadline is not None and time.monotonic() > deadline and thread.is_alive():
            raise _StillRunning()
    if "error" in done:
        raise done["error"]
    return done["returned"]


def _call_into(function: SpaceFunction, trial: optuna.Trial, done: dict[str, Any]) -> None:
    try:
        done["returned"] = function(trial)
    except BaseException as e:  # the user's, whatever it is, goes to the worker's thread
        done["error"] = e


def _user_frames(error: BaseException) -> types.TracebackType | None:
    """The traceback of `error` from the user's function down (below _call_into)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _call_into.__code__:
        tb = tb.tb_next
    return tb.tb_next if tb is not None else None


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


def largest_effective_batch(config: Config) -> int:
    """The largest effective batch a trial of this study can ask for: the search space's
    largest choice or high end, else training.effective_batch_size."""
    largest = config.training.effective_batch_size
    for name, spec in config.search_space.items():
        if search_paths.field_of(name) != ("training", "effective_batch_size"):
            continue
        if spec.choices is not None:
            largest = max(int(choice) for choice in spec.choices)
        elif spec.high is not None:
            largest = int(spec.high)
    return largest


def batch_search_bound(config: Config) -> int:
    """The largest physical batch worth a probe: the study's largest effective batch before
    the safety margin takes its share (the margin's cut of this bound still holds that batch).
    A search past it finds sizes no trial can use: 21 probes and 40 s up to 2,836 on an H200
    for a space whose largest batch was 256 (issue 42)."""
    training = config.training
    needed = math.ceil(largest_effective_batch(config) / training.batch_safety_margin)
    return max(1, min(training.batch_search_max, needed))


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
        model_changes["name_or_path"] = model_location(
            model_changes["name_or_path"], config.base_dir
        )
    sections = {name: getattr(config, name) for name in search_paths.SECTIONS}
    for section, fields in changes.items():
        for field, value in fields.items():
            sections[section] = search_paths.with_value(sections[section], section, field, value)
    if sections["training"].physical_batch_size == "auto":
        # The same bound for every trial of the study, so they share one search (its cache
        # key holds the bound: a later study with larger batches searches further).
        bound = batch_search_bound(config)
        sections["training"] = dataclasses.replace(sections["training"], batch_search_max=bound)
    return TrainJob(sections["data"], sections["model"], sections["training"], config.task)
