"""The documentation's screenshot of a study in MLflow's UI, in one command: a real `mlflow server`
on 127.0.0.1 (SQLite backend, its own artifact folder, in a temporary folder), a short study of
the CPU demo logging to it (`hpo run --tracking URI`, ASHA pruning some trials), then the
experiment's runs page (the study's run with its trials' runs nested under it, and their
metric charts) in the headless Debian Chromium the tests use, saved as PNG.

Run: .venv/bin/python docs/screenshots/make_mlflow_screenshot.py [--trials 8]
     [--out docs/mlflow.png] [--keep]   (needs `mlflow`, selenium, chromium, chromium-driver)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
# The tests' tiny study, loaded at run time (as bench/ does).
fixtures: Any = importlib.import_module("tests.conftest")
easy_rows, tiny_config = fixtures.easy_rows, fixtures.tiny_config
write_config, write_csv = fixtures.write_config, fixtures.write_csv
EXPERIMENT = "sentiment"
STUDY = "sentiment"


def start_server(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    command = [
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
    # Without MLflow 3's GenAI job runner and its seven consumers: the tracking server only.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = (folder / "server.log").open("wb")
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{uri}/health"), "the mlflow server to answer", 180)
    except BaseException:
        os.killpg(server.pid, signal.SIGKILL)
        raise
    return server, uri


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def wait_for(check: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.5)


def run_study(folder: Path, uri: str, trials: int) -> None:
    """The tests' tiny study (a 2-layer BERT learning an easy sentiment cue, seconds a trial on
    a CPU), with a wide learning-rate range and hpo's default pruner (ASHA), so that some trials
    are pruned."""
    train = write_csv(folder / "train.csv", easy_rows(256, 1))
    evaluation = write_csv(folder / "eval.csv", easy_rows(64, 2))
    config = tiny_config(
        train,
        evaluation,
        study={"n_trials": trials, "pruner": {"type": "successive_halving", "min_resource": 2}},
        search_space={
            "effective_batch_size": {"type": "categorical", "choices": [8, 16]},
            "learning_rate": {"type": "float", "low": 1.0e-5, "high": 5.0e-3, "log": True},
            "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2},
        },
        training={"epochs": 2, "evals_per_epoch": 4},
    )
    config["tracking"] = {"mlflow": {"experiment": EXPERIMENT}}
    path = write_config(folder / "study.yaml", config)
    command = [
        sys.executable,
        "-m",
        "hpo",
        "run",
        "--study",
        STUDY,
        "--config",
        str(path),
        "--storage",
        f"sqlite:///{folder / 'studies.db'}",
        "--tracking",
        uri,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(command, cwd=folder, env=env, check=True)


def experiment_id(uri: str) -> str:
    url = f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={EXPERIMENT}"
    with urllib.request.urlopen(url, timeout=30) as answer:
        return str(json.load(answer)["experiment"]["experiment_id"])


def browser(width: int, height: int) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        raise SystemExit("no chromium and chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--hide-scrollbars",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(driver))


PARENT_EXPANDER = "button[data-component-id*='runnamecellrenderer']"


def shoot(driver: Any, page: str, out: Path) -> None:
    """The runs page in MLflow's "Model training" view, its assistant panel closed, the study's
    run expanded to show its trials' runs, beside their metric charts."""
    driver.get(page)
    body = lambda: driver.find_element("tag name", "body").text  # noqa: E731
    wait_for(lambda: STUDY in body(), "the runs table", 120)
    driver.execute_script("localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false')")
    for toggle in driver.find_elements("css selector", "div"):
        if toggle.text.strip() == "Model training":
            toggle.click()
            time.sleep(2)
            break
    driver.get(f"{page}?compareRunsMode=CHART")
    driver.refresh()
    expander = wait_for(
        lambda: driver.find_elements("css selector", PARENT_EXPANDER), "the study's run", 120
    )
    expander[0].click()
    wait_for(lambda: "trial 0" in body(), "the trials' runs", 60)
    wait_for(
        lambda: len(driver.find_elements("css selector", ".js-plotly-plot, canvas")) > 0,
        "a metric chart",
        60,
    )
    time.sleep(5)  # the charts' lines drawn
    driver.save_screenshot(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "mlflow.png")
    parser.add_argument("--size", default="1500,1000", help="the browser window, WIDTH,HEIGHT")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hpo-mlflow-screenshot-"))
    server, uri = start_server(folder)
    driver = None
    try:
        run_study(folder, uri, options.trials)
        found = experiment_id(uri)
        width, height = (int(n) for n in options.size.split(","))
        driver = browser(width, height)
        shoot(driver, f"{uri}/#/experiments/{found}/runs", options.out)
    finally:
        if driver is not None:
            driver.quit()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        if not options.keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"kept {folder}")


if __name__ == "__main__":
    main()
