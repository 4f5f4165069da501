"""How many PostgreSQL connections hpo holds (issue 13): a pool of 2 per worker, or one per call
(`study.database_connections: on_demand`), and a full server waited for, not failed on."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState

from hpo.config.schema import Config, ParamSpec, PrunerConfig, StudyConfig
from hpo.stopping import StopRequest
from hpo.storage.batch_cache import BatchSizeCache
from hpo.storage.engine import engine_kwargs, open_storage
from hpo.storage.errors import StorageError
from hpo.storage.url import StorageURL
from hpo.study.join import open_study
from hpo.study.loop import run_trials
from hpo.trial.objective import Objective
from tests.conftest import missing
from tests.connection_watch import ConnectionWatch
from tests.pgbouncer import pgbouncer, pgbouncer_binary
from tests.tcp_proxy import CuttableProxy

pytestmark = pytest.mark.postgres


def test_a_pooled_worker_holds_at_most_two_and_on_demand_none_between_calls() -> None:
    pooled = engine_kwargs("postgresql")
    assert (pooled["pool_size"], pooled["max_overflow"]) == (2, 0)
    on_demand = engine_kwargs("postgresql", on_demand=True)
    assert on_demand["poolclass"] is sa.pool.NullPool
    assert on_demand["connect_args"] == pooled["connect_args"]  # same timeouts, keepalives
    assert "poolclass" not in engine_kwargs("sqlite", on_demand=True)  # PostgreSQL only


def _trivial(trial: Any, task: Any) -> float:
    for step in range(2):
        trial.report(float(step), step)
    return float(task.params["x"])


def test_on_demand_connections_run_a_study_and_hold_none_when_idle(postgres_url: str) -> None:
    study_config = StudyConfig(n_trials=4, trial_isolation="none", database_connections="on_demand")
    config = Config(study=study_config, search_space={"x": ParamSpec(type="float", low=0, high=1)})
    url = StorageURL(postgres_url, "test")
    storage = open_storage(url, patience_s=30, on_demand=True)
    study = open_study(storage, "light", config)
    stop = StopRequest()
    objective = Objective(config, None, url, stop, _trivial, BatchSizeCache(storage.engine))  # type: ignore[arg-type]
    assert run_trials(study, storage, objective, stop) == 4
    states = [t.state for t in optuna.load_study(study_name="light", storage=postgres_url).trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 4
    query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"
    with sa.create_engine(postgres_url, poolclass=sa.pool.NullPool).connect() as conn:
        assert conn.execute(sa.text(query), {"name": f"hpo {os.getpid()}"}).scalar() == 0


def postgres_admin(url: str) -> str:
    return sa.engine.make_url(url).set(username="postgres").render_as_string(hide_password=False)


@pytest.fixture
def limited_role(postgres_url: str) -> Iterator[str]:
    """The URL of `postgres_url`'s database as a role allowed two connections at a time (a
    superuser ignores connection limits; opening a storage takes two)."""
    role = f"hpo_limited_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 2'))
        conn.execute(sa.text(f'GRANT ALL ON SCHEMA public TO "{role}"'))
    try:
        yield postgres_url.replace("postgres@", f"{role}@", 1)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP OWNED BY "{role}"'))
            conn.execute(sa.text(f'DROP ROLE "{role}"'))
        admin.dispose()


def test_a_full_server_is_waited_for_at_start_and_a_wrong_name_is_not(limited_role: str) -> None:
    holder = sa.create_engine(limited_role, poolclass=sa.pool.NullPool)
    taken = [holder.connect(), holder.connect()]  # the server is "full" for the role
    with pytest.raises(StorageError, match="too many connections"):
        open_storage(StorageURL(limited_role, "test"))  # no patience: at once
    opened: list[Any] = []
    started = time.monotonic()
    thread = threading.Thread(
        target=lambda: opened.append(open_storage(StorageURL(limited_role, "test"), 60.0))
    )
    thread.start()
    time.sleep(1.5)
    assert not opened  # still waiting for a free connection
    for conn in taken:
        conn.close()
    thread.join(timeout=30)
    assert opened and 1.5 < time.monotonic() - started < 30
    role = sa.engine.make_url(limited_role).username
    with sa.create_engine(postgres_admin(limited_role)).connect() as conn:
        held = "SELECT count(*) FROM pg_stat_activity WHERE usename = :role"
        assert conn.execute(sa.text(held), {"role": role}).scalar() <= 2  # none left from waiting
    opened[0].engine.dispose()
    holder.dispose()
    wrong = limited_role.rsplit("/", 1)[0] + "/no_such_database_here"
    started = time.monotonic()
    with pytest.raises(StorageError, match="does not exist"):
        open_storage(StorageURL(wrong, "test"), 60.0)  # bad input: not waited on
    assert time.monotonic() - started < 10


def _light_worker(
    url: str, budget: int = 12, report_pause_s: float = 0.0, grace_period: int = 60
) -> None:
    """A worker process: a study of trivial trials, a connection per call. A trial whose
    heartbeats stop for `grace_period` is failed and retried: longer than any outage here,
    except where a killed worker's trial must be retried."""
    study_config = StudyConfig(
        n_trials=budget,
        trial_isolation="none",
        database_connections="on_demand",
        heartbeat_interval=1,
        grace_period=grace_period,
        pruner=PrunerConfig(type="none"),
    )
    config = Config(study=study_config, search_space={"x": ParamSpec(type="float", low=0, high=1)})
    storage_url = StorageURL(url, "test")
    storage = open_storage(storage_url, patience_s=60, on_demand=True)
    study = open_study(storage, "bounced", config)
    stop = StopRequest()

    def slow(trial: Any, task: Any) -> float:
        for step in range(3):
            time.sleep(report_pause_s)
            trial.report(float(step), step)
        return float(task.params["x"])

    objective = Objective(config, None, storage_url, stop, slow, BatchSizeCache(storage.engine))  # type: ignore[arg-type]
    run_trials(study, storage, objective, stop)


