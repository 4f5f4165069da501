"""Time between trials that trains nothing: per trial, its duration in the study (created to
finished) less the training and evaluation clocks of its training loop, on the CPU demo, with
the trial in the worker's kept trial process (the default) beside the trial in the worker
itself (`trial_isolation: none`, the baseline with no process at all), in the same run.

Also reported: `startup_s` (trial created to its first optimizer step: process, model, data
loaders, batch size) and the study's wall time. The first trial of each run pays the fork
server's start and the batch-size search: only the trials after it ("warm") count.

Run: .venv/bin/python bench/trial_overhead.py [--trials 8] [--config configs/demo.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"trial process (default)": "process", "trial in worker (baseline)": "none"}


@dataclass
class Run:
    variant: str
    wall_s: float
    outside_s: list[float]  # per warm trial: duration - train_s - eval_s
    startup_s: list[float]
    duration_s: list[float]
    parts: dict[str, list[float]]  # startup_s broken down (dispatch, setup, first step)
    kept: int  # warm trials that ran in a trial process kept from an earlier trial


def study_config(source: Path, isolation: str, trials: int) -> dict[str, Any]:
    """The config with absolute data paths, the isolation and the number of trials asked."""
    config = yaml.safe_load(source.read_text(encoding="utf-8"))
    data = config.setdefault("data", {})
    for key in ("train_file", "eval_file"):
        if key in data and not Path(data[key]).is_absolute():
            data[key] = str((source.parent / data[key]).resolve())
    study = config.setdefault("study", {})
    study.update(trial_isolation=isolation, n_trials=trials, pruner={"type": "none"})
    return config


def measure(variant: str, source: Path, trials: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="hpo-overhead-") as folder:
        config = Path(folder) / "config.yaml"
        config.write_text(yaml.safe_dump(study_config(source, VARIANTS[variant], trials)))
        url = f"sqlite:///{Path(folder) / 'bench.db'}"
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "hpo",
                "run",
                "--study",
                "bench",
                "--config",
                str(config),
                "--storage",
                url,
                "--quiet",
            ],
            cwd=folder,
            capture_output=True,
            text=True,
        )
        wall_s = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{variant}: hpo run failed:\n{done.stderr[-3000:]}")
        finished = optuna.load_study(study_name="bench", storage=url).get_trials()
    warm = [t for t in finished if t.number > 0 and "train_s" in t.user_attrs]
    durations = [(t.datetime_complete - t.datetime_start).total_seconds() for t in warm]  # type: ignore[operator]
    outside = [
        d - t.user_attrs["train_s"] - t.user_attrs["eval_s"]
        for d, t in zip(durations, warm, strict=True)
    ]
    startup = [t.user_attrs["startup_s"] for t in warm if "startup_s" in t.user_attrs]
    parts: dict[str, list[float]] = {}
    for t in warm:
        for name, seconds in t.user_attrs.get("startup_parts", {}).items():
            parts.setdefault(name, []).append(seconds)
    kept = sum(t.user_attrs.get("process_trials", 1) > 1 for t in warm)
    return Run(variant, wall_s, outside, startup, durations, parts, kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8, help="trials per variant")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    args = parser.parse_args()
    runs = [measure(variant, args.config, args.trials) for variant in VARIANTS]
    base = runs[-1]
    print(
        f"{args.config.name}, {args.trials} trials per variant, no pruning; medians of the "
        f"{len(base.outside_s)} warm trials"
    )
    print(f"{'variant':<28} {'outside s':>9} {'startup s':>9} {'trial s':>8} {'study s':>8}  ratio")
    for run in runs:
        outside = statistics.median(run.outside_s)
        ratio = outside / statistics.median(base.outside_s)
        print(
            f"{run.variant:<28} {outside:>9.2f} {statistics.median(run.startup_s):>9.2f} "
            f"{statistics.median(run.duration_s):>8.2f} {run.wall_s:>8.1f}  "
            f"{ratio:.2f}x the baseline's time outside training"
        )
    print("outside: trial created to finished, less its training and evaluation clocks")
    for run in runs:
        parts = ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in run.parts.items())
        kept = f"; {run.kept}/{len(run.outside_s)} warm trials in a kept process"
        print(
            f"{run.variant}: startup = {parts or 'not recorded'}"
            f"{kept if VARIANTS[run.variant] == 'process' else ''}"
        )


if __name__ == "__main__":
    main()
