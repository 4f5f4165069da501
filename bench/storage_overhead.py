"""Per-trial cost of hpo's study machinery beside plain Optuna, on PostgreSQL, with trivial
trials, for 1, 4 and 8 workers in the same run.

Plain Optuna: RDBStorage, TPE with constant liar, MaxTrialsCallback for the shared budget.
hpo: the same sampler and pruner, plus what every hpo worker adds: the study-wide budget under an
advisory lock (count, then ask), heartbeats and the stale-trial sweep before each trial, outage
retries, and the trial either in the worker (`trial_isolation: none`) or in the worker's trial
process (the default; kept from one trial to the next). Each variant runs `--repeat` times,
interleaved, so that a slow moment of the machine does not decide a ratio.

Run: .venv/bin/python bench/storage_overhead.py [--admin-url URL] [--workers 1,4,8]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import optuna

from hpo.config.schema import Config, ParamSpec, StudyConfig
from hpo.logs import setup_logging
from hpo.plugins.protocols import TrialLike
from hpo.stopping import StopRequest
from hpo.storage.engine import engine_kwargs, open_storage
from hpo.storage.url import StorageURL
from hpo.study.join import open_study
from hpo.study.loop import run_trials
from hpo.study.sampling import build_pruner, build_sampler
from hpo.trial.objective import Objective

# The scratch-database helper lives with the tests; this script runs from the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.scratch_db import scratch_database  # noqa: E402

ADMIN_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
EVALUATIONS = 3
WARMUP_TRIALS = 2
VARIANTS = ("optuna", "hpo, trial in worker", "hpo, trial process")


def trivial_trial(trial: TrialLike, params: dict[str, Any]) -> float:
    """What a real trial does with the study, minus the training: report and ask to prune."""
    value = math.log10(params["learning_rate"]) ** 2
    for step in range(EVALUATIONS):
        trial.report(value + step, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return value


def hpo_target(trial: TrialLike, task: Any) -> float:
    return trivial_trial(trial, task.params)


def optuna_objective(trial: optuna.Trial) -> float:
    params = {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-2, log=True),
        "effective_batch_size": trial.suggest_categorical("effective_batch_size", [16, 32, 64]),
    }
    return trivial_trial(trial, params)


def bench_config(isolation: str, n_trials: int) -> Config:
    study = StudyConfig(n_trials=n_trials, trial_isolation=isolation)  # type: ignore[arg-type]
    study.pruner.n_startup_trials = 5
    space = {
        "learning_rate": ParamSpec(type="float", low=1e-6, high=1e-2, log=True),
        "effective_batch_size": ParamSpec(type="categorical", choices=[16, 32, 64]),
    }
    return Config(study=study, search_space=space)


def worker(variant: str, url: str, n_trials: int, barrier: Barrier) -> None:
    setup_logging(30)
    if variant == "optuna":
        _optuna_worker(url, n_trials, barrier)
    else:
        _hpo_worker(
            "none" if variant == "hpo, trial in worker" else "process", url, n_trials, barrier
        )


def _optuna_worker(url: str, n_trials: int, barrier: Barrier) -> None:
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
    config = bench_config("none", n_trials).study
    studies = [
        optuna.create_study(
            storage=storage,
            study_name=name,
            sampler=build_sampler(config.sampler),
            pruner=build_pruner(config.pruner),
            load_if_exists=True,
        )
        for name in ("warmup", "bench")
    ]
    studies[0].optimize(optuna_objective, n_trials=WARMUP_TRIALS)
    barrier.wait()
    limit = optuna.study.MaxTrialsCallback(n_trials, states=None)
    studies[1].optimize(optuna_objective, n_trials=n_trials, callbacks=[limit])


def _hpo_worker(isolation: str, url: str, n_trials: int, barrier: Barrier) -> None:
    storage_url = StorageURL(url, "bench")
    stop = StopRequest()
    storage = open_storage(storage_url, patience_s=600)
    for name, budget in ((f"warmup-{os.getpid()}", WARMUP_TRIALS), ("bench", n_trials)):
        config = bench_config(isolation, budget)
        study = open_study(storage, name, config)
        objective = Objective(config, None, storage_url, stop, target=hpo_target)  # type: ignore[arg-type]
        run_trials(study, storage, objective, stop)
        if name != "bench":
            barrier.wait()


@dataclass
class Measurement:
    variant: str
    workers: int
    trials: int
    seconds: float

    @property
    def trials_per_s(self) -> float:
        return self.trials / self.seconds

    @property
    def worker_ms_per_trial(self) -> float:
        return 1000 * self.seconds * self.workers / self.trials


def measure(variant: str, workers: int, n_trials: int, admin_url: str) -> Measurement:
    context = multiprocessing.get_context("spawn")
    with scratch_database(admin_url, "hpo_bench") as url:
        # The tables exist before the workers start: table creation is not what is measured.
        optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs("postgresql")).remove_session()
        barrier = context.Barrier(workers + 1)
        processes = [
            context.Process(target=worker, args=(variant, url, n_trials, barrier))
            for _ in range(workers)
        ]
        for process in processes:
            process.start()
        barrier.wait(timeout=300)  # every worker connected and warmed up
        started = time.perf_counter()
        for process in processes:
            process.join()
        seconds = time.perf_counter() - started
        if any(process.exitcode != 0 for process in processes):
            raise SystemExit(f"{variant}: a worker failed")
        trials = len(optuna.load_study(study_name="bench", storage=url).get_trials())
    return Measurement(variant, workers, trials, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--workers", default="1,4,8")
    parser.add_argument("--trials", type=int, default=60, help="study budget per measurement")
    parser.add_argument(
        "--repeat", type=int, default=3, help="interleaved rounds; the median round counts"
    )
    args = parser.parse_args()
    print(
        f"trivial trials ({EVALUATIONS} reports each), PostgreSQL, budget {args.trials}, "
        f"median of {args.repeat} interleaved rounds"
    )
    print(
        f"{'workers':>7}  {'variant':<22} {'trials':>6} {'trials/s':>9} {'ms/trial':>9}  "
        f"{'spread':>13}  ratio"
    )
    for workers in (int(w) for w in args.workers.split(",")):
        rounds = [
            [measure(v, workers, args.trials, args.admin_url) for v in VARIANTS]
            for _ in range(args.repeat)
        ]
        results = [_median_round([r[i] for r in rounds]) for i in range(len(VARIANTS))]
        base = results[0][0]
        for r, low, high in results:
            ratio = r.worker_ms_per_trial / base.worker_ms_per_trial
            print(
                f"{workers:>7}  {r.variant:<22} {r.trials:>6} {r.trials_per_s:>9.1f} "
                f"{r.worker_ms_per_trial:>9.1f}  {low:>5.1f}-{high:<6.1f}  "
                f"{ratio:.2f}x optuna's cost per trial"
            )
    print(
        "ms/trial: worker-milliseconds per trial (workers x wall time / trials), the median "
        "round; spread: the fastest and slowest round"
    )


def _median_round(rounds: list[Measurement]) -> tuple[Measurement, float, float]:
    """The round with the median cost, and the lowest and highest cost of all rounds."""
    ordered = sorted(rounds, key=lambda m: m.worker_ms_per_trial)
    costs = [m.worker_ms_per_trial for m in ordered]
    return ordered[len(ordered) // 2], costs[0], costs[-1]


if __name__ == "__main__":
    main()
