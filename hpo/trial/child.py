"""The trial process's own side: it trains one trial after another for its worker, stops cleanly on
SIGTERM or when its worker is gone, and asks to be replaced when its memory grew.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from types import FrameType
from typing import Any

import optuna

from hpo.logs import set_optuna_verbosity, setup_logging
from hpo.plugins import by_value
from hpo.stopping import HandBack, Interrupted, TrialTimedOut
from hpo.trial import leftovers
from hpo.trial.protocol import (
    ASK,
    EXIT_STOPPED_BEFORE_TRAINING,
    ORPHANED,
    PAUSED,
    TAKEN,
    TRIAL_PROCESS_NAME,
    WORKER_WATCH_S,
    TrialTarget,
    WorkerStoppedListening,
    exited,
    name_this_process,
    process_stopped,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _ProcessState:
    """What this trial process knows of its own state, written by its signal handler, its
    watch of the worker and the trial, read by the training loop."""

    # Why this trial process was asked to stop, once it was (the first reason): a SIGTERM (from
    # its worker, or from the kernel when its fork server died), its worker gone, or its
    # worker no longer answering.
    stop_reason: str | None = None
    # The pid of this process's parent, the fork server. A SIGTERM that comes once the parent
    # has died is the kernel's notice (PR_SET_PDEATHSIG), not a stop from the worker.
    parent_pid: int | None = None
    # Whether the trial process has begun training, so that a stop would checkpoint. Until then
    # (batch search, model build: many seconds on a GPU) a SIGTERM ends it at once: nothing is
    # lost.
    training: bool = False
    # Set by the trial through `replace_after_this_trial`: this process ends after the trial.
    replace_reason: str | None = None

    def ask_to_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason


_state = _ProcessState()
# Two threads write to the pipe to the worker: the trial's, and the one that watches the worker
# (it sends PAUSED); one message at a time.
_sending = threading.Lock()
# A trial process is replaced once it holds this much more memory than after its first trial,
# or this much more CUDA memory in live tensors.
MEMORY_GROWTH_LIMIT = 2 * 1024**3
CUDA_LEFT_OVER_LIMIT = 64 * 1024**2


def stop_requested() -> bool:
    """In a trial process: whether to checkpoint and stop at the next optimizer step. The
    training loop first asks before its first step, so the first question also says that
    training runs."""
    _state.training = True
    return _state.stop_reason is not None


def stop_reason() -> str:
    """Why this trial process was asked to stop: SIGTERM (its worker), or `orphaned` (its fork
    server died and the kernel sent the notice)."""
    return _state.stop_reason or "SIGTERM"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    orphaned = _state.parent_pid is not None and os.getppid() != _state.parent_pid
    _stop(ORPHANED if orphaned else "SIGTERM")


def _stop(reason: str) -> None:
    """Checkpoint and stop at the next optimizer step; before training, exit at once."""
    _state.ask_to_stop(reason)
    if not _state.training:
        os._exit(EXIT_STOPPED_BEFORE_TRAINING)  # nothing to save; the worker hands it back


class ChildTrial:
    """The trial as the child process sees it: every call goes to the worker over a pipe. Once
    the worker stops listening (it is stopping this trial), calls do nothing and the trial is
    asked to stop."""

    def __init__(self, conn: Connection, number: int) -> None:
        self._conn = conn
        self._number = number

    @property
    def number(self) -> int:
        return self._number

    def set_user_attr(self, key: str, value: Any) -> None:
        # Sent while stopping too: the attributes that say what stopping cost (checkpoint_s,
        # checkpoint_error), which the worker records until the process exits
        # (TrialProcess._last_words).
        self._send(("attr", key, value), while_stopping=True)

    def report(self, value: float, step: int) -> None:
        self._send(("report", value, step))

    def send_progress(self, progress: dict[str, Any]) -> None:
        self._send(("progress", progress))

    def send_evaluation(self, report: dict[str, Any]) -> None:
        self._send(("evaluation", report))

    def ask(self, request: tuple[Any, ...]) -> Any:
        """The worker's answer to `request` (see WorkerRequests); waits for it. Raises
        WorkerStoppedListening once the worker no longer answers (it is stopping this trial)."""
        if not self._send((ASK, request)):
            raise WorkerStoppedListening(request[0])
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            _state.ask_to_stop("the worker stopped listening")
            raise WorkerStoppedListening(request[0]) from None

    def should_prune(self) -> bool:
        if not self._send(("should_prune",)):
            return False
        try:
            return bool(self._conn.recv())
        except (EOFError, OSError):
            _state.ask_to_stop("the worker stopped listening")
            return False

    def _send(self, message: tuple[Any, ...], while_stopping: bool = False) -> bool:
        if _state.stop_reason is not None and not while_stopping:
            return False
        try:
            with _sending:
                self._conn.send(message)
            return True
        except OSError:  # BrokenPipeError: the worker is gone or stopping this trial
            _state.ask_to_stop("the worker stopped listening")
            return False


def child_main(
    conn: Connection,
    target: TrialTarget,
    base: Any,
    log_level: int,
    worker_pid: int,
    worker_stderr: bool = False,
    sent: dict[str, bytes] | None = None,
) -> None:
    # The worker decides how its trial stops: Ctrl-C in a terminal reaches the whole group, and
    # the worker's SIGTERM means "checkpoint and stop".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by its fork server
    name_this_process(TRIAL_PROCESS_NAME)
    if worker_stderr:
        _write_where_the_worker_writes(conn)
    _state.parent_pid = os.getppid()
    by_value.receive(sent or {})  # the user's functions this process cannot import
    signal.signal(signal.SIGTERM, _on_sigterm)
    _stop_when_orphaned()
    # What a trial starts stays below this process, to be ended with the trial (leftovers.py).
    leftovers.become_subreaper()
    os.register_at_fork(after_in_child=_leave_stop_signals_to_the_fork)
    setup_logging(log_level)
    set_optuna_verbosity(log_level)
    _watch_worker(worker_pid, conn)
    # What the fork server loaded and the data live as long as the process: kept out of the
    # collections after each trial (a full one takes 150 ms with torch loaded).
    gc.freeze()
    memory = _MemoryWatch()
    runs = 0
    folder = os.getcwd()
    while True:
        try:
            _, number, changes = conn.recv()
        except (EOFError, OSError):
            return  # the worker has no more trials for this process
        try:
            with _sending:
                conn.send((TAKEN,))
        except OSError:
            return
        payload = base if changes is None else dataclasses.replace(base, **changes)
        runs += 1
        trial = ChildTrial(conn, number)
        trial.set_user_attr("process_trials", runs)  # 1: a new process; more: a kept one
        outcome = _run_target(target, trial, payload)
        _undo_process_changes(folder)
        leftovers.end_what_the_trial_left(number)
        staying = outcome[0] in ("complete", "pruned") and _state.stop_reason is None
        staying = staying and _state.replace_reason is None
        try:
            with _sending:
                conn.send(("outcome", outcome, staying))
        except OSError:
            return  # the worker stopped listening: it is handing this trial back
        _state.training = False  # idle: a SIGTERM now ends this process at once
        # The memory check runs while the worker records the trial; a process that grew
        # exits, and the worker starts a new one for its next trial.
        if not staying or not memory.fit():
            conn.close()
            return
        _state.stop_reason = None


def _write_where_the_worker_writes(conn: Connection) -> None:
    """Stderr becomes the worker's as it is now, which the worker sends first: its fork server
    got the worker's as it was then, and a live line on a terminal has since put a pipe in
    its place (hpo.live), which shows this process's lines above the line. A worker gone
    before it sent it: the first job never comes either, and this process ends."""
    with contextlib.suppress(OSError, EOFError, RuntimeError):
        fd = recv_handle(conn)
        os.dup2(fd, 2)
        os.close(fd)


def _leave_stop_signals_to_the_fork() -> None:
    """In a process the trial forked (a user's child, a DataLoader worker): a SIGTERM is its
    own again, as in any Python process. hpo's handler, inherited, would only note a stop for
    a training loop the fork does not run, so the fork would outlive the SIGTERM that ends
    what its trial left."""
    with contextlib.suppress(ValueError, OSError):  # forked from a thread other than the main
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _undo_process_changes(folder: str) -> None:
    """What a user's code changed of this kept process and hpo relies on in its next trial:
    the working folder (relative paths) and the stop signals' handlers (a SIGTERM must
    checkpoint and stop the trial, a Ctrl-C must not reach it)."""
    with contextlib.suppress(OSError):  # the folder is gone: the next trial says so
        if os.getcwd() != folder:
            log.info("the trial changed the working folder; back to %s", folder)
            os.chdir(folder)
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        log.info("the trial replaced the SIGTERM handler; hpo's is back")
        signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_target(target: TrialTarget, trial: ChildTrial, payload: Any) -> tuple[Any, ...]:
    try:
        return ("complete", target(trial, payload))
    except optuna.TrialPruned as e:
        return ("pruned", str(e))
    except TrialTimedOut as e:
        return ("timed_out", str(e))
    except Interrupted as e:
        return ("interrupted", e.signal_name)
    except HandBack as e:
        return ("handed_back", str(e))
    except Exception as e:
        return ("failed", f"{type(e).__name__}: {e}", traceback.format_exc())


def replace_after_this_trial(reason: str) -> None:
    """In a trial process: end this process after the current trial (its next trial starts
    in a new one): after an OOM at batch 1 or a CUDA error, the device's state is suspect."""
    log.info("the trial process will be replaced after this trial: %s", reason)
    _state.replace_reason = reason


