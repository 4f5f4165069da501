"""bench/search_efficiency.py replays strategies against a stored grid: its accounting of
compute, on a small synthetic grid (the real ones take an hour of training to make)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
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


# The conditional task: LoRA on or off, its rank only when on.
search_grid = sys.modules["search_grid"]  # imported by search_efficiency


def test_the_lora_grid_gives_a_rank_to_lora_points_only() -> None:
    points = search_grid.grid_points("lora")
    by_method = {m: [p for p in points if p["model.peft.method"] == m] for m in ("none", "lora")}
    assert len(by_method["none"]) + len(by_method["lora"]) == len(points)
    assert by_method["none"] and all("model.peft.r" not in p for p in by_method["none"])
    assert all(p["model.peft.r"] in (4, 16) for p in by_method["lora"])
    # Every learning rate with each method and rank: the condition is what varies, not the grid.
    rates = {p["learning_rate"] for p in by_method["none"]}
    assert {(p["model.peft.r"], p["learning_rate"]) for p in by_method["lora"]} == {
        (r, rate) for r in (4, 16) for rate in rates
    }
    runs = search_grid.grid_runs("lora")
    assert len(runs) == 2 * len(points) == len({search_grid.run_key(run) for run in runs})


def _lora_run(params: dict[str, Any], seed: int) -> dict[str, Any]:
    """Full fine-tuning best at 1e-4, LoRA at 3e-3 (rank 16 a little better), as the real grid."""
    best_rate = 1e-4 if params["model.peft.method"] == "none" else 3e-3
    final = 0.9 - 0.1 * abs(math.log10(params["learning_rate"] / best_rate))
    final += 0.01 * (params.get("model.peft.r") == 16)
    run = _run(1e-3, seed)
    for evaluation, value in zip(run["evaluations"], [0.4, 0.5, final - 0.05, final], strict=True):
        evaluation["metrics"] = {"accuracy": value}
    return {**run, "params": params}


@pytest.fixture
def lora_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    grid = tmp_path / "grid.jsonl"
    runs = [_lora_run(run["params"], run["seed"]) for run in search_grid.grid_runs("lora")]
    grid.write_text("".join(json.dumps(run) + "\n" for run in runs))
    monkeypatch.setattr(bench, "data_path", lambda name: grid)
    bench.load_task.cache_clear()
    yield "lora"
    bench.load_task.cache_clear()  # the real grid for whatever runs next


def test_a_trial_without_lora_snaps_to_a_point_without_a_rank(lora_task: str) -> None:
    _, _, table = bench.load_task(lora_task)
    batch = {"effective_batch_size": 32}
    full = table.nearest({"model.peft.method": "none", "learning_rate": 2e-3, **batch})
    assert [run.params for run in full] == 2 * [
        {"model.peft.method": "none", "learning_rate": 3e-3, **batch}
    ]
    lora = table.nearest(
        {"model.peft.method": "lora", "model.peft.r": 16, "learning_rate": 5e-5, **batch}
    )
    assert [run.params for run in lora] == 2 * [
        {"model.peft.method": "lora", "model.peft.r": 16, "learning_rate": 3e-5, **batch}
    ]
    assert sorted(run.seed for run in lora) == [1, 2]
    # What sample() never gives has no grid point: a rank without LoRA, LoRA without a rank.
    for wrong in ({"model.peft.method": "none", "model.peft.r": 4, "learning_rate": 1e-3},
                  {"model.peft.method": "lora", "learning_rate": 1e-3}):  # fmt: skip
        with pytest.raises(SystemExit, match="the grid has no run at"):
            table.nearest({**wrong, **batch})


def test_every_strategy_replays_the_conditional_task(lora_task: str) -> None:
    strategies = [s for s in bench.STRATEGIES if not s.startswith("GP")]  # GP: ~1 s a trial
    for strategy in strategies:
        search = bench.replay(lora_task, strategy, seed=0, n_trials=14)
        assert len(search.points) == 14, strategy
        for point in search.points:
            assert ("model.peft.r" in point) == (point["model.peft.method"] == "lora"), strategy
    searches = [bench.replay(lora_task, s, seed, 14) for s in ("random, no pruning",
                "hpo default") for seed in range(2)]  # fmt: skip
    table = bench.condition_use(lora_task, searches)
    assert table[0] == ("| strategy | model.peft.method: share of trials "
                        "| model.peft.r: share of trials |")  # fmt: skip
    assert table[2].startswith("| random, no pruning | lora: ") and "4: " in table[2]
    assert bench.branches(lora_task).startswith(
        "best run with model.peft.method none: 0.9000 (learning_rate 0.0001, "
        "effective_batch_size 32); model.peft.method lora: 0.9100 (model.peft.r 16, "
        "learning_rate 0.003, effective_batch_size 32)"
    )
