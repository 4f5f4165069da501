"""How a worker stops on SIGTERM or Ctrl-C: the running trial is stopped, recorded as
interrupted and handed back to the study, then the worker exits; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells expect after Ctrl-C


class Interrupted(KeyboardInterrupt):
    """Raised where a trial stops because its worker was asked to stop. A KeyboardInterrupt, so
    that Optuna records the trial as failed and then lets it through rather than going on."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopRequest:
    """Remembers the first SIGINT/SIGTERM. With `interrupt_at_once` (a trial training in this
    very process) the signal raises Interrupted where the worker is; otherwise the worker polls
    `requested` and stops its trial process itself."""

    def __init__(self, interrupt_at_once: bool = False) -> None:
        self.signal_name: str | None = None
        self.interrupt_at_once = interrupt_at_once

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def exit_code(self) -> int:
        # SIGTERM is how schedulers and spot instances preempt: a clean, expected stop.
        return EXIT_INTERRUPTED if self.signal_name == "SIGINT" else 0

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if name == "SIGINT":
                raise Interrupted(name)  # a second Ctrl-C: the user does not want to wait
            return
        self.signal_name = name
        log.warning("%s received: stopping the running trial and handing it back", name)
        if self.interrupt_at_once:
            raise Interrupted(name)
