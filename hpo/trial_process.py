"""Run a trial in a child process, so that a crash, a CUDA error or leaked memory ends with the
trial and not with the worker. The worker relays the child's reports and pruning questions to
the study as they happen.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Protocol

import optuna

from hpo.logs import set_optuna_verbosity, setup_logging
from hpo.stopping import Interrupted, StopRequest

log = logging.getLogger(__name__)

POLL_S = 0.2
# Imported once by the fork server: a trial process then starts in milliseconds, not seconds.
# None of them initialises CUDA, which must happen in the trial process itself.
_PRELOAD = ["torch", "transformers", "optuna", "hpo.objective"]
_context: ForkServerContext | None = None


class TrialLike(Protocol):
    """What training code needs of a trial; an optuna.Trial, or ChildTrial inside the child."""

    @property
    def number(self) -> int: ...

    def set_user_attr(self, key: str, value: Any) -> None: ...

    def report(self, value: float, step: int) -> None: ...

    def should_prune(self) -> bool: ...


TrialTarget = Callable[[TrialLike, Any], float]


class TrialFailed(Exception):
    """The trial raised in its child process; the child's traceback is attached as a note."""


class TrialProcessDied(Exception):
    """The child process ended without a result: killed, crashed or exited."""


# Set in a trial process by SIGTERM (the worker stopping it) or a lost worker.
_stop_reason: list[str] = []
# Whether the trial process has begun training, so that a stop would checkpoint. Until then
# (batch search, model build: many seconds on a GPU) a SIGTERM ends it at once: nothing is lost.
_training: list[bool] = []
EXIT_STOPPED_BEFORE_TRAINING = 128 + signal.SIGTERM


def stop_requested() -> bool:
    """In a trial process: whether to checkpoint and stop at the next optimizer step. The
    training loop first asks before its first step, so the first question also says that
    training runs."""
    if not _training:
        _training.append(True)
    return bool(_stop_reason)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _stop_reason.append("SIGTERM")
    if not _training:
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
        self._send(("attr", key, value))

    def report(self, value: float, step: int) -> None:
        self._send(("report", value, step))

    def should_prune(self) -> bool:
        if not self._send(("should_prune",)):
            return False
        try:
            return bool(self._conn.recv())
        except (EOFError, OSError):
            _stop_reason.append("the worker stopped listening")
            return False

    def _send(self, message: tuple[Any, ...]) -> bool:
        if _stop_reason:
            return False
        try:
            self._conn.send(message)
            return True
        except OSError:  # BrokenPipeError: the worker is gone or stopping this trial
            _stop_reason.append("the worker stopped listening")
            return False


def run_in_child(
    trial: optuna.Trial, target: TrialTarget, payload: Any, stop: StopRequest, stop_timeout_s: float
) -> float:
    """Run `target(trial, payload)` in a fresh process; returns its value or raises what Optuna
    needs to record the outcome (TrialPruned, TrialFailed, TrialProcessDied, Interrupted)."""
    context = _mp_context()
    parent_conn, child_conn = context.Pipe()
    process = context.Process(
        target=_child_main,
        args=(child_conn, target, payload, trial.number, logging.getLogger().level),
        name=f"hpo-trial-{trial.number}",
    )
    process.start()
    child_conn.close()
    watch = _ProcessWatch(process)
    try:
        outcome = _relay(trial, parent_conn, stop)
        watch.wait(stop_timeout_s)  # it sent its result, or died, and is exiting
    finally:
        parent_conn.close()  # a child waiting for an answer learns that none will come
        watch.end(stop_timeout_s)
    return _result(trial, outcome, process.exitcode)


def _relay(trial: optuna.Trial, conn: Connection, stop: StopRequest) -> tuple[Any, ...] | None:
    """Pass the child's calls on to the trial until it sends its outcome; None if it died."""
    while True:
        if stop.signal_name is not None:
            raise Interrupted(stop.signal_name)
        if not conn.poll(POLL_S):
            continue
        try:
            message = conn.recv()
        except EOFError:
            if stop.signal_name is not None:
                continue  # the signal reached the trial process too (a process group's stop)
            return None
        kind = message[0]
        if kind == "attr":
            trial.set_user_attr(message[1], message[2])
        elif kind == "report":
            trial.report(message[1], message[2])
        elif kind == "should_prune":
            conn.send(trial.should_prune())
        elif kind == "failed" and stop.signal_name is not None:
            # What broke after a stop request (a DataLoader worker the signal reached, say) is
            # not the trial's fault: it is handed back like any stopped trial.
            log.warning("trial %d failed while stopping: %s", trial.number, message[1])
            raise Interrupted(stop.signal_name)
        else:
            return message


