"""Locks between hpo's processes on one study database: an advisory lock on PostgreSQL (any
host), a file lock beside an SQLite file (SQLite studies live on one host).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine


def _lock_id(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)


@contextlib.contextmanager
def advisory_lock(engine: Engine, name: str) -> Iterator[None]:
    """A PostgreSQL session lock named by `name`, held on its own connection."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": _lock_id(name)})
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": _lock_id(name)})
            conn.commit()


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
