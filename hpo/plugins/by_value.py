"""The user's functions that a trial process cannot import (defined in a notebook cell, in
`python -c`, or given to hpo.run as objects), sent to it by value with cloudpickle, as Ray and
joblib send them. The worker packs each once, before any trial; every trial process it starts
receives the bytes and finds the function here before it would import anything.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hpo.errors import ConfigError

log = logging.getLogger(__name__)

# What one function may weigh with all it refers to (a closure's cells, the notebook's globals
# it reads): over WARN_BYTES a line says what it costs, over LIMIT_BYTES it is refused, as
# every trial process receives the bytes at its start.
WARN_BYTES = 16 * 2**20
LIMIT_BYTES = 256 * 2**20
# The interactive module's functions are named `__main__:name` in the config (an identifier
# after the colon, as trainer.config.ENTRYPOINT wants).
MAIN = "__main__"

_functions: dict[str, Callable[..., Any]] = {}  # spec -> function, in this process
_packed: dict[str, bytes] = {}  # spec -> cloudpickle's bytes, in the worker
_received: dict[str, bytes] = {}  # the same, in a trial process, until first used


def interactive_main() -> bool:
    """Whether `__main__` is a session a new process cannot import again: a notebook's
    kernel, `python -c`, the interactive prompt (a script or `python -m` can be)."""
    main = sys.modules.get(MAIN)
    if getattr(getattr(main, "__spec__", None), "name", None):
        return False
    path = getattr(main, "__file__", None)
    return path is None or not os.path.isfile(path)


def needs_sending(spec: str) -> bool:
    """Whether the function `spec` names reaches a trial process only by value."""
    return spec in _functions or (spec.partition(":")[0] == MAIN and interactive_main())


def find(spec: str) -> Callable[..., Any] | None:
    """The function sent or given for `spec`; None where `spec` is to be imported. One sent
    is unpickled at its first use, in the trial, so that an error doing so (a module it needs
    missing here) fails that trial with its traceback kept."""
    if spec not in _functions and spec in _received:
        function = pickle.loads(_received.pop(spec))
        _functions[spec] = function
        module, _, name = spec.partition(":")
        main = sys.modules.get(MAIN)
        if module == MAIN and main is not None:
            # What hpo's trainer imports by the path itself (a model factory, a task class)
            # finds it here as it did in the worker.
            setattr(main, name, function)
    return _functions.get(spec)


def spec_of(function: Callable[..., Any], key: str, classes: bool = False) -> str:
    """The config's text for a function object given where an import path goes (hpo.run's
    `entrypoint=`, a callable in a config mapping): its import path where a new process finds
    the same object by it, else `__main__:<name>`, kept here to be sent by value. `classes`:
    a class is accepted too (a task class)."""
    if not callable(function) or (isinstance(function, type) and not classes):
        raise ConfigError(
            [
                f"{key}: got {function!r}; give a function (def name(...)), or its import "
                "path as `package.module:name`"
            ]
        )
    module = getattr(function, "__module__", None) or MAIN
    qualname = getattr(function, "__qualname__", None) or type(function).__name__
    if module != MAIN and qualname.isidentifier() and _imports_as(function, module, qualname):
        return f"{module}:{qualname}"
    # A closure's or a lambda's own name (`make.<locals>.train`: train; `<lambda>`: lambda).
    name = re.sub(r"\W", "_", qualname.rsplit(".", 1)[-1]).strip("_") or "function"
    spec = f"{MAIN}:{name if name[0].isalpha() else 'f_' + name}"
    base, n = spec, 1
    while _functions.get(spec, function) is not function:  # two lambdas: two names
        n += 1
        spec = f"{base}_{n}"
    _functions[spec] = function
    return spec


def _imports_as(function: Callable[..., Any], module: str, name: str) -> bool:
    imported = sys.modules.get(module)
    path = getattr(imported, "__file__", None)
    has_file = path is not None and os.path.isfile(path)
    loadable = has_file or hasattr(imported, "__path__")  # a file, or a package
    return loadable and getattr(imported, name, None) is function


def keep(spec: str, function: Callable[..., Any], key: str) -> None:
    """In the worker, before any trial: `function` packed for the trial processes, with what
    it weighs said (or refused, one line) when it is heavy; ConfigError, one line, when it
    cannot be pickled."""
    _functions[spec] = function
    if spec in _packed:
        return
    data = _dumps(spec, function, key)
    size = len(data)
    if size > LIMIT_BYTES:
        raise ConfigError(
            [
                f"{key}: {spec} weighs {_mib(size)} with what it refers to"
                f"{_heaviest(function)}, past the {_mib(LIMIT_BYTES)} that each trial "
                "process may be sent: load the data inside the function, or move the "
                "function into a module file"
            ]
        )
    if size > WARN_BYTES:
        log.warning(
            "%s: %s is sent to each trial process by value: %s with what it refers to%s; "
            "load big objects inside the function to start trials sooner",
            key,
            spec,
            _mib(size),
            _heaviest(function),
        )
    else:
        log.info("%s: %s is sent to each trial process by value (%d bytes)", key, spec, size)
    _packed[spec] = data


def _dumps(spec: str, function: Callable[..., Any], key: str) -> bytes:
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(function))
    except Exception as e:  # pickling runs the user's objects' own __reduce__: anything
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        raise ConfigError(
            [
                f"{key}: {spec} cannot be sent to a trial process ({last}"
                f"{_unpicklable(function)}): refer to that object inside the function "
                "(create it there), move the function into a module file, or set "
                "study.trial_isolation: none"
            ]
        ) from e


def _referred(function: Callable[..., Any]) -> dict[str, Any]:
    """The globals and closure cells `function` reads, by name."""
    try:
        found = inspect.getclosurevars(function)
    except (TypeError, ValueError):
        return {}
    return {**found.globals, **found.nonlocals}


def _unpicklable(function: Callable[..., Any]) -> str:
    import cloudpickle

    for name, value in _referred(function).items():
        try:
            cloudpickle.dumps(value)
        except Exception:  # the same: whatever the object's own pickling raises
            return f"; it refers to `{name}`, a {type(value).__name__}"
    return ""


def _heaviest(function: Callable[..., Any]) -> str:
    import cloudpickle

    sizes = []
    for name, value in _referred(function).items():
        try:
            sizes.append((len(cloudpickle.dumps(value)), name))
        except Exception:  # measured only to name the culprit
            continue
    if not sizes:
        return ""
    size, name = max(sizes)
    return f" (`{name}`: {_mib(size)})" if size > WARN_BYTES // 2 else ""


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def packed() -> dict[str, bytes]:
    """What the worker sends each trial process (empty: nothing by value)."""
    return dict(_packed)


def receive(sent: dict[str, bytes]) -> None:
    """In a trial process, before its first trial: the functions sent by value, found by
    their spec from then on. What it inherited (its fork server may be a copy of the worker,
    made during an earlier run of the same session) gives way: a name may stand for another
    function in this run."""
    for spec, data in sent.items():
        _functions.pop(spec, None)
        _received[spec] = data


def forget() -> None:
    """For a new run in the same session (a notebook's next cell): nothing kept of the last."""
    _functions.clear()
    _packed.clear()
    _received.clear()
