"""Which database a study lives in, and how to print its URL without the password.

Precedence: --storage, then $HPO_STORAGE, then the config's study.storage, then ./hpo.db (SQLite).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from hpo.errors import StorageError

ENV_VAR = "HPO_STORAGE"
DEFAULT_SQLITE_FILE = "hpo.db"
SUPPORTED_BACKENDS = ("sqlite", "postgresql")


@dataclass(frozen=True)
class StorageURL:
    """A validated database URL and where it came from."""

    url: str
    origin: str  # "--storage", "$HPO_STORAGE", "config", "default"

    def __repr__(self) -> str:
        # Never the password, even in a traceback or a debug log.
        return f"StorageURL({self.masked!r}, origin={self.origin!r})"

    @property
    def masked(self) -> str:
        return mask_url(self.url)

    @property
    def backend(self) -> str:
        return make_url(self.url).get_backend_name()

    def describe(self) -> str:
        """A line for the user: where the study lives, password masked."""
        parsed = make_url(self.url)
        if parsed.get_backend_name() == "sqlite" and parsed.database:
            return f"SQLite file {Path(parsed.database).resolve()} (from {self.origin})"
        return f"{self.masked} (from {self.origin})"


def resolve_storage_url(cli_value: str | None, config_value: str | None) -> StorageURL:
    """Pick the storage URL by precedence and validate it; raises StorageError on a bad one."""
    env_value = os.environ.get(ENV_VAR) or None
    for value, origin in (
        (cli_value, "--storage"),
        (env_value, f"${ENV_VAR}"),
        (config_value, "config"),
    ):
        if value:
            return StorageURL(_validated(value, origin), origin)
    default = f"sqlite:///{Path(DEFAULT_SQLITE_FILE).resolve()}"
    return StorageURL(default, "default")


def _validated(url: str, origin: str) -> str:
    try:
        parsed: URL = make_url(url)
    except ArgumentError as e:
        raise StorageError(
            f"storage URL from {origin} is not a database URL: {mask_url(url)!r}; use e.g. "
            "sqlite:///hpo.db or postgresql+psycopg2://user:password@host:5432/dbname"
        ) from e
    backend = parsed.get_backend_name()
    if backend == "postgres":
        raise StorageError(
            f"storage URL from {origin} starts with 'postgres://', which SQLAlchemy does not "
            "accept; write it postgresql+psycopg2://... (the rest unchanged)"
        )
    if backend not in SUPPORTED_BACKENDS:
        raise StorageError(
            f"storage URL from {origin} uses {backend!r}, which hpo does not support; "
            "use sqlite:///FILE or postgresql+psycopg2://user:password@host:5432/dbname"
        )
    if backend == "sqlite" and not parsed.database:
        raise StorageError(
            f"storage URL from {origin} names no SQLite file ({mask_url(url)!r}); "
            "in-memory databases cannot hold a study: use sqlite:///hpo.db"
        )
    return url


_PASSWORD_IN_URL = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)(?P<pw>[^@\s]*)(?=@)")


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, even when the URL does not parse."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return mask_text(url)
    if parsed.password is None:
        return mask_text(url)
    return parsed.render_as_string(hide_password=True)


def mask_text(text: str) -> str:
    """Mask every `scheme://user:password@` in free text, such as a driver's error message."""
    return _PASSWORD_IN_URL.sub(lambda m: m.group("head") + "***", text)
