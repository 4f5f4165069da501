"""Locks between hpo's processes on one study database: an advisory lock on PostgreSQL (any
host), a file lock beside an SQLite file (SQLite studies live on one host).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import random
import time
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

# Pauses between two tries of a busy advisory lock: from 20 ms, doubling up to 1 s.
LOCK_FIRST_PAUSE_S = 0.02
LOCK_MAX_PAUSE_S = 1.0


def _lock_id(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)


@contextlib.contextmanager
def advisory_lock(engine: Engine, name: str) -> Iterator[None]:
    """A PostgreSQL session lock named by `name`, held on its own connection. A worker waiting
    for it holds no connection: waiters blocked in pg_advisory_lock once took every connection
    of a full server while the holder needed one more to finish (many workers on one server,
    issue 13), so the lock is tried, and tried again after a random pause that grows."""
    pause = LOCK_FIRST_PAUSE_S
    while (conn := try_advisory_lock(engine, name)) is None:
        time.sleep(random.uniform(pause / 2, pause))
        pause = min(2 * pause, LOCK_MAX_PAUSE_S)  # many waiters must not flood the server
    try:
        yield
    finally:
        release_advisory_lock(conn, name)


def try_advisory_lock(engine: Engine, name: str) -> sa.Connection | None:
    """The PostgreSQL session lock named by `name` if it is free now, held on the connection
    returned (release it with release_advisory_lock); None while another session holds it. For
    a caller that must go on with other work while it waits (a worker relaying its trial)."""
    conn = engine.connect()
    try:
        taken = conn.execute(sa.text("SELECT pg_try_advisory_lock(:id)"), {"id": _lock_id(name)})
        if taken.scalar():
            conn.commit()
            return conn
    except BaseException:
        conn.close()
        raise
    conn.close()
    return None


def release_advisory_lock(conn: sa.Connection, name: str) -> None:
    """Release a lock from try_advisory_lock. If the unlock fails, the connection is discarded
    rather than pooled: its session ends, and the server drops the lock with it."""
    try:
        conn.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": _lock_id(name)})
        conn.commit()
    except sa.exc.SQLAlchemyError:
        conn.invalidate()
    finally:
        conn.close()


def sqlite_lock(database: str | None) -> contextlib.AbstractContextManager[None]:
    """The one lock beside an SQLite database file under which hpo's processes take turns:
    creating tables, counting the trial budget, failing and re-queueing trials."""
    return file_lock(Path(f"{database}.hpo-lock"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes on one host."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def create_table_racing(engine: Engine, table: sa.Table) -> None:
    """Create one of hpo's own tables. Workers starting together race to create it: on SQLite
    they take turns under the file lock; on PostgreSQL the loser of the race finds it there."""
    if sa.inspect(engine).has_table(table.name):
        return
    in_file = engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:")
    with sqlite_lock(engine.url.database) if in_file else contextlib.nullcontext():
        try:
            table.create(engine, checkfirst=True)
        except sa.exc.DBAPIError:
            if not sa.inspect(engine).has_table(table.name):
                raise


def study_lock(engine: Engine, study_id: int) -> contextlib.AbstractContextManager[None]:
    """The lock under which workers of one study count its trials and create one, fail and
    re-queue a trial, or decide which checkpoint folders are still needed."""
    if engine.dialect.name == "postgresql":
        return advisory_lock(engine, f"hpo-study-{study_id}")
    return sqlite_lock(engine.url.database)
