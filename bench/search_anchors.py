"""Syne Tune's schedulers as anchors in search_efficiency's table (issue 47): ASHA, Hyperband,
BOHB and the median stopping rule replayed on the same grids as hpo's strategies.

A Syne Tune scheduler is driven through its own API (suggest, on_trial_add, on_trial_result,
on_trial_complete), one trial at a time as search_efficiency replays Optuna's: each suggested
configuration is snapped to the grid (search_efficiency.Table.nearest: the parameters whose
`when` holds, each number's nearest grid value), one of the point's stored seeds is drawn, and
its evaluations are fed one by one (the resource is the evaluation's ordinal, 1, 2, ...). The
scheduler answers CONTINUE, STOP or PAUSE after each: a stopped trial is pruned; a paused one
may be resumed later by a suggestion that names it, and then continues its stored curve from
where it paused, the samples before the pause counted once. A trial whose stored curve ends is
complete, with the run's best value (as a replayed Optuna trial). Each started or resumed trial
is one entry of the search (Syne Tune 0.16 ships no scheduler that pauses, so here an entry is a
trial). Compute, the target, the rule and the pairing of seeds are search_efficiency's own
(verdicts, report, choose): anchors sit in the same table and under the same rule.

Needs the bench extra (Syne Tune, and statsmodels for BOHB's kernel densities): see
bench/README.md, "search_anchors.py".

Run: .venv/bin/python bench/search_anchors.py [--task ner] [--seeds 20] [--jobs 2] [--cache F]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import multiprocessing
import random
import statistics
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from search_efficiency import (  # noqa: E402
    RANDOM,
    STRATEGIES,
    Run,
    Search,
    Table,
    Verdict,
    _replay,
    best_of,
    cached_searches,
    choose,
    load_task,
    report,
    verdicts,
)
from search_grid import TASKS, data_path  # noqa: E402

from hpo.config.schema import Config, ParamSpec  # noqa: E402
from hpo.config.space import applies, sampling_order  # noqa: E402

# The resource the schedulers see: the evaluation's ordinal in the run (1 = the first).
RESOURCE = "evaluation"
# Syne Tune's scheduler decisions (syne_tune.optimizer.scheduler.SchedulerDecision).
STOP, PAUSE = "STOP", "PAUSE"

# Each anchor: the Syne Tune scheduler and its settings. "epoch": the task's evaluations per
# epoch (training.evals_per_epoch); brackets "all": as many brackets as rungs (Hyperband).
# Syne Tune's own defaults otherwise: reduction factor 3, first rung at the first evaluation.
ANCHORS: dict[str, dict[str, Any]] = {
    # Syne Tune's random search, nothing stopped: the replay's check against the table's own.
    "Syne Tune random search": {"scheduler": "random"},
    "Syne Tune ASHA": {"scheduler": "asha"},
    "Syne Tune ASHA, first rung at one epoch": {"scheduler": "asha", "grace_period": "epoch"},
    "Syne Tune Hyperband (asynchronous brackets)": {"scheduler": "asha", "brackets": "all"},
    "Syne Tune BOHB": {"scheduler": "bohb"},
    "Syne Tune BOHB, first rung at one epoch": {"scheduler": "bohb", "grace_period": "epoch"},
    "Syne Tune median stopping rule (random search)": {"scheduler": "median"},
}
# hpo's strategies replayed beside the anchors (search_efficiency's names): random search (the
# target and the pairing), the baseline its table's "vs TPE+median" column needs, the default.
HPO_STRATEGIES = [RANDOM, "TPE + median (Trainer.hyperparameter_search)", "hpo default"]
DEFAULT = "hpo default"
# Random search against itself: its searches from seed 1000 on, set against those from seed 0
# as any strategy is. What this row shows (compute against random's, the rule) is the table's
# noise at the number of seeds run: a difference within it is not one the table can show.
NOISE = "random, no pruning, other seeds (from 1000)"
NOISE_SEED = 1000


class Scheduler(Protocol):
    """What the replay calls of a Syne Tune scheduler (syne_tune.optimizer.scheduler)."""

    def suggest(self) -> Any: ...
    def on_trial_add(self, trial: Any) -> None: ...
    def on_trial_error(self, trial: Any) -> None: ...
    def on_trial_result(self, trial: Any, result: dict[str, Any]) -> str: ...
    def on_trial_complete(self, trial: Any, result: dict[str, Any]) -> None: ...


@dataclass
class Trial:
    """What a scheduler reads of a trial (syne_tune.backend.trial_status.Trial's fields)."""

    trial_id: int
    config: dict[str, Any]


@dataclass
class Running:
    """A trial of the replay: its stored run, and how many of its evaluations were fed."""

    trial: Trial
    run: Run
    fed: int = 0


def config_space(space: dict[str, ParamSpec]) -> dict[str, Any]:
    """hpo's search space as a Syne Tune config space. Syne Tune has no conditions: a
    conditional parameter is always sampled, and dropped where its `when` does not hold
    (parameters_of). A categorical with one choice is a constant."""
    from syne_tune.config_space import choice, lograndint, loguniform, randint, uniform

    found: dict[str, Any] = {}
    for name, spec in space.items():
        choices = list(spec.choices or [])
        if spec.type == "categorical":
            found[name] = choices[0] if len(choices) == 1 else choice(choices)
        elif spec.type == "int":
            low, high = int(spec.low or 0), int(spec.high or 0)
            found[name] = lograndint(low, high) if spec.log else randint(low, high)
        else:
            low_f, high_f = float(spec.low or 0.0), float(spec.high or 0.0)
            found[name] = loguniform(low_f, high_f) if spec.log else uniform(low_f, high_f)
    return found


def parameters_of(config: dict[str, Any], space: dict[str, ParamSpec]) -> dict[str, Any]:
    """The parameters a suggested configuration trains with: those whose `when` holds, as
    hpo's sampling keeps them (hpo.trial.search_space.sample)."""
    params: dict[str, Any] = {}
    for name in sampling_order(space):
        if applies(space[name], params):
            params[name] = config[name]
    return params


def evaluations_per_run(table: Table) -> int:
    """The grid's full curve length: the schedulers' maximum resource."""
    return max(len(run.evaluations) for runs in table.runs.values() for run in runs)


def build_scheduler(anchor: str, config: Config, table: Table, seed: int) -> Scheduler:
    """The anchor's Syne Tune scheduler on the task (Syne Tune imported here: the replay and its
    tests run without it)."""
    from syne_tune.optimizer.baselines import ASHA, BOHB, RandomSearch
    from syne_tune.optimizer.schedulers.median_stopping_rule import MedianStoppingRule

    settings = ANCHORS[anchor]
    space = config_space(config.search_space)
    metric = config.study.primary_metric
    max_t = evaluations_per_run(table)
    grace = settings.get("grace_period", 1)
    grace = min(max_t, config.training.evals_per_epoch if grace == "epoch" else grace)
    brackets = settings.get("brackets", 1)
    if brackets == "all":  # Syne Tune's count of rungs in its first bracket
        brackets = int(np.log(max_t / grace) / np.log(3) + 1)
    common = {"config_space": space, "do_minimize": False, "random_seed": seed}
    kind = settings["scheduler"]
    if kind == "random":
        return RandomSearch(metrics=[metric], **common)
    if kind == "median":
        inner = RandomSearch(metrics=[metric], **common)
        return MedianStoppingRule(
            inner, time_attr=RESOURCE, metric=metric, random_seed=seed, do_minimize=False
        )
    multi_fidelity = {"metric": metric, "time_attr": RESOURCE, "max_t": max_t, **common}
    if kind == "bohb":
        return BOHB(grace_period=grace, brackets=brackets, **multi_fidelity)
    return ASHA(grace_period=grace, brackets=brackets, **multi_fidelity)


def replay_scheduler(
    scheduler: Scheduler,
    space: dict[str, ParamSpec],
    table: Table,
    metric: str,
    strategy: str,
    seed: int,
    n_trials: int,
) -> Search:
    """`n_trials` entries (trials started or resumed) of `scheduler`'s search replayed on the
    grid `table`, in search_efficiency's accounting."""
    pick = random.Random(seed)
    paused: dict[int, Running] = {}
    samples, seconds, best, pruned = [0.0], [0.0], [-math.inf], 0
    points: list[dict[str, Any]] = []
    for _ in range(n_trials):
        suggestion = scheduler.suggest()
        if suggestion is None:
            raise SystemExit(f"{strategy}: the scheduler suggested nothing after {len(points)}")
        if suggestion.spawn_new_trial_id:
            trial = Trial(len(points), dict(suggestion.config))
            run = pick.choice(table.nearest(parameters_of(trial.config, space)))
            points.append(run.params)
            job = Running(trial, run)
            scheduler.on_trial_add(trial)
        else:  # a paused trial resumed: it goes on from its last fed evaluation
            job = paused.pop(suggestion.checkpoint_trial_id)
        start = job.run.evaluations[job.fed - 1] if job.fed else {"samples": 0, "seconds": 0}
        outcome = advance(scheduler, job, metric)
        end = job.run.evaluations[job.fed - 1] if job.fed else start
        samples.append(samples[-1] + end["samples"] - start["samples"])
        seconds.append(seconds[-1] + end["seconds"] - start["seconds"])
        value = best_of(job.run, metric) if outcome == "completed" else -math.inf
        best.append(max(best[-1], value))
        if outcome == PAUSE:
            paused[job.trial.trial_id] = job
        pruned += outcome in (STOP, "failed")
    pruned += len(paused)  # paused and never resumed: stopped, in effect
    return Search(strategy, seed, samples[1:], seconds[1:], best[1:], pruned, points)


def advance(scheduler: Scheduler, job: Running, metric: str) -> str:
    """Feeds `job`'s stored evaluations from where it stands until the scheduler stops or
    pauses it (STOP, PAUSE) or its curve ends ("completed"; "failed" for a diverged run). The
    last evaluation is reported like the others, then the trial completes whatever the answer:
    its training is done (ASHA answers STOP at its maximum resource)."""
    evaluations = job.run.evaluations
    result: dict[str, Any] = {}
    while job.fed < len(evaluations):
        e = evaluations[job.fed]
        job.fed += 1
        result = {metric: e["metrics"][metric], RESOURCE: job.fed}
        decision = scheduler.on_trial_result(job.trial, result)
        if job.fed < len(evaluations) and decision in (STOP, PAUSE):
            return str(decision)
    if job.run.status == "diverged" or not evaluations:
        scheduler.on_trial_error(job.trial)
        return "failed"
    scheduler.on_trial_complete(job.trial, result)
    return "completed"


def replay_anchor(task: str, anchor: str, seed: int, n_trials: int) -> Search:
    """One search of `anchor` on the task's grid."""
    config, _, table = load_task(task)
    # Syne Tune's baselines warn of their own points_to_evaluate at every construction.
    logging.getLogger("syne_tune").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # pandas, inside Syne Tune
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="statsmodels")
    np.random.seed(seed)  # ASHA draws each trial's bracket from numpy's global generator
    scheduler = build_scheduler(anchor, config, table, seed)
    metric = config.study.primary_metric
    return replay_scheduler(scheduler, config.search_space, table, metric, anchor, seed, n_trials)


