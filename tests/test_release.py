"""hpo as users install it: one version in one place, what `hpo --version` reports, the
demo shipped in the package, the wheel's contents and the extras."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import hpo.version
from tests.conftest import REPO, run_hpo


def _pyproject_version() -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
    assert found is not None
    return found.group(1)


def test_the_version_is_pyprojects() -> None:
    assert hpo.version.hpo_version() == _pyproject_version()


def test_a_checkout_without_install_reads_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hpo.version.metadata, "version", not_installed)
    assert hpo.version.hpo_version() == _pyproject_version()
    monkeypatch.setattr(hpo.version, "_PYPROJECT", Path("/nonexistent/pyproject.toml"))
    assert hpo.version.hpo_version() == "unknown"


def test_version_names_what_a_bug_report_needs(tmp_path: Path) -> None:
    done = run_hpo("--version", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"hpo {_pyproject_version()}"
    names = [line.split()[0] for line in lines]
    assert names == ["hpo", "python", "torch", "transformers", "optuna", "device"]
    assert lines[-1] in {"device cpu", "device mps"} or lines[-1].startswith("device cuda")
    assert f"torch {metadata.version('torch')}" in lines


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, as `python -m build` makes them (the wheel from the sdist):
    scripts/test's, named by HPO_DIST, else built here."""
    given = os.environ.get("HPO_DIST")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("hpo-*.whl")
    return wheel


def test_the_wheel_ships_the_demo_laid_out_as_in_the_repository(dist: Path, tmp_path: Path) -> None:
    """Installed (no checkout beside it), hpo finds its demo config, and the config's relative
    data paths reach the demo's data inside the package."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + [str(_wheel(dist))],
        check=True,
        timeout=120,
    )
    code = (
        "from hpo.config.loader import DEMO_CONFIG, load_config; c = load_config(DEMO_CONFIG); "
        "print(DEMO_CONFIG); print(c.data.train_file); print(c.data.eval_file)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    config, train, evaluation = (Path(line) for line in done.stdout.splitlines())
    assert config == target / "hpo" / "_demo" / "configs" / "demo.yaml"
    for data, name in ((train, "train.csv"), (evaluation, "eval.csv")):
        assert data.resolve().is_relative_to(target / "hpo")
        assert data.read_bytes() == (REPO / "data" / "demo" / name).read_bytes()
    assert config.read_bytes() == (REPO / "configs" / "demo.yaml").read_bytes()


def test_the_wheel_holds_one_top_level_package(dist: Path) -> None:
    """trainer and storage are hpo.trainer and hpo.storage: installed beside Coqui's `trainer`
    or PyPI's `storage`, hpo overwrites none of their files."""
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        names = wheel.namelist()
        metadata_text = wheel.read(next(n for n in names if n.endswith("/METADATA"))).decode()
        top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"hpo"}
    assert "hpo/trainer/loop.py" in names and "hpo/storage/url.py" in names
    assert "License-Expression: Apache-2.0" in metadata_text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_sdist_holds_trainer_and_storage_once_and_no_links(dist: Path) -> None:
    (sdist,) = dist.glob("hpo-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
    names = {m.name.split("/", 1)[1] for m in members if "/" in m.name}
    assert not [m.name for m in members if m.issym() or m.islnk()]
    assert "trainer/loop.py" in names and "storage/url.py" in names
    assert not [n for n in names if n.startswith(("hpo/trainer", "hpo/storage"))]
    assert {"setup.py", "LICENSE", "configs/demo.yaml", "data/demo/train.csv"} <= names
