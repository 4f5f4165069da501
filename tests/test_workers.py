"""Many workers on one study: the study's trial budget holds exactly, on PostgreSQL and SQLite."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from tests.conftest import (
    hold_env,
    holding_metrics,
    record_faults,
    start_hpo,
    tiny_config,
    wait_until_held,
    wait_until_training,
    write_config,
)

BUDGET = 12


@pytest.mark.postgres
def test_workers_share_the_budget_exactly_on_postgres(
    tmp_path: Path, easy_data: tuple[Path, Path], postgres_url: str
) -> None:
    # Four workers race as eight did (tables, study and every trial of the budget contended),
    # for half the processes on a 2-core CI machine.
    run_workers(tmp_path, easy_data, postgres_url, workers=4)


def test_workers_share_the_budget_exactly_on_sqlite(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    run_workers(tmp_path, easy_data, f"sqlite:///{tmp_path / 'shared.db'}", workers=4)


def run_workers(tmp_path: Path, easy_data: tuple[Path, Path], url: str, workers: int) -> None:
    raw = tiny_config(
        *easy_data,
        # The trials train in their workers (trial_isolation: none): the race is the workers',
        # and each worker's fork server would cost seconds of imports.
        study={"n_trials": BUDGET, "pruner": {"type": "none"}, "trial_isolation": "none"},
        training={"max_steps": 1, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    args = ("run", "--study", "shared", "--config", str(config), "--storage", url, "--quiet")
    # Every worker starts on an empty database at once: tables and study are created racing.
    processes = [start_hpo(*args, cwd=tmp_path) for _ in range(workers)]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
    trials = optuna.load_study(study_name="shared", storage=url).get_trials()
    assert sorted(t.number for t in trials) == list(range(BUDGET)), [
        (t.number, t.state.name) for t in trials
    ]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    # The config fixes the sampler seed: each worker still draws its own configurations.
    configurations = {tuple(sorted(t.params.items())) for t in trials}
    assert len(configurations) == BUDGET, sorted(configurations)


@pytest.mark.postgres
def test_a_killed_workers_trial_is_failed_and_retried_elsewhere(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 1,
            "heartbeat_interval": 1,
            "grace_period": 3,
            "pruner": {"type": "none"},
            "checkpoint_interval": 0,  # a checkpoint at every evaluation, for the retry
        },
        # 12 evaluations (a checkpoint each) over 3 epochs, not 12 epochs of one: the worker is
        # killed in the second, held until its trial process sees the worker gone (a tiny trial
        # may otherwise finish first), and the retry trains what is left.
        training={"epochs": 3, "evals_per_epoch": 4},
    )
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "c.yaml", raw)
    args = ("run", "--study", "kill", "--config", str(config), "--storage", postgres_url, "--quiet")
    held = tmp_path / "held"
    doomed = start_hpo(*args, cwd=tmp_path, env=hold_env(held, at=2))
    try:
        # Training, and checkpointed once: the retry has something to resume from.
        wait_until_training(postgres_url, "kill", [doomed], evaluations=1)
        wait_until_held(held, [doomed])
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
    time.sleep(4)  # past the grace period: the trial's heartbeat has stopped
    # The survivor: hpo's main in this process (another worker, on this host), in the folder of
    # the dead worker's checkpoints; a worker process would spend seconds importing torch.
    monkeypatch.chdir(tmp_path)
    assert hpo_main(list(args)) == 0, capsys.readouterr().err[-3000:]
    study = optuna.load_study(study_name="kill", storage=postgres_url)
    record_faults(study, faults=1, budget=1)
    trials = study.get_trials()
    assert [t.state for t in trials] == [
        optuna.trial.TrialState.FAIL,
        optuna.trial.TrialState.COMPLETE,
    ]
    assert trials[1].system_attrs["failed_trial"] == 0
    assert trials[1].params == trials[0].params  # the same configuration, re-run
    assert trials[1].user_attrs["worker"] != trials[0].user_attrs["worker"]
    # The dead worker's trial process saw it die, checkpointed and stopped: the retry resumed.
    assert trials[1].user_attrs["resumed_at_step"] > 0
