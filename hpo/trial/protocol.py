"""What passes between a worker and its trial process: the messages' kinds, how each side sees
the other gone or stopped, and the errors each side raises then.
"""

from __future__ import annotations

import contextlib
import ctypes
import select
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

from hpo.plugins.protocols import TrialLike

# A trial's (and, for trials of hpo before 0.1's per-trial record, a study's) record of the
# LoRA adapter it trained: {method, base_model}, or None for full fine-tuning.
ADAPTER_ATTR = "adapter"

# How often a trial process looks at its worker: gone (it stops), or stopped by SIGSTOP (it
# pauses too, so that it writes no checkpoint into a folder that a retry may take over).
WORKER_WATCH_S = 0.5
PAUSED = "paused"
TAKEN = "taken"
ASK = "ask"  # a request the worker answers (WorkerRequests), e.g. the batch-size cache's


class WorkerRequests(Protocol):
    """What a worker answers for its trial process, so that the process needs no database
    connection of its own (storage.batch_cache.BatchCacheRequests)."""

    def answer(self, request: tuple[Any, ...]) -> Any | None:
        """The reply, or None while it cannot be given yet (asked again every poll)."""
        ...

    def end_trial(self) -> None:
        """Release what the trial's requests took (it ended, whatever way)."""
        ...


# A trial's value: one number, or one per objective of a study with several.
TrialValue = float | list[float]
TrialTarget = Callable[[TrialLike, Any], TrialValue]


class WorkerStoppedListening(Exception):
    """A trial process asked its worker something after the worker stopped this trial."""

    def __init__(self, request: str) -> None:
        super().__init__(f"no answer to {request!r}: the worker is stopping this trial")


class TrialFailed(Exception):
    """The trial raised in its child process; the child's traceback is attached as a note."""


class TrialProcessDied(Exception):
    """The child process ended without a result: killed, crashed or exited."""


ORPHANED = "orphaned"


EXIT_STOPPED_BEFORE_TRAINING = 128 + signal.SIGTERM


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode == EXIT_STOPPED_BEFORE_TRAINING:
        return "got SIGTERM before it began training, and exited"
    if exitcode >= 0:
        return f"exited with code {exitcode} before it sent a result"
    name = signal.Signals(-exitcode).name
    if name == "SIGKILL":
        return "was killed (SIGKILL); the host may have run out of memory (see dmesg)"
    return f"was killed by {name}"


# Names `ps -e`, `top` and `pgrep` show (a process made by fork keeps its parent's command
# line: the fork server made from a worker, and its trial processes, would read as workers).
FORK_SERVER_NAME = "hpo-forkserver"
TRIAL_PROCESS_NAME = "hpo-trial"


def name_this_process(name: str) -> None:
    """Linux's name of this process (at most 15 bytes), what `ps -e` and `top` show."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15])


def process_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal or a tracer (Linux: /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False  # gone, or no /proc here
    return stat.rpartition(b")")[2].split()[:1] in ([b"T"], [b"t"])


def exited(pidfd: int, timeout_s: float | None) -> bool:
    """Whether the process of `pidfd` exits within `timeout_s` (None: wait for it)."""
    poller = select.poll()  # not select(): a busy worker's fds may pass 1024
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))
