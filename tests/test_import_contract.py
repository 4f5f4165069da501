"""The import contract in pyproject.toml ([tool.importlinter]), as scripts/test runs it: kept
by the tree as it is, and broken by an upward import, between packages or between hpo's rooms,
or by an import cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120
    )


def _tree_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of hpo, trainer and storage where `module` (a file path) has `line` in a function.
    The links hpo/trainer and hpo/storage stay links, to the copies."""
    for package in ("hpo", "trainer", "storage"):
        shutil.copytree(
            REPO / package,
            tmp_path / package,
            symlinks=True,
            ignore=shutil.ignore_patterns("*.pyc"),
        )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with (tmp_path / module).open("a") as f:
        f.write(f"\n\ndef _added() -> None:\n    {line}  # noqa: F401\n")
    return tmp_path


def test_the_tree_keeps_the_contract() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


BREAKS = {
    "trainer reaching up into hpo": (
        "trainer/metrics.py",
        "from hpo.cli import app",
        "hpo sits above trainer and storage",
    ),
    "storage reaching up into hpo's errors": (
        "storage/url.py",
        "from hpo import errors",
        "hpo sits above trainer and storage",
    ),
    "storage importing the trainer": (
        "storage/batch_cache.py",
        "from hpo.trainer import device",
        "trainer and storage do not import each other",
    ),
    "a trial reaching up into a command": (
        "hpo/trial/objective.py",
        "from hpo.commands import run",
        "hpo's rooms, each importing only those below it",
    ),
    "a plug-in reaching up into the trial machinery": (
        "hpo/plugins/loading.py",
        "from hpo.trial import process",
        "hpo's rooms, each importing only those below it",
    ),
    "the trial machinery reaching up into the study's Pareto rule": (
        "hpo/trial/folders.py",
        "from hpo.study import front",
        "hpo's rooms, each importing only those below it",
    ),
    "the config reaching up into the study": (
        "hpo/config/loader.py",
        "from hpo.study import join",
        "hpo's rooms, each importing only those below it",
    ),
    "a command reaching up into the Python API": (
        "hpo/commands/monitor.py",
        "from hpo.api import Study",
        "hpo's rooms, each importing only those below it",
    ),
    "the Python API importing an integration": (
        "hpo/api/__init__.py",
        "from hpo.integrations import transformers",
        "hpo's rooms, each importing only those below it",
    ),
    "the command line importing the Python API": (
        "hpo/cli/app.py",
        "from hpo.api import run",
        "hpo's rooms, each importing only those below it",
    ),
    "a shared module reaching into a room": (
        "hpo/live.py",
        "from hpo.reports import text",
        "hpo's shared modules",
    ),
    "the command line importing the trainer": (
        "hpo/cli/parser.py",
        "import hpo.trainer.loop",
        "the command line parses and prints",
    ),
    # trial/training imports trial/task; the other way round closes a cycle, as
    # hpo/objective.py and hpo/trial_training.py once did, each importing the other.
    "an import cycle": (
        "hpo/trial/task.py",
        "from hpo.trial import training",
        "No cycles are allowed in hpo.trial",
    ),
}


@pytest.mark.parametrize("case", BREAKS.values(), ids=BREAKS.keys())
def test_a_wrong_import_breaks_it(tmp_path: Path, case: tuple[str, str, str]) -> None:
    module, line, contract = case
    result = _lint_imports(_tree_with(tmp_path, module, line))
    assert result.returncode != 0, result.stdout
    assert contract in result.stdout


def test_the_contract_names_every_module_trainer_and_storage_may_not_import() -> None:
    """The first contract lists hpo's modules by name: a new one must join the list."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c.get("source_modules") == ["hpo.trainer", "hpo.storage"]
    ]
    modules = {
        f"hpo.{path.stem if path.is_file() else path.name}"
        for path in (REPO / "hpo").iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    }
    assert set(contract["forbidden_modules"]) == modules - {"hpo.trainer", "hpo.storage"}
