"""`study.notify`: who hears of a study (Apprise URLs: Slack, email, Matrix, ntfy, a webhook) and
when. Each URL is checked by Apprise itself, and its secrets (tokens, passwords) are masked in
every message hpo writes from the moment the config is read (storage.url.add_secrets).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal

from hpo.storage.url import add_secrets

NotifyEvent = Literal["end", "best", "failures", "stall"]
EVENTS: tuple[NotifyEvent, ...] = ("end", "best", "failures", "stall")
EXTRA = "hpo[notify]"
# A URL's part shorter than this is not masked in free text on its own (its whole URL is): a
# two-letter "secret" would blank out every word that holds those letters.
SHORTEST_SECRET = 3
_PARTS = re.compile(r"[/:@#?&=]+")


@dataclass
class NotifyConfig:
    """Messages about the study, sent in the background by every worker (never in a trial's
    way); a watcher (`hpo status --watch --notify CONFIG`) says when the study stalls."""

    urls: list[str] = field(
        default_factory=list,
        repr=False,  # a token must not reach a traceback or a debug line through repr()
        metadata={
            "help": "Apprise URLs, e.g. slack://TokenA/TokenB/TokenC/#channel, "
            "mailtos://user:password@example.com, ntfy://ntfy.sh/topic, "
            "json://host:port/path (a webhook); their tokens and passwords are masked in "
            "everything hpo prints, logs or stores. Needs `pip install 'hpo[notify]'`."
        },
    )
    # Not `on`: YAML reads that key as true.
    events: list[NotifyEvent] = field(
        default_factory=lambda: list(EVENTS),
        metadata={
            "help": "What is said: end (the study's budget is spent and no trial runs, said "
            "once), best (a new best value, or a new trial on the Pareto front), failures "
            "(failures_in_a_row trials in a row failed for the same reason, said once per "
            "streak), stall (no trial has a live worker: said by `hpo status --watch "
            "--notify`)."
        },
    )
    failures_in_a_row: int = field(
        default=3,
        metadata={"help": "How many trials in a row must fail for the same reason to be said."},
    )
    stall_after: float | None = field(
        default=None,
        metadata={
            "help": "Seconds a watcher waits with no trial running on a live worker before it "
            "says the study stalled; default: the watcher's own rule (the study's grace "
            "period, at least three refreshes)."
        },
    )
    wait: float = field(
        default=10.0,
        metadata={
            "help": "Seconds a worker that ends waits for its last messages to go out (a "
            "notification service that is down or slow costs no trial, only this)."
        },
    )

    def __post_init__(self) -> None:
        hide([url for url in self.urls if isinstance(url, str)])  # from the first moment

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        shown = [shown_url(url) for url in self.urls]
        if not self.urls:
            found.append(
                ("urls", shown, "give at least one Apprise URL, e.g. ntfy://ntfy.sh/topic")
            )
        elif not apprise_installed():
            found.append(("urls", shown, f"needs apprise: pip install '{EXTRA}'"))
        else:
            found += [("urls", url, why) for url, why in url_problems(self.urls)]
        if self.failures_in_a_row < 1:
            found.append(("failures_in_a_row", self.failures_in_a_row, "must be >= 1"))
        if self.stall_after is not None and self.stall_after <= 0:
            found.append(("stall_after", self.stall_after, "must be more than 0, or null"))
        if self.wait < 0:
            found.append(("wait", self.wait, "must be >= 0"))
        if len(set(self.events)) != len(self.events):
            found.append(("events", self.events, "names an event twice"))
        return found


def hide_notify_secrets(raw: dict[Any, Any]) -> None:
    """Mask every text under a raw config's study.notify from now on, whatever its shape: a
    problem message quotes the value it refuses (`urls: [slack://..., 3]`)."""
    study = raw.get("study")
    notify = study.get("notify") if isinstance(study, dict) else None
    # What could be a URL: event names and numbers are no secret, and masking "end" would
    # blank that word out of every message.
    hide([text for text in _texts(notify) if any(c in text for c in ":/@")])


def hide(urls: list[str]) -> None:
    """Each URL, and each part of it that its shown form hides, masked by mask_text from now
    on in this process (the whole URL first: its parts are masked within what is left)."""
    add_secrets({url: shown_url(url) for url in urls})
    add_secrets({part: "****" for url in urls for part in secret_parts(url)})


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [text for item in value for text in _texts(item)]
    return []


def apprise_installed() -> bool:
    return importlib.util.find_spec("apprise") is not None


def parsed(url: str) -> Any:
    """Apprise's plugin for `url`, None where it refuses it. Apprise's own log lines about a
    URL it refuses are silenced: they quote the URL's parts (its tokens) before hpo can mask
    them, and the problem is hpo's one line."""
    import apprise

    logger = logging.getLogger("apprise")
    disabled, logger.disabled = logger.disabled, True
    try:
        return apprise.Apprise.instantiate(url, suppress_exceptions=True)
    finally:
        logger.disabled = disabled


def url_problems(urls: list[str]) -> list[tuple[str, str]]:
    """(masked URL, why) for each URL Apprise does not take."""
    found = []
    for url in urls:
        if parsed(url) is None:
            found.append(
                (
                    shown_url(url),
                    "is not a URL Apprise can send to: check its scheme and parts "
                    "(https://github.com/caronc/apprise/wiki lists every service's form)",
                )
            )
    return found


def shown_url(url: str) -> str:
    """The URL as hpo shows it: Apprise's own privacy form (tokens and passwords hidden),
    without its query; without Apprise, or for a URL it refuses, the scheme only."""
    text = str(url)
    plugin = parsed(text) if apprise_installed() else None
    if plugin is not None:
        return str(plugin.url(privacy=True)).split("?", 1)[0]
    # A URL Apprise refuses may hold a token anywhere, its host included (slack://TokenA/...).
    scheme, found, _ = text.partition("://")
    return f"{scheme}://****" if found and scheme.isalnum() else "****"


def secret_parts(url: str) -> list[str]:
    """The parts of `url` that its shown form hides (a token, a password, a query value):
    masked wherever they appear alone, as in a service's error message."""
    text = str(url)
    before_query, _, query = text.partition("?")
    after_scheme = before_query.split("://", 1)[-1]  # Apprise may show another (mailtos)
    parts = set(_PARTS.split(urllib.parse.unquote(after_scheme)))
    parts |= {value for _, value in urllib.parse.parse_qsl(query)}
    visible = set(_PARTS.split(urllib.parse.unquote(shown_url(text))))
    return sorted(p for p in parts - visible if len(p) >= SHORTEST_SECRET)
