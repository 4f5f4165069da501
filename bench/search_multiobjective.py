"""Pruning with several objectives measured: the hypervolume of [accuracy, samples/s] a search
reaches against the compute it spends, with study.pruner.objective (prune on accuracy) and
without (today's default with several objectives: nothing pruned). Issue 47.

The grids of bench/search_efficiency.py are replayed as it replays them (a trial's parameters
sampled by hpo's search space code, snapped to the nearest grid point, one of its training
seeds drawn), in a study of two objectives built as `hpo run` builds it: hpo's sampler, and
hpo's pruner from hpo.study.join.study_pruner, asked through hpo's own reporter and
hpo.trial.objective_pruning after each stored evaluation (which compares a trial only with the
complete trials at least as fast, within study.throughput_tolerance; "against every trial"
turns that off). A complete trial's values are its best
evaluation's accuracy and its run's samples/s; the stored runs keep no throughput, so samples/s
is derived from their clocks: the samples trained over the run's training seconds (train_s,
which excludes evaluation). Compute is samples trained (pruned trials included), as in
search_efficiency.

Hypervolume: of the complete trials' plain Pareto front, against the reference point (the
grid's worst accuracy, 0 samples/s), samples/s divided by the grid's fastest run (so a
hypervolume is at most 1 - that worst accuracy). The target is the median over seeds of the
unpruned TPE search's hypervolume after the task's n_trials; per strategy: median compute to
reach it (a seed that never does counts as infinite), seeds reaching it within --budget x
n_trials trials, the median hypervolume at a third and at all of the unpruned search's compute,
after n_trials trials, and the share of trials pruned.

Run: .venv/bin/python bench/search_multiobjective.py [--task nli-scratch] [--seeds 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import InMemoryStorage
from optuna.trial import TrialState

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from search_efficiency import Run, best_of, load_task  # noqa: E402
from search_grid import TASKS, data_path  # noqa: E402

from hpo.config.loader import parse_config  # noqa: E402
from hpo.config.schema import Config  # noqa: E402
from hpo.study.join import study_pruner  # noqa: E402
from hpo.study.sampling import build_sampler  # noqa: E402
from hpo.tracking.observer import NoObserver  # noqa: E402
from hpo.trainer.evaluation import Evaluation  # noqa: E402
from hpo.trial.objective import InWorkerTrial  # noqa: E402
from hpo.trial.objective_pruning import ObjectivePruner  # noqa: E402
from hpo.trial.search_space import sample  # noqa: E402
from hpo.trial.training import pruning_reporter  # noqa: E402

METRIC = "accuracy"
OBJECTIVES = [METRIC, "samples_per_s"]
UNPRUNED = "TPE, no pruning (default with several objectives)"
# Each strategy: the study.sampler and study.pruner sections (a seed is added); left out:
# hpo's defaults (TPE multivariate; the median rule with margin 0.02, from evaluation 2).
# "every trial": the pruner compares a trial with every complete trial, not only with those
# at least as fast (hpo's rule: hpo.trial.objective_pruning), to show what that rule is worth.
STRATEGIES: dict[str, dict[str, Any]] = {
    "random, no pruning": {"sampler": {"type": "random"}, "pruner": {"type": "none"}},
    "random + median on accuracy": {
        "sampler": {"type": "random"},
        "pruner": {"objective": METRIC},
    },
    UNPRUNED: {},
    "TPE + median on accuracy (pruner.objective)": {"pruner": {"objective": METRIC}},
    "TPE + median on accuracy, against every trial": {
        "pruner": {"objective": METRIC},
        "every trial": True,
    },
    "TPE + ASHA on accuracy": {
        "pruner": {"type": "successive_halving", "min_resource": 2, "objective": METRIC},
    },
}


@dataclass
class FrontSearch:
    """One replayed study of two objectives: per trial, compute so far and hypervolume."""

    strategy: str
    seed: int
    samples: list[float]  # cumulative, after each trial
    hypervolume: list[float]  # of the front after each trial
    pruned: int


@cache
def throughputs(task: str) -> dict[tuple[str, int], float]:
    """Each stored run's samples/s (its samples over its training seconds), by its grid point
    and training seed."""
    found = {}
    for line in data_path(task).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        run = json.loads(line)
        trained = run["evaluations"][-1]["samples"] if run["evaluations"] else 0
        if run.get("train_s"):
            found[_key(run["params"], run["seed"])] = trained / run["train_s"]
    return found


def _key(params: dict[str, Any], seed: int) -> tuple[str, int]:
    return json.dumps(params, sort_keys=True), seed


@cache
def reference(task: str) -> tuple[float, float]:
    """The hypervolume's reference: the grid's worst accuracy and its fastest run."""
    _, _, table = load_task(task)
    return min(table.values(METRIC)), max(throughputs(task).values())


def hypervolume(points: list[tuple[float, float]], task: str) -> float:
    """Area dominated by `points` (accuracy, samples/s; both maximized) above the reference."""
    floor, fastest = reference(task)
    area, best_speed = 0.0, 0.0
    # By accuracy, best first: each point adds the strip of speed it gains over the better ones.
    for accuracy, speed in sorted(points, key=lambda p: (-p[0], -p[1])):
        if accuracy <= floor or speed <= best_speed:
            continue
        area += (accuracy - floor) * (speed - best_speed) / fastest
        best_speed = speed
    return area


def strategy_config(task: str, strategy: str, seed: int) -> Config:
    """What `hpo run` would use: the task's config, two objectives, the strategy's sections."""
    _, raw, _ = load_task(task)
    raw = json.loads(json.dumps(raw))
    study = raw.setdefault("study", {})
    study["metric"] = list(OBJECTIVES)
    settings = STRATEGIES[strategy]
    study["sampler"] = {**settings.get("sampler", {}), "seed": seed}
    study.pop("pruner", None)
    if "pruner" in settings:
        study["pruner"] = dict(settings["pruner"])
    source = Path(TASKS[task]["config"])
    return parse_config(raw, source.parent, f"{source} ({strategy})")


def replay(task: str, strategy: str, seed: int, n_trials: int) -> FrontSearch:
    """`n_trials` of the strategy's search of two objectives, replayed on the task's grid."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("hpo").setLevel(logging.WARNING)  # no line per evaluation and study
    config = strategy_config(task, strategy, seed)
    _, _, table = load_task(task)
    speeds = throughputs(task)
    storage = InMemoryStorage()
    study = optuna.create_study(
        storage=storage,
        study_name="replay",
        directions=config.study.resolved_directions,
        sampler=build_sampler(config.study.sampler, 0, config.search_space),
        pruner=study_pruner(storage, "replay", config),
    )
    if STRATEGIES[strategy].get("every trial") and isinstance(study.pruner, ObjectivePruner):
        study.pruner.throughput = None
    pick = random.Random(seed)
    spent = [0.0]  # samples of the running trial, up to its last evaluation
    pruned_metric = config.study.pruned_metric

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        run: Run = pick.choice(table.nearest(sample(trial, config.search_space)))
        speed = speeds[_key(run.params, run.seed)]
        # The trial's samples/s so far at each evaluation: the run's own (its clocks per
        # evaluation include the process's start).
        report = pruning_reporter(
            InWorkerTrial(trial, NoObserver()), pruned_metric or METRIC, speed=lambda: speed
        )
        for e in run.evaluations:
            spent[0] = e["samples"]
            if pruned_metric is None:
                continue
            reason = report(Evaluation(e["index"], 0.0, e["step"], e["metrics"], None))
            if reason is not None:
                raise optuna.TrialPruned(reason)
        if run.status == "diverged" or not run.evaluations:
            raise optuna.TrialPruned("diverged")
        return best_of(run, METRIC), speed

    samples, volumes, pruned = [0.0], [], 0
    for _ in range(n_trials):
        spent[0] = 0.0
        study.optimize(objective, n_trials=1)
        pruned += study.trials[-1].state == TrialState.PRUNED
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        volumes.append(hypervolume([(t.values[0], t.values[1]) for t in complete], task))
        samples.append(samples[-1] + spent[0])
    return FrontSearch(strategy, seed, samples[1:], volumes, pruned)