def _light_worker_telling(failure: Path, *args: Any) -> None:
    """_light_worker, writing its traceback to `failure` if it fails: a CI run saw one exit 1
    and nothing said why."""
    try:
        _light_worker(*args)
    except BaseException:
        failure.write_text(traceback.format_exc())
        raise


def _wait_for_reports_of_running_trials(url: str, study_name: str, trials: int) -> None:
    """Until `trials` trials run and have reported, so an outage falls inside them (a fixed
    sleep was a guess: a slow machine could still be starting its workers)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(KeyError):
            found = optuna.load_study(study_name=study_name, storage=url).trials
            running = [t for t in found if t.state == TrialState.RUNNING and t.intermediate_values]
            if len(running) >= trials:
                return
        time.sleep(0.05)
    raise AssertionError(f"{trials} trials of {study_name} did not start reporting within 60 s")


BOUNCED_BUDGET = 12


def test_on_demand_workers_behind_pgbouncer_share_two_server_connections(
    postgres_url: str,
) -> None:
    """docs/concepts/storage.md: more workers than server connections, through the shipped
    deploy/pgbouncer/pgbouncer.ini (session mode). Six workers, each of which may hold two
    sessions at once (the study lock and a call under it), get by with two server connections:
    the budget exact, no trial failed, none left running."""
    _need_pgbouncer()
    optuna.storages.RDBStorage(postgres_url).engine.dispose()  # tables first, not raced here
    context = multiprocessing.get_context("fork")
    with (
        pgbouncer(postgres_url, pool_size=2) as bounced,
        ConnectionWatch(postgres_url, every_s=0.02) as seen,
    ):
        workers = [
            context.Process(target=_light_worker, args=(bounced, BOUNCED_BUDGET)) for _ in range(6)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=90)
        stuck = [w.pid for w in workers if w.is_alive()]
        for worker in workers:
            worker.kill()
    assert not stuck, f"workers {stuck} never ended: waiting for a server connection?"
    assert [w.exitcode for w in workers] == [0] * 6
    trials = optuna.load_study(study_name="bounced", storage=postgres_url).trials
    assert sorted(t.number for t in trials) == list(range(BOUNCED_BUDGET))
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert len({t.user_attrs["worker"] for t in trials}) > 1  # the workers shared the study
    assert 1 <= seen.total <= 2


def test_on_demand_workers_behind_pgbouncer_ride_out_a_server_outage(
    postgres_url: str, tmp_path: Path
) -> None:
    """The server goes away under PgBouncer (every server connection dropped, new ones refused,
    for 4 s) while two workers report: their calls are retried until it is back, and the study
    ends exact, every trial complete with every report."""
    _need_pgbouncer()
    optuna.storages.RDBStorage(postgres_url).engine.dispose()
    url = sa.engine.make_url(postgres_url)
    proxy = CuttableProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    context = multiprocessing.get_context("fork")
    failures = [tmp_path / f"worker-{i}.txt" for i in range(2)]
    try:
        with pgbouncer(proxied, pool_size=4) as bounced:
            workers = [
                context.Process(target=_light_worker_telling, args=(failure, bounced, 6, 0.4))
                for failure in failures
            ]
            for worker in workers:
                worker.start()
            _wait_for_reports_of_running_trials(postgres_url, "bounced", trials=2)
            proxy.cut()
            time.sleep(4)  # the outage's length, not a wait for something to happen
            proxy.restore()
            for worker in workers:
                worker.join(timeout=120)
            for worker in workers:
                worker.kill()
    finally:
        proxy.close()
    told = [f.read_text()[-3000:] for f in failures if f.exists()]
    assert [w.exitcode for w in workers] == [0, 0], told
    trials = optuna.load_study(study_name="bounced", storage=postgres_url).trials
    assert sorted(t.number for t in trials) == list(range(6))
    assert all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]
    assert all(sorted(t.intermediate_values) == [0, 1, 2] for t in trials)
    starts = sorted(t.datetime_start for t in trials if t.datetime_start is not None)
    ends = sorted(t.datetime_complete for t in trials if t.datetime_complete is not None)
    assert (ends[-1] - starts[0]).total_seconds() > 4  # the study ran through the outage


def test_a_killed_workers_trial_is_retried_behind_pgbouncer(postgres_url: str) -> None:
    """Heartbeats and retries through PgBouncer: a worker killed mid-trial (and mid-session,
    perhaps holding the study lock: PgBouncer's DISCARD ALL drops it) stops beating; another
    worker fails its trial after the grace period and runs the same configuration again."""
    _need_pgbouncer()
    optuna.storages.RDBStorage(postgres_url).engine.dispose()
    context = multiprocessing.get_context("fork")
    with pgbouncer(postgres_url, pool_size=2) as bounced:
        doomed = context.Process(target=_light_worker, args=(bounced, 1, 30.0, 3))
        doomed.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.3)
            with contextlib.suppress(KeyError):
                study = optuna.load_study(study_name="bounced", storage=postgres_url)
                trials = study.trials
                if trials and trials[0].state == TrialState.RUNNING and trials[0].params:
                    break  # into its first report's pause
        doomed.kill()
        doomed.join()
        time.sleep(4)  # past the grace period: the trial's heartbeat has stopped
        survivor = context.Process(target=_light_worker, args=(bounced, 1, 0.0, 3))
        survivor.start()
        survivor.join(timeout=90)
        survivor.kill()
    assert survivor.exitcode == 0
    failed, retry = optuna.load_study(study_name="bounced", storage=postgres_url).trials
    assert failed.state == TrialState.FAIL and retry.state == TrialState.COMPLETE
    assert retry.params == failed.params and retry.system_attrs["failed_trial"] == 0


def _need_pgbouncer() -> None:
    if pgbouncer_binary() is None:
        missing("pgbouncer is not installed (scripts/test installs it as root)")
