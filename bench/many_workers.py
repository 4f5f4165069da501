"""Many light workers on one PostgreSQL: hpo's real worker loop (the study's budget counted under
its lock, heartbeats, stale sweeps, outage retries) with a trivial trial in the worker (three
reports and pruning questions, no training, no torch), for 8, 32, 128 and 256 workers, one
fresh database each, in one run.

Per N: trials per second over the run; p50 and p99 of a trial's cycle in its worker (one trial's
end to the next one's, or its start for a worker's first: all of it is storage work, as the trial
itself computes nothing); the most connections hpo's processes held at once (pg_stat_activity,
sampled every 50 ms) and the most one worker held; errors (workers that exited with an error,
FAIL trials, errors in the workers' logs); retries (calls retried while the server was full or
unreachable: slower, not lost); whether
the budget is exact (as many trials as `n_trials`, not one more) and whether a trial was left
RUNNING.

The server's `max_connections` (100 on a stock PostgreSQL) bounds what a pool per worker allows:
see bench/README.md. The workers are forked from this process after hpo is imported (each about
60 MB, most of it shared).

Run: .venv/bin/python bench/many_workers.py [--workers 8 32 128 256] [--trials-per-worker 3]
       [--connections pooled on_demand] [--pgbouncer 0 80]  (0: straight to the server; 80:
       through PgBouncer holding 80 server connections, from deploy/pgbouncer/pgbouncer.ini)
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path

import optuna
import sqlalchemy as sa

from hpo.logs import setup_logging
from hpo.stopping import StopRequest
from hpo.storage.batch_cache import BatchSizeCache
from hpo.storage.engine import engine_kwargs, open_storage
from hpo.storage.url import StorageURL
from hpo.study.join import open_study
from hpo.study.loop import run_trials
from hpo.trial.objective import Objective

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from storage_overhead import bench_config, hpo_target  # noqa: E402

from tests.connection_watch import ConnectionWatch  # noqa: E402
from tests.pgbouncer import pgbouncer  # noqa: E402
from tests.scratch_db import scratch_database  # noqa: E402

ADMIN_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
STUDY = "many"
PATIENCE_S = 300  # how long a worker rides out a refused connection before it gives up


def light_worker(url: str, budget: int, on_demand: bool, barrier: Barrier, log_path: str) -> None:
    """One hpo worker with a trivial trial in the worker; its log goes to `log_path`."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 2)
    setup_logging(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage_url = StorageURL(url, "bench")
    barrier.wait()  # all forked: now they connect together, as a cluster's workers start
    storage = open_storage(storage_url, patience_s=PATIENCE_S, on_demand=on_demand)
    config = bench_config("none", budget)
    study = open_study(storage, STUDY, config)
    stop = StopRequest()
    cache = BatchSizeCache(storage.engine)
    objective = Objective(config, None, storage_url, stop, target=hpo_target, batch_cache=cache)  # type: ignore[arg-type]
    run_trials(study, storage, objective, stop)


@dataclass
class Result:
    workers: int
    budget: int
    seconds: float
    trials: int
    states: dict[str, int]
    cycle_p50_ms: float
    cycle_p99_ms: float
    connections: int
    per_worker: int
    failed_workers: int
    error_lines: int
    retries: int  # calls retried while the server refused (full) or was unreachable
    first_error: str

    @property
    def errors(self) -> int:
        return self.failed_workers + self.states.get("FAIL", 0) + self.error_lines

    @property
    def exact(self) -> bool:
        return self.trials == self.budget and self.states.get("RUNNING", 0) == 0


def measure(
    workers: int, per_worker: int, on_demand: bool, admin_url: str, bouncer_pool: int
) -> Result:
    """One run of `workers` light workers on a fresh database, straight to the server or, with
    `bouncer_pool` > 0, through PgBouncer holding that many server connections."""
    with scratch_database(admin_url, "hpo_many") as url:
        if not bouncer_pool:
            return _measure(workers, per_worker, on_demand, url, url)
        with pgbouncer(url, bouncer_pool) as bounced:
            return _measure(workers, per_worker, on_demand, url, bounced)


def _measure(workers: int, per_worker: int, on_demand: bool, url: str, worker_url: str) -> Result:
    budget = workers * per_worker
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as logs:
        # The tables exist before the workers start: creating them is not what is measured.
        # Its connections are closed before the fork: a child must not share a parent's socket.
        rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs("postgresql"))
        rdb.engine.dispose()
        barrier = context.Barrier(workers + 1)
        processes = [
            context.Process(
                target=light_worker,
                args=(worker_url, budget, on_demand, barrier, f"{logs}/{i}.log"),
            )
            for i in range(workers)
        ]
        for process in processes:
            process.start()
        with ConnectionWatch(url) as watch:
            barrier.wait(timeout=600)
            started = time.perf_counter()
            for process in processes:
                process.join()
            seconds = time.perf_counter() - started
        trials = optuna.load_study(study_name=STUDY, storage=url).get_trials(deepcopy=False)
        lines = [
            line
            for path in sorted(Path(logs).glob("*.log"))
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
        ]
        error_lines = sum(" ERROR " in line or "Traceback" in line for line in lines)
        retries = sum("retrying" in line for line in lines)
        failed = [i for i, p in enumerate(processes) if p.exitcode != 0]
        first_error = ""
        if failed:  # the last line of the first failed worker's log says why
            log_lines = Path(f"{logs}/{failed[0]}.log").read_text(encoding="utf-8").splitlines()
            first_error = (
                log_lines[-1][:300] if log_lines else f"exit {processes[failed[0]].exitcode}"
            )
    states: dict[str, int] = defaultdict(int)
    for trial in trials:
        states[trial.state.name] += 1
    cycles = _cycles_ms(trials)
    return Result(
        workers,
        budget,
        seconds,
        len(trials),
        dict(states),
        _percentile(cycles, 50),
        _percentile(cycles, 99),
        watch.total,
        watch.per_process,
        len(failed),
        error_lines,
        retries,
        first_error,
    )


