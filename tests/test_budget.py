"""study.budget_device_hours (and --budget-device-hours): no trial starts once the study's
device-hours (the figure `hpo status` prints) reach it, across all workers; a price per
device-hour gives `hpo status` and `hpo report` a cost, and the report the cost to come within
0.005 of the best (issue 47)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hpo.config.budget import budget_problems
from hpo.reports import cost
from hpo.reports import status as report
from hpo.storage.engine import StudyStorage, open_storage
from hpo.storage.url import StorageURL
from hpo.study.device_time import BUDGET_ATTR, PRICE_ATTR
from hpo.study.trials import StudyTrials
from tests.conftest import exit_code, tiny_config, write_config

HOUR_S = 3600.0


@pytest.mark.parametrize("hours", [0, -1, math.nan, math.inf, "two", True])
def test_a_budget_that_is_not_a_positive_finite_number_is_refused(hours: object) -> None:
    assert budget_problems(hours)
    assert budget_problems(None) == [] and budget_problems(0.5) == []


@pytest.mark.parametrize("flag", ["-1", "0", "nan", "inf"])
def test_the_flag_refuses_a_bad_budget_in_one_line(
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    flag: str,
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = f"sqlite:///{tmp_path / 'h.db'}"
    args = ["run", "--study", "s", "--config", str(config), "--storage", url]
    assert exit_code(hpo_main, [*args, "--budget-device-hours", flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budget-device-hours" in err[0], err
    assert "Traceback" not in err[0]
    assert not (tmp_path / "h.db").exists()  # nothing half-written


def _storage(tmp_path: Path) -> StudyStorage:
    return open_storage(StorageURL(f"sqlite:///{tmp_path / 'study.db'}", "test"))


def _worker(storage: StudyStorage, name: str, hours: float) -> StudyTrials:
    study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
    trials = StudyTrials(study, storage, name, budget=None, liveness=(1, 2, 2))
    trials.device_hours_budget = hours
    return trials


def _finish(trials: StudyTrials, trial: optuna.Trial, hours: float) -> None:
    """The trial ends having trained `hours` (its wall_s, as a worker records it): the seam
    that fakes device time."""
    trial.set_user_attr("wall_s", hours * HOUR_S)
    trials.tell(trial, TrialState.COMPLETE, 0.5)


def test_two_workers_share_the_device_hour_budget(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    a, b = _worker(storage, "a:1", 1.0), _worker(storage, "b:2", 1.0)
    for worker in (a, b, a):  # 0.4 h each: 0.4, 0.8, then 1.2 >= 1
        trial = worker.next_trial()
        assert trial is not None
        _finish(worker, trial, 0.4)
    assert b.next_trial() is None and a.next_trial() is None
    assert b.device_hours_spent == pytest.approx(1.2)
    assert len(a.study.get_trials()) == 3
    # The same figure as `hpo status` prints, and the budget beside it.
    a.study.set_user_attr(BUDGET_ATTR, 1.0)
    shown = report.status(a.study, storage=storage)
    assert shown["device_hours"] == pytest.approx(1.2)
    assert "budget 1 device-hours" in report.figures_line(shown)
    storage.engine.dispose()


def test_a_trial_running_on_another_worker_counts_towards_the_budget(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    a, b = _worker(storage, "a:1", 0.5), _worker(storage, "b:2", 0.5)
    trial = a.next_trial()
    assert trial is not None
    with storage.engine.begin() as conn:  # it started an hour ago, and beats still
        conn.execute(
            sa.text("UPDATE trials SET datetime_start = datetime(datetime_start, '-3600 seconds')")
        )
    assert b.next_trial() is None  # its worker's hour passes the budget of 0.5
    assert b.device_hours_spent == pytest.approx(1.0, abs=0.01)
    storage.engine.dispose()


def _trial(value: float, hours: float, started_min: int) -> optuna.trial.FrozenTrial:
    start = dt.datetime(2026, 11, 28, 10, 0) + dt.timedelta(minutes=started_min)
    trial = create_trial(
        state=TrialState.COMPLETE,
        value=value,
        params={"x": 0.5},
        distributions={"x": FloatDistribution(0, 1)},
        user_attrs={"wall_s": hours * HOUR_S},
    )
    trial.datetime_start, trial.datetime_complete = start, start + dt.timedelta(minutes=1)
    return trial


def test_the_report_shows_the_cost_to_reach_within_0_005_of_the_best() -> None:
    study = optuna.create_study(direction="maximize")
    for value, hours, minute in [(0.70, 1.0, 0), (0.898, 0.5, 1), (0.80, 2.0, 2), (0.90, 1.0, 3)]:
        study.add_trial(_trial(value, hours, minute))
    # 0.898 is within 0.005 of 0.90: reached at the second trial, after 1.5 device-hours.
    assert cost.to_reach(study.trials, study.direction) == (1, pytest.approx(1.5))
    assert cost.reach_line(study, study.trials) == (
        "to reach within 0.005 of the best: 1.500 device-hours (trial #1 first did)"
    )
    study.set_user_attr(PRICE_ATTR, {"amount": 2.0, "currency": "EUR"})
    line = cost.reach_line(study, study.trials)
    assert line is not None and "1.500 device-hours (3.00 EUR)" in line
    shown = report.status(study)
    assert shown["cost"] == {"amount": 9.0, "currency": "EUR"}  # 4.5 device-hours
    assert "cost 9.00 EUR" in report.figures_line(shown)


def test_a_study_without_a_price_shows_no_cost() -> None:
    study = optuna.create_study(direction="minimize")
    assert cost.reach_line(study, study.trials) is None  # nothing completed
    study.add_trial(_trial(0.3, 1.0, 0))
    assert report.status(study)["cost"] is None
    assert "cost" not in report.figures_line(report.status(study))


def test_hpo_run_refuses_a_bad_budget_by_its_argument_name(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    import hpo
    from hpo.errors import ConfigError

    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with pytest.raises(ConfigError) as refused:
        hpo.run(str(config), study="s", storage=url, budget_device_hours=-2.0, quiet=True)
    assert str(refused.value).startswith("hpo.run: budget_device_hours: got -2.0; must be")
    assert not (tmp_path / "h.db").exists()


def test_the_end_notice_hears_of_a_spent_device_hour_budget() -> None:
    from hpo.study.notices import study_ended

    done = [_trial(0.5, 1.0, 0)]
    queued = create_trial(state=TrialState.WAITING, params={}, distributions={})
    assert not study_ended([*done, queued], budget=10)  # by n_trials alone: more to run
    assert study_ended([*done, queued], budget=10, device_hours_spent=True)
    running = create_trial(state=TrialState.RUNNING, params={}, distributions={})
    assert not study_ended([*done, running], budget=10, device_hours_spent=True)


def test_a_watcher_sees_a_study_whose_device_hours_are_spent_as_ended() -> None:
    study = optuna.create_study(direction="maximize")
    study.add_trial(_trial(0.5, 1.0, 0))
    study.enqueue_trial({"x": 0.3})  # queued, but no worker will start it
    study.set_user_attr("n_trials", 10)
    shown = report.status(study)
    assert not report.ended(shown)  # by n_trials alone, a worker may yet come
    study.set_user_attr(BUDGET_ATTR, 1.0)
    shown = report.status(study)
    assert report.ended(shown) and report.ended_for_good(shown)


def test_two_worker_processes_stop_once_the_budget_is_spent_and_a_later_run_starts_none(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two real workers share the budget; then, on the spent study, a later run given a budget
    of its own (its trials as if they had trained two hours each) starts nothing and says so."""
    from tests.conftest import start_hpo

    raw = tiny_config(
        *easy_data,
        study={"n_trials": 200, "pruner": {"type": "none"}, "trial_isolation": "none"},
        training={"max_steps": 1, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    budget_h = 0.001  # 3.6 s of trials: a handful of tiny ones, far from n_trials
    args = ("run", "--study", "s", "--config", str(config), "--storage", url)
    workers = [
        start_hpo(*args, "--budget-device-hours", str(budget_h), cwd=tmp_path) for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=600) for worker in workers]
    for worker, (_, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr[-3000:]
        assert "starting no new trial" in stderr, stderr[-3000:]
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    assert 0 < len(trials) < 200 and all(t.state == TrialState.COMPLETE for t in trials)
    # No trial started once the trials that had ended before it held the budget (a lower
    # bound of the study's device-hours then: running trials count too).
    for trial in trials:
        before_s = sum(
            t.user_attrs["wall_s"]
            for t in trials
            if t.datetime_complete is not None
            and trial.datetime_start is not None
            and t.datetime_complete < trial.datetime_start
        )
        assert before_s < budget_h * HOUR_S, (trial.number, before_s)
    # Spent, across both workers: the study's figure passed the budget.
    assert sum(t.user_attrs["wall_s"] for t in trials) >= budget_h * HOUR_S

    engine = sa.create_engine(url)
    with engine.begin() as conn:  # as if each trial had trained two hours
        conn.execute(
            sa.text("UPDATE trial_user_attributes SET value_json = '7200.0' WHERE key = 'wall_s'")
        )
    engine.dispose()
    capsys.readouterr()
    later = [*args, "--n-trials", str(len(trials) + 5), "--budget-device-hours", "1.5"]
    assert hpo_main(later) == 0
    said = capsys.readouterr().err
    spent = f"has used {2 * len(trials):.3f} device-hours, its budget being 1.5"
    assert spent in said and "starting no new trial" in said, said[-3000:]
    assert len(optuna.load_study(study_name="s", storage=url).trials) == len(trials)
