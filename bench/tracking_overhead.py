"""What tracking costs a trial (issues 28, 45): the CPU demo's tiny study run by `hpo run` in
this process with no tracker and with an MLflow tracking server on this machine (started here:
127.0.0.1, SQLite backend), or with Weights & Biases (`--tracker wandb`: offline, its runs
written under the bench's folder by wandb's own service process, wandb-core, which runs on the
training host in every mode), in pairs: each round runs both, in alternating order, so that the
host's load falls on both alike.

Two accounts, per trial:
- wall time: its recorded wall_s (start to end of its training process' work) and the
  start-to-start gap between trials (the worker's part too); per round the ratio of the medians
  (tracking / none), then the median of those pair ratios over the rounds after the first (the
  first pays the fork server and imports). On a shared host this is as noisy as its load.
- CPU time, which is what tracking takes from training on a CPU host and is not moved by the
  other processes' load: the CPU seconds of hpo's tracker thread (time.thread_time in it), of
  the MLflow server's processes (psutil) or of wandb-core while the study ran, and of the
  trials' processes (getrusage of this process' children, all reaped when `hpo run` returns).

Needs the full `mlflow` package (the dev extra) for the server; with --remote-uri (a server
already running on another host, the way MLflow is deployed) only the client, and no server
is started here (its CPU is then not counted).
Run: .venv/bin/python bench/tracking_overhead.py [--tracker mlflow|wandb] [--rounds 5]
     [--trials 4] [--nice 0]
     [--remote-uri http://tracking-host:5000] [--epochs 2] [--evals-per-epoch 4]
     [--train-rows 256]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import resource
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
import psutil

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
    command = [
        "nice",
        "-n",
        str(nice),
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--default-artifact-root",
        str(folder / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # MLflow 3's server also starts a job runner and seven huey consumers (its GenAI jobs) by
    # default: processes that would take this host's cores from the trials, logging none.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
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


class TrackerCpu:
    """The CPU seconds of hpo's tracker threads (hpo.tracking.background), each measured in the
    thread itself as it ends."""

    def __init__(self) -> None:
        from hpo.tracking.background import BackgroundCalls

        self.seconds: list[float] = []
        run = BackgroundCalls._run

        def measured(calls: BackgroundCalls) -> None:
            try:
                run(calls)
            finally:
                self.seconds.append(time.thread_time())

        BackgroundCalls._run = measured  # type: ignore[method-assign,assignment]

    def take(self) -> float:
        taken, self.seconds = sum(self.seconds), []
        return taken


def tracker_processes(server: subprocess.Popen[bytes] | None) -> list[psutil.Process]:
    """The tracker's own processes on this host: the MLflow server's (its workers' included),
    or wandb's service (wandb-core, a child of this process once a run started) and its
    children."""
    if server is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(server.pid)
            return [root, *root.children(recursive=True)]
        return []
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.name().startswith("wandb"):
                found += [process, *process.children(recursive=True)]
    return found


def server_cpu(server: subprocess.Popen[bytes] | None) -> float:
    """CPU seconds of the tracker's processes so far."""
    total = 0.0
    for process in tracker_processes(server):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def trials_cpu(server: subprocess.Popen[bytes] | None) -> float:
    """CPU seconds of this process' descendants so far but the server's: the fork server and
    the trial processes it starts (each counted while it lives, then in its parent's children
    times once reaped), and whatever this process reaped itself."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    skip = {process.pid for process in tracker_processes(server)}
    for process in psutil.Process().children(recursive=True):
        if process.pid in skip:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_study(folder: Path, name: str, raw: dict, storage: str) -> tuple[list[float], list[float]]:
    from hpo.cli.app import main

    config = write_config(folder / f"{name}.yaml", raw)
    args = ["run", "--study", name, "--config", str(config), "--storage", storage, "--quiet"]
    if main(args) != 0:
        raise SystemExit(f"hpo run of {name} failed")
    trials = sorted(
        optuna.load_study(study_name=name, storage=storage).trials, key=lambda t: t.number
    )
    walls = [float(t.user_attrs["wall_s"]) for t in trials]
    starts = [t.datetime_start for t in trials if t.datetime_start is not None]
    gaps = [(b - a).total_seconds() for a, b in zip(starts, starts[1:], strict=False)]
    return walls, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="pairs, the first one a warm-up")
    parser.add_argument(
        "--tracker",
        choices=("mlflow", "wandb"),
        default="mlflow",
        help="mlflow: a server started here (or --remote-uri); wandb: offline, under the "
        "bench's folder (no network needed)",
    )
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument(
        "--remote-uri",
        default=None,
        metavar="URI",
        help="log to this MLflow tracking server (on another host) instead of one started here; "
        "each run logs under a new experiment, hpo-bench-<time>",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=2,
        help="epochs per trial: longer trials, as a real study's are",
    )
    parser.add_argument(
        "--evals-per-epoch",
        type=int,
        default=4,
        help="evaluations per epoch: what tracking logs scales with them, not with training",
    )
    parser.add_argument(
        "--train-rows",
        type=int,
        default=256,
        help="training examples (the eval set has a quarter as many): more training per "
        "evaluation, as a real study has",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="the server's niceness: 19 keeps its CPU off the trials' cores on a small host "
        "(a real server runs elsewhere); 0 measures it competing with them",
    )
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hpo-tracking-bench-"))
    data = (
        write_csv(folder / "train.csv", easy_rows(options.train_rows, 1)),
        write_csv(folder / "eval.csv", easy_rows(options.train_rows // 4, 2)),
    )
    experiment = f"hpo-bench-{int(time.time())}"
    tracking: dict[str, Any]
    server: subprocess.Popen[bytes] | None = None
    if options.tracker == "wandb":
        os.environ["WANDB_MODE"] = "offline"
        for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            os.environ[variable] = str(folder / "wandb")
        (folder / "wandb").mkdir()
        tracking = {"wandb": {"project": experiment}}
    else:
        server, uri = (
            (None, options.remote_uri) if options.remote_uri else start_server(folder, options.nice)
        )
        tracking = {"mlflow": {"uri": uri, "experiment": experiment}}
    storage = f"sqlite:///{folder / 'studies.db'}"
    tracker = TrackerCpu()
    columns = ("none", options.tracker)
    walls: dict[str, list[float]] = {name: [] for name in columns}
    gaps: dict[str, list[float]] = {name: [] for name in columns}
    cpu: dict[str, dict[str, float]] = {name: dict.fromkeys(CPU, 0.0) for name in columns}
    ratios: list[float] = []
    loads: list[float] = []
    try:
        for index in range(options.rounds):
            medians = {}
            for name in columns if index % 2 == 0 else columns[::-1]:
                training = {"epochs": options.epochs, "evals_per_epoch": options.evals_per_epoch}
                raw = tiny_config(*data, study={"n_trials": options.trials}, training=training)
                if name != "none":
                    raw["tracking"] = tracking
                before = (trials_cpu(server), self_cpu(), server_cpu(server))
                tracker.take()
                round_walls, round_gaps = run_study(folder, f"{name}-{index}", raw, storage)
                after = (trials_cpu(server), self_cpu(), server_cpu(server))
                tracker_s = tracker.take()
                medians[name] = statistics.median(round_walls)
                print(
                    f"round {index} {name}: wall_s {medians[name]:.3f} (median), CPU s: "
                    f"trials {after[0] - before[0]:.2f}, worker {after[1] - before[1]:.2f}, "
                    f"server {after[2] - before[2]:.2f}, tracker thread {tracker_s:.3f}, "
                    f"load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
                if index == 0:
                    continue
                walls[name] += round_walls
                gaps[name] += round_gaps
                spent = cpu[name]
                spent["trials"] += after[0] - before[0]
                spent["worker"] += after[1] - before[1]
                spent["tracker"] += tracker_s
                spent["server"] += after[2] - before[2]
            if index > 0:
                ratios.append(medians[options.tracker] / medians["none"])
            loads.append(os.getloadavg()[0])
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
    counted = {name: len(walls[name]) for name in columns}
    print(f"load average (1 min) after each round: {', '.join(f'{x:.1f}' for x in loads)}")
    print("| tracking | trials | wall_s per trial (median) | start to start (median) |")
    print("|----------|-------:|--------------------------:|------------------------:|")
    for name in columns:
        print(
            f"| {name} | {counted[name]} | {statistics.median(walls[name]):.3f} s "
            f"| {statistics.median(gaps[name]):.3f} s |"
        )
    listed = ", ".join(f"{r:.3f}" for r in ratios)
    print(
        f"pair ratios {options.tracker} / none (median wall_s per trial, per round): {listed}; "
        f"median {statistics.median(ratios):.3f}"
    )
    print()
    print(
        "| tracking | CPU s per trial: trial process | worker process | of which tracker thread "
        f"| {'wandb-core' if options.tracker == 'wandb' else 'MLflow server'} |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in columns:
        per = {key: value / counted[name] for key, value in cpu[name].items()}
        print(
            f"| {name} | {per['trials']:.3f} | {per['worker']:.3f} | {per['tracker']:.4f} "
            f"| {per['server']:.4f} |"
        )
    trial_cpu = cpu["none"]["trials"] / counted["none"]
    if trial_cpu <= 0:
        raise SystemExit("the trials' CPU time was not measured")
    used = {key: value / counted[options.tracker] for key, value in cpu[options.tracker].items()}
    print(
        f"tracking's CPU per trial: tracker thread {used['tracker']:.4f} s "
        f"({100 * used['tracker'] / trial_cpu:.2f}% of a trial's {trial_cpu:.2f} CPU s), "
        f"its processes {used['server']:.4f} s ({100 * used['server'] / trial_cpu:.2f}%), "
        f"together {100 * (used['tracker'] + used['server']) / trial_cpu:.2f}%"
    )


CPU = ("trials", "worker", "tracker", "server")


if __name__ == "__main__":
    main()
