"""The tracker's calls, run by one background thread off the training path: a bounded queue,
retries within a patience, and what could not be logged remembered per trial (said once)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

from hpo.storage.url import mask_text

log = logging.getLogger(__name__)
# Calls waiting for the tracker at most: a tracker that is down does not fill the memory.
MAX_WAITING = 2000
STUDY = -1  # the "trial" of the study's own calls (its parent run)


class GiveUp(Exception):
    """A call the tracker refuses for good (a wrong value, no permission): not retried."""


class BackgroundCalls:
    """Runs submitted calls in order on a daemon thread. A call is retried until it works or
    `patience_s` has passed; then the trial it belongs to is missing from the tracker: its
    remaining calls are skipped and the reason is said once (secrets masked)."""

    def __init__(self, tracker: str, patience_s: float, max_waiting: int = MAX_WAITING) -> None:
        self.tracker = tracker
        self.patience_s = patience_s
        self.calls: queue.Queue[tuple[int, str, Callable[[], None]] | None] = queue.Queue(
            max_waiting
        )
        self.lock = threading.Lock()
        self.missing: dict[int, str] = {}  # trial number (or STUDY) -> why, first reason
        self.unreported: list[int] = []  # missing trials the worker has not recorded yet
        self.thread = threading.Thread(target=self._run, name=f"hpo-{tracker}", daemon=True)
        self.thread.start()

    def submit(self, trial: int, what: str, call: Callable[[], None]) -> None:
        """Never blocks: a full queue gives the call up."""
        if self._lost(trial):
            self._skip(trial, what)
            return
        try:
            self.calls.put_nowait((trial, what, call))
        except queue.Full:
            self._give_up(trial, f"{what}: {self.calls.maxsize} calls wait for the tracker")

    def close(self, wait_s: float) -> bool:
        """Let the waiting calls run for up to `wait_s` seconds; what is left is given up.
        Returns whether everything ran."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.calls.put(None, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self.thread.join(max(0.0, deadline - time.monotonic()))
        done = not self.thread.is_alive()
        if not done:  # the calls still waiting are lost: say so for their trials
            while True:
                try:
                    item = self.calls.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._give_up(item[0], f"{item[1]}: not sent before the worker ended")
            # The end, queued again: the thread stops once its hung call returns, rather than
            # waiting for calls for ever (a notebook runs many studies in one process).
            with contextlib.suppress(queue.Full):
                self.calls.put_nowait(None)
        return done

    def take_unreported(self) -> dict[int, str]:
        """The trials found missing since the last call (for the worker to record)."""
        with self.lock:
            taken = {n: self.missing[n] for n in self.unreported}
            self.unreported.clear()
        return taken

    def _lost(self, trial: int) -> bool:
        with self.lock:
            return trial in self.missing or STUDY in self.missing

    def _run(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            trial, what, call = item
            if self._lost(trial):
                self._skip(trial, what)
                continue
            error = self._call(call)
            if error is not None:
                self._give_up(trial, f"{what}: {error}")

    def _call(self, call: Callable[[], None]) -> str | None:
        """None once the call worked; else why it did not within the patience."""
        deadline = time.monotonic() + self.patience_s
        pause = 0.5
        while True:
            try:
                call()
                return None
            except GiveUp as e:
                return str(e)
            except Exception as e:  # the tracker's client raises anything: never the trial's
                error = f"{type(e).__name__}: {e}"
            if time.monotonic() + pause >= deadline:
                return error
            time.sleep(pause)
            pause = min(pause * 2, 8.0)

    def _skip(self, trial: int, what: str) -> None:
        """A call of a trial whose logging failed already, or of any trial once the study's
        own run is missing: given up (said once for the trial)."""
        with self.lock:
            study_gone = self.missing.get(STUDY) if trial != STUDY else None
        if study_gone is not None:
            self._give_up(trial, f"{what}: {study_gone}")

    def _give_up(self, trial: int, reason: str) -> None:
        reason = mask_text(" ".join(reason.split()))[:300]
        with self.lock:
            if trial in self.missing:
                return
            self.missing[trial] = reason
            if trial != STUDY:
                self.unreported.append(trial)
        whose = "the study's run" if trial == STUDY else f"trial {trial}"
        log.warning("%s is missing from %s: %s", whose, self.tracker, reason)
