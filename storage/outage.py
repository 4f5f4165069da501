"""Riding out a database outage (PostgreSQL restarted, network blip): calls that fail for lack
of a connection are retried with backoff until the database is back or the patience runs out.
Errors that are not about the connection are raised at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import Engine

from hpo.storage.errors import DatabaseUnreachable, StorageError
from hpo.storage.url import mask_text

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0
# SQLite's code for an error in the SQL itself ("no such table", a syntax error), which its
# driver raises as an OperationalError like a locked or unreadable file: no wait changes it.
SQLITE_ERROR = 1
_CONNECTION_ERRORS = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.DisconnectionError,
)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and what caused it, in turn (each once: a chain may loop)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient(error: BaseException) -> bool:
    """A lost or refused connection, possibly wrapped by Optuna in StorageInternalError: the one
    decision of what a retry may fix. Not hpo's own StorageError (a retry already gave up, or
    the database is unusable), nor SQL the database refuses (a missing table, a bad query)."""
    if isinstance(error, StorageError):
        return False
    chain = list(_chain(error))
    if any(_sql_refused(e) for e in chain):
        return False
    return any(
        isinstance(e, _CONNECTION_ERRORS)
        or (isinstance(e, sqlalchemy.exc.DBAPIError) and e.connection_invalidated)
        for e in chain
    )


def _sql_refused(error: BaseException) -> bool:
    """SQLite's driver says "OperationalError" for a missing table as for a locked file; its
    error code tells them apart. (PostgreSQL's driver raises ProgrammingError for those.)"""
    driver = getattr(error, "orig", None) or error  # SQLAlchemy's error holds the driver's
    return "sqlite" in type(driver).__module__ and getattr(driver, "sqlite_errorcode", None) == (
        SQLITE_ERROR
    )


def is_gone(error: BaseException) -> bool:
    """An SQLite file deleted, moved or made read-only under the worker: SQLite says
    "attempt to write a readonly database". It will not come back by waiting."""
    return any(
        "readonly database" in str(e) and "sqlite" in type(e).__module__ for e in _chain(error)
    )


def retrying(
    call: Callable[[], T],
    what: str,
    patience_s: float,
    wrote_before: bool = True,
    database: str = "the study database",
    then: str = "start the worker again",
) -> T:
    """`call()`, again and again while the database is unreachable, for up to `patience_s`;
    then DatabaseUnreachable. `wrote_before`: whether this process has written to the database
    yet, which tells an SQLite file made read-only under it from one that never took a write.
    `database` and `then` name the database (its URL masked) and what to do once it is up."""
    deadline = time.monotonic() + patience_s
    delay = FIRST_DELAY_S
    failures = 0
    while True:
        try:
            result = call()
        except Exception as e:
            if is_gone(e):
                raise StorageError(_gone(wrote_before)) from e
            if not is_transient(e):
                raise
            if time.monotonic() + delay > deadline:
                raise DatabaseUnreachable(
                    f"{database} was unreachable for {patience_s:g} s ({_reason(e)}); "
                    f"check that it is up, then {then}"
                ) from e
            failures += 1
            if failures == 1:
                log.warning("%s unreachable (%s); retrying %s", database, _reason(e), what)
            time.sleep(delay)
            delay = min(2 * delay, MAX_DELAY_S)
            continue
        if failures:
            log.warning("%s back after %d retries of %s", database, failures, what)
        return result


def _gone(wrote_before: bool) -> str:
    refused = "the study's SQLite file refuses writes (attempt to write a readonly database)"
    if not wrote_before:
        return (
            f"{refused}: it is read-only (its permissions, a read-only file system, or mode=ro "
            "in the URL); make it writable, or copy it to a writable place and point --storage "
            "at the copy"
        )
    return (
        f"{refused}: it was deleted, moved or made read-only while the worker ran; "
        "put it back or start a new study"
    )


def wait_for_connections(engine: Engine, patience_s: float) -> None:
    """New connections are retried too: after a restart, every pooled one is gone."""

    @sqlalchemy.event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
        return retrying(lambda: dbapi_connect(dialect, cargs, cparams), "connect", patience_s)


def dbapi_connect(dialect: Any, cargs: Any, cparams: Any) -> Any:
    """The driver's own connection, outside SQLAlchemy's pool and the queries it runs on a
    first connection; the driver's error is raised as SQLAlchemy's."""
    try:
        return dialect.loaded_dbapi.connect(*cargs, **cparams)
    except dialect.loaded_dbapi.OperationalError as e:
        # Wrapped so that is_transient sees it as what it is.
        raise sqlalchemy.exc.OperationalError("connect", None, e) from e


def _reason(error: BaseException) -> str:
    root: BaseException = error
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    return mask_text(lines[0] if lines else type(root).__name__)
