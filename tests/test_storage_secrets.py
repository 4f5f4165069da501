"""A password in a mistyped storage URL is never printed or logged, whatever the typo: one
slash, none, `//` without the colon, no scheme, three slashes; nor when the server echoes it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hpo.storage.url import StorageURL, mask_text, mask_url, resolve_storage_url

SECRET = "Sekr1t"

MISTYPED_URLS = [
    f"postgresql+psycopg2:/user:{SECRET}@127.0.0.1/db",  # one slash
    f"postgresql+psycopg2:user:{SECRET}@127.0.0.1/db",  # no slash
    f"postgresql+psycopg2//user:{SECRET}@127.0.0.1/db",  # no colon
    f"user:{SECRET}@127.0.0.1:5432/db",  # no scheme
    f"postgresql+psycopg2:///user:{SECRET}@127.0.0.1/db",  # three slashes
    f"postgresql+psycopg2:////user:{SECRET}@127.0.0.1/db",  # four
    f"postgresql+psycopg2:/user:{SECRET}@x@127.0.0.1/db",  # and an `@` in the password
    f"postgresql+psycopg2:/:{SECRET}@127.0.0.1/db",  # no user name
    f" postgresql+psycopg2:/user:{SECRET}@127.0.0.1/db",  # a space before it
    f"postgresql+psycopg2:/user:{SECRET}@127.0.0.1/db\n",  # a newline after it
]
IDS = [
    "1 slash",
    "0 slashes",
    "no colon",
    "no scheme",
    "3 slashes",
    "4 slashes",
    "@ in password",
    "no user",
    "space",
    "newline",
]


@pytest.mark.parametrize("url", MISTYPED_URLS, ids=IDS)
def test_masking_finds_the_password_in_any_shape(url: str) -> None:
    assert SECRET not in mask_url(url)
    assert SECRET not in mask_text(f"got {url!r} here")
    assert SECRET not in mask_text(f"got {url} here")


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (
            f'FATAL:  database "user:{SECRET}@127.0.0.1/db" does not exist',
            'FATAL:  database "user:***@127.0.0.1/db" does not exist',
        ),
        (
            f"createdb -h localhost 'user:{SECRET}@127.0.0.1/db'",
            "createdb -h localhost 'user:***@127.0.0.1/db'",
        ),
        (f"postgresql+psycopg2:user:{SECRET}@h/db", "postgresql+psycopg2:user:***@h/db"),
        # What has no password is left alone: an address, a path or a time with an `@`.
        ("mail alice@example.com at 12:00", "mail alice@example.com at 12:00"),
        ("sqlite:////data/hpo@2024.db", "sqlite:////data/hpo@2024.db"),
        ("file:///shared/run@1/best", "file:///shared/run@1/best"),
        ("postgresql+psycopg2://alice@db/hpo", "postgresql+psycopg2://alice@db/hpo"),
    ],
)
def test_mask_text_keeps_what_is_not_a_password(text: str, masked: str) -> None:
    assert mask_text(text) == masked


def test_masking_a_long_text_takes_no_time() -> None:
    """A driver's message is masked before it is cut to one line: one long word must not make
    the masking take seconds (a pattern that searched each word for an `@` did: quadratic)."""
    import time

    started = time.monotonic()
    masked = mask_text("x" * 1_000_000 + f" user:{SECRET}@h")
    assert time.monotonic() - started < 1.0
    assert masked.endswith(" user:***@h")


def test_three_slashes_are_refused_before_a_server_is_asked() -> None:
    from hpo.storage.errors import StorageError

    with pytest.raises(StorageError) as caught:
        resolve_storage_url(f"postgresql+psycopg2:///user:{SECRET}@127.0.0.1/db", None)
    message = str(caught.value)
    assert "has a third '/' after the scheme" in message and SECRET not in message


class _ServerError(Exception):
    """What psycopg2 says of a database that does not exist."""


def test_a_database_name_the_server_echoes_is_masked_with_its_createdb_line() -> None:
    # A URL that reached the server with the password inside the database name.
    url = StorageURL(f"postgresql+psycopg2://h/user:{SECRET}@127.0.0.1", "test")
    error = _ServerError(f'FATAL:  database "user:{SECRET}@127.0.0.1" does not exist')
    from hpo.storage.preflight import _connection_failure
    from hpo.storage.url import open_fix

    message = _connection_failure(url, error)
    assert "createdb" in message and SECRET not in message, message
    fix = mask_text(open_fix(url, str(error)))
    assert "createdb" in fix and SECRET not in fix, fix


def _args(command: str, config: Path) -> list[str]:
    if command == "run":
        return ["run", "--study", "s", "--config", str(config)]
    return ["status", "--study", "s"] if command == "status" else ["studies"]


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "--debug"])
@pytest.mark.parametrize("source", ["--storage", "$HPO_STORAGE"])
@pytest.mark.parametrize("command", ["run", "studies", "status"])
@pytest.mark.parametrize("url", MISTYPED_URLS, ids=IDS)
def test_no_command_prints_or_logs_the_password_of_a_mistyped_url(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
    url: str,
    command: str,
    source: str,
    debug: bool,
) -> None:
    from tests.conftest import easy_rows, tiny_config, write_config, write_csv

    monkeypatch.chdir(tmp_path)
    train = write_csv(tmp_path / "train.csv", easy_rows(16, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(8, 2))
    config = write_config(tmp_path / "c.yaml", tiny_config(train, evaluation))
    args = _args(command, config) + (["--debug"] if debug else [])
    if source == "--storage":
        args += ["--storage", url]
    else:
        monkeypatch.setenv("HPO_STORAGE", url)
    assert hpo_main(args) == 2
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert SECRET not in output, output
    assert "hpo: error: storage URL" in captured.err
    assert ("Traceback" in captured.err) == debug
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "eval.csv", "train.csv"]


def test_a_log_line_and_its_traceback_are_masked(
    capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    """A library's error quoted in a --debug traceback (a driver echoing the database name)."""
    import logging

    from hpo.logs import setup_logging

    setup_logging(logging.DEBUG)  # hpo_main's teardown removes the handler
    try:
        raise RuntimeError(f'database "user:{SECRET}@127.0.0.1/db" does not exist')
    except RuntimeError:
        logging.getLogger("hpo").exception(f"opening postgresql+psycopg2:/user:{SECRET}@h/db")
    logged = capsys.readouterr().err
    assert "Traceback" in logged and "user:***@127.0.0.1/db" in logged
    assert SECRET not in logged, logged


