"""hpo as users install it: one version in one place, what `hpo --version` reports, the
demo shipped in the package, the wheel's contents and the extras."""

from __future__ import annotations

import re
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
