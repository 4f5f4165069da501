"""The database's answers (storage.study_queries, used by hpo status, best and studies and by the
worker's budget count) equal the public API's, on SQLite and PostgreSQL, for a study with every
kind of trial. These tests break when an Optuna upgrade changes the schema the queries read."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from hpo.reports import status as report
from hpo.storage import open_storage, study_queries
from hpo.storage.engine import StudyStorage
from hpo.storage.url import StorageURL
from hpo.study.trials import counted_trials

LR = FloatDistribution(1e-5, 1e-1, log=True)
NOW = dt.datetime(2030, 1, 1)


def _trial(
    state: TrialState, value: float | list[float] | None = None, **attrs: object
) -> optuna.trial.FrozenTrial:
    values = value if isinstance(value, list) or value is None else [value]
    return optuna.create_trial(
        state=state,
        values=values,
        params={"learning_rate": 1e-3},
        distributions={"learning_rate": LR},
        user_attrs=dict(attrs),
        intermediate_values={} if state == TrialState.WAITING else {0: 0.5},
    )


def _fill(study: optuna.Study, storage: StudyStorage) -> None:
    """Complete (finite, tied, infinite), pruned and failed trials with and without reasons,
    running and waiting ones, retries, and a wall_s that is not a number."""
    for trial in [
        _trial(TrialState.COMPLETE, 0.8, wall_s=30.0),
        _trial(TrialState.COMPLETE, 0.9, wall_s=60),
        _trial(TrialState.COMPLETE, 0.9, wall_s="n/a"),  # tied with the one before: not best
        _trial(TrialState.COMPLETE, -math.inf),
        _trial(TrialState.PRUNED, prune_reason="pruner: accuracy=0.3 at evaluation 1", wall_s=5),
        _trial(TrialState.PRUNED, prune_reason="pruner: accuracy=0.2 at evaluation 2"),
        _trial(TrialState.PRUNED, prune_reason="diverged: loss is NaN at step 3"),
        _trial(TrialState.PRUNED),
        _trial(TrialState.FAIL, fail_reason="stale: no heartbeat from its worker h:1 for 90 s"),
        _trial(TrialState.FAIL, fail_reason="RuntimeError: x|y: z", checkpoint_error="e: 1"),
        _trial(TrialState.FAIL, checkpoint_error="no checkpoints for this trial: x"),
        _trial(TrialState.RUNNING, worker="host:42"),
        _trial(TrialState.WAITING),
    ]:
        study.add_trial(trial)
    for number in (11, 12):  # two retries: a running one and a queued one
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(study.study_name), number
        )
        storage.set_trial_system_attr(trial_id, "failed_trial", 8)


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StudyStorage]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'q.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    opened = open_storage(StorageURL(url, "test"))
    yield opened
    opened.engine.dispose()


@contextlib.contextmanager
def _reading_no_whole_study(study: optuna.Study, storage: StudyStorage) -> Iterator[None]:
    """Fails the block if it reads every trial of a study (all it may read whole is the
    running ones)."""
    read = storage.rdb.get_all_trials

    def running_only(study_id: int, deepcopy: bool = True, states: Any = None) -> Any:
        assert states == (TrialState.RUNNING,), "read every trial of the study"
        return read(study_id, deepcopy=deepcopy, states=states)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(storage.rdb, "get_all_trials", running_only)
        patch.setattr(study, "get_trials", None)
        yield


def test_the_database_answers_as_the_public_api_does(storage: StudyStorage) -> None:
    study = optuna.create_study(storage=storage, study_name="q", direction="maximize")
    _fill(study, storage)
    optuna.create_study(storage=storage, study_name="empty", direction="minimize")
    assert study_queries.supported(storage.engine)
    with _reading_no_whole_study(study, storage):
        fast = report.status(study, NOW, storage=storage)
        best = report.best_trials(study, storage=storage)
        rows = report.studies(storage)
    slow = report.status(study, NOW)
    assert fast == slow
    assert fast["best"]["number"] == 1  # 0.9, the first of two
    assert fast["trials"] == {"complete": 4, "pruned": 4, "fail": 3, "running": 1, "waiting": 1}
    assert fast["prunes"] == {"pruner": 2, "diverged": 1, "no reason recorded": 1}
    running = study.trials[11].datetime_start  # its time so far counts too
    assert fast["device_hours"] == round((95 + (NOW - running).total_seconds()) / 3600, 4)
    assert fast["lost_checkpoints"] == {
        "trials": 2,
        "latest": 10,
        "reason": "no checkpoints for this trial: x",
    }
    assert best == report.best_trials(study)
    assert rows == report.studies(storage.rdb)
    assert counted_trials(study.get_trials(deepcopy=False)) == 10


def test_a_study_of_two_objectives_gets_its_pareto_front(storage: StudyStorage) -> None:
    study = optuna.create_study(storage=storage, study_name="two", directions=["maximize"] * 2)
    for values in ([0.9, 0.5], [0.9, 0.5], [0.8, 0.9], [0.7, 0.7], [math.inf, 0.1]):
        study.add_trial(_trial(TrialState.COMPLETE, values))
    with _reading_no_whole_study(study, storage):
        fast = report.status(study, NOW, storage=storage)
    assert fast == report.status(study, NOW)
    assert [t["number"] for t in fast["pareto_front"]] == [0, 2, 4]
    assert report.studies(storage) == report.studies(storage.rdb)


def test_a_schema_hpo_does_not_know_gets_the_public_api(storage: StudyStorage) -> None:
    study = optuna.create_study(storage=storage, study_name="q", direction="maximize")
    _fill(study, storage)
    with storage.engine.begin() as conn:
        conn.execute(sa.text("UPDATE version_info SET schema_version = 999"))
    assert not study_queries.supported(storage.engine)
    assert report.status(study, NOW, storage=storage) == report.status(study, NOW)


def test_the_schema_version_the_queries_know_is_the_installed_optunas() -> None:
    from optuna.storages._rdb import models  # the guard: a new schema must be checked first

    assert models.SCHEMA_VERSION in study_queries.KNOWN_SCHEMA_VERSIONS


def test_trials_read_in_bulk_are_optunas_trials(
    storage: StudyStorage, local_time_zone: Any
) -> None:
    local_time_zone("Asia/Kolkata")  # Optuna hands times out in local time: so must these
    study = optuna.create_study(storage=storage, study_name="q", direction="maximize")
    _fill(study, storage)
    trial = study.ask()
    trial.suggest_int("layers", 1, 12, log=True)
    trial.suggest_categorical("pooling", ["mean", None, 3])
    trial.report(float("nan"), 0)
    trial.report(float("inf"), 1)
    study_id = storage.get_study_id_from_name("q")
    ids = [
        storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        for t in study.get_trials()
    ]
    bulk = [_comparable(t) for t in study_queries.trials(storage.engine, ids)]
    assert bulk == [_comparable(storage.rdb.get_trial(i)) for i in ids]
    # A sample to draw a large study from: the best, the latest, and some of the rest.
    picked = study_queries.sample_ids(storage.engine, study_id, maximize=True, limit=8)
    best_id = storage.get_trial_id_from_study_id_trial_number(study_id, 1)
    assert best_id in picked and ids[-1] in picked and len(picked) <= 10
    status = report.status(study, storage=storage)
    (running,) = [r for r in status["running"] if r["number"] == 11]
    assert 0 <= running["age_s"] < 600  # its age, not hours off by the time zone


def _comparable(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """The trial's fields, NaN written out (NaN equals nothing, itself included)."""
    fields = dict(vars(trial))
    fields["intermediate_values"] = {
        step: "nan" if math.isnan(v) else v for step, v in trial.intermediate_values.items()
    }
    return fields


