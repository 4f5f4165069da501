"""Physical batch sizes found by the batch finder, kept in the study's own database so every
worker of the study, on every host, reuses a search; a recovery from OOM only ever lowers them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from hpo.storage.errors import StorageError
from hpo.storage.locks import (
    advisory_lock,
    release_advisory_lock,
    try_advisory_lock,
)
from hpo.storage.tables import batch_sizes, ensure_tables


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class BatchSizeCache:
    """Read, record and lower cached physical batch sizes; safe for many concurrent workers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        try:
            ensure_tables(engine)
        except sa.exc.SQLAlchemyError as e:
            raise StorageError(
                f"cannot create the batch-size cache table: {e.__class__.__name__}"
            ) from e

    def get(self, key: dict[str, Any]) -> int | None:
        query = sa.select(batch_sizes.c.physical_batch_size).where(
            batch_sizes.c.key_hash == key_hash(key)
        )
        with self.engine.connect() as conn:
            return conn.execute(query).scalar_one_or_none()

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        """Store a search result unless another worker stored one first; returns the stored size."""
        insert = _insert_for(self.engine).values(
            key_hash=key_hash(key),
            key=json.dumps(key, sort_keys=True, default=str),
            physical_batch_size=physical_batch_size,
            search=json.dumps(search, default=str),
            host=socket.gethostname(),
            updated_at=_now(),
        )
        with self.engine.begin() as conn:
            conn.execute(insert.on_conflict_do_nothing(index_elements=["key_hash"]))
        stored = self.get(key)
        return stored if stored is not None else physical_batch_size

    def lower(self, key: dict[str, Any], physical_batch_size: int) -> None:
        """After an OOM: later trials start from the size that worked (never raised here)."""
        update = (
            batch_sizes.update()
            .where(batch_sizes.c.key_hash == key_hash(key))
            .where(batch_sizes.c.physical_batch_size > physical_batch_size)
            .values(physical_batch_size=physical_batch_size, updated_at=_now())
        )
        with self.engine.begin() as conn:
            conn.execute(update)

    @contextlib.contextmanager
    def searching(self, key: dict[str, Any]) -> Iterator[None]:
        """On PostgreSQL, one worker searches a key while the others wait for its result."""
        if self.engine.dialect.name != "postgresql":
            yield  # SQLite: concurrent searches are harmless, the first one recorded wins
            return
        with advisory_lock(self.engine, _search_lock_name(key)):
            yield


def _search_lock_name(key: dict[str, Any]) -> str:
    return f"hpo-batch-{key_hash(key)}"


# A trial process opens no connection of its own: its cache calls go to its worker, which
# answers them from the worker's pool (at most 2 connections per worker, issue 13).
Request = tuple[Any, ...]  # (operation, key, arguments...)
Reply = tuple[str, Any]  # ("ok", value) or ("error", what went wrong)


class BatchCacheRequests:
    """The worker's side: answers its trial process's cache calls. A search lock is taken
    without blocking: `answer` says "not ready" and the worker asks again while it goes on
    watching its trial, its stop signals and its timeouts. Locks still held when the trial ends
    (it died, was stopped or taken over) are released by `end_trial`."""

    def __init__(self, cache: BatchSizeCache) -> None:
        self.cache = cache
        self._held: dict[str, sa.Connection] = {}

    def answer(self, request: Request) -> Reply | None:
        """The reply to `request`, or None when a search lock is not free yet."""
        operation, key, *arguments = request
        try:
            if operation == "lock":
                return ("ok", True) if self._take(key) else None
            calls: dict[str, Callable[..., Any]] = {
                "get": self.cache.get,
                "record": self.cache.record,
                "lower": self.cache.lower,
                "unlock": lambda key: self._release(key),
            }
            return ("ok", calls[operation](key, *arguments))
        except (sa.exc.SQLAlchemyError, StorageError) as e:
            return ("error", f"the batch-size cache: {type(e).__name__}: {e}"[:500])

    def end_trial(self) -> None:
        for name in list(self._held):
            release_advisory_lock(self._held.pop(name), name)

    def _take(self, key: dict[str, Any]) -> bool:
        if self.cache.engine.dialect.name != "postgresql":
            return True  # as BatchSizeCache.searching: concurrent searches are harmless
        name = _search_lock_name(key)
        if name not in self._held:
            conn = try_advisory_lock(self.cache.engine, name)
            if conn is None:
                return False
            self._held[name] = conn
        return True

    def _release(self, key: dict[str, Any]) -> None:
        name = _search_lock_name(key)
        if name in self._held:
            release_advisory_lock(self._held.pop(name), name)


class RelayedBatchCache:
    """The trial process's side: the cache calls of BatchSizeCache, each one asked of the
    worker (`ask` sends a request and waits for its Reply)."""

    def __init__(self, ask: Callable[[Request], Reply]) -> None:
        self._ask = ask

    def get(self, key: dict[str, Any]) -> int | None:
        return self._call("get", key)

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        return self._call("record", key, physical_batch_size, search)

    def lower(self, key: dict[str, Any], physical_batch_size: int) -> None:
        self._call("lower", key, physical_batch_size)

    @contextlib.contextmanager
    def searching(self, key: dict[str, Any]) -> Iterator[None]:
        self._call("lock", key)  # answered once this worker holds the lock
        try:
            yield
        finally:
            self._call("unlock", key)

    def _call(self, operation: str, key: dict[str, Any], *arguments: Any) -> Any:
        status, value = self._ask((operation, key, *arguments))
        if status != "ok":
            raise StorageError(str(value))
        return value


def _insert_for(engine: Engine) -> Any:
    if engine.dialect.name == "postgresql":
        return postgresql.insert(batch_sizes)
    return sqlite.insert(batch_sizes)


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)
