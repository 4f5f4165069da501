"""How a worker stops on SIGTERM or Ctrl-C: the running trial is stopped, recorded as
interrupted and handed back to the study, then the worker exits; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells expect after Ctrl-C

# The files of Python's import machinery: a module's code runs under their frames while it loads.
_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
AFTER_IMPORT_CHECK_S = 0.05  # how often a stop held back by an import looks again


def stopped_exit_code(signal_name: str) -> int:
    # SIGTERM is how schedulers and spot instances preempt: a clean, expected stop.
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else 0


def inside_import(frame: FrameType | None) -> bool:
    """Whether `frame` runs while a module loads. A signal handler raises no exception there:
    it would land in whatever the module's code is doing, which torch's C++ cannot take (a
    call back into Python during its import aborts the process: pybind11's error_already_set
    escapes) and numpy's lazy attributes take badly (its `__getattr__` recurses until
    RecursionError). The stop is raised once the import is over instead."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


class Interrupted(KeyboardInterrupt):
    """Raised where a trial stops because its worker was asked to stop. A KeyboardInterrupt, so
    that Optuna records the trial as failed and then lets it through rather than going on."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class TakenOver(Exception):
    """This worker's trial was failed and queued again by another worker (its heartbeats had
    stopped: the worker was paused or unreachable); this worker drops its result."""


class HandBack(Exception):
    """The trial stopped for a reason that is not its own (its fork server died, say): it is
    recorded FAIL with the reason and queued again, and the worker goes on."""


class TrialTimedOut(Exception):
    """The trial ran past `study.trial_timeout`."""


class StopRequest:
    """Remembers the first SIGINT/SIGTERM. With `interrupt_at_once` (a trial training in this
    very process) the signal raises Interrupted where the worker is; otherwise the worker polls
    `requested` and stops its trial process itself."""

    BEFORE_FIRST_TRIAL = "stopping before the first trial"
    RUNNING = "stopping the running trial and handing it back"
    BETWEEN_TRIALS = "starting no new trial"

    def __init__(self, interrupt_at_once: bool = False, doing: str = RUNNING) -> None:
        self.signal_name: str | None = None
        self.installed = False  # whether install() set the process's handlers
        self.interrupt_at_once = interrupt_at_once
        self.doing = doing  # what the signal stops, for the log line
        # A second Ctrl-C exits at once; not in a notebook's kernel, whose exit would end the
        # user's session (the trial process is killed past study.stop_timeout all the same).
        self.exit_on_second = True
        self._held_back: str | None = None  # a stop to raise once an import is over
        self._alarm_handler: Any = signal.SIG_DFL  # SIGALRM's handler before hpo's looks

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def exit_code(self) -> int:
        return stopped_exit_code(self.signal_name or "SIGINT")

    def note(self, signal_name: str) -> None:
        """A stop signal that another handler received (the launcher's, passing it on to its
        workers): from now on this request says the worker was asked to stop."""
        if self.signal_name is None:
            self.signal_name = signal_name

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # hpo.run in a thread of the caller's: signals reach the main thread only
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True

    @property
    def handler(self) -> Callable[[int, FrameType | None], None]:
        """The handler install() sets (a bound method: compare it with ==, not `is`)."""
        return self._handle

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if name == "SIGINT":
                self._stop_at_once(name, frame)  # a second Ctrl-C: the user will not wait
            return
        self.signal_name = name
        log.warning("%s received: %s", name, self.doing)
        if self.interrupt_at_once:
            self._interrupt(name, frame)

    def _interrupt(self, name: str, frame: FrameType | None) -> None:
        """Interrupted raised where the worker is, or, while a module loads (inside_import),
        as soon as no module does: SIGALRM looks again every AFTER_IMPORT_CHECK_S, and raises
        then if the worker still stops at once."""
        if not inside_import(frame):
            raise Interrupted(name)
        if self._held_back is None:
            handler = signal.getsignal(signal.SIGALRM)
            self._alarm_handler = signal.SIG_DFL if handler is None else handler
            signal.signal(signal.SIGALRM, self._after_import)
        self._held_back = name
        signal.setitimer(signal.ITIMER_REAL, AFTER_IMPORT_CHECK_S)

    def _after_import(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupt_at_once and inside_import(frame):
            signal.setitimer(signal.ITIMER_REAL, AFTER_IMPORT_CHECK_S)
            return
        name, self._held_back = self._held_back, None
        signal.signal(signal.SIGALRM, self._alarm_handler)
        if self.interrupt_at_once and name is not None:
            raise Interrupted(name)

    def _stop_at_once(self, name: str, frame: FrameType | None) -> None:
        """An exception raised from a signal handler lands wherever the worker is: in a garbage
        collector's callback or an exit hook it is printed as a traceback and ignored, and the
        worker goes on. So it is raised only while a trial trains in this very process (the
        only way to stop it there); elsewhere the worker exits now, without handing its trial
        back: its trial process, orphaned, checkpoints and exits, and the next worker queues
        the trial again once past the grace period."""
        if self.interrupt_at_once:
            self._interrupt(name, frame)
            return
        if not self.exit_on_second:
            log.warning("%s again: still %s (it ends within study.stop_timeout)", name, self.doing)
            return
        log.warning("%s again: exiting at once", name)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_INTERRUPTED)
