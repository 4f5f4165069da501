"""Storage URL precedence, validation and password masking."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpo.storage import mask_url, open_storage, resolve_storage_url
from hpo.storage.errors import StorageError
from hpo.storage.url import mask_text


def test_precedence_cli_env_config_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_storage_url(None, None).url == f"sqlite:///{tmp_path / 'hpo.db'}"
    assert resolve_storage_url(None, None).origin == "default"
    assert resolve_storage_url(None, "sqlite:///cfg.db").origin == "config"
    monkeypatch.setenv("HPO_STORAGE", "sqlite:///env.db")
    assert resolve_storage_url(None, "sqlite:///cfg.db").url == "sqlite:///env.db"
    chosen = resolve_storage_url("postgresql+psycopg2://u:pw@h/db", "sqlite:///cfg.db")
    assert (chosen.url, chosen.origin) == ("postgresql+psycopg2://u:pw@h/db", "--storage")


def test_default_describes_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        resolve_storage_url(None, None).describe()
        == f"SQLite file {tmp_path / 'hpo.db'} (from default)"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "is not a database URL"),
        ("mysql://u:secret@h/db", "'mysql', which hpo does not support"),
        ("sqlite://", "names no SQLite file"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(StorageError, match=message) as caught:
        resolve_storage_url(url, None)
    assert "secret" not in str(caught.value)


def test_masking() -> None:
    assert (
        mask_url("postgresql+psycopg2://alice:s3cr%40t@db:5432/hpo")
        == "postgresql+psycopg2://alice:***@db:5432/hpo"
    )
    assert mask_url("sqlite:///hpo.db") == "sqlite:///hpo.db"
    text = 'connection to "postgresql://bob:hunter2@10.0.0.1/x" failed'
    assert mask_text(text) == 'connection to "postgresql://bob:***@10.0.0.1/x" failed'


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql+psycopg2://u:Zq9@host:abc/db", "is not a database URL: 'postgresql+psy"),
        ("postgresql+psycopg2://u:Zq9@host:99999/db", "has port 99999, outside 1-65535"),
        ("postgresql+psycopg2://u:Zq9@Xk7@host/db", "has more than one '@' ("),
        ("postgresql+asyncpg://u:Zq9@host/db", "asynchronous driver 'asyncpg'"),
        ("postgresql+nosuch://u:Zq9@host/db", "driver 'nosuch', which SQLAlchemy does not know"),
        ("sqlite+nosuch:///hpo.db", "write sqlite:///FILE"),
        (" sqlite:///hpo.db", "spaces around it or control characters in it"),
        ("postgresql+psycopg2://u:Zq9@host/db\n", "(a newline read from a file?)"),
    ],
)
def test_unusable_urls_are_one_line_without_the_password(url: str, message: str) -> None:
    with pytest.raises(StorageError) as caught:
        resolve_storage_url(url, None)
    text = str(caught.value)
    assert message in text
    assert "Zq9" not in text and "Xk7" not in text and "\n" not in text


def test_a_driver_that_is_not_installed_names_the_one_to_use() -> None:
    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg (3) is installed here")
    with pytest.raises(StorageError) as caught:
        resolve_storage_url("postgresql+psycopg://u:Zq9@host/db", None)
    assert "driver 'psycopg', which is not installed; write postgresql+psycopg2://" in str(
        caught.value
    )


def test_bare_postgresql_means_psycopg2() -> None:
    # SQLAlchemy 2.1 reads postgresql:// as psycopg (3), which hpo does not install.
    chosen = resolve_storage_url("postgresql://u:pw@h:5432/db", None)
    assert chosen.url == "postgresql+psycopg2://u:pw@h:5432/db"
    assert resolve_storage_url("postgresql+psycopg2://u@h/db", None).url.count("psycopg2") == 1


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg2://user:p@ss@host/db", "postgresql+psycopg2://user:***@host/db"),
        ("postgresql://user:a/b:c@d@host:5432/db", "postgresql://user:***@host:5432/db"),
        ("postgresql://u:Zq9@host:abc/db", "postgresql://u:***@host:abc/db"),
        ("postgresql://u@host/db?password=Zq9&x=1", "postgresql://u@host/db?password=***&x=1"),
        (
            "postgresql://u@/db?dsn=host%3Dh%20password%3DZq9",
            "postgresql://u@/db?dsn=host%3Dh%20password%3D***",
        ),
        ("postgresql://u@h/db?sslpassword=Zq9", "postgresql://u@h/db?sslpassword=***"),
        ("sqlite:////data/hpo@2024.db", "sqlite:////data/hpo@2024.db"),  # no user:password
    ],
)
def test_masking_hides_everything_up_to_the_last_at(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    text = mask_text(f'could not connect to "{url}": refused')
    assert text == f'could not connect to "{masked}": refused'


def test_unreachable_server_fails_fast_without_the_password() -> None:
    # Port 1 on loopback refuses at once; the message must still be one masked line.
    url = resolve_storage_url("postgresql+psycopg2://alice:topsecret@127.0.0.1:1/hpo", None)
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        open_storage(url)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "topsecret" not in message and "alice:***@127.0.0.1:1/hpo" in message
    assert "\n" not in message


def test_sqlite_in_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="a folder that does not exist; create the folder"):
        resolve_storage_url(f"sqlite:///{tmp_path}/absent/folder/hpo.db", None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///:memory:", "in-memory databases cannot hold a study"),
        ("sqlite:///file::memory:?mode=memory&uri=true", "in-memory databases"),
        ("postgresql+psycopg2://", "names no database"),
        ("postgresql://user@host", "names no database"),
    ],
)
def test_urls_that_cannot_hold_a_study_are_refused(url: str, expected: str) -> None:
    with pytest.raises(StorageError, match=expected):
        resolve_storage_url(url, None)


def test_an_sqlite_url_that_names_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="names a folder"):
        resolve_storage_url(f"sqlite:///{tmp_path}", None)


@pytest.mark.parametrize(
    ("stamped", "advice"), [("older", "optuna storage upgrade"), ("unknown", "newer")]
)
def test_a_database_of_another_optuna_schema_is_one_clear_error(
    tmp_path: Path, stamped: str, advice: str
) -> None:
    """hpo's own schema check (Optuna's holds two connections at once: see check_schema)."""
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'old.db'}"
    storage = open_storage(resolve_storage_url(url, None))
    versions = storage.rdb.get_all_versions()
    revision = versions[1] if stamped == "older" else "f00dbeef"  # walk_revisions: newest first
    storage.engine.dispose()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
    engine.dispose()
    for read_only in (False, True):
        with pytest.raises(StorageError, match=f"schema {revision}, not {versions[0]}.*{advice}"):
            open_storage(resolve_storage_url(url, None), read_only=read_only)


def test_an_sqlite_file_deleted_under_a_worker_fails_at_once(tmp_path: Path) -> None:
    """Not retried as an outage for `database_patience` (600 s): it will not come back. (A file
    made read-only gives SQLite's same error; as root, which CI is, a mode cannot make it so.)"""
    import optuna

    from hpo.storage.url import StorageURL

    db = tmp_path / "gone.db"
    storage = open_storage(StorageURL(f"sqlite:///{db}", "test"), patience_s=600)
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    db.unlink()
    started = time.monotonic()
    with pytest.raises(StorageError, match="deleted, moved or made read-only"):
        trial.report(0.5, 1)
    assert time.monotonic() - started < 5


def test_an_sqlite_file_read_only_from_the_start_is_not_said_to_have_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that never took a write was not "made read-only while the worker ran". (As root,
    which CI is, a mode cannot make a file read-only: SQLite's mode=ro does.)"""
    import optuna

    from hpo.storage.url import StorageURL

    db = tmp_path / "ro.db"
    optuna.create_study(study_name="old", storage=f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)  # hpo's lock file beside the URI's relative name
    url = StorageURL("sqlite:///file:ro.db?mode=ro&uri=true", "test")
    storage = open_storage(url, patience_s=600)
    with pytest.raises(StorageError) as caught:
        optuna.create_study(study_name="s", storage=storage)
    assert "it is read-only (its permissions, a read-only file system, or mode=ro" in str(
        caught.value
    )
    assert "while the worker ran" not in str(caught.value)


@pytest.mark.parametrize("damage", ["garbage pages", "a bare header"])
def test_a_corrupt_sqlite_file_is_called_corrupt(tmp_path: Path, damage: str) -> None:
    import sqlite3

    from hpo.storage.url import StorageURL

    db = tmp_path / "study.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.executemany("INSERT INTO t VALUES (?)", [("x" * 100,)] * 500)
    data = db.read_bytes()
    kept = 100 if damage == "garbage pages" else 16  # the header that passes hpo's own check
    db.write_bytes(data[:kept] + b"\xff" * (len(data) - kept))
    for read_only in (False, True):
        with pytest.raises(StorageError) as caught:
            open_storage(StorageURL(f"sqlite:///{db}", "test"), read_only=read_only)
        message = str(caught.value)
        assert (
            "the file is damaged, or is not an SQLite database: restore it from a backup, or "
            "point --storage at a new file name" in message
        )
        assert "folder exists" not in message


@pytest.mark.postgres
def test_a_missing_postgres_database_says_how_to_create_it(postgres_url: str) -> None:
    from sqlalchemy.engine import make_url

    from hpo.storage.url import StorageURL

    parsed = make_url(postgres_url).set(database="hpo_no_such_db", password="s3cret")
    url = parsed.render_as_string(hide_password=False)
    with pytest.raises(StorageError) as caught:
        open_storage(StorageURL(url, "test"))
    message = str(caught.value)
    user = f" -U {parsed.username}" if parsed.username else ""
    assert f"create it with `createdb -h {parsed.host}{user} hpo_no_such_db`" in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "sqlite:///z.db?cache=shared&uri=true",
            "has options after '?' (cache, uri), which hpo does not support in an SQLite URL: "
            "write 'sqlite:///z.db', nothing after the file name",
        ),
        ("sqlite:///z.db?timeout=60", "has options after '?' (timeout)"),
        ("sqlite:///z.db?mode=ro", "has options after '?' (mode)"),
        ("sqlite:///z.db?", "has options after '?' (empty)"),
        ("sqlite:///file:z.db", "is an SQLite URI ('sqlite:///file:z.db'), which hpo does not"),
    ],
)
def test_sqlite_options_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, expected: str
) -> None:
    """Options would make hpo's lock file, its existence checks and SQLite name different files:
    `?cache=shared&uri=true` made a file named `z.db?cache=shared`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError) as caught:
        resolve_storage_url(url, None)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["run", "studies", "status"])
def test_no_command_makes_a_file_named_after_sqlite_options(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    command: str,
) -> None:
    from tests.conftest import tiny_config, write_config

    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data, study={"n_trials": 1}))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = {"run": ["run", "--config", str(config)], "status": ["status"], "studies": ["studies"]}
    study = [] if command == "studies" else ["--study", "s"]
    url = "sqlite:///z.db?cache=shared&uri=true"
    assert hpo_main([*args[command], *study, "--storage", url]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        "hpo: error: storage URL from --storage has options after '?' (cache, uri), which hpo "
        "does not support in an SQLite URL: write 'sqlite:///z.db', nothing after the file name"
    ]
    assert list(work.iterdir()) == []
