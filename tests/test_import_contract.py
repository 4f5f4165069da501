"""The import contract in pyproject.toml ([tool.importlinter]), as scripts/test runs it: kept
by the tree as it is, and broken by an upward import or an import cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120
    )


def _copy_of_the_tree(tmp_path: Path) -> Path:
    for package in ("hpo", "trainer", "storage"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_the_contract() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_it(tmp_path: Path) -> None:
    root = _copy_of_the_tree(tmp_path)
    with (root / "trainer" / "metrics.py").open("a") as f:
        f.write("\n\ndef _upward() -> None:\n    from hpo import cli  # noqa: F401\n")
    result = _lint_imports(root)
    assert result.returncode != 0
    assert "hpo sits above trainer and storage" in result.stdout
    assert "trainer.metrics -> hpo.cli" in result.stdout


def test_an_import_cycle_breaks_it(tmp_path: Path) -> None:
    root = _copy_of_the_tree(tmp_path)
    # trial_training imports trial_task; the other way round closes a cycle (as objective and
    # trial_training once did, each importing the other).
    with (root / "hpo" / "trial_task.py").open("a") as f:
        f.write("\n\ndef _back() -> None:\n    from hpo import trial_training  # noqa: F401\n")
    result = _lint_imports(root)
    assert result.returncode != 0
    assert "No cycles are allowed in hpo" in result.stdout
