"""Search efficiency: how much compute each search strategy spends to find a good configuration.

Strategies are built by hpo from a config (the sampler and pruner that `hpo run` would build)
and replayed against a table of real runs of hpo's trainer (bench/search_grid.py made it: every
grid point of the task's search space, several training seeds, full learning curves). Each
replayed trial samples its parameters through hpo's search space code, snaps them to the
nearest grid point (log scale for log parameters), takes one of that point's training seeds,
and reports the stored evaluations one by one through hpo's own reporter, which asks the pruner
after each one, as a real trial does. Many seeds per strategy cost seconds instead of days.

Compute is samples trained (optimizer steps x effective batch, pruned and diverged runs
included) and device-seconds (the stored runs' clocks). The target is the median over seeds of
random search's best after `n_trials` trials, without pruning. Per strategy: the median compute
to reach the target (min and max over seeds that reach it), how many seeds reach it within
`--budget` x n_trials trials, the best value at a third of random search's compute, and the best
after n_trials trials.

Issue 29's rule, per task: at equal trials (n_trials) a strategy ends no worse than random
search: its median best at least random search's, and in at most 10% of seeds worse by more than
0.005, its seeds set against random search's rank by rank (its k-th worst against random
search's k-th worst: a comparison of the two spreads; seed i against seed i compares two
independent draws, shown too). The default is chosen by its worst task: of
the strategies that keep the rule on every task, the least compute to the target on the task
where it needs the most (against random search's); the last table says which.

Run: .venv/bin/python bench/search_efficiency.py [--task nli-scratch|demo|lora|ner|regression]
     [--seeds 20] [--cache replays.jsonl]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import multiprocessing
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.study import StudyDirection

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from curve_pruner import RunningMedianPruner  # noqa: E402
from search_grid import TASKS, data_path  # noqa: E402

from hpo.config.loader import parse_config  # noqa: E402
from hpo.config.schema import Config, ParamSpec, has_conditions  # noqa: E402
from hpo.study.join import enqueue  # noqa: E402
from hpo.study.sampling import build_pruner, build_sampler  # noqa: E402
from hpo.trainer.loop import Evaluation  # noqa: E402
from hpo.trial.search_space import sample  # noqa: E402
from hpo.trial.training import pruning_reporter  # noqa: E402

# Each strategy: the study.sampler and study.pruner sections of a config (a seed is added).
# "hpo default" leaves both out: whatever hpo's config defaults are.
STRATEGIES: dict[str, dict[str, Any]] = {
    "random, no pruning": {"sampler": {"type": "random"}, "pruner": {"type": "none"}},
    # transformers' Trainer.hyperparameter_search(backend="optuna"): optuna.create_study()'s
    # TPESampler() and MedianPruner(), asked at every evaluation.
    "TPE + median (Trainer.hyperparameter_search)": {
        "sampler": {
            "type": "tpe",
            "n_startup_trials": 10,
            "multivariate": False,
            "constant_liar": False,
        },
        "pruner": {"type": "median", "n_startup_trials": 5, "n_warmup_steps": 0},
    },
    "TPE + median (hpo's default before this benchmark)": {
        "sampler": {"type": "tpe", "multivariate": False},
        "pruner": {"type": "median", "n_startup_trials": 3, "n_warmup_steps": 1},
    },
    # Since issue 29: TPE (multivariate) + the median rule, margin 0.02, from evaluation 2.
    "hpo default": {},
    "TPE multivariate + ASHA (hpo's default before issue 29)": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "successive_halving"},
    },
    # With conditions (`when`) hpo turns TPE's group on; this is the default without it:
    # multivariate TPE then samples a conditional parameter (LoRA's rank) on its own.
    "hpo default, TPE not grouped": {
        "sampler": {"type": "tpe", "multivariate": True, "group": False}
    },
    "TPE multivariate, grouped + Hyperband": {
        "sampler": {"type": "tpe", "multivariate": True, "group": True},
        "pruner": {"type": "hyperband"},
    },
    "TPE + successive halving (ASHA)": {
        "sampler": {"type": "tpe", "multivariate": False},
        "pruner": {"type": "successive_halving"},
    },
    "GP + median": {"sampler": {"type": "gp"}, "pruner": {"type": "median"}},
    "TPE multivariate, no pruning": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "none"},
    },
    # A fine-tuning recipe from the BERT paper's range, tried first (warm start). On a model
    # trained from scratch it is a poor guess: what a wrong recipe costs.
    "hpo default + BERT recipe enqueued": {
        "enqueue": {
            "learning_rate": 3e-5,
            "effective_batch_size": 32,
            "warmup_ratio": 0.1,
            "weight_decay": 0.01,
        },
    },
    "TPE + median, margin 0.01": {
        "sampler": {"type": "tpe", "multivariate": False},
        "pruner": {"type": "median", "margin": 0.01},
    },
    "TPE multivariate + median, margin 0.01": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "median", "margin": 0.01},
    },
    "TPE multivariate + median, margin 0.02, 2 warmup evaluations": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "median", "margin": 0.02, "n_warmup_steps": 2},
    },
    "TPE multivariate + Hyperband": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "hyperband"},
    },
    "TPE multivariate, 5 startup trials + ASHA": {
        "sampler": {"type": "tpe", "multivariate": True, "n_startup_trials": 5},
        "pruner": {"type": "successive_halving"},
    },
    "TPE, 5 startup trials + ASHA": {
        "sampler": {"type": "tpe", "multivariate": False, "n_startup_trials": 5},
        "pruner": {"type": "successive_halving"},
    },
    "TPE multivariate, 5 startup trials + median, margin 0.02, 2 warmup evaluations": {
        "sampler": {"type": "tpe", "multivariate": True, "n_startup_trials": 5},
        "pruner": {"type": "median", "margin": 0.02, "n_warmup_steps": 2},
    },
    "TPE multivariate, grouped, 5 startup trials + Hyperband": {
        "sampler": {"type": "tpe", "multivariate": True, "group": True, "n_startup_trials": 5},
        "pruner": {"type": "hyperband"},
    },
    "TPE multivariate + ASHA, first rung at evaluation 2": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "successive_halving", "min_resource": 2},
    },
    "TPE multivariate + ASHA, reduction factor 2": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "successive_halving", "reduction_factor": 2},
    },
    "random + ASHA": {"sampler": {"type": "random"}, "pruner": {"type": "successive_halving"}},
    "TPE multivariate + median, patience 1": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "median", "patience": 1, "min_delta": 0.01},
    },
    # Issue 29's candidates: pruning that waits for the curves of a task to leave chance.
    # "epoch": the task's evaluations per epoch (training.evals_per_epoch), so the first rung is
    # at the end of the first epoch, not at its first evaluation.
    "TPE multivariate + ASHA, first rung at one epoch": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "successive_halving", "min_resource": "epoch"},
    },
    "TPE multivariate + ASHA, after 5 complete trials": {
        "sampler": {"type": "tpe", "multivariate": True},
        "after_complete": 5,
    },
    "TPE multivariate + ASHA, decision held over two evaluations": {
        "sampler": {"type": "tpe", "multivariate": True},
        "held": 0.01,
    },
    "TPE multivariate + ASHA, first rung at one epoch, after 5 complete trials": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "successive_halving", "min_resource": "epoch"},
        "after_complete": 5,
    },
    "TPE multivariate + ASHA, first rung at one epoch, held over two evaluations": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "successive_halving", "min_resource": "epoch"},
        "held": 0.01,
    },
    "TPE multivariate + median, margin 0.02, first at one epoch": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "median", "margin": 0.02, "n_warmup_steps": "epoch"},
    },
    # Issue 47: the default's median rule (margin 0.02, from evaluation 2) judged on the
    # running average of each curve (curve_pruner.py), as Syne Tune's median stopping rule is.
    "TPE multivariate + median on the running average": {
        "sampler": {"type": "tpe", "multivariate": True},
        "curve": "running_mean",
    },
    "TPE multivariate + median on the running average, first at one epoch": {
        "sampler": {"type": "tpe", "multivariate": True},
        "pruner": {"type": "median", "n_warmup_steps": "epoch"},
        "curve": "running_mean",
    },
}


class AfterComplete(optuna.pruners.BasePruner):
    """Prunes nothing until the study holds `trials` complete trials, then asks `inner`: the
    first trials' curves show what the task's curves look like before any is judged."""

    def __init__(self, inner: optuna.pruners.BasePruner, trials: int) -> None:
        self.inner = inner
        self.trials = trials

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        states = (optuna.trial.TrialState.COMPLETE,)
        if len(study.get_trials(deepcopy=False, states=states)) < self.trials:
            return False
        return self.inner.prune(study, trial)


class Held(optuna.pruners.BasePruner):
    """`inner`'s decision to prune must hold at the next evaluation: a trial it would prune
    goes on one more evaluation and is pruned then unless its value moved past its value at
    the decision by more than `min_delta` (its metric jumped: a late starter). A decision on
    one noisy evaluation, or on a plateau just before the jump, is not final.

    The state is the pruner's own (one trial runs in one process, as in the replay)."""

    def __init__(self, inner: optuna.pruners.BasePruner, min_delta: float) -> None:
        self.inner = inner
        self.min_delta = min_delta
        self.pending: dict[int, float] = {}  # trial number: its value when inner said prune

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        value = trial.intermediate_values[step]
        if trial.number in self.pending:
            before = self.pending.pop(trial.number)
            maximize = study.direction == StudyDirection.MAXIMIZE
            if not (value - before if maximize else before - value) > self.min_delta:  # NaN too
                return True
        if self.inner.prune(study, trial):
            self.pending[trial.number] = value
        return False