class _MemoryWatch:
    """Whether the process's memory stayed near what it held after its first trial (a trial
    that leaks, or a library cache that grows, ends its process rather than the host). Both
    baselines are taken after the first trial: what a process keeps on purpose (torch's
    imports, cuBLAS and attention workspaces, the caching allocator's own blocks) is not a
    leak; growth past the limits is, and the reason is logged."""

    def __init__(self) -> None:
        self.rss_baseline: int | None = None
        self.cuda_baseline: int | None = None

    def fit(self) -> bool:
        gc.collect()
        cuda = _cuda_allocated_bytes()
        if cuda is not None:
            if self.cuda_baseline is None:
                self.cuda_baseline = cuda
            if cuda - self.cuda_baseline > CUDA_LEFT_OVER_LIMIT:
                log.info(
                    "%d MiB of CUDA tensors outlived the trial; replacing the trial process",
                    (cuda - self.cuda_baseline) // 2**20,
                )
                return False
        rss = _resident_bytes()
        if rss is None:
            return True
        if self.rss_baseline is None:
            self.rss_baseline = rss
        if rss - self.rss_baseline > MEMORY_GROWTH_LIMIT:
            log.info(
                "the trial process holds %d MiB more than after its first trial; replacing it",
                (rss - self.rss_baseline) // 2**20,
            )
            return False
        return True


