"""What MLflow tracking costs a trial (issue 28): the CPU demo's tiny study run by `hpo run` in
this process with no tracker and with an MLflow tracking server on this machine (started here:
127.0.0.1, SQLite backend), interleaved over several rounds so that the host's load falls on
both alike. Per trial: its recorded wall_s (start to end of its training process' work) and the
start-to-start gap between trials (the worker's part too), medians over the rounds after the
first (the first pays the fork server and imports).

Needs the full `mlflow` package (the dev extra) for the server; with --remote-uri (a server
already running on another host, the way MLflow is deployed) only the client, and no server
is started here.
Run: .venv/bin/python bench/tracking_overhead.py [--rounds 3] [--trials 4] [--nice 19]
     [--remote-uri http://tracking-host:5000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import optuna

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The tests' tiny study (a 2-layer BERT, an easy dataset), loaded at run time: mypy checks
# bench/, not tests/.
fixtures: Any = importlib.import_module("tests.conftest")
easy_rows, tiny_config = fixtures.easy_rows, fixtures.tiny_config
write_config, write_csv = fixtures.write_config, fixtures.write_csv


def start_server(folder: Path, nice: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    command = ["nice", "-n", str(nice), sys.executable, "-m", "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
               "--default-artifact-root", str(folder / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    # MLflow 3's server also starts a job runner and seven huey consumers (its GenAI jobs) by
    # default: processes that would take this host's cores from the trials, logging none.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env, start_new_session=True)  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return server, uri
        except OSError:
            time.sleep(0.5)
    os.killpg(server.pid, signal.SIGKILL)
    raise SystemExit("the mlflow server did not start within 120 s")


def run_study(folder: Path, name: str, raw: dict, storage: str) -> tuple[list[float], list[float]]:
    from hpo.cli.app import main

    config = write_config(folder / f"{name}.yaml", raw)
    args = ["run", "--study", name, "--config", str(config), "--storage", storage, "--quiet"]
    if main(args) != 0:
        raise SystemExit(f"hpo run of {name} failed")
    trials = sorted(optuna.load_study(study_name=name, storage=storage).trials,
                    key=lambda t: t.number)  # fmt: skip
    walls = [float(t.user_attrs["wall_s"]) for t in trials]
    starts = [t.datetime_start for t in trials if t.datetime_start is not None]
    gaps = [(b - a).total_seconds() for a, b in zip(starts, starts[1:], strict=False)]
    return walls, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument(
        "--remote-uri", default=None, metavar="URI",
        help="log to this MLflow tracking server (on another host) instead of one started here; "
        "each run logs under a new experiment, hpo-bench-<time>",
    )  # fmt: skip
    parser.add_argument(
        "--epochs", type=int, default=2,
        help="epochs per trial (4 evaluations each): longer trials, as a real study's are",
    )  # fmt: skip
    parser.add_argument(
        "--nice", type=int, default=0,
        help="the server's niceness: 19 keeps its CPU off the trials' cores on a small host "
        "(a real server runs elsewhere); 0 measures it competing with them",
    )  # fmt: skip
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hpo-tracking-bench-"))
    data = (write_csv(folder / "train.csv", easy_rows(256, 1)),
            write_csv(folder / "eval.csv", easy_rows(64, 2)))  # fmt: skip
    server, uri = (None, options.remote_uri) if options.remote_uri else start_server(
        folder, options.nice)  # fmt: skip
    experiment = f"hpo-bench-{int(time.time())}"
    storage = f"sqlite:///{folder / 'studies.db'}"
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for index in range(options.rounds):
            for name in ("none", "mlflow"):
                training = {"epochs": options.epochs, "evals_per_epoch": 4}
                raw = tiny_config(*data, study={"n_trials": options.trials}, training=training)
                if name == "mlflow":
                    raw["tracking"] = {"mlflow": {"uri": uri, "experiment": experiment}}
                walls, gaps = run_study(folder, f"{name}-{index}", raw, storage)
                if index > 0:
                    found = results.setdefault(name, {"wall_s": [], "gap_s": []})
                    found["wall_s"] += walls
                    found["gap_s"] += gaps
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
    print("| tracking | trials | wall_s per trial (median) | start to start (median) |")
    print("|----------|-------:|--------------------------:|------------------------:|")
    for name, found in results.items():
        print(f"| {name} | {len(found['wall_s'])} | {statistics.median(found['wall_s']):.3f} s "
              f"| {statistics.median(found['gap_s']):.3f} s |")  # fmt: skip
    none, mlflow = results["none"], results["mlflow"]
    ratio = statistics.median(mlflow["wall_s"]) / statistics.median(none["wall_s"])
    print(f"mlflow / none, wall_s per trial: {ratio:.3f}")


if __name__ == "__main__":
    main()
