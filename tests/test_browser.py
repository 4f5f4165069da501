"""The report and `hpo dashboard` in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium; scripts/test installs them where it can). Without them:
a failure under CI=true, a skip elsewhere. With HPO_SCREENSHOTS=DIR the pages are saved there as
PNG (the documentation's screenshots come from here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import missing, run_hpo
from tests.test_monitoring import start_dashboard
from tests.test_study_report import PLOTS, finished_study

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or DRIVER is None:
        missing("no chromium and chromedriver: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.3)


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(driver: Any, name: str) -> None:
    folder = os.environ.get("HPO_SCREENSHOTS")
    if folder:
        driver.save_screenshot(str(Path(folder) / name))


DRAWN_PLOTS = """return Array.from(document.querySelectorAll('.plotly-graph-div')).map(div => {
  const svg = div.querySelector('svg.main-svg');
  if (!svg) return null;
  const box = svg.getBoundingClientRect();
  // Data marks, not the modebar's icons or the background: a plot of nothing has none.
  const marks = div.querySelectorAll(
    '.scatterlayer .trace .point, .scatterlayer .trace path.js-line, .barlayer .point');
  return [box.width, box.height, marks.length];
});"""


def test_the_report_draws_every_plot_in_a_real_browser(tmp_path: Path, browser: Any) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    finished_study(url)
    page = tmp_path / "report.html"
    made = run_hpo(
        "report", "--study", "watched", "--storage", url, "--out", str(page), cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr[-2000:]
    browser.get(page.as_uri())
    plots = wait_for(
        lambda: (drawn := browser.execute_script(DRAWN_PLOTS)) and all(drawn) and drawn,
        "every plot of the report drawn as SVG",
    )
    assert len(plots) == len(PLOTS)
    for width, height, marks in plots:
        assert width > 300 and height > 300 and marks > 0, plots
    assert console_errors(browser) == []
    screenshot(browser, "report.png")


def test_the_dashboard_names_the_metric_and_shows_user_attributes(
    tmp_path: Path, browser: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    finished_study(url)
    server, port = start_dashboard(url, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}/dashboard/studies/1"
        wait_for(lambda: _serving(base, server), "the dashboard answering")
        browser.get(base)
        text = wait_for(
            lambda: "accuracy" in (t := _text(browser)) and _svgs(browser) >= 2 and t,
            "the study's history plotted, its metric named",
        )
        assert "Objective 0" not in text
        screenshot(browser, "dashboard.png")
        browser.get(f"{base}/trials")
        text = wait_for(lambda: "User Attributes" in (t := _text(browser)) and t, "the trial list")
        assert "10 Trials" in text and "Pruned" in text and "Fail" in text
        assert "samples_per_s" in text and "physical_batch_size" in text
        assert console_errors(browser) == []
    finally:
        server.terminate()
        server.wait(timeout=30)


def _text(driver: Any) -> str:
    return str(driver.execute_script("return document.body.innerText"))


def _svgs(driver: Any) -> int:
    return int(driver.execute_script("return document.querySelectorAll('svg.main-svg').length"))


def _serving(address: str, server: subprocess.Popen[bytes]) -> bool:
    import urllib.request

    if server.poll() is not None:
        raise AssertionError(f"hpo dashboard exited with {server.returncode}")
    try:
        with urllib.request.urlopen(address, timeout=5):
            return True
    except OSError:
        return False
