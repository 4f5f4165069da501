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


@contextlib.contextmanager
def advisory_lock(engine: Engine, name: str) -> Iterator[None]:
    """A PostgreSQL session lock named by `name`, held on its own connection."""
    lock_id = int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": lock_id})
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": lock_id})
            conn.commit()


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