# -- secrets in a URL's query string (issue 42): tracking URIs, presigned URLs, DSNs ------------

SECRET_QUERIES = [
    f"http://host:5077/mlflow?access_token={SECRET}",
    f"http://host:5077/mlflow?experiment=7&ACCESS_TOKEN={SECRET}&x=1",
    f"https://b.s3.amazonaws.com/k?X-Amz-Credential={SECRET}%2F2024&X-Amz-Signature={SECRET}",
    f"https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig={SECRET}%2B%3D&se=2030",
    f"https://api.example.com/v1?api_key={SECRET}",
    f"https://api.example.com/v1?apiKey={SECRET}",
    f"https://login.example.com/cb?code=1&client_secret={SECRET}",
    f"https://login.example.com/cb#id=1&refresh_token={SECRET}",
    f"http://h/?Authorization=Bearer%20{SECRET}",
    f"http://h/?credentials={SECRET}",
    f"postgresql+psycopg2://u@h/db?sslpassword={SECRET}",
    f"postgresql+psycopg2://u@h/db?dsn=host%3Dh%20password%3D{SECRET}",
    f"http://h/?token={SECRET}={SECRET}",
]


@pytest.mark.parametrize("url", SECRET_QUERIES)
def test_a_secret_query_value_is_masked_wherever_a_url_is_shown(url: str) -> None:
    from hpo.storage.artifacts import masked_artifact_url

    for shown in (
        mask_url(url),
        mask_text(f"got {url!r} here"),
        mask_text(f"MLflow at {url}: 403"),
        masked_artifact_url(url),
    ):
        assert SECRET not in shown and "***" in shown, shown


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (
            f"http://host:5077/mlflow?access_token={SECRET}&experiment=7",
            "http://host:5077/mlflow?access_token=***&experiment=7",
        ),
        (
            f"https://b/k?X-Amz-Expires=60&X-Amz-Signature={SECRET}#top",
            "https://b/k?X-Amz-Expires=60&X-Amz-Signature=***#top",
        ),
        # What names no secret is left alone: `signal` and `design` are not a `sig`.
        (
            "http://h/x?experiment=7&signal=15&design=a&q=a=b",
            "http://h/x?experiment=7&signal=15&design=a&q=a=b",
        ),
        ("sqlite:////data/hpo.db", "sqlite:////data/hpo.db"),
    ],
)
def test_only_the_secret_values_are_masked(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_a_quoted_secret_in_a_connection_string_is_masked_whole() -> None:
    text = f"could not connect: host=h password='{SECRET} two' user=u"
    assert mask_text(text) == "could not connect: host=h password='***' user=u"


def test_masking_a_long_text_with_many_equals_signs_takes_no_time() -> None:
    import time

    started = time.monotonic()
    masked = mask_text("x" * 1_000_000 + "=" * 100_000 + f" a=1&token={SECRET}")
    assert time.monotonic() - started < 1.0
    assert masked.endswith(" a=1&token=***")


def test_a_user_error_the_cli_prints_never_shows_a_token(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    """Whatever message a command raises, the one line `hpo: error: ...` is masked."""
    from hpo.cli import app
    from hpo.errors import HPOError

    def refuses(args: object) -> int:
        raise HPOError(f"MLflow at http://h:5077/mlflow?access_token={SECRET} refused")

    monkeypatch.setattr(app, "monitor_command", refuses)
    assert hpo_main(["studies"]) == 2
    err = capsys.readouterr().err
    assert "hpo: error: MLflow at http://h:5077/mlflow?access_token=*** refused" in err, err
    assert SECRET not in err
