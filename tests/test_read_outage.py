"""The read commands (studies, status, status --watch, best, report) ride out a study database
that drops out, as the workers do: a read that lost its connection is read again on a fresh one
within the outage window; past it, one line naming the database and exit 1. A wrong query or a
missing table is no outage: it fails at once."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import FloatDistribution
from sqlalchemy.engine import make_url

from hpo.storage import outage
from hpo.storage.errors import DatabaseUnreachable
from tests.conftest import PG_ADMIN_URL, start_hpo
from tests.tcp_proxy import CuttableProxy

DEADLINE_S = 60


def _dropped() -> sa.exc.OperationalError:
    """What SQLAlchemy raises when the server ends a connection under a query."""
    driver = Exception("terminating connection due to administrator command")
    return sa.exc.OperationalError("SELECT 1", {}, driver, connection_invalidated=True)


def _no_such_table_sqlite() -> BaseException:
    """SQLite's real error for a missing table, as SQLAlchemy raises it: an OperationalError,
    as for a locked file."""
    engine = sa.create_engine("sqlite://")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select * from trials"))
    except sa.exc.OperationalError as e:
        return e
    finally:
        engine.dispose()
    raise AssertionError("SQLite found a table in an empty database")


def _wrapped(error: BaseException, outer: BaseException) -> BaseException:
    """`outer` raised from `error`, as Optuna wraps a driver's error."""
    try:
        try:
            raise error
        except BaseException as e:
            raise outer from e
    except BaseException as caught:
        return caught


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (_dropped(), True),
        (sa.exc.InterfaceError("SELECT 1", {}, Exception("connection already closed")), True),
        (_wrapped(_dropped(), optuna.exceptions.StorageInternalError("commit failed")), True),
        # PostgreSQL's missing table and bad query: ProgrammingError.
        (sa.exc.ProgrammingError("SELECT * FROM x", {}, Exception("no relation x")), False),
        (_no_such_table_sqlite(), False),
        # A retry inside already gave up: the outer one must not start a second window.
        (_wrapped(_dropped(), DatabaseUnreachable("unreachable for 600 s")), False),
        (ValueError("not a database error"), False),
    ],
    ids=[
        "dropped",
        "closed",
        "optuna-wrapped",
        "missing-table-pg",
        "missing-table-sqlite",
        "given-up",
        "other",
    ],
)
def test_the_retry_decision_is_a_dropped_connection_only(
    error: BaseException, transient: bool
) -> None:
    assert outage.is_transient(error) is transient


class FlakyRead:
    """A read that fails `drops` times with a dropped connection, then answers."""

    def __init__(self, drops: int, error: Callable[[], BaseException] = _dropped) -> None:
        self.drops, self.error, self.calls = drops, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.drops:
            raise self.error()
        return "the answer"


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outage, "FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(outage, "MAX_DELAY_S", 0.02)


def test_a_read_that_lost_its_connection_is_read_again_and_the_outage_said_once(
    short_backoff: None, caplog: pytest.LogCaptureFixture
) -> None:
    read = FlakyRead(drops=3)
    with caplog.at_level(logging.WARNING, logger="hpo.storage.outage"):
        answer = outage.retrying(read, "the report", 30, database="the study database X")
    assert answer == "the answer" and read.calls == 4
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # unreachable once, back once: not a line per retry
    assert said[0].startswith("the study database X unreachable (")
    assert said[1] == "the study database X back after 3 retries of the report"


@pytest.mark.parametrize(
    "error",
    [
        lambda: sa.exc.ProgrammingError("SELECT * FROM nope", {}, Exception("no relation")),
        _no_such_table_sqlite,
    ],
    ids=["missing-table-pg", "missing-table-sqlite"],
)
def test_a_wrong_query_is_not_retried(
    error: Callable[[], BaseException], short_backoff: None
) -> None:
    read = FlakyRead(drops=1, error=error)
    with pytest.raises(sa.exc.DBAPIError):
        outage.retrying(read, "the report", 30)
    assert read.calls == 1


