"""Which database a study lives in, and how to print its URL without the password.

Precedence: --storage, then $HPO_STORAGE, then the config's study.storage, then ./hpo.db (SQLite).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from hpo.storage.errors import StorageError

ENV_VAR = "HPO_STORAGE"
DEFAULT_SQLITE_FILE = "hpo.db"
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
# SQLAlchemy 2.1 reads a bare postgresql:// as psycopg (3); hpo installs psycopg2.
DEFAULT_DRIVERS = {"postgresql": "postgresql+psycopg2"}
EXAMPLE_URLS = "sqlite:///hpo.db or postgresql+psycopg2://user:password@host:5432/dbname"


@dataclass(frozen=True)
class StorageURL:
    """A validated database URL and where it came from."""

    url: str
    origin: str  # "--storage", "$HPO_STORAGE", "config", "default"
    flag: str = "--storage"
    """How the user gives a URL, for messages: the CLI's --storage, or hpo.run's `storage`."""

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


def resolve_storage_url(
    cli_value: str | None, config_value: str | None, flag: str = "--storage"
) -> StorageURL:
    """Pick the storage URL by precedence and validate it; raises StorageError on a bad one.
    `flag`: how the user gives `cli_value` (--storage, or the API's `storage`), for messages."""
    if cli_value is not None and not cli_value.strip():
        raise StorageError(
            f"{flag} is empty; give a database URL such as sqlite:///hpo.db, or leave "
            f"{flag} out for ${ENV_VAR}, the config's study.storage or ./{DEFAULT_SQLITE_FILE}"
        )
    env_value = os.environ.get(ENV_VAR) or None
    for value, origin in (
        (cli_value, flag),
        (env_value, f"${ENV_VAR}"),
        (config_value, "config"),
    ):
        if value:
            return StorageURL(_validated(value, origin), origin, flag)
    default = f"sqlite:///{Path(DEFAULT_SQLITE_FILE).resolve()}"
    return StorageURL(default, "default", flag)


def sqlite_file_relative_to(url: str, folder: Path) -> str:
    """An SQLite URL whose file name is relative, made absolute against `folder`; any other
    URL as given. For a config's study.storage: relative to the config file, as its data paths
    are, so that workers started from different folders share one database (--storage and
    $HPO_STORAGE stay relative to the working folder, as a path on a command line is)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return url  # resolve_storage_url says what is wrong with it
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database or database.startswith(":memory:"):
        return url
    try:
        path = Path(database).expanduser()
    except RuntimeError:  # `~nosuchuser/...`: left as written
        path = Path(database)
    if str(path) == database and path.is_absolute():
        return url
    absolute = str((folder / path).absolute())  # `folder /` keeps an absolute path as it is
    return parsed.set(database=absolute).render_as_string(hide_password=False)


def _validated(url: str, origin: str) -> str:
    """The URL to connect with (a bare postgresql:// gets hpo's driver); raises StorageError
    naming what is wrong with it, password masked."""
    where = f"storage URL from {origin}"
    if url != url.strip() or any(ord(c) < 32 for c in url):
        raise StorageError(
            f"{where} has spaces around it or control characters in it ({_shown(url)}); "
            "remove them (a newline read from a file?)"
        )
    try:
        parsed: URL = make_url(url)
    except (ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        raise StorageError(
            f"{where} is not a database URL: {_shown(url)}; use e.g. {EXAMPLE_URLS}"
        ) from e
    backend = parsed.get_backend_name()
    if backend == "postgres":
        raise StorageError(
            f"{where} starts with 'postgres://', which SQLAlchemy does not accept; write it "
            "postgresql+psycopg2://... (the rest unchanged)"
        )
    if backend not in SUPPORTED_BACKENDS:
        raise StorageError(
            f"{where} uses {backend[:40]!r}, which hpo does not support; use {EXAMPLE_URLS}"
        )
    if backend == "sqlite" and (
        not parsed.database or parsed.database.startswith(":memory:") or "mode=memory" in url
    ):
        raise StorageError(
            f"{where} names no SQLite file ({_shown(url)}); in-memory databases cannot hold "
            "a study: use sqlite:///hpo.db"
        )
    if backend == "sqlite":
        _check_sqlite_options(url, parsed.database or "", where)
        _check_sqlite_path(parsed.database or "", url, where)
    if backend == "postgresql" and not parsed.database:
        raise StorageError(
            f"{where} names no database ({_shown(url)}); write "
            "postgresql+psycopg2://user:password@host:5432/dbname"
        )
    if backend == "postgresql":
        _check_server_address(parsed, url, where)
    if parsed.drivername in DEFAULT_DRIVERS:
        url = DEFAULT_DRIVERS[parsed.drivername] + url[url.index("://") :]
        parsed = make_url(url)
    _check_driver(parsed, where)
    return url


SQLITE_HEADER = b"SQLite format 3\x00"


def _check_sqlite_options(url: str, database: str, where: str) -> None:
    """No `?options` and no `file:` URI: hpo derives its lock file, its checks that the file
    exists and can be written, and the monitoring commands' read-only opening from the file
    name, and each would name another file than SQLite opens (sqlite:///z.db?cache=shared&uri=true
    made a file named `z.db?cache=shared`, locked as z.db and looked for as z.db). hpo sets
    the options it needs (the busy timeout) itself."""
    if "?" in url:
        options = url.partition("?")[2].split("&")
        names = ", ".join(sorted({o.partition("=")[0][:40] for o in options if o}))[:200]
        raise StorageError(
            f"{where} has options after '?' ({names or 'empty'}), which hpo does not support "
            f"in an SQLite URL: write {_shown(url.partition('?')[0])}, nothing after the file name"
        )
    if database.startswith("file:"):
        raise StorageError(
            f"{where} is an SQLite URI ({_shown(url)}), which hpo does not support: write "
            "sqlite:///FILE, the file's path after the third '/'"
        )


def _check_sqlite_path(database: str, url: str, where: str) -> None:
    """The file must be an SQLite database or not exist yet, in a folder that exists: checked
    here, before SQLite or hpo's lock file write anything beside it."""
    path = Path(database)
    if path.is_dir():
        raise StorageError(
            f"{where} names a folder, not an SQLite file ({_shown(url)}); add a file name, "
            "e.g. sqlite:///FOLDER/hpo.db"
        )
    if not path.parent.is_dir():
        raise StorageError(
            f"{where} names an SQLite file in {str(path.parent.absolute())[:200]!r}, a folder "
            "that does not exist; create the folder or fix the path"
        )
    if path.exists() and not path.is_file():
        # /dev/null, a pipe, a socket: SQLite would open it (a pipe blocks) and leave its
        # journal and hpo's lock file beside it.
        raise StorageError(
            f"{where} names {str(path)[:200]!r}, which is not a regular file (a device, a pipe "
            "or a socket); point it at a study database or at a new file name"
        )
    try:
        with path.open("rb") as handle:
            head = handle.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return  # hpo run creates it
    except OSError as e:
        raise StorageError(
            f"{where}: cannot read {str(path)[:200]!r} ({e.strerror}); check its permissions"
        ) from e
    if head and head != SQLITE_HEADER:
        raise StorageError(
            f"{where} names {str(path)[:200]!r}, which is not an SQLite database; point it at "
            "a study database or at a new file name"
        )


def _check_server_address(parsed: URL, url: str, where: str) -> None:
    if url.partition("://")[2].partition("?")[0].count("@") > 1:
        # user:p@ss@host parses as password `p` and host `ss@host`: connection errors naming
        # the host would print the rest of the password.
        raise StorageError(
            f"{where} has more than one '@' ({_shown(url)}); write an '@' inside the user "
            "name or password as %40"
        )
    if not parsed.host and "host" not in parsed.query and "@" in (parsed.database or ""):
        # postgresql:///user:pw@host/db: no host, and a database named `user:pw@host/db`,
        # which the server would echo back in its "does not exist".
        raise StorageError(
            f"{where} has a third '/' after the scheme ({_shown(url)}), so the user, "
            "password and host are read as the database name; write "
            "postgresql+psycopg2://user:password@host:5432/dbname"
        )
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise StorageError(
            f"{where} has port {parsed.port}, outside 1-65535; PostgreSQL listens on 5432 "
            "by default"
        )


def _check_driver(parsed: URL, where: str) -> None:
    """The database driver must be installed and synchronous (Optuna's storage is)."""
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()[:40]
    suggestion = "sqlite:///FILE" if backend == "sqlite" else "postgresql+psycopg2://..."
    try:
        dialect = parsed.get_dialect()
        if getattr(dialect, "is_async", False):
            raise StorageError(
                f"{where} asks for the asynchronous driver {driver!r}, which Optuna cannot use; "
                f"write {suggestion}"
            )
        dialect.import_dbapi()
    except ArgumentError as e:  # NoSuchModuleError: SQLAlchemy knows no such driver
        raise StorageError(
            f"{where} asks for the driver {driver!r}, which SQLAlchemy does not know; "
            f"write {suggestion}"
        ) from e
    except ImportError as e:
        raise StorageError(
            f"{where} asks for the driver {driver!r}, which is not installed; "
            f"write {suggestion} (installed with hpo) or pip install {e.name or 'that driver'}"
        ) from e


def _shown(url: str) -> str:
    """The URL for a message: quoted, password masked, at most 200 characters."""
    masked = mask_url(url)
    return repr(masked if len(masked) <= 200 else masked[:197] + "...")


# A URL in free text ends at whitespace or a quote; a password may hold `@`, `/` or `:`.
_BETWEEN_WORDS = re.compile(r"([\s\"'<>`]+)")
# A scheme before the user name, however it is typed: `scheme://`, `scheme:/`, `scheme:///`,
# `scheme:` or `scheme//`.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(?::/*|/+)")
# A parameter whose name holds one of these, in any case, carries a secret: `access_token`,
# `api_key`, `X-Amz-Signature`, `X-Amz-Credential`, `client_secret`, `sslpassword`, `pwd`,
# `auth`. `sig` (Azure's signature) counts as a whole part of the name only: `signal=` does not.
_SECRET_NAME = re.compile(
    r"token|key|secret|passw|pwd|auth|signature|credential|(?:^|[^a-z0-9])sig(?:$|[^a-z0-9])",
    re.IGNORECASE,
)
# `=`, also percent-encoded inside another parameter (libpq's `dsn=host%3Dh%20password%3D...`).
_EQUALS = re.compile(r"=|%3D", re.IGNORECASE)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.~-%")
_LONGEST_NAME = 200
# A value ends where the next parameter, the fragment, a word or a quoted string ends.
_VALUE_END = re.compile(r"[&;#\s\"'<>`]")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter called `name` holds a secret, whose value hpo never prints or
    stores. The one place that decides, for every URL hpo shows: the study database's, the
    tracking server's, the artifact store's, and any a library's message quotes."""
    return _SECRET_NAME.search(name) is not None


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, even when the URL does not parse.

    Anything shaped like `user:password@host` is masked, with or without a scheme and with any
    number of slashes after it (a mistyped URL is where a password is most often shown).
    Everything between `user:` and the last `@` is hidden: a password with an unescaped `@`
    is hidden whole, not cut at its first `@`; so is the value of every parameter whose name
    says it is a secret (`?access_token=***`, `password=***`: see is_secret_name)."""
    return _mask_secret_parameters(_mask_userinfo(url))


def _mask_secret_parameters(text: str) -> str:
    """`name=value` with `value` replaced by *** wherever is_secret_name(name). Found from each
    `=` (the name read backwards from it): linear in the text's length, however long a word."""
    kept: list[str] = []
    done = 0  # text[:done] is in `kept`
    for equals in _EQUALS.finditer(text):
        if equals.start() < done or not is_secret_name(_name_before(text, equals.start())):
            continue  # inside a value masked already, or not a secret's name
        start = equals.end()
        quote = text[start : start + 1]
        if quote in ("'", '"'):  # libpq's `password='two words'`: up to the closing quote
            start += 1
            end = text.find(quote, start)
        else:
            found = _VALUE_END.search(text, start)
            end = found.start() if found else -1
        kept += [text[done:start], "***"]
        done = end if end >= 0 else len(text)
    return "".join(kept) + text[done:]


def _name_before(text: str, end: int) -> str:
    start = end
    while start > max(0, end - _LONGEST_NAME) and text[start - 1] in _NAME_CHARS:
        start -= 1
    return text[start:end]


def _mask_userinfo(url: str) -> str:
    userinfo, at, address = url.rpartition("@")
    if not at:
        return url
    scheme = _SCHEME.match(userinfo)
    if scheme and ":" in userinfo[scheme.end() :]:
        start = scheme.end()  # scheme, then user:password
    elif scheme and "/" in scheme[0]:
        return url  # `scheme://user@host`, or a path that holds an `@`: no password
    else:
        start = 0  # `user:password@host`, no scheme: `user:` is not one
    user, colon, _ = userinfo[start:].partition(":")
    if not colon:
        return url
    return f"{userinfo[:start]}{user}:***@{address}"


def mask_text(text: str) -> str:
    """Mask every `user:password@` in free text, such as a driver's error message that echoes
    a database name (`database "user:pw@host/db" does not exist`), every secret parameter
    (`password=`, `access_token=`, `X-Amz-Signature=`: see is_secret_name) and every secret
    registered with add_secrets (a notification URL's token)."""
    for secret, shown in _REGISTERED:
        if secret in text:
            text = text.replace(secret, shown)
    # Split, not searched with a pattern: linear in the text's length (a pattern that looks
    # for an `@` inside a word took seconds on one long word).
    words = _BETWEEN_WORDS.split(text)
    masked = "".join(_mask_userinfo(word) if "@" in word else word for word in words)
    return _mask_secret_parameters(masked)


# Secrets that no pattern recognises (a Slack token is a plain path segment of its URL), each
# with what is shown in its place, longest first: a whole URL is replaced before its parts.
# A tuple, replaced whole: a thread masking a log line reads the old one or the new one.
_REGISTERED: tuple[tuple[str, str], ...] = ()


def add_secrets(secrets: dict[str, str]) -> None:
    """Have mask_text replace each key of `secrets` by its value from now on, in this process:
    the logs, the errors and everything the trackers are sent go through mask_text."""
    global _REGISTERED
    known = dict(_REGISTERED)
    known.update({secret: shown for secret, shown in secrets.items() if secret})
    _REGISTERED = tuple(sorted(known.items(), key=lambda pair: -len(pair[0])))


_SQLITE_NOT_A_DATABASE = ("file is not a database", "database disk image is malformed")


def open_fix(storage_url: StorageURL, reason: str) -> str:
    """What to do about a database that would not open, from the driver's reason."""
    if storage_url.backend == "sqlite":
        if any(words in reason for words in _SQLITE_NOT_A_DATABASE):
            return (
                "the file is damaged, or is not an SQLite database: restore it from a backup, "
                f"or point {storage_url.flag} at a new file name for a new study"
            )
        return "check that its folder exists and can be written"
    # hpo creates its tables, never the database or the user (the compose file makes both).
    parsed = make_url(storage_url.url)
    server = ["-h", parsed.host or "localhost"]
    if parsed.port is not None and parsed.port != 5432:
        server += ["-p", str(parsed.port)]
    if 'role "' in reason and "does not exist" in reason:
        command = shlex.join(["createuser", *server, "-P", parsed.username or ""])
        return f"hpo does not create users: create it with `{command}` (as an admin)"
    if 'database "' in reason and "does not exist" in reason:
        user = ["-U", parsed.username] if parsed.username else []
        command = shlex.join(["createdb", *server, *user, parsed.database or ""])
        return f"hpo does not create databases: create it with `{command}`"
    return "check the host, port, database name and credentials"
