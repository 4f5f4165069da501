"""The worker's side of a trial process: run a trial in a child process, so that a crash, a CUDA
error or leaked memory ends with the trial and not with the worker, and relay the child's
reports and pruning questions to the study as they happen. The child's side is child.py, what
the two say to each other protocol.py, how one starts fork_start.py and is watched
process_watch.py.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import send_handle
from typing import Any, Protocol

import optuna

from hpo import live
from hpo.plugins import by_value
from hpo.stopping import HandBack, Interrupted, StopRequest, TakenOver, TrialTimedOut
from hpo.tracking.observer import NoObserver, TrialObserver
from hpo.trial import objective_pruning
from hpo.trial.child import child_main
from hpo.trial.fork_start import PRELOAD, mp_context, sigint_blocked
from hpo.trial.process_watch import ProcessWatch
from hpo.trial.protocol import (
    ASK,
    EXIT_STOPPED_BEFORE_TRAINING,
    ORPHANED,
    PAUSED,
    TAKEN,
    TrialFailed,
    TrialProcessDied,
    TrialTarget,
    TrialValue,
    WorkerRequests,
    describe_exit,
)

log = logging.getLogger(__name__)

POLL_S = 0.2
STDERR_FD = 2
# A trial process sends PAUSED just before it stops itself (SIGSTOP) because its worker was
# stopped. One still running this long after the message was continued (SIGCONT) by someone
# else, and the worker watches it as a running process again.
PAUSE_SETTLE_S = 5.0


class _JobNotTaken(Exception):
    """The kept trial process ended before it took the trial (it died while idle)."""


@dataclass(frozen=True)
class TrialLimits:
    """How long a trial process may take: to stop once asked, and to run at all (None: no
    limit). Past `trial_timeout_s` of training (its startup is not counted) it checkpoints and
    stops itself; past that plus `stop_timeout_s` (stuck where it cannot stop) it is ended.
    Stopped (SIGSTOP, a debugger) for `stopped_limit_s` while its worker runs, it is killed and
    its trial handed back: the worker beats for it, so no other worker would take it over."""

    stop_timeout_s: float
    trial_timeout_s: float | None = None
    stopped_limit_s: float | None = None


class TrialProcess:
    """The worker's trial process, kept from one trial to the next: a new trial starts in
    milliseconds, with torch, the model's code, the data and (on a GPU) the CUDA context already
    loaded. Each trial still gets a fresh model, optimizer and RNG state (the target builds
    them). The process is replaced after a trial that failed, crashed, was stopped, timed out or
    taken over, when the target asks for it (`replace_after_this_trial`: an OOM at batch 1, a
    CUDA error), or when its memory grew past MEMORY_GROWTH_LIMIT since its first trial.

    `base` goes to the process once, when it starts; each trial sends only its `changes`
    (fields of the `base` dataclass), so the prepared data is not pickled per trial."""

    def __init__(
        self,
        target: TrialTarget,
        base: Any,
        stop: StopRequest,
        limits: TrialLimits,
        requests: WorkerRequests | None = None,
        preload: list[str] | None = None,
    ):
        self.target = target
        self.preload = preload or PRELOAD
        self.base = base
        self.stop = stop
        self.limits = limits
        self.requests = requests
        self.started = 0  # processes started, for logs and tests
        self.observer: TrialObserver = NoObserver()  # hears the trial's evaluations
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._watch: ProcessWatch | None = None

    def run(
        self,
        trial: optuna.Trial,
        changes: dict[str, Any] | None = None,
        taken_over: threading.Event | None = None,
    ) -> TrialValue:
        """The trial's value; raises what the worker needs to record the outcome
        (TrialPruned, TrialFailed, TrialProcessDied, Interrupted, HandBack, TrialTimedOut,
        TakenOver: then the process is killed at once, saving nothing)."""
        limit_s = None
        if self.limits.trial_timeout_s is not None:
            limit_s = self.limits.trial_timeout_s + self.limits.stop_timeout_s
        watchers = _Watchers(limit_s, taken_over, self.limits.stopped_limit_s)
        try:
            while True:
                started = self.started
                conn, watch = self._send_job(("run", trial.number, changes))
                try:
                    message = _relay(
                        trial, conn, watch, self.stop, watchers, self.requests, self.observer
                    )
                    break
                except _JobNotTaken:
                    if self.started != started:
                        message = None  # a fresh process died before taking the job: trial fails
                        break
                    self.close()  # the kept process had died while idle: start a new one
        except TakenOver:
            if self._watch is not None:
                self._watch.kill()  # its checkpoints now belong to the worker that took over
            self.close()
            raise
        except Interrupted:
            self._last_words(trial)  # a second Ctrl-C here exits at once, as during close()
            self.close()
            raise
        except BaseException:
            self.close()  # stopped (checkpointing if it trains) or killed after the timeout
            raise
        finally:
            if self.requests is not None:
                self.requests.end_trial()
        if message is None or not message[2]:  # it died, or ends after this trial
            if message is not None:
                watch.wait(self.limits.stop_timeout_s)  # it sent its result and is exiting
            process = self._process
            self.close()
            exitcode = process.exitcode if process is not None else None
            return _result(trial, None if message is None else message[1], exitcode, self.stop)
        return _result(trial, message[1], None, self.stop)

    def _last_words(self, trial: optuna.Trial) -> None:
        """A stopped trial process checkpoints on its way out and says what that cost (seconds,
        a checkpoint or upload that failed): its user attributes are recorded until it sends
        its outcome or exits, for at most the stop timeout. Nothing else is passed on; a
        question it asked before it heard of the stop gets a reply that lets it go on (not
        pruned; a request refused), or it would wait for ever."""
        conn, watch = self._conn, self._watch
        if conn is None or watch is None:
            return
        watch.ask_to_stop()
        read_last_words(conn, watch, trial, self.limits.stop_timeout_s)
        if not watch.wait(0):  # still running past the stop timeout: killed, as close() would
            log.warning(
                "trial process %s did not stop within %.0f s; killing it",
                watch.process.pid,
                self.limits.stop_timeout_s,
            )
            watch.kill()

    def close(self) -> None:
        """End the process: closing its pipe tells an idle one to exit; a running one is asked
        to stop (SIGTERM), then killed after the stop timeout."""
        if self._conn is not None:
            self._conn.close()  # a child waiting for an answer or a job learns none will come
        if self._watch is not None:
            self._watch.end(self.limits.stop_timeout_s)
        self._process = self._conn = self._watch = None
        atexit.unregister(self.close)

    def _send_job(self, job: tuple[Any, ...]) -> tuple[Connection, ProcessWatch]:
        if self._watch is not None and self._watch.wait(0):
            self.close()  # it died while idle (the OOM killer, a stray signal): a new one
        if self._conn is not None and self._watch is not None:
            try:
                self._conn.send(job)
                return self._conn, self._watch
            except OSError:
                self.close()
        conn, watch = self._start()
        with contextlib.suppress(OSError):  # died at once: _relay finds the pipe closed
            conn.send(job)
        return conn, watch

    def _start(self) -> tuple[Connection, ProcessWatch]:
        context = mp_context(self.preload)
        parent_conn, child_conn = context.Pipe()
        stderr = _stderr_open()
        process = context.Process(
            target=child_main,
            args=(
                child_conn,
                self.target,
                self.base,
                logging.getLogger().level,
                os.getpid(),
                stderr,
                by_value.packed(),
            ),
            name="hpo-trial-process",
        )
        try:
            with sigint_blocked():
                process.start()
            if stderr:  # where the process writes: this worker's stderr now (child.py)
                with contextlib.suppress(OSError):  # died at once: _relay finds the pipe closed
                    send_handle(parent_conn, STDERR_FD, process.pid)
        except OSError as e:  # the fork server died with a stop signal to the process group
            parent_conn.close()
            if self.stop.signal_name is not None:
                raise Interrupted(self.stop.signal_name) from e
            raise
        finally:
            child_conn.close()
        self.started += 1
        self._process, self._conn, self._watch = process, parent_conn, ProcessWatch(process)
        # Before multiprocessing's own exit hook, which would wait for an idle child forever.
        atexit.register(self.close)
        return parent_conn, self._watch


def run_in_child(
    trial: optuna.Trial,
    target: TrialTarget,
    payload: Any,
    stop: StopRequest,
    limits: TrialLimits,
    taken_over: threading.Event | None = None,
) -> TrialValue:
    """Run `target(trial, payload)` in a process of its own, used for this trial only."""
    process = TrialProcess(target, payload, stop, limits)
    try:
        return process.run(trial, None, taken_over)
    finally:
        process.close()


@dataclass(frozen=True)
class _Watchers:
    """What ends a trial from the worker's side, besides a stop request."""

    limit_s: float | None  # training time (trial_timeout) plus the stop timeout
    taken_over: threading.Event | None
    stopped_limit_s: float | None = None  # see TrialLimits
    stopped_since: list[float] = field(default_factory=list)  # first and last seen stopped
    deadline: list[float] = field(default_factory=list)  # monotonic; past it: timed out
    created: float = field(default_factory=time.monotonic)

    def training(self) -> None:
        """The trial trains (its first progress): the trial timeout counts training only, and
        the trial process starts its own clock no later than this."""
        if self.limit_s is not None and not self.deadline:
            self.deadline.append(time.monotonic() + self.limit_s)

    def check(self) -> None:
        if self.taken_over is not None and self.taken_over.is_set():
            raise TakenOver()
        now = time.monotonic()
        if self.deadline and now > self.deadline[0]:
            raise TrialTimedOut("the trial process did not stop at study.trial_timeout")
        # Startup (data, model, batch search) is not counted, but it may not last for ever: a
        # process that has not started training after twice its whole limit is stuck there.
        if not self.deadline and self.limit_s is not None and now > self.created + 2 * self.limit_s:
            raise TrialTimedOut(
                "the trial process did not start training within twice study.trial_timeout "
                "plus study.stop_timeout (stuck loading its data or model, or searching its batch)"
            )

    def check_stopped(self, watch: ProcessWatch) -> None:
        """A trial process stopped by someone else (not paused along with its worker): past the
        limit it is killed (a stopped process cannot checkpoint) and its trial handed back, to
        resume from its last checkpoint."""
        if self.stopped_limit_s is None:
            return
        if not watch.stopped():
            self.stopped_since.clear()
            return
        now = time.monotonic()
        since, last = self.stopped_since if self.stopped_since else (now, now)
        if now - last > 10 * POLL_S:  # not looked at meanwhile (this worker slept): count anew
            since = now
        self.stopped_since[:] = [since, now]
        if now - since >= self.stopped_limit_s:
            watch.kill()
            raise HandBack(
                f"its trial process was stopped (SIGSTOP, a debugger) for "
                f"{now - since:.0f} s, past study.grace_period; killed"
            )


