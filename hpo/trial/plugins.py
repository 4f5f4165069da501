"""The user's code named in the config by import path (`package.module:name`): the training
function (`training.entrypoint`) and the plug-ins (`search_space:` a define-by-run function).
Each is imported and checked before any trial (one line when it cannot be), and a failure inside
a trial keeps the user's traceback with the trial.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from hpo.errors import ConfigError
from hpo.trial.protocol import TrialLike

log = logging.getLogger(__name__)

MAX_TRACEBACK_CHARS = 20_000  # the user attribute keeps the end, where the error is


def load_plugin(spec: str, base_dir: str, key: str) -> Callable[..., Any]:
    """The callable `spec` names (`package.module:name`), imported with the config's folder
    first on sys.path. Raises ConfigError, one line starting with the config's `key`: the
    module, the name and the error's last line, when the module does not import, lacks the
    name, or the name is not callable."""
    module_name, _, name = spec.partition(":")
    if base_dir and base_dir not in sys.path:
        sys.path.insert(0, base_dir)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # the user's module may raise anything as it imports
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        raise ConfigError([f"{key}: {spec}: module {module_name} does not import "
                           f"({last})"]) from e  # fmt: skip
    function = getattr(module, name, None)
    if function is None:
        raise ConfigError([f"{key}: {spec}: module {module_name} "
                           f"({getattr(module, '__file__', '?')}) has no {name}"])  # fmt: skip
    if not callable(function):
        raise ConfigError([f"{key}: {spec}: {name} is not callable (it is "
                           f"{type(function).__name__}); name a function"])  # fmt: skip
    return function


def record_failure(
    trial: TrialLike, spec: str, error: BaseException, started: float, what: str
) -> None:
    """The user's traceback, from their function down, kept with the trial (user attribute
    `traceback`) and in the worker's log: never lost. `what` names the code in the log line
    (the training function, the search space)."""
    tb = error.__traceback__
    user_frames = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    text = "".join(traceback.format_exception(type(error), error, user_frames))
    trial.set_user_attr("traceback", text[-MAX_TRACEBACK_CHARS:])
    trial.set_user_attr("fail_reason", f"{spec}: {type(error).__name__}: {error}"[:1000])
    trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
    log.error("trial %d: %s %s failed:\n%s", trial.number, what, spec, text.rstrip())