def _replay_any(job: tuple[str, str, int, int]) -> Search:
    task, strategy, seed, n_trials = job
    if strategy in ANCHORS:
        return replay_anchor(task, strategy, seed, n_trials)
    if strategy == NOISE:
        other = _replay((task, RANDOM, NOISE_SEED + seed, n_trials))
        return dataclasses.replace(other, strategy=NOISE, seed=seed)
    return _replay(job)


def against_default(by_task: dict[str, dict[str, Verdict]]) -> list[str]:
    """Issue 47's rule: per task, hpo's default against the best anchor that keeps the rule
    (least compute to the target); the worst task decides."""
    lines = [
        "| task | hpo default: compute vs random | best anchor (keeps the rule) | its compute "
        "vs random | default / best anchor | default matches or beats it |",
        "|---|---|---|---|---|---|",
    ]
    for task, judged in by_task.items():
        default = judged[DEFAULT]
        kept = [v for s, v in judged.items() if s in ANCHORS and v.meets_rule]
        if not kept:
            kept_too = "yes" if default.meets_rule else "no"
            lines.append(
                f"| {task} | {_times(default.ratio)} | none keeps the rule | - | - | {kept_too} |"
            )
            continue
        anchor = min(kept, key=lambda v: v.ratio)
        share = default.ratio / anchor.ratio if math.isfinite(anchor.ratio) else math.nan
        beats = default.meets_rule and default.ratio <= anchor.ratio
        lines.append(
            f"| {task} | {_times(default.ratio)} | {anchor.strategy} | {_times(anchor.ratio)} "
            f"| {share:.2f}x | {'yes' if beats else 'no'} |"
        )
    return lines