def _relay(
    trial: optuna.Trial,
    conn: Connection,
    watch: ProcessWatch,
    stop: StopRequest,
    watchers: _Watchers,
    requests: WorkerRequests | None = None,
    observer: TrialObserver | None = None,
) -> tuple[Any, ...] | None:
    """Pass the child's calls on to the trial (its evaluations to `observer`) until it sends
    ("outcome", outcome, staying); None if it died first."""
    paused = False  # the child said it stops itself, because this worker was stopped
    paused_at = 0.0
    taken = False  # the child took the job: if it dies from now on, the trial fails with it
    pending: tuple[Any, ...] | None = None  # a request not answerable yet (a lock in use)
    while True:
        if pending is not None:
            pending = _answer(requests, conn, pending)
        if stop.signal_name is not None:
            raise Interrupted(stop.signal_name)
        watchers.check()
        if paused and watch.stopped():
            log.info(
                "trial %d: continuing its trial process, paused with this worker", trial.number
            )
            watch.resume()
            paused = False
        elif paused and time.monotonic() - paused_at > PAUSE_SETTLE_S:
            paused = False  # someone else continued it: watched as running again
        if not conn.poll(POLL_S):
            if not paused:  # pipe empty, so a stop now is not its own pause (PAUSED comes first)
                watchers.check_stopped(watch)
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):  # OSError: ECONNRESET, it died with a job unread
            if stop.signal_name is not None:
                continue  # the group's stop signal ended it too: Interrupted is raised next round
            if not taken:
                raise _JobNotTaken() from None
            return None
        if message[0] == PAUSED:
            paused, paused_at = True, time.monotonic()
            continue
        if message[0] == TAKEN:
            taken = True
            continue
        if message[0] == ASK:
            pending = _answer(requests, conn, message[1])
            continue
        if message[0] == "progress":
            watchers.training()
        try:
            outcome = _pass_on(trial, conn, stop, message, observer)
        except optuna.exceptions.UpdateFinishedTrialError as e:
            raise TakenOver() from e  # another worker failed the trial while this one slept
        if outcome is not None:
            return outcome