def _cuda_allocated_bytes() -> int | None:
    """CUDA memory held by live tensors after emptying the allocator's cache; None when this
    process never used CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # no /proc here: memory growth is not watched


def _stop_when_orphaned() -> None:
    """A worker killed outright takes its fork server with it; the kernel then sends this
    process SIGTERM (Linux), so it checkpoints and stops instead of training on unseen."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != _state.parent_pid:  # orphaned before the line above took effect
        _state.ask_to_stop(ORPHANED)


def _watch_worker(worker_pid: int, conn: Connection) -> None:
    """The worker is not this process's parent (the fork server is, and notices the worker's
    death seconds late): a thread follows the worker itself, so a trial whose worker was killed
    checkpoints at its next step and stops before another worker retries it.

    A worker stopped by SIGSTOP (`kill -STOP`, a debugger) sends no heartbeats: another worker
    may fail its trial and resume it from its checkpoint folder. This process then stops
    itself too, writing nothing more there; the worker continues it once it runs again (and
    kills it at once if the trial was taken over meanwhile)."""
    try:
        pidfd = os.pidfd_open(worker_pid)
    except (AttributeError, OSError):
        return  # no pidfds here: the fork server's notice (PR_SET_PDEATHSIG) has to do

    def watch() -> None:
        seen_stopped = 0
        while not exited(pidfd, WORKER_WATCH_S):
            seen_stopped = seen_stopped + 1 if process_stopped(worker_pid) else 0
            if seen_stopped >= 2:  # not a moment's ptrace stop (py-spy dump, say)
                log.warning(
                    "trial process: its worker %d is stopped (SIGSTOP?); pausing with it",
                    worker_pid,
                )
                _notify_paused(conn)
                os.kill(os.getpid(), signal.SIGSTOP)
                seen_stopped = 0
        _stop(ORPHANED)

    threading.Thread(target=watch, name="hpo-worker-watch", daemon=True).start()


def _notify_paused(conn: Connection) -> None:
    """Tells the worker that this process stops itself because the worker is stopped: once
    the worker runs again, it continues this process."""
    try:
        with _sending:
            conn.send((PAUSED,))
    except OSError:
        pass  # the worker is gone: the watch sees it next