def _result(trial: optuna.Trial, outcome: tuple[Any, ...] | None, exitcode: int | None) -> float:
    if outcome is None:
        reason = f"the trial process {describe_exit(exitcode)}"
        trial.set_user_attr("fail_reason", reason)
        raise TrialProcessDied(reason)
    kind = outcome[0]
    if kind == "complete":
        return float(outcome[1])
    if kind == "pruned":
        raise optuna.TrialPruned(outcome[1])
    if kind == "interrupted":  # the stop signal reached the trial process first
        raise Interrupted(outcome[1])
    trial.set_user_attr("fail_reason", str(outcome[1])[:1000])
    error = TrialFailed(outcome[1])
    error.add_note(f"in the trial process:\n{outcome[2]}")
    raise error


class _ProcessWatch:
    """Waits for, stops and kills the trial process by its own pid. multiprocessing's join()
    hears of the exit from the fork server; a signal to the whole process group (Slurm, systemd,
    `timeout`) kills the fork server too, and join() then returns at once while the trial
    process trains on, orphaned, holding its GPU memory (seen in CI: the worker exited and its
    trial process went on for 20 s). A pidfd follows the process itself, and no reused pid."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        self.pidfd: int | None = None
        if hasattr(os, "pidfd_open") and process.pid is not None:
            try:
                self.pidfd = os.pidfd_open(process.pid)
            except ProcessLookupError:
                pass  # already gone
            except OSError:
                self.pidfd = None  # no pidfds (old kernel, seccomp): multiprocessing's view

    def wait(self, timeout_s: float) -> bool:
        """Whether the process has exited within `timeout_s`."""
        if self.pidfd is None:
            self.process.join(timeout=timeout_s)
            return not self.process.is_alive()
        poller = select.poll()  # not select(): a busy worker's fds may pass 1024
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))

    def end(self, stop_timeout_s: float) -> None:
        """A process still running is asked to stop (SIGTERM: it checkpoints at the next
        optimizer step and exits), then killed after the timeout."""
        try:
            if not self.wait(0):
                self._signal(signal.SIGTERM)
                if not self.wait(stop_timeout_s):
                    log.warning("trial process %s ignored SIGTERM for %.0f s; killing it",
                                self.process.pid, stop_timeout_s)  # fmt: skip
                    self._signal(signal.SIGKILL)
                    self.wait(stop_timeout_s)
            self.process.join(timeout=1)  # multiprocessing's own record of the exit
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None

    def _signal(self, signum: int) -> None:
        if self.pidfd is None:
            self.process.kill() if signum == signal.SIGKILL else self.process.terminate()
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:
            pass  # exited in the meantime


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


def _child_main(
    conn: Connection, target: TrialTarget, payload: Any, number: int, log_level: int
) -> None:
    # The worker decides how its trial stops: Ctrl-C in a terminal reaches the whole group, and
    # the worker's SIGTERM means "checkpoint and stop".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _stop_when_orphaned()
    setup_logging(log_level)
    set_optuna_verbosity(log_level)
    trial = ChildTrial(conn, number)
    try:
        outcome: tuple[Any, ...] = ("complete", target(trial, payload))
    except optuna.TrialPruned as e:
        outcome = ("pruned", str(e))
    except Interrupted as e:
        outcome = ("interrupted", e.signal_name)
    except Exception as e:
        outcome = ("failed", f"{type(e).__name__}: {e}", traceback.format_exc())
    try:
        conn.send(outcome)
    except OSError:
        pass  # the worker stopped listening: it is handing this trial back
    finally:
        conn.close()


def _stop_when_orphaned() -> None:
    """A worker killed outright takes its fork server with it; the kernel then sends this
    process SIGTERM (Linux), so it checkpoints and stops instead of training on unseen."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # orphaned before the line above took effect
        _stop_reason.append("orphaned")


def _mp_context() -> ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        _context = context
    return _context
