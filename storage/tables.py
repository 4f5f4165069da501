"""hpo's own tables beside Optuna's in a study database, declared in one place: heartbeats of
running trials, the shared physical batch sizes, and the version of these tables' layout.

`ensure_tables` creates them on first use and refuses a database whose hpo tables another
version of hpo laid out, before anything is written to it.
"""

from __future__ import annotations

import contextlib
import weakref

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from hpo.storage.errors import StorageError
from hpo.storage.locks import create_table_racing

# The layout of the tables below. Raise it with any change to them (a column, a key, a new
# table), and say in the release notes what moves a database from the old layout to the new.
SCHEMA_VERSION = 1

metadata = sa.MetaData()

heartbeats = sa.Table(
    "hpo_heartbeats",
    metadata,
    sa.Column("study_id", sa.Integer, primary_key=True),
    sa.Column("number", sa.Integer, primary_key=True),
    sa.Column("worker", sa.String(255), nullable=False),
    sa.Column("beat_at", sa.DateTime(timezone=True), nullable=False),
)

batch_sizes = sa.Table(
    "hpo_batch_sizes",
    metadata,
    sa.Column("key_hash", sa.String(64), primary_key=True),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("physical_batch_size", sa.Integer, nullable=False),
    sa.Column("search", sa.Text, nullable=True),
    sa.Column("host", sa.String(255), nullable=True),
    sa.Column("updated_at", sa.DateTime, nullable=False),
)

# One row (id 1): the SCHEMA_VERSION of the hpo that created the tables.
schema_version = sa.Table(
    "hpo_schema_version",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
)

# Engines whose database was checked: a worker builds its heartbeats and its batch-size cache
# more than once, and each would otherwise ask the server again.
_checked: weakref.WeakSet[Engine] = weakref.WeakSet()


class SchemaVersionError(StorageError):
    """The database's hpo tables have another layout than this hpo's."""


def ensure_tables(engine: Engine) -> None:
    """hpo's tables exist in the database and have this hpo's layout; else SchemaVersionError,
    raised before anything is written."""
    if engine in _checked:
        return
    check_version(engine)
    for table in metadata.sorted_tables:
        create_table_racing(engine, table)
    _record_version(engine)  # a new database's, or one whose tables predate the record
    _checked.add(engine)


def check_version(engine: Engine) -> int | None:
    """The database's recorded layout version (None: no hpo tables yet), reading only;
    SchemaVersionError when it is not this hpo's."""
    found = recorded_version(engine)
    if found is not None and found != SCHEMA_VERSION:
        raise SchemaVersionError(_mismatch(found))
    return found


def recorded_version(engine: Engine) -> int | None:
    """The layout version the database records; None for a database without hpo's tables.
    hpo tables from before the version was recorded have the first layout."""
    inspector = sa.inspect(engine)
    if not inspector.has_table(schema_version.name):
        legacy = any(inspector.has_table(t.name) for t in (heartbeats, batch_sizes))
        return 1 if legacy else None
    with engine.connect() as conn:
        version = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar()
    return int(version) if version is not None else None


def _record_version(engine: Engine) -> None:
    # Only where no row is: workers starting together each try, the first row stands.
    with contextlib.suppress(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(schema_version.insert().values(id=1, version=SCHEMA_VERSION))


def _mismatch(found: int) -> str:
    made_by = "a newer" if found > SCHEMA_VERSION else "an older"
    return (
        f"the study database's hpo tables have layout version {found}, made by {made_by} hpo; "
        f"this hpo reads and writes version {SCHEMA_VERSION}. Run every worker of a study with "
        "the same hpo version (install the one that made the database), or give this one a "
        "new database"
    )