def _cycles_ms(trials: list[optuna.trial.FrozenTrial]) -> list[float]:
    """Per worker, each trial's end less the previous one's end (its start for the first)."""
    by_worker: dict[str, list[optuna.trial.FrozenTrial]] = defaultdict(list)
    for trial in trials:
        if trial.state.is_finished() and trial.datetime_complete is not None:
            by_worker[str(trial.user_attrs.get("worker"))].append(trial)
    cycles = []
    for own in by_worker.values():
        own.sort(key=lambda t: t.number)
        previous = own[0].datetime_start
        for trial in own:
            if previous is not None and trial.datetime_complete is not None:
                cycles.append((trial.datetime_complete - previous).total_seconds() * 1000)
            previous = trial.datetime_complete
    return cycles


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--trials-per-worker", type=int, default=3)
    parser.add_argument(
        "--connections",
        nargs="+",
        choices=["pooled", "on_demand"],
        default=["pooled", "on_demand"],
        help="study.database_connections, each in turn",
    )
    parser.add_argument(
        "--pgbouncer",
        type=int,
        nargs="+",
        default=[0],
        metavar="POOL",
        help="through PgBouncer (deploy/pgbouncer/pgbouncer.ini, session mode) holding POOL "
        "server connections; 0: straight to the server (default)",
    )
    args = parser.parse_args()
    with sa.create_engine(args.admin_url).connect() as conn:
        limit = conn.execute(sa.text("SHOW max_connections")).scalar()
    pool = engine_kwargs("postgresql")
    print(
        f"PostgreSQL max_connections {limit}; a pooled worker's pool: {pool['pool_size']} + "
        f"{pool['max_overflow']} overflow; {args.trials_per_worker} trials a worker"
    )
    print(
        "| connections | PgBouncer pool | workers | trials/s | cycle p50 ms | cycle p99 ms "
        "| server connections (most at once) | most per worker | errors | retries "
        "| budget exact, none RUNNING | states |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    runs = ((m, b, w) for m in args.connections for b in args.pgbouncer for w in args.workers)
    for mode, bouncer, workers in runs:
        r = measure(workers, args.trials_per_worker, mode == "on_demand", args.admin_url, bouncer)
        states = ", ".join(f"{k} {v}" for k, v in sorted(r.states.items()))
        print(
            f"| {mode} | {bouncer or 'none'} | {r.workers} | {r.trials / r.seconds:.1f} "
            f"| {r.cycle_p50_ms:.0f} | {r.cycle_p99_ms:.0f} | {r.connections} | {r.per_worker} "
            f"| {r.errors} | {r.retries} "
            f"| {'yes' if r.exact else f'NO: {r.trials} of {r.budget}'} | {states} |",
            flush=True,
        )
        if r.first_error:
            print(f"  first failed worker's last line: {r.first_error}", flush=True)


if __name__ == "__main__":
    main()
