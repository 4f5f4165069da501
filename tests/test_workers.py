"""Many workers on one study: the study's trial budget holds exactly, on PostgreSQL and SQLite."""

from __future__ import annotations

import subprocess
import sys
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
