"""docker-compose.yml run for real with podman-compose, as a user would: PostgreSQL, the dashboard
and two CPU workers on the demo config. The study ends with its exact budget; a worker killed in
the middle of a trial has that trial retried by the other; the dashboard answers on its published
port and renders in Chromium; after `down` and `up` the study is still there and a new worker
continues it. tests/stack/compose.override.yml holds what differs here (local stand-in images
from scripts/stack-images, built once and reused; the test's copy of the demo config).
No podman: a failure under CI=true, a skip elsewhere."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, missing
from tests.test_browser import _svgs, _text, browser, console_errors, wait_for  # noqa: F401

PROJECT = "hpo-stack-test"
COMPOSE_FILES = ["-f", "docker-compose.yml", "-f", "tests/stack/compose.override.yml"]
DB_BIND = "127.0.0.2"  # the shipped file's knob; this host's own PostgreSQL holds 127.0.0.1:5432
DASHBOARD = "http://127.0.0.1:8080"  # the port docker-compose.yml publishes
STUDY = "stack"
BUDGET = 2  # trials of the first run (the killed one retried makes it 3); the second: +1
HEARTBEAT_S = 1  # a killed worker's trial goes stale after 4 s instead of 90


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """The stand-in images and hpo's, from scripts/stack-images (built only when missing)."""
    if shutil.which("apt-get") is None and shutil.which("podman") is None:
        missing("no podman, and no apt-get to install it (scripts/podman-host)")
    built = _built_by_scripts_test() or subprocess.run(
        ["scripts/stack-images"], cwd=REPO, capture_output=True, text=True, timeout=3600
    )
    if built.returncode != 0 and shutil.which("podman") is None:
        missing(f"podman is not installed and scripts/podman-host could not: {built.stderr[-500:]}")
    assert built.returncode == 0, built.stderr[-3000:]
    return dict(line.split("=", 1) for line in built.stdout.split())


