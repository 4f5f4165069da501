"""The study database checked before `hpo run` prepares its data: reachable, the credentials
right, Optuna's tables there or the right to create them. Writes nothing (no SQLite file, no
table, no study), and loads no Optuna: a wrong password is said in a second, not after minutes.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import Connection, make_url

from hpo.storage.errors import StorageError
from hpo.storage.url import StorageURL, mask_text, open_fix

CONNECT_TIMEOUT_S = 10
# A table of Optuna's every hpo worker writes to.
TRIALS_TABLE = "trials"
PROBE_PREFIX = ".hpo-probe-"  # a file made and removed at once, to try a folder's rights


def check_database(storage_url: StorageURL) -> None:
    """Raises StorageError, one line naming what is wrong and what to do."""
    if storage_url.backend == "sqlite":
        _check_sqlite(storage_url)
    else:
        _check_server(storage_url)


def _check_sqlite(storage_url: StorageURL) -> None:
    """Cheap: no connection. The file (if there) and its folder, where SQLite writes its
    journal and hpo its lock file, must be writable by this user."""
    path = Path(make_url(storage_url.url).database or "").absolute()
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise StorageError(
            f"the study database {path} cannot be written by this user (read-only file or "
            f"mount); make it writable (chmod u+rw) or name another file with {storage_url.flag}"
        )
    why = _folder_refusal(path.parent)
    if why is not None:
        raise StorageError(
            f"the folder {path.parent} of the study database cannot be written by this user "
            f"({why}; SQLite writes its journal beside the file); make it writable or name a "
            f"file in another folder with {storage_url.flag}"
        )


def _folder_refusal(folder: Path) -> str | None:
    """Why a file cannot be created in `folder`; None if it can. The permission bits are not
    enough: root passes them everywhere, yet cannot create a file in /proc or /sys. So a file
    is created and removed at once: unnamed where the filesystem allows it (O_TMPFILE), else
    under a name of its own that no one else uses."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "no write permission"
    try:
        os.close(os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600))
        return None
    except AttributeError:  # no O_TMPFILE outside Linux
        pass
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return f"creating a file there fails: {e.strerror or e}"
    probe = folder / f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        return f"creating a file there fails: {e.strerror or e}"
    probe.unlink()
    return None


def _check_server(storage_url: StorageURL) -> None:
    engine = sqlalchemy.create_engine(
        storage_url.url,
        poolclass=sqlalchemy.pool.NullPool,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )
    try:
        with engine.connect() as conn:
            _check_rights(conn, storage_url)
    except sqlalchemy.exc.DBAPIError as e:
        from hpo.storage.engine import server_full

        if server_full(e):
            return  # open_storage waits for a free connection, up to study.database_patience
        raise StorageError(_connection_failure(storage_url, e)) from e
    finally:
        engine.dispose()


def _check_rights(conn: Connection, storage_url: StorageURL) -> None:
    """Optuna's tables written to, or created, by this user: asked of the server, not tried."""
    text = sqlalchemy.text
    user = conn.execute(text("SELECT current_user")).scalar()
    if sqlalchemy.inspect(conn).has_table(TRIALS_TABLE):
        may_write = conn.execute(
            text("SELECT has_table_privilege(:t, 'SELECT,INSERT,UPDATE')"), {"t": TRIALS_TABLE}
        ).scalar()
        if not may_write:
            raise StorageError(
                f"user {user!r} may not write to the study tables in {storage_url.masked}; "
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {user} "
                "(and USAGE on its sequences), or use the user that created them"
            )
        return
    may_create = conn.execute(
        text("SELECT has_schema_privilege(current_schema(), 'CREATE')")
    ).scalar()
    if not may_create:  # PostgreSQL 15 and later: only the database's owner, by default
        raise StorageError(
            f"user {user!r} may not create Optuna's tables in {storage_url.masked} (no CREATE "
            f"on its schema); GRANT CREATE ON SCHEMA public TO {user}, or make the user the "
            "database's owner"
        )


def _connection_failure(storage_url: StorageURL, error: BaseException) -> str:
    root = getattr(error, "orig", None) or error
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    reason = mask_text(lines[0] if lines else type(root).__name__)[:300]
    fix = open_fix(storage_url, reason)
    # The fix names the database, which a mistyped URL can make hold the password.
    return mask_text(f"cannot open the study database {storage_url.masked}: {reason}; {fix}")
