"""Warm start measured: the compute a search needs to reach its target on one task, with and
without study.warm_start from a related task's earlier study (issue 47).

Two related grids of bench/search_grid.py (the NLI task trained from scratch, and the pretrained
MiniLM on the same kind of data, fully or through LoRA) are replayed as bench/search_efficiency.py
replays them. The earlier study is a random search of `--source-trials` trials on the source
grid (a run drawn per trial, seeded); its `--top` best configurations are mapped onto the
target's space by hpo's own warm start (hpo.study.warm_start.map_onto) and queued first; with
narrowing, the target's ranges are narrowed by hpo.study.warm_start.narrowed. The target is the
same as search_efficiency's: the median over seeds of random search's best after n_trials.

Run: .venv/bin/python bench/warm_start.py [--seeds 20] [--source nli-scratch --target lora]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from search_efficiency import (  # noqa: E402
    RANDOM,
    Search,
    best_of,
    compute_to_reach,
    load_task,
    replay,
    replay_config,
    strategy_config,
)
from search_grid import TASKS  # noqa: E402

from hpo.config.schema import Config  # noqa: E402
from hpo.study import warm_start  # noqa: E402

DEFAULT = "hpo default"


def earlier_best(task: str, seed: int, trials: int, top: int) -> list[dict[str, Any]]:
    """The `top` best configurations of a random search of `trials` runs on `task`'s grid."""
    config, _, table = load_task(task)
    pick = random.Random(10_000 + seed)
    every = [run for runs in table.runs.values() for run in runs]
    runs = [pick.choice(every) for _ in range(trials)]
    runs.sort(key=lambda run: best_of(run, config.study.primary_metric), reverse=True)
    chosen: list[dict[str, Any]] = []
    for run in runs:
        if run.params not in chosen:
            chosen.append(dict(run.params))
    return chosen[:top]


def warm_config(task: str, seed: int, configurations: list[dict[str, Any]], narrow: bool) -> Config:
    """The default strategy's config on `task`, the configurations mapped onto its space and
    queued, its ranges narrowed around them if asked."""
    _, raw, _ = load_task(task)
    config = strategy_config(raw, Path(TASKS[task]["config"]), DEFAULT, seed)
    mapped = warm_start.Mapped("earlier")
    queued = [warm_start.map_onto(c, config.search_space, mapped) for c in configurations]
    config.study.enqueue = [c for c in queued if c]
    if narrow:
        for name, (low, high) in warm_start.narrowed(config.search_space, queued).items():
            config.search_space[name].low, config.search_space[name].high = low, high
    return config


def warm_replay(task: str, config: Config, seed: int, n_trials: int) -> Search:
    """search_efficiency.replay, with this config (its queued trials first)."""
    _, _, table = load_task(task)
    return replay_config(task, config, table, DEFAULT, seed, n_trials)


def summary(name: str, searches: list[Search], target: float, random_median: float) -> str:
    reached = [compute_to_reach(s, target, "samples") for s in searches]
    hit = [r for r in reached if r is not None]
    median = statistics.median(hit) if hit else math.nan
    finals = statistics.median(s.best[-1] for s in searches)
    return (
        f"| {name} | {len(hit)}/{len(searches)} | {median / 1e3:.0f} k "
        f"({median / random_median:.2f}x random) | {finals:.4f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", default="nli-scratch", choices=sorted(TASKS))
    parser.add_argument("--target", default="lora", choices=sorted(TASKS))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--source-trials", type=int, default=20)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--budget", type=float, default=3.0, help="trials: this x n_trials")
    args = parser.parse_args()
    config, _, _ = load_task(args.target)
    n_trials = config.study.n_trials or 20
    total = math.ceil(args.budget * n_trials)
    randoms = [replay(args.target, RANDOM, seed, total) for seed in range(args.seeds)]
    target = statistics.median(s.best[n_trials - 1] for s in randoms)
    random_reach = [compute_to_reach(s, target, "samples") for s in randoms]
    random_median = statistics.median(r for r in random_reach if r is not None)
    rows = {
        RANDOM: randoms,
        DEFAULT: [replay(args.target, DEFAULT, seed, total) for seed in range(args.seeds)],
    }
    for narrow in (False, True):
        name = f"{DEFAULT} + warm start from {args.source}" + (", narrowed" if narrow else "")
        rows[name] = []
        for seed in range(args.seeds):
            earlier = earlier_best(args.source, seed, args.source_trials, args.top)
            warm = warm_config(args.target, seed, earlier, narrow)
            rows[name].append(warm_replay(args.target, warm, seed, total))
    print(
        f"target {args.target}: {target:.4f} (random search's median best after {n_trials} "
        f"trials); warm start: top {args.top} of a {args.source_trials}-trial random search "
        f"on {args.source}; {args.seeds} seeds, {total} trials each"
    )
    print(
        "| strategy | seeds reaching it | median samples trained to reach it | median final best |"
    )
    print("|---|---:|---:|---:|")
    for name, searches in rows.items():
        print(summary(name, searches, target, random_median))


if __name__ == "__main__":
    main()