@dataclass
class Run:
    """One stored training run: a grid point and seed, its evaluations and status."""

    params: dict[str, Any]
    seed: int
    status: str
    evaluations: list[dict[str, Any]]


class Table:
    """The task's stored runs, looked up by the nearest grid point. A parameter whose `when`
    does not hold is absent from a run's point, as from a trial's parameters."""

    def __init__(self, runs: list[Run], space: dict[str, ParamSpec]) -> None:
        self.space = space
        self.runs: dict[tuple[tuple[str, Any], ...], list[Run]] = defaultdict(list)
        for run in runs:
            self.runs[self._key(run.params)].append(run)
        # Per branch (which parameters a point has, and its categorical values): the values of
        # each number there, to snap to.
        self.axes: dict[tuple[Any, ...], dict[str, set[Any]]] = {}
        for key in self.runs:
            point = dict(key)
            axes = self.axes.setdefault(self._branch(point), {})
            for name, value in point.items():
                axes.setdefault(name, set()).add(value)

    def _key(self, params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple((name, params[name]) for name in self.space if name in params)

    def _branch(self, params: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(
            (name, params[name] if self.space[name].type == "categorical" else None)
            for name in self.space
            if name in params
        )

    def nearest(self, params: dict[str, Any]) -> list[Run]:
        """The runs of the grid point with the trial's parameters (no more: a trial without
        a rank meets the points without one), its categorical values, and each number's
        nearest value among those points (in log space for log parameters)."""
        axes = self.axes.get(self._branch(params), {})
        point = {}
        for name in (n for n in self.space if n in params):
            spec, value = self.space[name], params[name]
            if spec.type == "categorical" or name not in axes:
                point[name] = value
                continue
            scale = math.log if spec.log else float
            point[name] = min(axes[name], key=lambda a: abs(scale(a) - scale(value)))  # noqa: B023
        runs = self.runs.get(self._key(point))
        if not runs:
            raise SystemExit(f"the grid has no run at {point}; finish bench/search_grid.py")
        return runs

    def values(self, metric: str) -> list[float]:
        """Every run's best value: how rare good configurations are."""
        return [best_of(run, metric) for runs in self.runs.values() for run in runs]


def best_of(run: Run, metric: str) -> float:
    values = [e["metrics"][metric] for e in run.evaluations]
    return max(values, default=0.0)


@functools.cache
def load_task(task: str) -> tuple[Config, dict[str, Any], Table]:
    """The task's config, its parsed YAML (copied before any change: see strategy_raw) and its
    grid; read once per process, not once per replayed search."""
    source = Path(TASKS[task]["config"])
    raw = yaml.safe_load(source.read_text(encoding="utf-8"))
    config = parse_config(raw, source.parent, str(source))
    path = data_path(task)
    if not path.is_file():
        raise SystemExit(f"{path}: no grid; run bench/search_grid.py --task {task}")
    lines = path.read_text(encoding="utf-8").splitlines()
    fields = ("params", "seed", "status", "evaluations")
    runs = [Run(**{k: json.loads(line)[k] for k in fields}) for line in lines if line.strip()]
    return config, raw, Table(runs, config.search_space)


def strategy_raw(raw: dict[str, Any], strategy: str, seed: int) -> dict[str, Any]:
    """The task's config (as parsed YAML) with the strategy's sampler, pruner and enqueued
    configurations in place of the task's."""
    raw = json.loads(json.dumps(raw))
    study = raw.setdefault("study", {})
    study.pop("sampler", None)
    study.pop("pruner", None)
    settings = STRATEGIES[strategy]
    study["sampler"] = {**settings.get("sampler", {}), "seed": seed}
    if "pruner" in settings:
        per_epoch = raw.get("training", {}).get("evals_per_epoch", 1)
        study["pruner"] = {
            k: per_epoch if v == "epoch" else v for k, v in settings["pruner"].items()
        }
    if "enqueue" in settings:  # the recipe's values of the task's parameters
        recipe = {k: v for k, v in settings["enqueue"].items() if k in raw["search_space"]}
        study["enqueue"] = [recipe]
    return raw


def strategy_config(raw: dict[str, Any], source: Path, strategy: str, seed: int) -> Config:
    """What `hpo run` would use for the strategy on the task."""
    return parse_config(strategy_raw(raw, strategy, seed), source.parent, f"{source} ({strategy})")


@dataclass
class Search:
    """One replayed study: per trial, the compute it used and the best value so far."""

    strategy: str
    seed: int
    samples: list[float]  # cumulative, after each trial
    seconds: list[float]
    best: list[float]  # best value so far, after each trial
    pruned: int
    # The grid point each trial was snapped to (not kept for real studies).
    points: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def replay(task: str, strategy: str, seed: int, n_trials: int) -> Search:
    source = Path(TASKS[task]["config"])
    _, raw, table = load_task(task)
    config = strategy_config(raw, source, strategy, seed)
    return replay_config(task, config, table, strategy, seed, n_trials)


def replay_config(
    task: str, config: Config, table: Table, strategy: str, seed: int, n_trials: int
) -> Search:
    """`n_trials` of `config`'s search (its queued trials first) replayed on the task's grid
    `table`, with the strategy's pruner wrappers."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    metric = config.study.primary_metric
    if config.study.resolved_direction != "maximize":
        raise SystemExit(
            f"{task}: the replay takes the best value as the largest; give the "
            "task a metric to maximize"
        )
    study = optuna.create_study(
        direction="maximize",
        sampler=build_sampler(config.study.sampler, 0, config.search_space),
        pruner=strategy_pruner(config, strategy),
    )
    for params in config.study.enqueue:
        enqueue(study, params)
    pick = random.Random(seed)
    spent = {"samples": 0.0, "seconds": 0.0}  # by the running trial, up to its last evaluation
    samples, seconds, best, pruned = [0.0], [0.0], [-math.inf], 0
    points: list[dict[str, Any]] = []

    def objective(trial: optuna.Trial) -> float:
        run = pick.choice(table.nearest(sample(trial, config.search_space)))
        points.append(run.params)
        report = pruning_reporter(trial, metric)
        for e in run.evaluations:
            spent.update(samples=e["samples"], seconds=e["seconds"])
            evaluation = Evaluation(e["index"], 0.0, e["step"], e["metrics"], None)
            reason = report(evaluation)
            if reason is not None:
                raise optuna.TrialPruned(reason)
        if run.status == "diverged" or not run.evaluations:
            raise optuna.TrialPruned("diverged")
        return best_of(run, metric)

    for _ in range(n_trials):
        spent.update(samples=0.0, seconds=0.0)
        study.optimize(objective, n_trials=1)
        trial = study.trials[-1]
        pruned += trial.state == optuna.trial.TrialState.PRUNED
        value = trial.value if trial.value is not None else -math.inf
        best.append(max(value, best[-1]))
        samples.append(samples[-1] + spent["samples"])
        seconds.append(seconds[-1] + spent["seconds"])
    samples, seconds, best = samples[1:], seconds[1:], best[1:]
    return Search(strategy, seed, samples, seconds, best, pruned, points)


def strategy_pruner(config: Config, strategy: str) -> optuna.pruners.BasePruner:
    """hpo's pruner for the config, inside the strategy's wrappers (the bench's own)."""
    settings = STRATEGIES[strategy]
    pruner = build_pruner(config.study.pruner)
    if settings.get("curve") == "running_mean":  # the config's median rule on running averages
        cfg = config.study.pruner
        pruner = RunningMedianPruner(cfg.n_startup_trials, cfg.n_warmup_steps, cfg.margin)
    if "held" in settings:
        pruner = Held(pruner, settings["held"])
    if "after_complete" in settings:
        pruner = AfterComplete(pruner, settings["after_complete"])
    return pruner


def _replay(job: tuple[str, str, int, int]) -> Search:
    return replay(*job)


def real_search(task: str, strategy: str, seed: int, n_trials: int, folder: Path) -> Search:
    """The strategy as users run it: `hpo run` on the task's config, real training."""
    source = Path(TASKS[task]["config"])
    task_config, raw, _ = load_task(task)
    task_batch = task_config.training.effective_batch_size  # where the space does not search it
    raw = strategy_raw(raw, strategy, seed)
    raw["study"]["n_trials"] = n_trials
    data = raw["data"]
    for key in ("train_file", "eval_file"):
        data[key] = str((source.parent / data[key]).resolve())
    run = folder / f"{strategy.split()[0]}-{seed}-{abs(hash(strategy)) % 10**6}"
    run.mkdir(parents=True)
    config = run / "config.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    url = f"sqlite:///{run / 'study.db'}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpo",
            "run",
            "--study",
            "s",
            "--config",
            str(config),
            "--storage",
            url,
            "--quiet",
        ],
        cwd=run,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{strategy}, seed {seed}: hpo run failed:\n{done.stderr[-3000:]}")
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    samples: list[float] = []
    seconds: list[float] = []
    best: list[float] = []
    pruned = 0
    for trial in sorted(trials, key=lambda t: t.number):
        attrs = trial.user_attrs
        steps = attrs.get("optimizer_steps", 0)
        batch = trial.params.get("effective_batch_size", task_batch)
        used = steps * batch
        samples.append((samples[-1] if samples else 0.0) + used)
        spent = attrs.get("train_s", 0.0) + attrs.get("eval_s", 0.0)
        seconds.append((seconds[-1] if seconds else 0.0) + spent)
        pruned += trial.state == optuna.trial.TrialState.PRUNED
        value = trial.value if trial.value is not None else -math.inf
        best.append(max(value, best[-1] if best else -math.inf))
    return Search(strategy, seed, samples, seconds, best, pruned)


def compute_to_reach(search: Search, target: float, unit: str) -> float | None:
    compute = search.samples if unit == "samples" else search.seconds
    for used, best in zip(compute, search.best, strict=True):
        if best >= target:
            return used
    return None


def best_at(search: Search, compute: float, unit: str) -> float:
    used = search.samples if unit == "samples" else search.seconds
    i = bisect.bisect_right(used, compute)
    return search.best[i - 1] if i else math.nan


# Issue 29's rule, per task: at equal trials a strategy never ends worse than random search:
# its median best after n_trials is at least random search's, and in at most this share of seeds
# is it worse than random search by more than TOLERANCE, the seeds of each sorted and set against
# each other rank by rank. Seed i against random search's seed i would compare independent
# draws: random search against a copy of itself with other seeds would fail the rule.
TOLERANCE = 0.005
WORSE_SHARE = 0.10
RANDOM = "random, no pruning"


@dataclass
class Verdict:
    """One strategy on one task, against random search."""

    strategy: str
    ratio: float  # median compute to the target / random search's (inf: not reached)
    reached: int  # seeds that reach the target
    seeds: int
    final: float  # median best after n_trials
    random_final: float
    worse: float  # share of ranks worse than random search's same rank by > TOLERANCE
    worse_by_seed: float  # share of seeds worse than random search's same seed by > TOLERANCE

    @property
    def meets_rule(self) -> bool:
        return self.final >= self.random_final and self.worse <= WORSE_SHARE


def verdicts(searches: list[Search], n_trials: int, unit: str) -> dict[str, Verdict]:
    """Per strategy: compute to the target against random search's, and the rule at equal
    trials. The target is random search's median best after n_trials."""
    by_strategy = _by_strategy(searches)
    randoms = {s.seed: s for s in by_strategy[RANDOM]}
    target = statistics.median(s.best[n_trials - 1] for s in randoms.values())
    medians: dict[str, float] = {}
    reaching: dict[str, int] = {}
    for strategy, runs in by_strategy.items():
        reached = [c for s in runs if (c := compute_to_reach(s, target, unit)) is not None]
        # A seed that never reaches the target counts as infinite compute in the median.
        missed = [math.inf] * (len(runs) - len(reached))
        medians[strategy] = statistics.median(reached + missed)
        reaching[strategy] = len(reached)
    found = {}
    for strategy, runs in by_strategy.items():
        paired = [
            (s.best[n_trials - 1], randoms[s.seed].best[n_trials - 1])
            for s in runs
            if s.seed in randoms
        ]
        ranked = zip(sorted(a for a, _ in paired), sorted(b for _, b in paired), strict=True)
        worse = sum(ours < theirs - TOLERANCE for ours, theirs in ranked)
        by_seed = sum(ours < theirs - TOLERANCE for ours, theirs in paired)
        median = medians[strategy]
        ratio = median / medians[RANDOM] if math.isfinite(median) else math.inf
        found[strategy] = Verdict(
            strategy,
            ratio,
            reaching[strategy],
            len(runs),
            statistics.median(s.best[n_trials - 1] for s in runs),
            target,
            worse / len(paired) if paired else math.nan,
            by_seed / len(paired) if paired else math.nan,
        )
    return found


def _by_strategy(searches: list[Search]) -> dict[str, list[Search]]:
    by_strategy: dict[str, list[Search]] = defaultdict(list)
    for search in searches:
        by_strategy[search.strategy].append(search)
    return by_strategy


def report(task: str, searches: list[Search], n_trials: int, unit: str) -> list[str]:
    by_strategy = _by_strategy(searches)
    random_runs = by_strategy[RANDOM]
    judged = verdicts(searches, n_trials, unit)
    target = statistics.median(s.best[n_trials - 1] for s in random_runs)
    random_compute = statistics.median(
        (s.samples if unit == "samples" else s.seconds)[n_trials - 1] for s in random_runs
    )
    baseline = {}
    rows = []
    for strategy, runs in by_strategy.items():
        reached = [c for s in runs if (c := compute_to_reach(s, target, unit)) is not None]
        median = statistics.median(sorted(reached) + [math.inf] * (len(runs) - len(reached)))
        baseline[strategy] = median
        at_third = statistics.median(best_at(s, random_compute / 3, unit) for s in runs)
        pruned = statistics.mean(s.pruned / len(s.best) for s in runs)
        rows.append((strategy, median, reached, len(runs), at_third, pruned))
    scale = 1e6 if unit == "samples" else 3600.0
    label = "M samples" if unit == "samples" else "device-hours"
    lines = [
        f"task {task}: target {target:.4f} (median best of random search after {n_trials} "
        f"trials); random search's {n_trials} trials use {random_compute / scale:.3f} {label}",
        "",
        f"| strategy | compute to target ({label}), median [min, max] | vs random | vs TPE+median "
        f"| seeds reaching | best at 1/3 random's compute | best after {n_trials} trials "
        f"| seeds worse than random by > {TOLERANCE}: rank by rank (seed by seed) | rule "
        "| trials pruned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    tpe_median = baseline.get("TPE + median (Trainer.hyperparameter_search)", math.inf)
    for strategy, median, reached, count, at_third, pruned in rows:
        spread = f"[{min(reached) / scale:.3f}, {max(reached) / scale:.3f}]" if reached else ""
        shown = (
            f"{median / scale:.3f} {spread}" if math.isfinite(median) else f"not reached {spread}"
        )
        verdict = judged[strategy]
        lines.append(
            f"| {strategy} | {shown} | {_ratio(median, baseline[RANDOM])} "
            f"| {_ratio(median, tpe_median)} | {len(reached)}/{count} | {at_third:.4f} "
            f"| {verdict.final:.4f} | {verdict.worse:.0%} ({verdict.worse_by_seed:.0%}) "
            f"| {'yes' if verdict.meets_rule else 'no'} | {pruned:.0%} |"
        )
    return lines


def choose(by_task: dict[str, dict[str, Verdict]]) -> list[str]:
    """Every strategy on every task, and the default by its worst task: among the strategies
    that keep the rule on every task, the least worst-task compute ratio against random
    search; if none keeps it, the one that misses it on fewest tasks, and by how much."""
    tasks = list(by_task)
    strategies = [
        s
        for s in next(iter(by_task.values()))
        if s != RANDOM and all(s in by_task[t] for t in tasks)
    ]

    def cell(verdict: Verdict) -> str:
        ratio = f"{verdict.ratio:.2f}x" if math.isfinite(verdict.ratio) else "not reached"
        return ratio + ("" if verdict.meets_rule else " (rule: no)")

    def worst(strategy: str) -> float:
        return max(by_task[t][strategy].ratio for t in tasks)

    def median_task(strategy: str) -> float:
        return statistics.median(by_task[t][strategy].ratio for t in tasks)

    def misses(strategy: str) -> int:
        return sum(not by_task[t][strategy].meets_rule for t in tasks)

    ranked = sorted(strategies, key=lambda s: (misses(s), worst(s), median_task(s)))
    lines = [
        "compute to the target against random search's, per task (median over seeds); "
        "(rule: no): the strategy ends worse than random search at equal trials on that task",
        "",
        f"| strategy | {' | '.join(tasks)} | worst task | median task | tasks where the rule "
        "fails |",
        "|---" * (len(tasks) + 4) + "|",
    ]
    for strategy in ranked:
        cells = " | ".join(cell(by_task[t][strategy]) for t in tasks)
        failing = [t for t in tasks if not by_task[t][strategy].meets_rule]
        summary = f"{_times(worst(strategy))} | {_times(median_task(strategy))}"
        lines.append(f"| {strategy} | {cells} | {summary} | {', '.join(failing) or '-'} |")
    if not ranked:
        return lines
    best = ranked[0]
    lines.append("")
    if misses(best) == 0:
        lines.append(
            f"chosen by the worst-task rule: {best} (worst task {_times(worst(best))}, "
            f"median task {_times(median_task(best))} of random search's compute)"
        )
    else:
        shortfalls = []
        for t in tasks:
            v = by_task[t][best]
            if not v.meets_rule:
                shortfalls.append(
                    f"{t}: median best {v.final:.4f} against random's "
                    f"{v.random_final:.4f}, {v.worse:.0%} of seeds worse by > "
                    f"{TOLERANCE}"
                )
        lines.append(
            f"no strategy keeps the rule on every task; the nearest, {best}, misses it "
            f"on {misses(best)} ({'; '.join(shortfalls)})"
        )
    return lines


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "not reached"


def _ratio(a: float, b: float) -> str:
    if not (math.isfinite(a) and math.isfinite(b)):
        return "-"
    return f"{a / b:.2f}x"


def rarity(task: str) -> str:
    config, _, table = load_task(task)
    values = table.values(config.study.primary_metric)
    top = max(values)
    near = sum(v >= top - 0.01 for v in values) / len(values)
    return (
        f"grid: {len(values)} runs; best {top:.4f}; within one point of it: {near:.0%} of "
        f"runs; median run {statistics.median(values):.4f}"
    )


def branches(task: str) -> str:
    """For a space with conditions: the best run with each value of a parameter that a `when`
    names (LoRA on or off), and where it is."""
    config, _, table = load_task(task)
    metric = config.study.primary_metric
    parts = []
    for name in condition_names(config.search_space):
        for value in config.search_space[name].choices or []:
            runs = [
                run
                for key, point_runs in table.runs.items()
                if (name, value) in key
                for run in point_runs
            ]
            top = max(runs, key=lambda run: best_of(run, metric))
            where = ", ".join(f"{k} {v}" for k, v in top.params.items() if k != name)
            parts.append(f"{name} {value}: {best_of(top, metric):.4f} ({where})")
    return "best run with " + "; ".join(parts)


def condition_names(space: dict[str, ParamSpec]) -> list[str]:
    """The parameters some `when` names, in the space's order."""
    named = {name for spec in space.values() for name in spec.when or {}}
    return [name for name in space if name in named]


def condition_use(task: str, searches: list[Search]) -> list[str]:
    """For a space with conditions: per strategy, how often its trials took each value of a
    parameter that a `when` names, and each value of a conditional parameter among the trials
    where it applied (every trial of every search)."""
    config, _, _ = load_task(task)
    space = config.search_space
    columns = [*condition_names(space), *(name for name, spec in space.items() if spec.when)]
    if not columns:
        return []
    lines = [
        "| strategy | " + " | ".join(f"{name}: share of trials" for name in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    by_strategy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for search in searches:
        by_strategy[search.strategy].extend(search.points)
    for strategy, points in by_strategy.items():
        cells = []
        for name in columns:
            counts = Counter(point[name] for point in points if name in point)
            total = sum(counts.values())
            cells.append(
                ", ".join(
                    f"{value}: {count / total:.0%}" for value, count in sorted(counts.items())
                )
            )
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", choices=sorted(TASKS), action="append")
    parser.add_argument("--seeds", type=int, default=20, help="searches per strategy")
    parser.add_argument("--budget", type=float, default=3.0, help="trials: this x n_trials")
    parser.add_argument("--unit", choices=["samples", "seconds"], default="samples")
    parser.add_argument("--strategy", action="append", choices=sorted(STRATEGIES))
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    parser.add_argument(
        "--cache",
        type=Path,
        help="JSON Lines of replayed searches: those in it (same task, strategy, seed and "
        "trials) are read, not replayed again; new ones are added (a replay is deterministic)",
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help="run real studies with `hpo run` instead of replaying the grid (slow: use few "
        "--seeds and --strategy; --budget 1)",
    )
    args = parser.parse_args()
    if args.real:
        return real_runs(args)
    strategies = args.strategy or list(STRATEGIES)
    for required in (RANDOM, "TPE + median (Trainer.hyperparameter_search)"):
        if required not in strategies:
            strategies.insert(0, required)
    by_task = {}
    for task in args.task or [t for t in TASKS if data_path(t).is_file()]:
        config, _, _ = load_task(task)
        n_trials = config.study.n_trials or 20
        total = math.ceil(args.budget * n_trials)
        jobs = [(task, s, seed, total) for s in strategies for seed in range(args.seeds)]
        started = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            searches, _ = cached_searches(
                task, jobs, args.cache, lambda todo: pool.imap_unordered(_replay, todo, chunksize=1)
            )
        print(rarity(task))
        if has_conditions(config.search_space):
            print(branches(task))
        print("\n".join(report(task, searches, n_trials, args.unit)))
        print("\n".join(condition_use(task, searches)))
        print(
            f"({len(jobs)} searches of {total} trials in {time.perf_counter() - started:.0f} s)\n"
        )
        by_task[task] = verdicts(searches, n_trials, args.unit)
    print("\n".join(choose(by_task)))


Job = tuple[str, str, int, int]
"""A replay: task, strategy, seed, trials."""


def cached_searches(
    task: str,
    jobs: list[Job],
    cache: Path | None,
    replay_jobs: Callable[[list[Job]], Iterable[Search]],
) -> tuple[list[Search], int]:
    """The searches of `jobs` (all of `task`), in their order: those `cache` holds read back,
    the others replayed by `replay_jobs` and appended to it; and how many were replayed."""
    cached = read_cache(cache, task, jobs[0][3] if jobs else 0)
    todo = [job for job in jobs if job[1:3] not in cached]
    for search in replay_jobs(todo):
        cached[search.strategy, search.seed] = search
        if cache is not None:
            with cache.open("a", encoding="utf-8") as out:
                out.write(json.dumps({"task": task, **dataclasses.asdict(search)}) + "\n")
    return [cached[job[1:3]] for job in jobs], len(todo)


def read_cache(path: Path | None, task: str, total: int) -> dict[tuple[str, int], Search]:
    """The searches of `task` with `total` trials that the cache holds, by strategy and seed."""
    if path is None or not path.is_file():
        return {}
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.pop("task", None) == task and len(record["best"]) == total:
            search = Search(**record)
            found[search.strategy, search.seed] = search
    return found


def real_path(task: str) -> Path:
    """Finished real studies of a task, one JSON line each, kept so that runs resume."""
    return REPO / "bench" / "data" / f"search-{task}-real.jsonl"


def real_runs(args: argparse.Namespace) -> None:
    """Real studies (each finished one saved at once, so a stopped run resumes), then the
    same table as the replay's, and the replay's spread for the same strategies beside them."""
    strategies = args.strategy or ["random, no pruning", "hpo default"]
    for task in args.task or ["nli-scratch"]:
        config, _, _ = load_task(task)
        n_trials = config.study.n_trials or 20
        total = math.ceil(args.budget * n_trials)
        path = real_path(task)
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        done = [Search(**json.loads(line)) for line in lines if line.strip()]
        done = [s for s in done if len(s.best) == total]
        have = {(s.strategy, s.seed) for s in done}
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="hpo-search-") as folder:
            jobs = [
                (task, s, seed, total, Path(folder))
                for s in strategies
                for seed in range(args.seeds)
                if (s, seed) not in have
            ]
            with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
                for search in pool.imap_unordered(_real_search, jobs):
                    with path.open("a", encoding="utf-8") as out:
                        out.write(json.dumps(dataclasses.asdict(search)) + "\n")
                    done.append(search)
                    print(
                        f"{search.strategy}, seed {search.seed}: best {search.best[-1]:.4f}, "
                        f"{search.samples[-1] / 1e6:.3f} M samples, {search.pruned} pruned",
                        flush=True,
                    )
        searches = [s for s in done if s.strategy in strategies and s.seed < args.seeds]
        print("\n".join(report(task, searches, n_trials, args.unit)))
        print(
            f"({len(jobs)} real studies of {total} trials run in "
            f"{time.perf_counter() - started:.0f} s; {len(searches) - len(jobs)} read from "
            f"{path.relative_to(REPO)})\n"
        )
        print("\n".join(agreement(task, searches, n_trials, args.unit)))


def _real_search(job: tuple[str, str, int, int, Path]) -> Search:
    return real_search(*job)


def agreement(task: str, real: list[Search], n_trials: int, unit: str) -> list[str]:
    """Real studies against 100 replayed ones of the same strategies: where each real study's
    best value and compute fall in the replay's spread."""
    replayed = [
        replay(task, s, seed, n_trials)
        for s in sorted({r.strategy for r in real})
        for seed in range(100)
    ]
    lines = [
        f"| strategy | real: best after {n_trials} trials, per seed | replay (100 seeds): "
        f"best, median [10th, 90th percentile] | real: compute ({unit}) | replay: compute, "
        "median [10th, 90th] |",
        "|---|---|---|---|---|",
    ]
    for strategy in sorted({r.strategy for r in real}):
        runs = sorted((r for r in real if r.strategy == strategy), key=lambda r: r.seed)
        ours = [r for r in replayed if r.strategy == strategy]
        best = sorted(r.best[n_trials - 1] for r in ours)
        used = sorted(_used(r, unit)[n_trials - 1] for r in ours)
        scale = 1e6 if unit == "samples" else 3600.0
        lines.append(
            f"| {strategy} | {', '.join(f'{r.best[n_trials - 1]:.4f}' for r in runs)} "
            f"| {_spread(best, 1.0, '.4f')} "
            f"| {', '.join(f'{_used(r, unit)[n_trials - 1] / scale:.3f}' for r in runs)} "
            f"| {_spread(used, scale, '.3f')} |"
        )
    return lines


def _used(search: Search, unit: str) -> list[float]:
    return search.samples if unit == "samples" else search.seconds


def _spread(values: list[float], scale: float, form: str) -> str:
    def at(q: float) -> float:
        return values[min(len(values) - 1, round(q * (len(values) - 1)))] / scale

    return f"{format(at(0.5), form)} [{format(at(0.1), form)}, {format(at(0.9), form)}]"


if __name__ == "__main__":
    main()
