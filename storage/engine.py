"""Open a study database: Optuna's RDB storage with engine options that suit the backend,
behind hpo's outage retries.

Library errors are wrapped here into StorageError with the password masked.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
import urllib.parse
from collections.abc import Callable, Container
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import make_url

from hpo.storage import study_queries
from hpo.storage.errors import StorageError
from hpo.storage.locks import sqlite_lock, study_lock
from hpo.storage.outage import dbapi_connect, retrying, wait_for_connections
from hpo.storage.resilient import ResilientStorage
from hpo.storage.trial_cache import TrialCache
from hpo.storage.url import StorageURL, mask_text, open_fix

CONNECT_TIMEOUT_S = 10
TABLE_CREATION_ATTEMPTS = 5
SQLITE_BUSY_TIMEOUT_S = 60
T = TypeVar("T")


def engine_kwargs(backend: str, on_demand: bool = False) -> dict[str, Any]:
    """SQLAlchemy engine options: resilient long-lived connections on PostgreSQL, or with
    `on_demand` a connection per call, closed after it (study.database_connections)."""
    if backend == "postgresql" and on_demand:
        pooled = engine_kwargs(backend)
        return {"poolclass": sqlalchemy.pool.NullPool, "connect_args": pooled["connect_args"]}
    if backend == "postgresql":
        return {
            # Optuna sets pre-ping only for MySQL; idle PostgreSQL connections get dropped too.
            "pool_pre_ping": True,
            "pool_recycle": 1800,
            # A process holds at most 2 connections, whatever it does (issue 13: 256 workers
            # against one server): a worker's trial calls, its heartbeats, the study lock and
            # the batch-size cache of its trial process all share them.
            "pool_size": 2,
            "max_overflow": 0,
            "connect_args": {
                "connect_timeout": CONNECT_TIMEOUT_S,
                "keepalives": 1,
                "keepalives_idle": 60,
                "keepalives_interval": 10,
                "keepalives_count": 5,
                # Which process holds a connection, in pg_stat_activity.
                "application_name": f"hpo {os.getpid()}",
            },
        }
    # SQLite serialises writers; wait for the lock instead of failing at once.
    return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}


def create_engine(
    storage_url: StorageURL, patience_s: float | None = None, on_demand: bool = False
) -> sqlalchemy.engine.Engine:
    """A plain SQLAlchemy engine on the study database, for hpo's own tables; with
    `patience_s`, new connections wait that long for a database that is down."""
    kwargs = engine_kwargs(storage_url.backend, on_demand)
    engine = sqlalchemy.create_engine(storage_url.url, **kwargs)
    if patience_s is not None:
        wait_for_connections(engine, patience_s)
    return engine


class StudyStorage(ResilientStorage):
    """The Optuna storage of hpo's studies (a cache of finished trials, outage retries) with
    what hpo's workers add beside it: the engine for hpo's own tables and the per-study lock.
    On a schema the study queries do not know, trials are read through Optuna, uncached."""

    def __init__(self, rdb: optuna.storages.RDBStorage, url: StorageURL, patience_s: float | None):
        super().__init__(rdb, patience_s, database=f"the study database {url.masked}")
        self.rdb = rdb
        self.url = url
        self.cache = TrialCache(rdb) if study_queries.supported(rdb.engine) else None

    def read(self, what: str, call: Callable[[], T], patience_s: float) -> T:
        """`call()`, which only reads, run again from its start while the database is
        unreachable (a dropped connection, a restart), for up to `patience_s`; then
        DatabaseUnreachable naming the database. The pool checks each connection before
        handing it out (pool_pre_ping), so a retry reads on a fresh one. A read repeats no
        write, so the whole of it is retried: the study queries beside Optuna's calls too."""
        return retrying(call, what, patience_s, database=self.database, then="run it again")

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        if self.cache is None:
            return super().get_all_trials(study_id, deepcopy, states)
        return self._call(
            "get_all_trials", partial(self.cache.all_trials, study_id, deepcopy, states)
        )

    def get_trial(self, trial_id: int) -> FrozenTrial:
        finished = self.cache.finished_trial(trial_id) if self.cache is not None else None
        return finished if finished is not None else super().get_trial(trial_id)

    @property
    def engine(self) -> sqlalchemy.engine.Engine:
        return self.rdb.engine

    def lock(self, study_id: int) -> contextlib.AbstractContextManager[None]:
        """See storage.locks.study_lock."""
        return study_lock(self.engine, study_id)


