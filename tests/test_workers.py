"""Many workers on one study: the study's trial budget holds exactly, on PostgreSQL and SQLite."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests.conftest import tiny_config, write_config

BUDGET = 12


@pytest.mark.postgres
def test_workers_share_the_budget_exactly_on_postgres(
    tmp_path: Path, easy_data: tuple[Path, Path], postgres_url: str
) -> None:
    run_workers(tmp_path, easy_data, postgres_url, workers=8)


def test_workers_share_the_budget_exactly_on_sqlite(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    run_workers(tmp_path, easy_data, f"sqlite:///{tmp_path / 'shared.db'}", workers=4)


def run_workers(tmp_path: Path, easy_data: tuple[Path, Path], url: str, workers: int) -> None:
    raw = tiny_config(
        *easy_data,
        study={"n_trials": BUDGET, "pruner": {"type": "none"}},
        training={"max_steps": 1, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    command = [sys.executable, "-m", "hpo", "run", "--study", "shared", "--config", str(config),
               "--storage", url, "--quiet"]  # fmt: skip
    # Every worker starts on an empty database at once: tables and study are created racing.
    processes = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for _ in range(workers)
    ]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
    trials = optuna.load_study(study_name="shared", storage=url).get_trials()
    assert sorted(t.number for t in trials) == list(range(BUDGET)), [
        (t.number, t.state.name) for t in trials
    ]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


@pytest.mark.postgres
def test_a_killed_workers_trial_is_failed_and_retried_elsewhere(
    tmp_path: Path, easy_data: tuple[Path, Path], postgres_url: str
) -> None:
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 1,
            "heartbeat_interval": 1,
            "grace_period": 3,
            "pruner": {"type": "none"},
        },
        training={"epochs": 4},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    command = [sys.executable, "-m", "hpo", "run", "--study", "kill", "--config", str(config),
               "--storage", postgres_url, "--quiet"]  # fmt: skip
    doomed = subprocess.Popen(command, cwd=tmp_path, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_running_trial(postgres_url, "kill", doomed)
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
    time.sleep(4)  # past the grace period: the trial's heartbeat has stopped
    survivor = subprocess.run(command, cwd=tmp_path, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    trials = optuna.load_study(study_name="kill", storage=postgres_url).get_trials()
    assert [t.state for t in trials] == [
        optuna.trial.TrialState.FAIL,
        optuna.trial.TrialState.COMPLETE,
    ]
    assert trials[1].system_attrs["failed_trial"] == 0
    assert trials[1].params == trials[0].params  # the same configuration, re-run
    assert trials[1].user_attrs["worker"] != trials[0].user_attrs["worker"]


def wait_for_running_trial(url: str, study: str, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert worker.poll() is None, "the worker ended before its trial started"
        try:
            trials = optuna.load_study(study_name=study, storage=url).get_trials()
        except KeyError:
            trials = []
        if any(t.state == optuna.trial.TrialState.RUNNING and t.params for t in trials):
            return
        time.sleep(0.2)
    raise AssertionError("no trial started within 120 s")
