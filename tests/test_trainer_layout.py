"""The packages' shape: no trainer module imports another that imports it back (not even from
inside a function), nothing in trainer/ or storage/ reaches up into hpo, and functions fit on a
screen."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

TRAINER = REPO / "trainer"
SCREEN_LINES = 50


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "trainer":  # from trainer import device
                found.update(f"trainer.{alias.name}" for alias in node.names)
    return found


def _trainer_graph() -> dict[str, set[str]]:
    modules = {f"trainer.{p.stem}": p for p in TRAINER.glob("*.py") if p.stem != "__init__"}
    return {name: _imports(path) & modules.keys() for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            cycle = visit(imported, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m, [])) is not None), None)


def test_trainer_modules_import_each_other_without_cycles() -> None:
    graph = _trainer_graph()
    assert "trainer.step" in graph["trainer.loop"]  # the graph is read, imports and all
    assert "trainer.step" in graph["trainer.batch_finder"]
    assert _cycle(graph) is None, _cycle(graph)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_trainer_imports_nothing_from_hpo_storage_or_optuna() -> None:
    upward = {
        f"{path.name}: {module}"
        for path in TRAINER.glob("*.py")
        for module in _imports(path)
        if module.split(".")[0] in ("hpo", "storage", "optuna")
    }
    assert not upward


def test_storage_imports_nothing_from_hpo_or_the_trainer() -> None:
    """storage/ sits below hpo/: its errors are its own, which hpo/cli.py maps to exit 2."""
    files = list((REPO / "storage").glob("*.py"))
    assert len(files) > 5  # the package is there and read
    upward = {
        f"{path.name}: {module}"
        for path in files
        for module in _imports(path)
        if module.split(".")[0] in ("hpo", "trainer")
    }
    assert not upward


def test_trainer_functions_fit_on_a_screen() -> None:
    long = []
    for path in TRAINER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > SCREEN_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long


def test_one_place_decides_an_auto_physical_batch() -> None:
    """trainer/batch_finder.py's resolve_physical_batch decides between the configured size,
    the cache and a search; nothing else searches or keys the cache itself (train() and the
    objective both once did, and could disagree)."""
    deciders = {"find_physical_batch_size", "batch_key", "BatchFinder"}
    calls = []
    for package in ("trainer", "hpo"):
        for path in (REPO / package).rglob("*.py"):
            where = path.relative_to(REPO).as_posix()
            # `hpo batch-size` runs a search on request and prints it: it decides no run's batch.
            if where in ("trainer/batch_finder.py", "hpo/commands/batch_size.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in deciders:
                        calls.append(f"{where}:{node.lineno} {name}")
    assert calls == []
    users = [
        path.relative_to(REPO).as_posix()
        for package in ("trainer", "hpo")
        for path in (REPO / package).rglob("*.py")
        if "resolve_physical_batch(" in path.read_text(encoding="utf-8")
    ]
    assert sorted(users) == ["hpo/trial/training.py", "trainer/batch_finder.py", "trainer/loop.py"]


def test_the_worker_loop_imports_neither_torch_nor_transformers() -> None:
    # A worker's study loop, storage and objective load in 60 MB instead of 240 (issue 13:
    # hundreds of light workers on a host, bench/many_workers.py); only the trial's training
    # (hpo/trial_training.py, in the trial process) needs them.
    import subprocess
    import sys

    code = (
        "import sys, hpo.study.loop, hpo.trial.objective, hpo.study.trials, storage.engine, "
        "storage.batch_cache; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