def open_storage(
    storage_url: StorageURL,
    patience_s: float | None = None,
    read_only: bool = False,
    must_exist: bool = False,
    on_demand: bool = False,
) -> StudyStorage:
    """Connect (creating the tables if needed); raises StorageError naming what is wrong.
    With `patience_s`, once connected, calls ride out a database outage of up to that many
    seconds, and a server that is full (all its connections taken) is waited for from the
    start. `read_only` (the monitoring commands) creates nothing: no database file, no tables,
    no lock file; with `patience_s`, only the opening rides out an outage: the reads are
    retried whole, by StudyStorage.read. `must_exist` refuses to create an SQLite file.
    `on_demand`: see engine_kwargs."""
    if read_only or must_exist:
        _check_sqlite_file(storage_url)
    try:
        if read_only:
            return _open_read_only(storage_url, patience_s)
        rdb = _create_tables_retrying(storage_url, patience_s or 0.0, on_demand)
        if patience_s is not None:
            wait_for_connections(rdb.engine, patience_s)
        return StudyStorage(rdb, storage_url, patience_s)
    except (
        sqlalchemy.exc.SQLAlchemyError,
        optuna.exceptions.StorageInternalError,
        ImportError,
        ValueError,
        OSError,
    ) as e:
        reason = _first_line(mask_text(str(_root_cause(e))))
        # The fix names the user and database, which a mistyped URL can make hold the password.
        fix = mask_text(open_fix(storage_url, reason))
        raise StorageError(
            f"cannot open the study database {storage_url.masked}: {reason}; {fix}"
        ) from e


# SQLite's words for a file that is not one of its databases (past a right header) or is damaged.
def _check_sqlite_file(storage_url: StorageURL) -> None:
    if storage_url.backend != "sqlite":
        return
    database = Path(make_url(storage_url.url).database or "")
    if not database.is_file():
        raise StorageError(
            f"no study database at {database.resolve()}: no such file; check {storage_url.flag} or "
            "$HPO_STORAGE (hpo run creates it)"
        )


def _open_read_only(storage_url: StorageURL, patience_s: float | None) -> StudyStorage:
    url = storage_url.url
    if storage_url.backend == "sqlite":
        database = Path(make_url(url).database or "").resolve()
        # SQLite's read-only URI mode: not a byte written, not even a journal beside the file.
        url = f"sqlite:///file:{urllib.parse.quote(str(database))}?mode=ro&uri=true"

    def riding_out(call: Callable[[], T]) -> T:
        if patience_s is None:
            return call()
        database = f"the study database {storage_url.masked}"
        return retrying(call, "the opening", patience_s, database=database, then="run it again")

    probe = sqlalchemy.create_engine(url, **engine_kwargs(storage_url.backend))
    try:
        # Unreachable from the start (a mistyped host, a server that is down): said at once.
        # Reached once, a connection dropped from then on is an outage, ridden out.
        _reach(probe, engine_kwargs(storage_url.backend)["connect_args"])
        tables = riding_out(lambda: sqlalchemy.inspect(probe).has_table("version_info"))
    finally:
        probe.dispose()
    if not tables:  # Optuna's own open would say "no such table: version_info"
        raise StorageError(
            f"{storage_url.masked} holds no Optuna tables: no study was ever created in it (or "
            f"it is another program's database); check {storage_url.flag}, or start a study with "
            "hpo run"
        )
    # No retries of Optuna's calls (patience None): the reads are retried whole (read()).
    return riding_out(lambda: StudyStorage(_rdb_read_only(url, storage_url), storage_url, None))


