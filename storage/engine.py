"""Open an Optuna RDB storage with engine options that suit the backend.

Library errors are wrapped here into StorageError with the password masked.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import make_url

from hpo.errors import StorageError
from storage.budget import BudgetedRDBStorage, sqlite_lock
from storage.outage import wait_for_connections
from storage.retry import RetryStaleTrial
from storage.url import StorageURL, mask_text

CONNECT_TIMEOUT_S = 10
TABLE_CREATION_ATTEMPTS = 5
SQLITE_BUSY_TIMEOUT_S = 60


def engine_kwargs(backend: str) -> dict[str, Any]:
    """SQLAlchemy engine options: resilient long-lived connections on PostgreSQL."""
    if backend == "postgresql":
        return {
            # Optuna sets pre-ping only for MySQL; idle PostgreSQL connections get dropped too.
            "pool_pre_ping": True,
            "pool_recycle": 1800,
            "pool_size": 2,
            "max_overflow": 2,
            "connect_args": {
                "connect_timeout": CONNECT_TIMEOUT_S,
                "keepalives": 1,
                "keepalives_idle": 60,
                "keepalives_interval": 10,
                "keepalives_count": 5,
                "application_name": "hpo",
            },
        }
    # SQLite serialises writers; wait for the lock instead of failing at once.
    return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}


def create_engine(
    storage_url: StorageURL, patience_s: float | None = None
) -> sqlalchemy.engine.Engine:
    """A plain SQLAlchemy engine on the study database, for hpo's own tables; with
    `patience_s`, new connections wait that long for a database that is down."""
    engine = sqlalchemy.create_engine(storage_url.url, **engine_kwargs(storage_url.backend))
    if patience_s is not None:
        wait_for_connections(engine, patience_s)
    return engine


@dataclass(frozen=True)
class Liveness:
    """Heartbeats of running trials: a trial silent for `grace_period_s` is failed and re-run."""

    heartbeat_interval_s: int
    grace_period_s: int
    max_retries: int


def open_storage(
    storage_url: StorageURL,
    trial_budget: int | None = None,
    liveness: Liveness | None = None,
    patience_s: float | None = None,
) -> BudgetedRDBStorage:
    """Connect (creating the tables if needed); raises StorageError naming what is wrong.
    With `trial_budget`, no trial is created once the study holds that many. With `patience_s`,
    once connected, calls ride out a database outage of up to that many seconds."""
    try:
        storage = _create_tables_retrying(storage_url, liveness)
        storage.trial_budget = trial_budget
        if patience_s is not None:
            storage.patience_s = patience_s
            wait_for_connections(storage.engine, patience_s)
        return storage
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError, OSError) as e:
        reason = _first_line(mask_text(str(getattr(e, "orig", None) or e)))
        raise StorageError(
            f"cannot open the study database {storage_url.masked}: {reason}; "
            "check the host, port, database name and credentials (or that the SQLite folder exists)"
        ) from e


def _create_tables_retrying(
    storage_url: StorageURL, liveness: Liveness | None
) -> BudgetedRDBStorage:
    """Workers starting together on an empty database race to create Optuna's tables. On SQLite
    a file lock serialises them; on PostgreSQL the losers see a duplicate-object error and
    succeed on a retry, once the tables exist."""
    kwargs: dict[str, Any] = {"engine_kwargs": engine_kwargs(storage_url.backend)}
    if liveness is not None:
        kwargs["heartbeat_interval"] = liveness.heartbeat_interval_s
        kwargs["grace_period"] = liveness.grace_period_s
        kwargs["heartbeat_stale_trial_callback"] = RetryStaleTrial(liveness.max_retries)
    if storage_url.backend == "sqlite":
        with sqlite_lock(make_url(storage_url.url).database):
            return BudgetedRDBStorage(storage_url.url, **kwargs)
    for attempt in range(TABLE_CREATION_ATTEMPTS):
        try:
            return BudgetedRDBStorage(storage_url.url, **kwargs)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == TABLE_CREATION_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * (attempt + 1) + random.random() * 0.3)
    raise AssertionError("unreachable")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"
