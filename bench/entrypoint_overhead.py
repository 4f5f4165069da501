"""What hpo adds per trial around a user's own training function (`training.entrypoint`): the same
1-second function run by `hpo run` (its worker, trial process, heartbeats, checkpoint folder,
pruning path) and by a plain Optuna `study.optimize` loop, on one SQLite storage, in one run.

Per trial: the time from one trial's start to the next one's (its function, and everything
around it up to the next trial's start), median over the trials after the first (the first pays
the worker's fork server and imports: reported apart, as the whole run's wall time).

Run: .venv/bin/python bench/entrypoint_overhead.py [--trials 10] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import yaml

REPO = Path(__file__).resolve().parents[1]
# The user's function sleeps this long (a fixed, load-independent 'training'); set by --seconds.
SECONDS_ENV = "HPO_BENCH_FUNCTION_S"


def work(learning_rate: float) -> float:
    """The user's training: a second of it, then a metric."""
    time.sleep(float(os.environ.get(SECONDS_ENV, "1.0")))
    return 1.0 / (1.0 + learning_rate)


def train(ctx: Any) -> dict[str, float]:
    """The function as hpo calls it (training.entrypoint: entrypoint_overhead:train)."""
    loss = work(float(ctx.params["learning_rate"]))
    ctx.report({"loss": loss}, step=0)
    return {"loss": loss}


def objective(trial: optuna.Trial) -> float:
    """The same function as a plain Optuna objective."""
    loss = work(trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True))
    trial.report(loss, 0)
    if trial.should_prune():
        raise optuna.TrialPruned()
    return loss


def per_trial_s(study: optuna.Study) -> list[float]:
    """Start-to-start gaps between consecutive trials (the last: start to its completion)."""
    trials = sorted(study.trials, key=lambda t: t.number)
    starts = [t.datetime_start for t in trials]
    gaps = [(b - a).total_seconds() for a, b in zip(starts, starts[1:], strict=False) if a and b]
    return gaps


def run_optuna(url: str, trials: int) -> tuple[float, list[float]]:
    started = time.perf_counter()
    study = optuna.create_study(study_name="plain", storage=url, direction="minimize")
    study.optimize(objective, n_trials=trials)
    return time.perf_counter() - started, per_trial_s(study)


def run_hpo(url: str, trials: int, folder: Path) -> tuple[float, list[float]]:
    config = {
        "training": {"entrypoint": "entrypoint_overhead:train", "device": "cpu"},
        "study": {"metric": "loss", "direction": "minimize", "n_trials": trials},
        "search_space": {
            "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-1, "log": True}
        },
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), str(REPO)])}
    started = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "hpo",
        "run",
        "--config",
        str(path),
        "--study",
        "hpo",
        "--storage",
        url,
        "--quiet",
    ]
    subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
    wall_s = time.perf_counter() - started
    return wall_s, per_trial_s(optuna.load_study(study_name="hpo", storage=url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    os.environ[SECONDS_ENV] = str(args.seconds)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        plain_wall, plain = run_optuna(url, args.trials)
        hpo_wall, hpo = run_hpo(url, args.trials, Path(tmp))
    plain_s, hpo_s = statistics.median(plain[1:]), statistics.median(hpo[1:])
    print(f"{args.trials} trials of a {args.seconds:g} s function, one SQLite storage")
    print(f"{'':24} {'per trial (median)':>18} {'max':>8} {'first':>8} {'whole run':>10}")
    for name, wall, gaps, median in (
        ("optuna study.optimize", plain_wall, plain, plain_s),
        ("hpo run (entrypoint)", hpo_wall, hpo, hpo_s),
    ):
        print(f"{name:24} {median:>17.3f}s {max(gaps[1:]):>7.3f}s {gaps[0]:>7.3f}s {wall:>9.2f}s")
    print(f"hpo / optuna per trial: {hpo_s / plain_s:.3f}x (goal: at most 1.2x)")


if __name__ == "__main__":
    main()