def _reach(engine: sqlalchemy.engine.Engine, connect_args: dict[str, Any]) -> None:
    """One connection of the driver's, made and closed: the URL is right and the server up."""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    dbapi_connect(engine.dialect, cargs, {**cparams, **connect_args}).close()


def _rdb_read_only(url: str, storage_url: StorageURL) -> optuna.storages.RDBStorage:
    rdb = optuna.storages.RDBStorage(
        url,
        engine_kwargs=engine_kwargs(storage_url.backend),
        skip_table_creation=True,
        skip_compatibility_check=True,
    )
    check_schema(rdb, storage_url)
    return rdb


def check_schema(rdb: optuna.storages.RDBStorage, storage_url: StorageURL) -> None:
    """Refuse a database whose Optuna schema is not this Optuna's. Optuna's own check holds one
    connection while it opens a second: behind a pooler that queues (PgBouncer), workers
    starting together each held one and waited for ever on the other. This one, through
    Optuna's public version calls, holds one at a time."""
    current, head = rdb.get_current_version(), rdb.get_head_version()
    if current == head:
        return
    if current in rdb.get_all_versions():
        fix = f"upgrade it with `optuna storage upgrade --storage {storage_url.masked}`"
    else:
        fix = "use the (newer) Optuna version that wrote it"
    raise StorageError(
        f"the study database {storage_url.masked} has Optuna schema {current}, not {head} of "
        f"the installed Optuna {optuna.__version__}: {fix}"
    )


def _create_tables_retrying(
    storage_url: StorageURL, full_patience_s: float, on_demand: bool
) -> optuna.storages.RDBStorage:
    """Workers starting together on an empty database race to create Optuna's tables. On SQLite
    a file lock serialises them; on PostgreSQL the losers see a duplicate-object error and
    succeed on a retry, once the tables exist. A server with no connection free is waited
    for up to `full_patience_s` (hundreds of workers starting at once); a wrong password or
    database name fails at once."""
    kwargs: dict[str, Any] = {
        "engine_kwargs": engine_kwargs(storage_url.backend, on_demand),
        "skip_compatibility_check": True,  # check_schema, below
    }
    if storage_url.backend == "sqlite":
        with sqlite_lock(make_url(storage_url.url).database):
            rdb = optuna.storages.RDBStorage(storage_url.url, **kwargs)
        check_schema(rdb, storage_url)
        return rdb
    deadline = time.monotonic() + full_patience_s
    attempt = 0
    while True:
        try:
            rdb = optuna.storages.RDBStorage(storage_url.url, **kwargs)
            check_schema(rdb, storage_url)
            return rdb
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            attempt += 1
            if attempt == TABLE_CREATION_ATTEMPTS:
                raise
            time.sleep(0.2 * attempt + random.random() * 0.3)
        except (sqlalchemy.exc.OperationalError, optuna.exceptions.StorageInternalError) as e:
            if not server_full(e) or time.monotonic() > deadline:
                raise
            # The failed attempt's engine may hold a connection it got before the server
            # refused the next one: closed now, not counted by the server while this one waits.
            gc.collect()
            time.sleep(0.5 + random.random())


def server_full(error: BaseException) -> bool:
    """PostgreSQL refused a connection because all of its connections are taken."""
    text = str(_root_cause(error))
    # The server's limit, its reserved slots, or a database's or role's CONNECTION LIMIT.
    full = ("too many clients", "connection slots are reserved", "too many connections for")
    return any(phrase in text for phrase in full)


def _root_cause(error: BaseException) -> BaseException:
    """The driver's own words: Optuna wraps them in a generic "exception during the commit"."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "orig", None) or error.__cause__
        if inner is None:
            break
        error = inner
    return error


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"
