"""Turn the config's search space into Optuna suggestions (define-by-run: a parameter whose
`when` does not hold is never suggested), or call the user's define-by-run function. A trial's
parameters become its training job in hpo.config.search_paths.with_params.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable
from typing import Any

import optuna

from hpo.config.param_checks import function_params
from hpo.config.schema import Config
from hpo.config.space import ParamSpec, applies, sampling_order
from hpo.plugins.loading import load_plugin, record_failure
from hpo.stopping import Interrupted, StopRequest

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