def _replay(job: tuple[str, str, int, int]) -> FrontSearch:
    return replay(*job)


def reached_at(search: FrontSearch, target: float) -> float:
    """Samples trained when the hypervolume first reaches `target` (inf: never)."""
    for used, volume in zip(search.samples, search.hypervolume, strict=True):
        if volume >= target - 1e-12:
            return used
    return math.inf


def volume_at(search: FrontSearch, compute: float) -> float:
    """The hypervolume once `compute` samples are spent (of the trials done by then)."""
    pairs = zip(search.samples, search.hypervolume, strict=True)
    done = [volume for used, volume in pairs if used <= compute]
    return done[-1] if done else 0.0


def report(task: str, searches: list[FrontSearch], n_trials: int) -> list[str]:
    by_strategy: dict[str, list[FrontSearch]] = {}
    for search in searches:
        by_strategy.setdefault(search.strategy, []).append(search)
    unpruned = by_strategy[UNPRUNED]
    target = statistics.median(s.hypervolume[n_trials - 1] for s in unpruned)
    compute = statistics.median(s.samples[n_trials - 1] for s in unpruned)
    base = statistics.median(reached_at(s, target) for s in unpruned)
    floor, fastest = reference(task)
    lines = [
        f"task {task}: target hypervolume {target:.4f} (median of the unpruned TPE search after "
        f"{n_trials} trials, which train {compute / 1e6:.3f} M samples); reference: accuracy "
        f"{floor:.4f}, samples/s / {fastest:.0f}",
        "",
        "| strategy | M samples to target, median | vs unpruned TPE | seeds reaching "
        "| hypervolume at 1/3 of its compute | at its compute "
        f"| after {n_trials} trials | trials pruned |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for strategy, runs in by_strategy.items():
        reached = [reached_at(s, target) for s in runs]
        median = statistics.median(reached)
        shown = f"{median / 1e6:.3f}" if math.isfinite(median) else "not reached"
        ratio = f"{median / base:.2f}x" if math.isfinite(median) else "-"
        third = statistics.median(volume_at(s, compute / 3) for s in runs)
        whole = statistics.median(volume_at(s, compute) for s in runs)
        final = statistics.median(s.hypervolume[n_trials - 1] for s in runs)
        share = statistics.mean(s.pruned / len(s.hypervolume) for s in runs)
        lines.append(
            f"| {strategy} | {shown} | {ratio} | {sum(map(math.isfinite, reached))}/{len(runs)} "
            f"| {third:.4f} | {whole:.4f} | {final:.4f} | {share:.0%} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", choices=sorted(TASKS), action="append")
    parser.add_argument("--seeds", type=int, default=20, help="searches per strategy")
    parser.add_argument("--budget", type=float, default=2.0, help="trials: this x n_trials")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    args = parser.parse_args()
    for task in args.task or ["nli-scratch", "demo"]:
        config, _, _ = load_task(task)
        n_trials = config.study.n_trials or 20
        total = math.ceil(args.budget * n_trials)
        jobs = [(task, s, seed, total) for s in STRATEGIES for seed in range(args.seeds)]
        started = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            searches = list(pool.imap(_replay, jobs, chunksize=1))
        print("\n".join(report(task, searches, n_trials)))
        took = time.perf_counter() - started
        print(f"({len(jobs)} searches of {total} trials in {took:.0f} s)\n")


if __name__ == "__main__":
    main()
