"""Watching a trial process by its own pid (a pidfd): whether it has exited, asking it to stop,
and killing it with what it started.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.process import BaseProcess

from hpo.trial import leftovers
from hpo.trial.protocol import exited, process_stopped

log = logging.getLogger(__name__)

# How long a process killed at once (no chance to checkpoint) is waited for.
KILL_WAIT_S = 2.0


class ProcessWatch:
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
        return exited(self.pidfd, timeout_s)

    def ask_to_stop(self) -> None:
        """SIGTERM: it checkpoints at the next optimizer step and exits."""
        if not self.wait(0):
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)  # a paused process acts on SIGTERM only then

    def end(self, stop_timeout_s: float) -> None:
        """A process still running is asked to stop (see ask_to_stop), then killed after the
        timeout."""
        try:
            if not self.wait(0):
                self.ask_to_stop()
                if not self.wait(stop_timeout_s):
                    log.warning(
                        "trial process %s ignored SIGTERM for %.0f s; killing it",
                        self.process.pid,
                        stop_timeout_s,
                    )
                    self._kill_with_what_it_started(stop_timeout_s)
            self.process.join(timeout=1)  # multiprocessing's own record of the exit
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP): it paused itself with its worker."""
        return self.process.pid is not None and process_stopped(self.process.pid)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """At once, with no chance to checkpoint."""
        if not self.wait(0):
            self._kill_with_what_it_started(KILL_WAIT_S)

    def _kill_with_what_it_started(self, wait_s: float) -> None:
        """SIGKILL, then what the process had started (its trial's children, which it can no
        longer end itself: leftovers.py) is ended too."""
        left = leftovers.Snapshot.below(self.process.pid) if self.process.pid else None
        self._signal(signal.SIGKILL)
        self.wait(wait_s)
        ended = left.end() if left is not None else 0
        if ended:
            log.warning(
                "the killed trial process %s left %d process%s running; ended %s",
                self.process.pid,
                ended,
                "" if ended == 1 else "es",
                "it" if ended == 1 else "them",
            )

    def _signal(self, signum: int) -> None:
        if self.pidfd is None:
            self.process.kill() if signum == signal.SIGKILL else self.process.terminate()
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:
            pass  # exited in the meantime
