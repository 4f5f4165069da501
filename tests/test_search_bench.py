"""bench/search_efficiency.py replays strategies against a stored grid: its accounting of
compute, on a small synthetic grid (the real ones take an hour of training to make)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, tiny_config, write_config

sys.path.insert(0, str(REPO / "bench"))
import search_efficiency as bench  # noqa: E402

RATES = [1e-4, 1e-3, 1e-2]


def _run(rate: float, seed: int) -> dict[str, Any]:
    """A curve at chance level, then good only at the middle learning rate."""
    final = 0.9 if rate == 1e-3 else 0.4
    curve = [0.33, 0.33, final - 0.1, final]
    return {
        "params": {"effective_batch_size": 8, "learning_rate": rate},
        "seed": seed,
        "status": "completed",
        "evaluations": [
            {
                "index": i,
                "step": 10 * i,
                "samples": 80 * i,
                "seconds": 1.0 * i,
                "metrics": {"accuracy": value + 0.001 * seed},
            }  # fmt: skip
            for i, value in enumerate(curve, 1)
        ],
    }


@pytest.fixture
def task(tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> str:
    space = {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    raw = tiny_config(*easy_data, study={"n_trials": 6})
    raw["search_space"] = {**raw["search_space"], **space}
    config = write_config(tmp_path / "task.yaml", raw)
    grid = tmp_path / "grid.jsonl"
    grid.write_text("".join(json.dumps(_run(r, s)) + "\n" for r in RATES for s in (1, 2)))
    monkeypatch.setitem(bench.TASKS, "toy", {"config": config})
    monkeypatch.setattr(bench, "data_path", lambda name: grid)
    bench.load_task.cache_clear()  # this test's grid, not an earlier test's
    return "toy"


def test_a_replayed_trial_costs_what_its_run_trained_up_to_where_it_stopped(task: str) -> None:
    unpruned = bench.replay(task, "random, no pruning", seed=0, n_trials=6)
    assert unpruned.samples == [320.0 * k for k in range(1, 7)]  # every run: 4 evaluations
    assert unpruned.pruned == 0 and unpruned.best == sorted(unpruned.best)
    pruned = bench.replay(task, "TPE + successive halving (ASHA)", seed=0, n_trials=12)
    steps = [b - a for a, b in zip([0.0, *pruned.samples], pruned.samples, strict=False)]
    assert pruned.pruned > 0 and set(steps) <= {80.0, 160.0, 240.0, 320.0}
    assert steps.count(320.0) == 12 - pruned.pruned  # only completed runs paid in full


def test_the_report_compares_each_strategy_with_random_search(task: str) -> None:
    searches = [
        bench.replay(task, strategy, seed, 12)
        for strategy in ("random, no pruning", "hpo default")
        for seed in range(3)
    ]
    lines = bench.report(task, searches, 6, "samples")
    assert lines[0].startswith("task toy: target 0.9")
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert "1.00x" in rows["random, no pruning"]
    assert set(rows) >= {"random, no pruning", "hpo default"}