def test_a_running_trial_whose_worker_went_silent_is_shown_and_the_study_stalled(
    storage: StudyStorage,
) -> None:
    from hpo.storage.heartbeats import Heartbeats

    study = optuna.create_study(storage=storage, study_name="q", direction="maximize")
    study.set_user_attr("grace_period_s", 90)
    alive, dead = study.ask(), study.ask()
    beats = Heartbeats(storage.engine, storage.get_study_id_from_name("q"))
    beats.start(alive.number, "host:1")
    beats.start(dead.number, "host:2")
    with storage.engine.begin() as conn:
        conn.execute(sa.text("UPDATE hpo_heartbeats SET beat_at = '2000-01-01' WHERE number = 1"))
    summary = report.status(study, storage=storage)
    assert report.stale(summary) == [dead.number] and not report.stalled(summary)
    lines = "\n".join(report.status_lines(summary))
    assert f"running #{dead.number} on unknown for" in lines and "silent for" in lines
    assert lines.count("silent for") == 1
    study.tell(alive, 0.5)  # the live worker ended its trial; the dead one's trial is all left
    summary = report.status(study, storage=storage)
    assert report.stalled(summary) and not report.ended(summary)


def test_the_indexes_the_queries_rely_on_exist(storage: StudyStorage) -> None:
    """An Optuna upgrade that drops one would make every per-trial read a scan of the table."""
    inspector = sa.inspect(storage.engine)
    for table, leading in study_queries.INDEXES_USED:
        indexed = [tuple(i["column_names"]) for i in inspector.get_indexes(table)]
        indexed += [tuple(u["column_names"]) for u in inspector.get_unique_constraints(table)]
        assert any(cols[: len(leading)] == leading for cols in indexed), (table, indexed)


def test_device_hours_count_every_trial_and_trials_per_hour_waits_for_one(
    storage: StudyStorage,
) -> None:
    study = optuna.create_study(storage=storage, study_name="t", direction="maximize")
    started = NOW - dt.timedelta(hours=1)

    def add(state: TrialState, ran_s: float, **attrs: object) -> None:
        trial = _trial(state, 0.5 if state == TrialState.COMPLETE else None, **attrs)
        trial.datetime_start = started
        trial.datetime_complete = started + dt.timedelta(seconds=ran_s) if ran_s else None
        study.add_trial(trial)

    # Interrupted after 195 s (it recorded its time), a worker killed after 120 s (it could
    # not: from start to end), and one running for an hour.
    add(TrialState.FAIL, 200, wall_s=195.0, fail_reason="interrupted: the worker got SIGTERM")
    add(TrialState.FAIL, 120, fail_reason="stale: no heartbeat")
    add(TrialState.RUNNING, 0)
    shown = report.status(study, NOW, storage=storage)
    assert shown == report.status(study, NOW)
    assert shown["device_hours"] == round((195 + 120 + 3600) / 3600, 4)
    assert shown["trials_per_hour"] is None  # none completed or was pruned: no rate yet
    line = next(text for text in report.status_lines(shown) if "device-hours" in text)
    assert line.startswith("device-hours 1.087 (every trial") and "trials/hour" not in line

    add(TrialState.PRUNED, 90, wall_s=80.0)
    add(TrialState.COMPLETE, 180, wall_s=170.0)
    shown = report.status(study, NOW, storage=storage)
    assert shown == report.status(study, NOW)
    assert shown["trials_per_hour"] == 40.0  # two in the 180 s from the first start
    assert "40.0 trials/hour (completed or pruned)" in report.figures_line(shown)
