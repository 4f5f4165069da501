"""What a worker's fork server costs: `hpo run` of one short trial with the server a copy of the
worker (the default on Linux, hpo/trial/worker_copy.py) against one started afresh
(HPO_FORK_SERVER=fresh, the baseline: a new interpreter that imports torch and transformers
again). Runs the two in alternating pairs and prints each run's wall time from the command's
start to its exit, the medians, and the ratio copy / fresh. The first pair is a warm-up.
Run: .venv/bin/python bench/worker_start.py [--pairs 5] [--device cpu]
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

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import easy_rows, tiny_config, write_csv  # noqa: E402


def one_run(folder: Path, config: Path, study: str, fresh: bool) -> float:
    env = {**os.environ, "HPO_FORK_SERVER": "fresh" if fresh else "copy"}
    started = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpo",
            "run",
            "--study",
            study,
            "--config",
            str(config),
            "--storage",
            f"sqlite:///{folder / 'bench.db'}",
            "--debug",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall_s = time.perf_counter() - started
    expected = "will start afresh" if fresh else "is a copy of this worker"
    if result.returncode != 0 or expected not in result.stderr:
        raise SystemExit(
            f"{study}: exit {result.returncode}, no {expected!r}:\n{result.stderr[-3000:]}"
        )
    return wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train = write_csv(folder / "train.csv", easy_rows(64, 1))
        evaluation = write_csv(folder / "eval.csv", easy_rows(16, 2))
        raw = tiny_config(
            train, evaluation, study={"n_trials": 1}, training={"epochs": 1, "device": args.device}
        )
        config = folder / "c.yaml"
        config.write_text(yaml.safe_dump(raw, sort_keys=False))
        copy: list[float] = []
        fresh: list[float] = []
        for pair in range(args.pairs + 1):
            for is_fresh in (False, True) if pair % 2 else (True, False):
                wall_s = one_run(
                    folder, config, f"{'fresh' if is_fresh else 'copy'}{pair}", is_fresh
                )
                print(
                    f"pair {pair} {'fresh' if is_fresh else 'copy '}: {wall_s:6.2f} s"
                    + ("  (warm-up)" if pair == 0 else "")
                )
                if pair:
                    (fresh if is_fresh else copy).append(wall_s)
    copy_s, fresh_s = statistics.median(copy), statistics.median(fresh)
    print(
        f"median wall, one-trial worker: copy {copy_s:.2f} s, fresh {fresh_s:.2f} s; "
        f"copy / fresh = {copy_s / fresh_s:.2f}x ({copy_s - fresh_s:+.2f} s a worker)"
    )


if __name__ == "__main__":
    main()
