"""How trial processes start: a fork server, with torch and hpo's modules preloaded (or the
worker's own copy, worker_copy.py), and SIGINT held back while one starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
from collections.abc import Container, Iterator
from multiprocessing import resource_tracker
from multiprocessing.context import ForkServerContext

from hpo.trial import worker_copy

# Imported once by the fork server: a trial process then starts in milliseconds, not seconds.
# transformers.modeling_utils is what every model class of transformers imports (with
# torch._dynamo, seconds of CPU): loaded here, not again in each new trial process. None of
# them initialises CUDA, which must happen in the trial process itself. The last one makes the
# fork server exit without the interpreter's slow teardown (see fork_server.py).
PRELOAD = [
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "optuna",
    "hpo.trial.objective",
    "hpo.trial.fork_server",
]
# A user's training function (training.entrypoint) needs no transformers: its trial process
# starts seconds sooner without them (its own imports happen in its first trial).
ENTRYPOINT_PRELOAD = ["torch", "optuna", "hpo.trial.own_function", "hpo.trial.fork_server"]
# ...unless the user's module uses transformers' Trainer (the worker imported the module to
# check it): then loaded once here, not again in each trial (seconds of CPU each).
TRAINER_PRELOAD = ["transformers", "transformers.trainer", "hpo.integrations.transformers"]
_context: ForkServerContext | None = None


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back (not lost) while a trial process starts. A fork server started here
    inherits the blocked signal and keeps it blocked: a Ctrl-C while it imports torch would
    otherwise print its KeyboardInterrupt traceback (it ignores SIGINT only once ready).
    multiprocessing's resource tracker unblocks SIGINT after it starts: it starts first."""
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def entrypoint_preload(modules: Container[str] = sys.modules) -> list[str]:
    """What the fork server of a worker running a user's training function preloads
    (`modules`: those loaded in the worker)."""
    loaded = [name for name in TRAINER_PRELOAD if name in modules]
    return [*ENTRYPOINT_PRELOAD[:-1], *loaded, ENTRYPOINT_PRELOAD[-1]]


def fork_server_preload(user_function: bool) -> list[str]:
    """What the fork server preloads for hpo's own training, or a user's function."""
    return entrypoint_preload() if user_function else PRELOAD


def prepare_fork_server(user_function: bool) -> int:
    """For a worker that runs its trial processes, before it loads the user's modules: what the
    fork server preloads imported here; returns the native threads running then (see
    start_fork_server)."""
    return worker_copy.import_preload(fork_server_preload(user_function))


def start_fork_server(user_function: bool, native_threads_before: int | None = None) -> bool:
    """For a worker that runs its trial processes, once its inputs are checked and before it
    prepares the data, opens the study or starts a thread: the fork server as a copy of the
    worker (worker_copy.py; True), else started afresh with the first trial process (False).
    `native_threads_before`: prepare_fork_server's count, before the user's modules ran."""
    mp_context(fork_server_preload(user_function))  # what a server started afresh preloads
    return worker_copy.start_as_copy(native_threads_before)


def mp_context(preload: list[str]) -> ForkServerContext:
    """The fork server, started with the first trial process (what it preloads then stays)."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(preload)
        _context = context
    return _context