def test_a_read_past_the_window_is_one_error_naming_the_database(short_backoff: None) -> None:
    read = FlakyRead(drops=10**9)
    started = time.monotonic()
    with pytest.raises(DatabaseUnreachable) as caught:
        outage.retrying(
            read, "the report", 0.3, database="the study database X", then="run it again"
        )
    took = time.monotonic() - started
    assert 0.2 < took < 5 and read.calls > 2
    assert str(caught.value).startswith("the study database X was unreachable for 0.3 s (")
    assert str(caught.value).endswith("; check that it is up, then run it again")


# -- the commands, in this process, on SQLite: the wiring ------------------------------------


@pytest.fixture
def finished_study(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'read.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    _add_trials(study, 5)
    return url


def _add_trials(study: optuna.Study, count: int) -> None:
    space = {"learning_rate": FloatDistribution(1e-5, 1e-2, log=True)}
    study.add_trials(
        [
            optuna.trial.create_trial(
                params={"learning_rate": 1e-4 * (1 + i)},
                distributions=space,
                value=i / count,
                intermediate_values={1: i / count},
            )
            for i in range(count)
        ]
    )


def _status_dropping(monkeypatch: pytest.MonkeyPatch, drops: set[int]) -> list[int]:
    """hpo.reports.status.status losing its connection at the calls numbered in `drops` (from
    1). Returns the list of calls made."""
    from hpo.reports import status as report

    real, calls = report.status, []

    def status(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(len(calls) + 1)
        if len(calls) in drops:
            raise _wrapped(_dropped(), optuna.exceptions.StorageInternalError("commit failed"))
        return real(*args, **kwargs)

    monkeypatch.setattr(report, "status", status)
    return calls


def test_status_prints_its_answer_after_a_dropped_connection(
    finished_study: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    short_backoff: None,
) -> None:
    calls = _status_dropping(monkeypatch, drops={1, 2})
    assert hpo_main(["status", "--study", "s", "--storage", finished_study, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["trials"] == {"complete": 5} and calls == [1, 2, 3]
    assert err.count("unreachable") == 1 and "back after 2 retries of the status" in err


def test_a_watch_goes_on_through_drops(
    finished_study: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    short_backoff: None,
) -> None:
    """A finished study: the watch ends after two refreshes that succeed; drops between."""
    calls = _status_dropping(monkeypatch, drops={1, 3, 4})
    args = ["status", "--study", "s", "--storage", finished_study, "--watch", "--interval", "0.1"]
    assert hpo_main(args) == 0
    out, err = capsys.readouterr()
    assert out.count("study 's': 5 complete") == 2 and len(calls) == 5
    assert err.count("unreachable") == 2  # once per outage, not once per retry
    assert "has ended" in err


def test_a_read_past_the_window_is_one_line_and_exit_1(
    finished_study: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    short_backoff: None,
) -> None:
    _status_dropping(monkeypatch, drops=set(range(1, 10**6)))
    args = ["status", "--study", "s", "--storage", finished_study, "--database-patience", "0.2"]
    assert hpo_main(args) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"hpo: error: the study database {finished_study} was unreachable for 0.2 s ("
    )
    assert last.endswith("; check that it is up, then run it again")


# -- PostgreSQL: the server ends the command's connection mid-read ---------------------------


@pytest.fixture
def pg_study(postgres_url: str) -> str:
    """A study "outage-read" of 20 complete trials (values 0 to 0.95)."""
    storage = optuna.storages.RDBStorage(postgres_url)
    study = optuna.create_study(study_name="outage-read", storage=storage, direction="maximize")
    _add_trials(study, 20)
    storage.engine.dispose()  # its connections would hold up the database's drop
    return postgres_url


@contextlib.contextmanager
def trials_locked(url: str) -> Iterator[sa.Connection]:
    """The trials table locked in a transaction: a read of it waits, mid-query, until the
    transaction ends (rollback())."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("LOCK TABLE trials IN ACCESS EXCLUSIVE MODE"))
            yield conn
    finally:
        engine.dispose()


def _wait_for_blocked_read(admin: sa.Engine, pid: int, process: Any) -> list[int]:
    """The backends of the hpo process `pid` that wait on the lock, once there is one."""
    query = sa.text(
        "SELECT pid FROM pg_stat_activity WHERE application_name = :app"
        " AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        with admin.connect() as conn:  # a new transaction: pg_stat_activity is fresh
            found = list(conn.execute(query, {"app": f"hpo {pid}"}).scalars())
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"hpo ended before it read: {process.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"hpo {pid} never read the trials within {DEADLINE_S} s")


@pytest.fixture
def admin() -> Iterator[sa.Engine]:
    engine = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


READS = {  # a read command and what its answer holds
    "report": (["report", "--study", "outage-read", "--format", "md"], "- trials: 20 complete"),
    "status --watch": (
        ["status", "--study", "outage-read", "--watch", "--interval", "0.1"],
        "study 'outage-read': 20 complete",
    ),
    "best": (["best", "--study", "outage-read", "--json"], '"number": 19'),
    "studies": (["studies"], "outage-read  maximize      20  0.9500"),
}


@pytest.mark.postgres
@pytest.mark.parametrize("command", list(READS))
def test_a_read_whose_connection_the_server_ends_prints_its_answer(
    command: str, pg_study: str, admin: sa.Engine, tmp_path: Path
) -> None:
    args, expected = READS[command]
    with trials_locked(pg_study) as lock:
        hpo = start_hpo(*args, "--storage", pg_study, cwd=tmp_path)
        try:
            blocked = _wait_for_blocked_read(admin, hpo.pid, hpo)
            with admin.connect() as conn:  # the server ends it mid-query, as an admin would
                for pid in blocked:
                    conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            lock.rollback()
            out, err = hpo.communicate(timeout=DEADLINE_S)
        finally:
            hpo.kill()
    assert hpo.returncode == 0, err[-3000:]
    assert expected in out, out[-3000:]
    assert "Traceback" not in err and err.count("unreachable (") == 1, err[-3000:]


@pytest.mark.postgres
def test_a_read_past_the_window_on_postgresql_is_one_line_and_exit_1(
    pg_study: str, admin: sa.Engine, tmp_path: Path
) -> None:
    """The server unreachable (every connection dropped, new ones refused) for longer than
    --database-patience: one line naming the database, its password masked; exit 1."""
    url = make_url(pg_study)
    proxy = CuttableProxy(url.host or "127.0.0.1", url.port or 5432)
    # The server trusts local connections: any password passes, and must not be printed.
    proxied = url.set(host="127.0.0.1", port=proxy.port, password="s3cret-pw")
    shown = proxied.render_as_string(hide_password=False)
    args = ("report", "--study", "outage-read", "--format", "md", "--database-patience", "2")
    try:
        with trials_locked(pg_study):
            hpo = start_hpo(*args, "--storage", shown, cwd=tmp_path)
            try:
                _wait_for_blocked_read(admin, hpo.pid, hpo)
                proxy.cut()  # and left cut: the outage outlasts the window
                started = time.monotonic()
                out, err = hpo.communicate(timeout=DEADLINE_S)
                took = time.monotonic() - started
            finally:
                hpo.kill()
    finally:
        proxy.close()
    assert hpo.returncode == 1, err[-3000:]
    assert out == "" and "Traceback" not in err and "s3cret-pw" not in err, err[-3000:]
    assert took < 2 + 10, took  # the window, and a connect timeout at most
    masked = proxied.render_as_string(hide_password=True)
    lines = err.strip().splitlines()
    assert lines[-1].startswith(
        f"hpo: error: the study database {masked} was unreachable for 2 s ("
    ), lines
    # Before it: the outage said once, as a warning; nothing else.
    assert len(lines) == 2 and "unreachable (" in lines[0], lines