def _built_by_scripts_test(
    timeout_s: float = 3600,
) -> subprocess.CompletedProcess[str] | None:
    """What scripts/test's build of the images gave ($HPO_STACK_IMAGES: it starts them
    before the tests), once it has ended; None where it started none."""
    names = os.environ.get("HPO_STACK_IMAGES")
    if not names:
        return None
    rc = Path(f"{names}.rc")
    pid = int(os.environ.get("HPO_STACK_IMAGES_PID", "0"))
    deadline = time.monotonic() + timeout_s
    while not rc.exists() or not rc.read_text().strip():
        gone = pid > 0 and not _running(pid)
        if gone and not rc.exists():  # killed before it could say how it ended
            pytest.fail(
                f"scripts/test's build of the stack's images ended with no result ({names}.err)"
            )
        if time.monotonic() > deadline:
            pytest.fail(
                f"scripts/test's build of the stack's images gave no result in "
                f"{timeout_s:.0f} s ({names}.err)"
            )
        time.sleep(1)
    err = Path(f"{names}.err")
    return subprocess.CompletedProcess(
        ["scripts/stack-images"],
        int(rc.read_text()),
        Path(names).read_text(),
        err.read_text() if err.exists() else "",
    )


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended and not yet reaped by scripts/test, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def stack(images: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment podman-compose runs with; the project's containers and volumes are
    removed before and after."""
    env = dict(
        os.environ,
        HPO_DB_PASSWORD=secrets.token_hex(8),
        HPO_DB_BIND=DB_BIND,
        HPO_STUDY=STUDY,
        HPO_CONFIG="stack-demo.yaml",
        HPO_STACK_CONFIG=str(tmp_path / "stack-demo.yaml"),
        HPO_STACK_IMAGE=images["HPO_IMAGE"],
        HPO_STACK_POSTGRES_IMAGE=images["POSTGRES_IMAGE"],
    )
    compose(env, "down", "-v")
    try:
        yield env
    finally:
        compose(env, "down", "-v")


@pytest.mark.slow
def test_the_stack_runs_the_demo_survives_a_killed_worker_and_keeps_its_study(
    stack: dict[str, str],
    browser: Any,  # noqa: F811 (the fixture of tests/test_browser.py, imported above)
) -> None:
    write_config(Path(stack["HPO_STACK_CONFIG"]), BUDGET)
    url = f"postgresql+psycopg2://hpo:{stack['HPO_DB_PASSWORD']}@{DB_BIND}:5432/hpo"
    up(stack, workers=2)
    killed = kill_a_worker_mid_trial(url)
    survivor = next(n for n in worker_names(2) if n != killed)
    assert wait_exit(survivor) == 0, logs(survivor)

    trials = load_trials(url)
    finished = [t for t in trials if t.state.is_finished() and t.state.name != "FAIL"]
    assert len(finished) == BUDGET and not [t for t in trials if not t.state.is_finished()]
    lost = [t for t in trials if t.state.name == "FAIL"]
    assert [t.user_attrs["worker"].split(":")[0] for t in lost] == [hostname(killed)]
    retry = next(t for t in finished if t.user_attrs.get("retry_of") == lost[0].number)
    assert retry.user_attrs["worker"].startswith(hostname(survivor) + ":")
    check_dashboard(browser, len(trials))

    compose(stack, "down")
    write_config(Path(stack["HPO_STACK_CONFIG"]), BUDGET + 1)
    up(stack, workers=1)
    assert wait_exit(worker_names(1)[0]) == 0, logs(worker_names(1)[0])
    again = load_trials(url)
    assert [t.number for t in again[: len(trials)]] == [t.number for t in trials]  # the volume
    new = [t for t in again[len(trials) :] if t.state.is_finished() and t.state.name != "FAIL"]
    assert len(new) == 1 and new[0].user_attrs["worker"].startswith(
        hostname(worker_names(1)[0]) + ":"
    )


def test_the_worker_keeps_its_gpu_reservation() -> None:
    """podman-compose ignores it and there is no GPU here: the file still asks for every GPU."""
    shipped = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    override = yaml.safe_load((REPO / "tests/stack/compose.override.yml").read_text())
    devices = shipped["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "resources" not in override["services"]["worker"].get("deploy", {})


def write_config(path: Path, n_trials: int) -> None:
    """The demo config, with the test's budget, a short heartbeat, one epoch and the physical
    batch the finder settles on for it on a CPU (32: the finder's probes are tested elsewhere);
    its data paths still resolve (it is mounted next to configs/demo.yaml in the image)."""
    config = yaml.safe_load((REPO / "configs/demo.yaml").read_text())
    config["study"].update(n_trials=n_trials, heartbeat_interval=HEARTBEAT_S)
    config["training"].update(epochs=1, physical_batch_size=32)
    path.write_text(yaml.safe_dump(config))


def compose(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        ["podman-compose", "-p", PROJECT, *COMPOSE_FILES, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def up(env: dict[str, str], workers: int) -> None:
    """docs/guides/deploy.md's order: the database and the dashboard, then the workers once
    the database is healthy (podman-compose 1.0 does not wait for `condition: service_healthy`
    itself)."""
    compose(env, "up", "-d", "postgres", "dashboard")
    wait_for(
        lambda: podman("healthcheck", "run", f"{PROJECT}_postgres_1").returncode == 0,
        "PostgreSQL healthy by the compose file's own healthcheck",
        timeout=120,
    )
    compose(dict(env, HPO_STACK_WORKERS=str(workers)), "up", "-d", "worker")


def worker_names(count: int) -> list[str]:
    return [f"{PROJECT}_worker_{n}" for n in range(1, count + 1)]


def hostname(container: str) -> str:
    return podman("inspect", "--format", "{{.Config.Hostname}}", container).stdout.strip()


def logs(container: str) -> str:
    done = podman("logs", "--tail", "60", container)
    return f"{container}:\n{done.stdout}{done.stderr}"


def wait_exit(container: str, timeout: float = 900) -> int:
    done = podman("wait", container, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def load_trials(url: str) -> list[Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=STUDY, storage=url)
    return sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)


def kill_a_worker_mid_trial(url: str) -> str:
    """SIGKILL the container of the first worker seen with a trial that has reported an
    evaluation (the middle of a trial, not its start); returns its name."""
    by_host = {hostname(name): name for name in worker_names(2)}

    def training() -> str | None:
        try:
            trials = load_trials(url)
        except Exception:  # the study is not created yet
            return None
        for trial in trials:
            if trial.state.name == "RUNNING" and trial.intermediate_values:
                return by_host.get(str(trial.user_attrs.get("worker", "")).split(":")[0])
        return None

    try:
        name: str = wait_for(training, "a worker in the middle of a trial", timeout=300)
    except AssertionError as e:
        raise AssertionError(f"{e}\n" + "\n".join(map(logs, worker_names(2)))) from None
    assert podman("kill", name).returncode == 0
    return name


def check_dashboard(driver: Any, trials: int) -> None:
    wait_for(
        lambda: podman("healthcheck", "run", f"{PROJECT}_dashboard_1").returncode == 0,
        "the dashboard healthy by the compose file's own healthcheck",
    )
    with urllib.request.urlopen(f"{DASHBOARD}/api/studies", timeout=30) as answer:
        studies = json.load(answer)["study_summaries"]
    study = next(s for s in studies if s["study_name"] == STUDY)
    driver.get(f"{DASHBOARD}/dashboard/studies/{study['study_id']}/trials")
    text = wait_for(
        lambda: f"{trials} Trials" in (t := _text(driver)) and t,
        "the dashboard's trial list in Chromium",
    )
    driver.get(f"{DASHBOARD}/dashboard/studies/{study['study_id']}")
    wait_for(
        lambda: "accuracy" in _text(driver) and _svgs(driver) >= 2,
        "the study's history plotted, its metric named",
    )
    assert "Fail" in text and console_errors(driver) == []
