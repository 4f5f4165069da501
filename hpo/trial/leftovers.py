"""Processes a trial left running (a training function that forked a child and returned, a
library's helper it started): found below the trial process in /proc and ended with its trial.

The trial process is a child subreaper (Linux): a child whose parent exited is handed to it,
not to init, so everything a trial started stays below it and can be found. The trial process
ends what its trial left before it reports the outcome; its worker ends what a trial process
it had to kill left (`Snapshot`). Elsewhere than on Linux nothing is found and nothing ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hpo.trial.protocol import exited

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
# How long a process left behind has to exit after SIGTERM before it is killed.
END_GRACE_S = 2.0
POLL_S = 0.02
# Started by a library in the kept trial process and reused by its next trials, so not the
# trial's own: torch.compile's pool of compile workers (inductor starts it on first use and
# keeps it for the life of the process; killed, the next trial's compile would break).
KEPT_HELPERS = (b"torch/_inductor/compile_worker", b"torch._inductor.compile_worker")


def become_subreaper() -> bool:
    """Make this process the one its orphaned descendants are handed to (Linux); whether it
    is now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class ProcessInfo:
    """One process as /proc shows it."""

    pid: int
    parent_pid: int
    zombie: bool  # exited, not yet waited for by its parent


def read_processes(proc: str = "/proc") -> dict[int, ProcessInfo]:
    """Every process of this host by pid (empty where there is no /proc)."""
    try:
        names = os.listdir(proc)
    except OSError:
        return {}
    processes = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue  # exited meanwhile
        # The command name, in parentheses, may hold spaces and parentheses itself.
        fields = stat.rpartition(b")")[2].split()
        if len(fields) < 2:
            continue
        processes[int(name)] = ProcessInfo(int(name), int(fields[1]), fields[0] == b"Z")
    return processes


def descendants(
    root_pid: int,
    processes: dict[int, ProcessInfo],
    keep: Callable[[int], bool] = lambda pid: False,
) -> list[ProcessInfo]:
    """The processes below `root_pid`, parents before their children; a process `keep`
    accepts is left out with everything below it."""
    children: dict[int, list[ProcessInfo]] = {}
    for info in processes.values():
        children.setdefault(info.parent_pid, []).append(info)
    found: list[ProcessInfo] = []
    level = [root_pid]
    while level:
        below = [c for pid in level for c in children.get(pid, []) if not keep(c.pid)]
        found.extend(below)
        level = [c.pid for c in below]
    return found


def _has_children(pid: int, proc: str = "/proc") -> bool:
    """Whether `pid` has a child, from its threads' lists of children: a few small reads, where
    reading every process of a busy host takes a tenth of a second (all of /proc is read
    where the lists are missing: a kernel built without them)."""
    try:
        for thread in os.listdir(f"{proc}/{pid}/task"):
            with open(f"{proc}/{pid}/task/{thread}/children", "rb") as handle:
                if handle.read().strip():
                    return True
        return False
    except FileNotFoundError:
        return bool(descendants(pid, read_processes(proc)))
    except OSError:
        return False


def kept_helper(pid: int, proc: str = "/proc") -> bool:
    """Whether `pid` is a helper a library keeps for the process's next trials (KEPT_HELPERS)."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as handle:
            command = handle.read()
    except OSError:
        return False
    return any(helper in command for helper in KEPT_HELPERS)


class Snapshot:
    """Processes held by pidfd (a pid may be reused once its process is gone; a pidfd names
    the process itself), to end later, after the process above them is gone."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.pidfds: dict[int, int] = {}
        for pid in pids:
            with contextlib.suppress(OSError, AttributeError):  # gone, or no pidfds here
                self.pidfds[pid] = os.pidfd_open(pid)

    @classmethod
    def below(cls, root_pid: int) -> Snapshot:
        """The live processes below `root_pid` now."""
        alive = [p.pid for p in descendants(root_pid, read_processes()) if not p.zombie]
        return cls(alive)

    def end(self, grace_s: float | None = None) -> int:
        """SIGTERM to each process still running, SIGKILL to any still running `grace_s`
        (END_GRACE_S) later; returns how many were running."""
        grace_s = END_GRACE_S if grace_s is None else grace_s
        try:
            running = {pid: fd for pid, fd in self.pidfds.items() if not exited(fd, 0)}
            for fd in running.values():
                _send(fd, signal.SIGTERM)
                _send(fd, signal.SIGCONT)  # a stopped process acts on SIGTERM only then
            deadline = time.monotonic() + grace_s
            left = dict(running)
            while left and time.monotonic() < deadline:
                left = {pid: fd for pid, fd in left.items() if not exited(fd, POLL_S)}
            for fd in left.values():
                _send(fd, signal.SIGKILL)
            for fd in left.values():
                exited(fd, grace_s)
            return len(running)
        finally:
            for fd in self.pidfds.values():
                os.close(fd)
            self.pidfds.clear()


def _send(pidfd: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
        signal.pidfd_send_signal(pidfd, signum)


def end_what_the_trial_left(trial_number: int) -> int:
    """In a trial process, once its trial has ended: end every process below this one that is
    still running (a kept library helper aside), wait for those that are this process's
    children, and say how many there were."""
    me = os.getpid()
    if not _has_children(me):
        return 0
    gc.collect()  # hpo's own DataLoader workers end with their loader, not here
    below = descendants(me, read_processes(), keep=kept_helper)
    ended = Snapshot(p.pid for p in below if not p.zombie).end()
    reap_children(me)
    if ended:
        log.warning(
            "trial %d left %d process%s running; ended %s",
            trial_number,
            ended,
            "" if ended == 1 else "es",
            "it" if ended == 1 else "them",
        )
    return ended


def reap_children(me: int) -> None:
    """Wait for every child of this process that has exited (one ended here, or an orphan
    handed to this subreaper that exited on its own): no zombie stays behind."""
    for info in read_processes().values():
        if info.parent_pid == me and info.zombie:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.pid, os.WNOHANG)
