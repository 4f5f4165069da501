"""A trial whose worker died (a second Ctrl-C, kill -9) counts in the study's device-hours up to
its last heartbeat: not its whole age while it waits, RUNNING, for a worker to sweep it, and the
same figure once swept; a retry does not carry its failed attempt's time (issue 42)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hpo.reports import status as report
from hpo.storage.engine import StudyStorage, open_storage
from hpo.storage.heartbeats import heartbeats
from hpo.storage.url import StorageURL
from hpo.study.retry import retry_trial
from hpo.study.trials import StudyTrials

HOUR_S = 3600.0


def test_a_running_trial_counts_up_to_its_last_heartbeat() -> None:
    now = dt.datetime(2026, 11, 28, 12, 0, 0)
    trial = create_trial(state=TrialState.RUNNING, params={}, distributions={})
    trial.datetime_start = now - dt.timedelta(hours=1)
    assert report._device_s(trial, now, silent_s=3000.0) == pytest.approx(600.0)
    assert report._device_s(trial, now, silent_s=5.0) == pytest.approx(3595.0)  # it beats
    assert report._device_s(trial, now) == pytest.approx(HOUR_S)  # no heartbeat row: its age


def _storage(tmp_path: Path) -> StudyStorage:
    return open_storage(StorageURL(f"sqlite:///{tmp_path / 'study.db'}", "test"))


def _worker(storage: StudyStorage, name: str) -> StudyTrials:
    study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
    return StudyTrials(study, storage, name, budget=3, liveness=(1, 2, 2))


def _killed_an_hour_in(storage: StudyStorage, trial: optuna.Trial, ran_s: int) -> None:
    """As if the trial started an hour ago and its worker was killed `ran_s` seconds in: its
    last heartbeat then, and nothing since (the database's clock)."""
    with storage.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE trials SET datetime_start = "
                "datetime(datetime_start, '-3600 seconds') WHERE number = :n"
            ),
            {"n": trial.number},
        )
        silent_s = int(HOUR_S) - ran_s
        conn.execute(
            heartbeats.update().values(beat_at=sa.text(f"datetime('now', '-{silent_s} seconds')"))
        )


def test_a_dead_workers_trial_counts_up_to_its_last_heartbeat_before_and_after_the_sweep(
    tmp_path: Path,
) -> None:
    storage = _storage(tmp_path)
    dead = _worker(storage, "dead:1")
    trial = dead.next_trial()
    assert trial is not None
    _killed_an_hour_in(storage, trial, ran_s=600)  # then a second Ctrl-C: os._exit

    # Still RUNNING (no worker has come since): on main, its whole hour counted.
    shown = report.status(dead.study, storage=storage)
    assert shown["trials"] == {"running": 1}
    assert shown["device_hours"] == pytest.approx(600 / HOUR_S, abs=0.003)

    # A worker comes and sweeps it: FAIL, its time recorded as the same figure.
    assert _worker(storage, "w:2").sweep() == [trial.number]
    swept = report.status(dead.study, storage=storage)
    assert swept["trials"] == {"fail": 1, "waiting": 1}
    assert swept["device_hours"] == pytest.approx(600 / HOUR_S, abs=0.003)
    storage.engine.dispose()


def test_a_retry_does_not_carry_its_failed_attempts_time() -> None:
    study = optuna.create_study(direction="maximize")
    x = {"x": FloatDistribution(0, 1)}
    study.add_trial(
        create_trial(
            state=TrialState.FAIL, params={"x": 0.5}, distributions=x, user_attrs={"wall_s": 500.0}
        )
    )
    number = retry_trial(study, study.trials[0], max_retries=2)
    assert number is not None
    retry = study.trials[number]
    # On main the retry began with wall_s 500: interrupted before it recorded its own time
    # (a Ctrl-C through a trial training in the worker), it counted its attempt's 500 s.
    assert "wall_s" not in retry.user_attrs