def against_default_per_anchor(by_task: dict[str, dict[str, Verdict]]) -> list[str]:
    """Each anchor's compute to the target per task against hpo's default's (below 1: the
    anchor needs less); "(rule: no)": the anchor ends worse than random search there."""
    tasks = list(by_task)
    lines = [
        f"| anchor | {' | '.join(tasks)} | tasks where it needs less than hpo's default |",
        "|---" * (len(tasks) + 2) + "|",
    ]
    for anchor in (a for a in ANCHORS if all(a in by_task[t] for t in tasks)):
        cells, fewer = [], []
        for task in tasks:
            ours, theirs = by_task[task][anchor], by_task[task][DEFAULT]
            share = ours.ratio / theirs.ratio if math.isfinite(theirs.ratio) else math.nan
            cells.append(
                (f"{share:.2f}x" if math.isfinite(share) else _times(ours.ratio))
                + ("" if ours.meets_rule else " (rule: no)")
            )
            if ours.meets_rule and ours.ratio < theirs.ratio:
                fewer.append(task)
        lines.append(f"| {anchor} | {' | '.join(cells)} | {', '.join(fewer) or '-'} |")
    return lines


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "not reached"


def replay_all(jobs: list[tuple[str, str, int, int]], processes: int) -> Iterable[Search]:
    if processes <= 1:
        yield from map(_replay_any, jobs)
        return
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        yield from pool.imap_unordered(_replay_any, jobs, chunksize=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", choices=sorted(TASKS), action="append")
    parser.add_argument("--seeds", type=int, default=20, help="searches per strategy")
    parser.add_argument("--budget", type=float, default=3.0, help="trials: this x n_trials")
    parser.add_argument("--anchor", action="append", choices=sorted(ANCHORS))
    parser.add_argument(
        "--hpo",
        action="append",
        choices=sorted(STRATEGIES),
        help=f"hpo's strategies beside the anchors (random search and the default always; "
        f"without --hpo: {', '.join(HPO_STRATEGIES)})",
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes (the machine is shared)")
    parser.add_argument("--cache", type=Path, help="as search_efficiency.py's --cache")
    args = parser.parse_args()
    if importlib.util.find_spec("syne_tune") is None:
        print(
            "search_anchors.py needs Syne Tune, not installed; pip install --no-deps "
            "'syne-tune>=0.16,<0.17' && pip install 'statsmodels>=0.14' (the bench extra)",
            file=sys.stderr,
        )
        sys.exit(2)
    ours = [RANDOM, DEFAULT, *(s for s in args.hpo or HPO_STRATEGIES if s not in (RANDOM, DEFAULT))]
    strategies = [*ours, NOISE, *(args.anchor or ANCHORS)]
    by_task = {}
    for task in args.task or [t for t in TASKS if data_path(t).is_file()]:
        config, _, _ = load_task(task)
        n_trials = config.study.n_trials or 20
        total = math.ceil(args.budget * n_trials)
        jobs = [(task, s, seed, total) for s in strategies for seed in range(args.seeds)]
        started = time.perf_counter()
        searches, replayed = cached_searches(
            task, jobs, args.cache, lambda todo: replay_all(todo, args.jobs)
        )
        print("\n".join(report(task, searches, n_trials, "samples")))
        spent = time.perf_counter() - started
        print(f"({replayed} searches of {total} trials replayed in {spent:.0f} s)\n")
        by_task[task] = verdicts(searches, n_trials, "samples")
    print("\n".join(choose(by_task)))
    print()
    print("\n".join(against_default(by_task)))
    print()
    print("\n".join(against_default_per_anchor(by_task)))
    ratios = [by_task[t][DEFAULT].ratio for t in by_task]
    print(f"\nhpo default on the median task: {_times(statistics.median(ratios))} (goal 0.50x)")


if __name__ == "__main__":
    main()
