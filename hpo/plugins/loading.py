"""The user's code named in the config by import path (`package.module:name`): the training
function (`training.entrypoint`) and the plug-ins (`search_space:` a define-by-run function,
`metrics:`, `task:` a task class, `model.factory:`).
Each is imported and checked before any trial (one line when it cannot be), and a failure inside
a trial keeps the user's traceback with the trial.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.errors import ConfigError
from hpo.plugins import by_value
from hpo.plugins.protocols import TrialLike

if TYPE_CHECKING:
    from hpo.config.schema import Config

log = logging.getLogger(__name__)

MAX_TRACEBACK_CHARS = 20_000  # the user attribute keeps the end, where the error is


def load_plugin(spec: str, base_dir: str, key: str) -> Callable[..., Any]:
    """The callable `spec` names (`package.module:name`), imported with the config's folder
    first on sys.path. Raises ConfigError, one line starting with the config's `key`: the
    module, the name and the error's last line, when the module does not import, lacks the
    name, or the name is not callable."""
    sent = by_value.find(spec)  # a notebook's function, sent to this trial process by value
    return _checked(spec, key, sent) if sent is not None else _imported(spec, base_dir, key)


def _imported(spec: str, base_dir: str, key: str) -> Callable[..., Any]:
    module_name, _, name = spec.partition(":")
    if base_dir and base_dir not in sys.path:
        sys.path.insert(0, base_dir)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # the user's module may raise anything as it imports
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        fix = ""
        if module_name.endswith(".py") and isinstance(e, ImportError):
            fix = f"; name the module without its .py: {module_name[:-3]}:{name}"
        raise ConfigError(
            [f"{key}: {spec}: module {module_name} does not import ({last}){fix}"]
        ) from e
    function = getattr(module, name, None)
    if function is None:
        where = getattr(module, "__file__", None) or "built in"
        raise ConfigError(
            [
                f"{key}: {spec}: module {module_name} ({where}) has no "
                f"{name}{_shadowed(module_name, where, base_dir)}"
            ]
        )
    return _checked(spec, key, function)


def _checked(spec: str, key: str, function: Any) -> Callable[..., Any]:
    """`function` if hpo can call it as the plug-in `key`; ConfigError, one line, if not."""
    name = spec.partition(":")[2]
    if not callable(function):
        raise ConfigError(
            [
                f"{key}: {spec}: {name} is not callable (it is "
                f"{type(function).__name__}); name a function"
            ]
        )
    kind = _not_plain_function(function)
    if kind and key != "task":
        raise ConfigError(
            [
                f"{key}: {spec}: {name} is {kind}, so calling it runs none of its "
                "body; hpo calls it and uses what it returns: make it a plain "
                "`def` that returns its result"
            ]
        )
    return function


def _shadowed(module_name: str, where: str, base_dir: str) -> str:
    """A hint when the config's folder has a file of the module's name that is not the module
    imported (one of the standard library's, or one imported earlier, took the name)."""
    mine = Path(base_dir, *module_name.split(".")).with_suffix(".py")
    if not base_dir or not mine.is_file() or Path(where).resolve() == mine.resolve():
        return ""
    return (
        f"; your {mine} is not the module imported under that name (Python's own or "
        "another one loaded first): rename your file"
    )


def _not_plain_function(function: Any) -> str:
    """What kind of function `function` is when calling it only creates an object (a
    generator, a coroutine) rather than running it; empty for any other callable."""
    if inspect.isasyncgenfunction(function):
        return "an async generator function"
    if inspect.iscoroutinefunction(function):
        return "an async function (`async def`; await it in a plain def with asyncio.run)"
    if inspect.isgeneratorfunction(function):
        return "a generator function (it yields)"
    return ""


def record_failure(
    trial: TrialLike,
    spec: str,
    error: BaseException,
    started: float,
    what: str,
    user_frames: types.TracebackType | None = None,
) -> None:
    """The user's traceback, from their function down (or from `user_frames`), kept with the
    trial (user attribute `traceback`) and in the worker's log: never lost. `what` names the
    code in the log line (the training function, the search space)."""
    tb = error.__traceback__
    if user_frames is None:
        user_frames = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    text = "".join(traceback.format_exception(type(error), error, user_frames))
    trial.set_user_attr("traceback", text[-MAX_TRACEBACK_CHARS:])
    trial.set_user_attr("fail_reason", f"{spec}: {type(error).__name__}: {error}"[:1000])
    trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
    log.error("trial %d: %s %s failed:\n%s", trial.number, what, spec, text.rstrip())


def load_user_code(config: Config) -> None:
    """Every plug-in of hpo's trainer the config names, imported and checked: before any trial
    (hpo run) and again in each trial process. ConfigError, one line, for the first that
    cannot be used."""
    if config.metrics is not None:
        load_plugin(config.metrics, config.base_dir, "metrics")
    if config.model.factory is not None:
        load_plugin(config.model.factory, config.base_dir, "model.factory")
    if user_task(config) is not None:
        check_task_class(config)


def check_trial_processes_import(config: Config) -> None:
    """Each trial process imports the script that started its worker (hpo.run in a script), as
    multiprocessing does, and there the user's code it runs; a function it cannot import (one
    of a notebook, of `python -c`) is packed here to be sent to it by value. One line, before
    any trial, when neither can be, rather than every trial failing as its process starts."""
    if config.study.trial_isolation != "process":
        return  # the user's code runs in the worker, where it was imported already
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    named = getattr(getattr(main, "__spec__", None), "name", None)
    if not named and path is not None and not os.path.isfile(path):
        raise ConfigError(
            [
                f"study.trial_isolation: process: each trial process imports the "
                f"script that started its worker, and {path} is no file (a script "
                "read from stdin?): run it from a file, or set "
                "study.trial_isolation: none"
            ]
        )
    for key, spec in _specs_in_trial_processes(config):
        if by_value.needs_sending(spec):
            by_value.keep(spec, load_plugin(spec, config.base_dir, key), key)


def _specs_in_trial_processes(config: Config) -> list[tuple[str, str]]:
    """The config's plug-ins that a trial process imports, by their keys."""
    named = [
        ("training.entrypoint", config.training.entrypoint),
        ("metrics", config.metrics),
        ("model.factory", getattr(config.model, "factory", None)),
        ("task", user_task(config)),
    ]
    return [(key, spec) for key, spec in named if spec is not None]


def user_task(config: Config) -> str | None:
    """The task class the config names by import path; None for a built-in task."""
    from hpo.trainer.tasks import is_task_path

    return config.task if is_task_path(config.task) else None


def check_task_class(config: Config) -> None:
    """`task: package.module:ClassName`: it imports, it is a task class (a subclass of
    trainer.tasks.base.Task with a catalog entry), and it has the study's metrics, each improving
    the way study.direction says. ConfigError, one line, otherwise."""
    from hpo.trainer.tasks import TaskClassError, task_class

    spec = config.task
    load_plugin(spec, config.base_dir, "task")
    try:
        info = task_class(spec).describe()
    except TaskClassError as e:
        raise ConfigError([f"task: {e}"]) from e
    study = config.study
    for name, way in zip(study.objectives, study.resolved_directions, strict=True):
        if name == "samples_per_s" or (name not in info.metrics and config.metrics is not None):
            continue  # the throughput, or a metric of the user's metrics function
        if name not in info.metrics:
            raise ConfigError(
                [
                    f"study.metric: the task {spec} has no metric {name}; its metrics: "
                    f"{', '.join(info.metrics)}"
                ]
            )
        if way != info.metrics[name]:
            raise ConfigError(
                [f"study.direction: metric {name} of the task {spec} must be {info.metrics[name]}d"]
            )


def first_user_frame(
    error: BaseException, config: Config
) -> tuple[str, types.TracebackType] | None:
    """Where an error raised in hpo's trainer entered the user's task class or model factory:
    the plug-in's import path and the traceback from its first frame; None when it passed
    through no module of theirs."""
    specs = [spec for spec in (user_task(config), config.model.factory) if spec is not None]
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        mine = [spec for spec in specs if spec.partition(":")[0] == module]
        if mine:  # one module may hold both: the frame's class or function says which
            owner = tb.tb_frame.f_code.co_qualname.split(".")[0]
            named = [spec for spec in mine if spec.partition(":")[2] == owner]
            return (named or mine)[0], tb
        tb = tb.tb_next
    return None
