"""The packages' shape, as a reader meets it: no module of hpo/, trainer/ or storage/ over 600
lines, functions that fit on a screen, the trainer free of Optuna, one place that decides a
trial's physical batch, a worker's loop that loads no torch, and a map of the tests that names
every test file (tests/README.md).

Which package imports which, and that no package's modules import each other in a cycle, is the
import contract's to say (pyproject.toml [tool.importlinter], tests/test_import_contract.py).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("hpo", "trainer", "storage")
MAX_MODULE_LINES = 600
SCREEN_LINES = 50
# hpo/ still has functions longer than a screen (the CLI's parser, the commands' workflows):
# at most this many, none longer than HPO_MAX_FUNCTION_LINES. Lower both as they are split;
# never raise them.
HPO_LONG_FUNCTIONS = 26
HPO_MAX_FUNCTION_LINES = 140
# `hpo batch-size` runs a search on request and prints it: it decides no run's batch.
BATCH_SIZE_COMMAND = "hpo/commands/batch_size.py"


def _modules(package: str) -> list[Path]:
    modules = sorted((REPO / package).rglob("*.py"))
    assert len(modules) > 5, f"{package}/ is not where it was"  # the package is there and read
    return modules


def _functions(source: str, where: str) -> Iterator[tuple[str, int]]:
    """Every function and method in `source`, nested ones too: (where it starts, its lines)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            yield f"{where}:{node.lineno} {node.name}", lines


def _long_functions(package: str, bound: int) -> dict[str, int]:
    """The functions of `package` longer than `bound` lines, by where they start."""
    return {
        name: lines
        for path in _modules(package)
        for name, lines in _functions(path.read_text(encoding="utf-8"), _relative(path))
        if lines > bound
    }


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_longer_than_600_lines(package: str) -> None:
    long = {
        _relative(path): lines
        for path in _modules(package)
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, "split these by job: " + ", ".join(f"{p} ({n})" for p, n in long.items())


def test_the_function_measure_counts_every_line_of_a_function() -> None:
    body = "".join(f"        x = {i}\n" for i in range(SCREEN_LINES))
    source = f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}"
    assert dict(_functions(source, "m.py")) == {"m.py:1 short": 2, "m.py:6 long": 51}


@pytest.mark.parametrize("package", ["trainer", "storage"])
def test_trainer_and_storage_functions_fit_on_a_screen(package: str) -> None:
    assert _long_functions(package, SCREEN_LINES) == {}


def test_hpo_has_no_more_functions_longer_than_a_screen_than_it_had() -> None:
    long = _long_functions("hpo", SCREEN_LINES)
    shown = ", ".join(f"{name} ({lines})" for name, lines in sorted(long.items()))
    assert len(long) <= HPO_LONG_FUNCTIONS, shown
    assert max(long.values(), default=0) <= HPO_MAX_FUNCTION_LINES, shown


def test_the_trainer_never_imports_optuna() -> None:
    """Not even inside a function: the trainer takes a plain config and knows no trial (the
    import contract covers hpo, trainer and storage, not Optuna)."""
    found = []
    for path in _modules("trainer"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            found += [f"{_relative(path)}:{node.lineno}" for n in names if n.startswith("optuna")]
    assert found == []


def test_one_place_decides_an_auto_physical_batch() -> None:
    """trainer/batch_finder.py's resolve_physical_batch decides between the configured size,
    the cache and a search; nothing else searches or keys the cache itself (train() and the
    objective both once did, and could disagree)."""
    assert (REPO / BATCH_SIZE_COMMAND).is_file(), f"{BATCH_SIZE_COMMAND} moved: name it here"
    deciders = {"find_physical_batch_size", "batch_key", "BatchFinder"}
    calls, users = [], []
    for package in ("trainer", "hpo"):
        for path in _modules(package):
            where, source = _relative(path), path.read_text(encoding="utf-8")
            if "resolve_physical_batch(" in source:
                users.append(where)
            if where in ("trainer/batch_finder.py", BATCH_SIZE_COMMAND):
                continue
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in deciders:
                        calls.append(f"{where}:{node.lineno} {name}")
    assert calls == []
    # The trainer's own loop, each rank of a distributed run (trainer/rank_batch.py: the
    # smallest rank's size wins, the cache asked by the main rank), and one module of hpo: the
    # trial's training, which asks first (for the batch cache shared by the study's trials).
    assert [u for u in users if u.startswith("trainer/")] == [
        "trainer/batch_finder.py",
        "trainer/loop.py",
        "trainer/rank_batch.py",
    ]
    assert len([u for u in users if u.startswith("hpo/")]) == 1, users


def test_the_worker_loop_imports_neither_torch_nor_transformers() -> None:
    # A worker's study loop, storage and objective load in 60 MB instead of 240: hundreds of
    # light workers on a host (bench/many_workers.py). Only the trial's training, in the
    # trial process, needs them.
    modules = [
        "hpo.study.loop",
        "hpo.trial.objective",
        "hpo.study.trials",
        "hpo.storage.engine",
        "hpo.storage.batch_cache",
        "hpo.storage.artifacts",
    ]
    code = (
        f"import sys, {', '.join(modules)}; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_map_of_the_tests_names_every_test_file_and_no_other() -> None:
    named = set(re.findall(r"`(test_\w+\.py)`", (REPO / "tests" / "README.md").read_text()))
    files = {path.name for path in (REPO / "tests").glob("test_*.py")}
    assert len(files) > 50  # the folder is read
    assert sorted(files - named) == [], "add them to tests/README.md"
    assert sorted(named - files) == [], "tests/README.md names files that are not there"