def _answer(
    requests: WorkerRequests | None, conn: Connection, request: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    """Send the child the answer to `request`; returns the request while it must wait."""
    if requests is None:
        reply: Any = ("error", "this worker answers no requests")
    else:
        reply = requests.answer(request)
        if reply is None:
            return request
    with contextlib.suppress(OSError):  # it died asking: the next read says so
        conn.send(reply)
    return None


def _pass_on(
    trial: optuna.Trial,
    conn: Connection,
    stop: StopRequest,
    message: tuple[Any, ...],
    observer: TrialObserver | None = None,
) -> tuple[Any, ...] | None:
    """One call of the child on the trial; returns the child's outcome once it sends it."""
    kind = message[0]
    if kind == "attr":
        trial.set_user_attr(message[1], message[2])
    elif kind == "report":
        objective_pruning.report(trial, message[1], message[2])
    elif kind == "progress":
        live.trial_progress(trial.number, message[1])
    elif kind == "evaluation":
        if observer is not None:
            observer.evaluation(trial.number, message[1])
    elif kind == "should_prune":
        with contextlib.suppress(OSError):  # it died asking: the next read says so
            conn.send(objective_pruning.should_prune(trial))
    elif kind == "outcome" and message[1][0] == "failed" and stop.signal_name is not None:
        # What broke after a stop request (a DataLoader worker the signal reached, say) is
        # not the trial's fault: it is handed back like any stopped trial.
        log.warning("trial %d failed while stopping: %s", trial.number, message[1][1])
        raise Interrupted(stop.signal_name)
    else:
        return message
    return None


def _result(
    trial: optuna.Trial, outcome: tuple[Any, ...] | None, exitcode: int | None, stop: StopRequest
) -> TrialValue:
    if outcome is None:
        reason = f"the trial process {describe_exit(exitcode)}"
        trial.set_user_attr("fail_reason", reason)
        if exitcode == EXIT_STOPPED_BEFORE_TRAINING and stop.signal_name is None:
            raise HandBack(reason + ", though its worker did not ask (its fork server died?)")
        raise TrialProcessDied(reason)
    kind = outcome[0]
    if kind == "complete":
        value = outcome[1]
        return [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)
    if kind == "pruned":
        raise optuna.TrialPruned(outcome[1])
    if kind == "timed_out":
        raise TrialTimedOut(outcome[1])
    if kind == "handed_back":  # not the trial's fault (a rank of its run was lost): again
        trial.set_user_attr("fail_reason", str(outcome[1])[:1000])
        raise HandBack(outcome[1])
    if kind == "interrupted":
        if stop.signal_name is not None:  # the stop signal reached the trial process first
            raise Interrupted(stop.signal_name)
        cause = (
            "lost its fork server (killed?), so the kernel stopped it"
            if outcome[1] == ORPHANED
            else "got a SIGTERM that its worker did not send"
        )
        reason = f"interrupted: the trial process {cause}; it checkpointed"
        trial.set_user_attr("fail_reason", reason)
        raise HandBack(reason)
    trial.set_user_attr("fail_reason", str(outcome[1])[:1000])
    error = TrialFailed(outcome[1])
    error.add_note(f"in the trial process:\n{outcome[2]}")
    raise error


class _Exits(Protocol):
    """What read_last_words needs of a process watch: whether the process has exited."""

    def wait(self, timeout_s: float) -> bool: ...


def read_last_words(conn: Connection, watch: _Exits, trial: optuna.Trial, limit_s: float) -> None:
    """Record the attributes a stopping trial process sends until its outcome, its exit or
    `limit_s`. What it sent just before exiting is still in the pipe when the exit is seen:
    that is read too (a CI run lost the stopped trial's checkpoint_s so, one run in four)."""
    deadline = time.monotonic() + limit_s
    while True:
        exited = watch.wait(0)
        try:
            if not conn.poll(0 if exited else POLL_S):
                if exited or time.monotonic() >= deadline:
                    return
                continue
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "outcome":
            return
        if message[0] == "attr":
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                trial.set_user_attr(message[1], message[2])
        elif message[0] in ("should_prune", ASK) and not exited:  # asked before the stop
            reply = False if message[0] == "should_prune" else ("error", "stopping")
            with contextlib.suppress(OSError):
                conn.send(reply)


def _stderr_open() -> bool:
    try:
        os.fstat(STDERR_FD)
    except OSError:
        return False  # started with it closed (`2>&-`): the process keeps its fork server's
    return True
