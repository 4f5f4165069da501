"""Open an Optuna RDB storage with engine options that suit the backend.

Library errors are wrapped here into StorageError with the password masked.
"""

from __future__ import annotations

from typing import Any

import optuna
import sqlalchemy.exc

from hpo.errors import StorageError
from storage.url import StorageURL, mask_text

CONNECT_TIMEOUT_S = 10
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


def open_storage(storage_url: StorageURL) -> optuna.storages.RDBStorage:
    """Connect (creating the tables if needed); raises StorageError naming what is wrong."""
    try:
        return optuna.storages.RDBStorage(
            storage_url.url, engine_kwargs=engine_kwargs(storage_url.backend)
        )
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError) as e:
        reason = _first_line(mask_text(str(getattr(e, "orig", None) or e)))
        raise StorageError(
            f"cannot open the study database {storage_url.masked}: {reason}; "
            "check the host, port, database name and credentials (or that the SQLite folder exists)"
        ) from e


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"
