"""Messages about a study to people (study.notify: Slack, email, Matrix, ntfy, a webhook, through
Apprise), never in a trial's way: the worker hands each job to one background thread with a
bounded queue; a service that is down or hangs delays that thread only. What a job decides
(is this a new best? has the study ended?) is hpo.study.notices'; this package sends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from hpo.config.notify import NotifyConfig, NotifyEvent, parsed
from hpo.storage.url import mask_text

log = logging.getLogger(__name__)
# Jobs waiting at most: a service that is down does not fill the memory, and no worker waits.
MAX_WAITING = 100
Job = Callable[[], None]


class Notices(Protocol):
    """Where a worker hands what may be worth a message; each call returns at once."""

    def wants(self, event: NotifyEvent) -> bool: ...

    def submit(self, job: Job) -> None: ...

    def say(self, title: str, body: str) -> None: ...

    def close(self) -> None: ...


class NoNotices:
    """A study without study.notify: nothing is said."""

    def wants(self, event: NotifyEvent) -> bool:
        return False

    def submit(self, job: Job) -> None:
        pass

    def say(self, title: str, body: str) -> None:
        pass

    def close(self) -> None:
        pass


class Notifier:
    """Runs submitted jobs in order on a daemon thread; a job says things with `say`, which
    sends through Apprise on that thread. `close` waits `config.wait` seconds at most."""

    def __init__(self, config: NotifyConfig, max_waiting: int = MAX_WAITING) -> None:
        self.config = config
        # Each service is called on this notifier's own thread, one after the other, through
        # its plugin: Apprise.notify() sends on Apprise's shared thread pool, which the
        # interpreter waits for at exit, so a service that hangs would keep a finished worker
        # from ending.
        self.services = [parsed(url) for url in config.urls]
        self.jobs: queue.Queue[Job | None] = queue.Queue(max_waiting)
        self.sent = 0
        self.unsent = 0  # messages a service refused or never answered; said once
        self.dropped = 0  # jobs given up on a full queue; said once
        self.thread = threading.Thread(target=self._run, name="hpo-notify", daemon=True)
        self.thread.start()

    def wants(self, event: NotifyEvent) -> bool:
        return event in self.config.events

    def submit(self, job: Job) -> None:
        """Never blocks: with the queue full (a service that hangs), the job is given up."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "notifications: %d messages wait for a service that does not answer; "
                    "dropping new ones",
                    self.jobs.maxsize,
                )

    def say(self, title: str, body: str) -> None:
        """Send now, on the calling thread (a job's): every URL, secrets masked in the text."""
        title, body = mask_text(title), mask_text(body)
        sent = True
        for service in self.services:
            try:
                sent = bool(service is not None and service.notify(title=title, body=body)) and sent
            except Exception as e:  # Apprise's services raise anything: never the worker's
                log.debug("notification not sent: %s", mask_text(f"{type(e).__name__}: {e}"))
                sent = False
        if sent:
            self.sent += 1
            return
        self.unsent += 1
        if self.unsent == 1:
            log.warning(
                "notifications: a message was not delivered to every study.notify URL (%s); "
                "the trials go on",
                title,
            )

    def close(self) -> None:
        """Let the waiting jobs run for up to config.wait seconds; what is left is lost."""
        deadline = time.monotonic() + self.config.wait
        try:
            self.jobs.put(None, timeout=max(0.01, self.config.wait))
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            log.warning(
                "notifications: the last messages were not sent within study.notify.wait "
                "(%.0f s); a notification service is slow or down",
                self.config.wait,
            )

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception as e:  # a job reads the study: the database's trouble is its own
                log.debug("notification job failed", exc_info=e)
                log.warning("notifications: %s", mask_text(f"{type(e).__name__}: {e}")[:300])


def start(config: NotifyConfig | None) -> Notices:
    """The worker's notifier; one that says nothing without study.notify."""
    if config is None or not config.urls:
        return NoNotices()
    return Notifier(config)
