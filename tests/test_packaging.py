"""What the package imports is what it declares: an undeclared import works only where another
package happens to pull it in."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("hpo", "trainer", "storage")


def _imported_top_level_modules() -> set[str]:
    found: set[str] = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    found.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module.split(".")[0])
    return found - set(PACKAGES) - set(sys.stdlib_module_names)


def _declared() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    # The users' extras (hpo[mlflow], hpo[tensorboard]) declare what the package imports only
    # when a config asks for it; dev is the tests' and tools', which the package never imports.
    extras = [
        spec
        for name, specs in project["optional-dependencies"].items()
        if name != "dev"
        for spec in specs
    ]
    specs = [*project["dependencies"], *extras]
    names = {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0] for spec in specs}
    return {name.lower().replace("_", "-") for name in names}


def test_every_third_party_import_of_the_package_is_a_declared_dependency() -> None:
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    undeclared = {}
    for module in sorted(_imported_top_level_modules()):
        owners = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not owners & declared:
            undeclared[module] = sorted(owners)
    assert undeclared == {}, f"imported but not in pyproject dependencies: {undeclared}"


def _shipped_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports (anywhere in it, functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(name for name in names if name in modules)
    return found


def _module_name(path: Path) -> str:
    """The name a file imports as: trainer/ and storage/ are hpo.trainer and hpo.storage."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts if parts[0] == "hpo" else ("hpo", *parts))


def test_every_shipped_module_serves_the_command_line() -> None:
    """A module that only the tests import (a scratch database helper once shipped in storage/)
    belongs under tests/; a module nothing imports is dead."""
    files = {
        _module_name(path): path for package in PACKAGES for path in (REPO / package).rglob("*.py")
    }
    modules = {name.removesuffix(".__init__") for name in files}
    by_module = {name.removesuffix(".__init__"): path for name, path in files.items()}
    # Task modules are imported by name from the catalog (trainer.tasks.task_class), and the
    # fork server imports its preload list by name (hpo.trial.fork_server only there).
    from hpo.trainer.tasks import TASKS
    from hpo.trial.fork_start import ENTRYPOINT_PRELOAD, PRELOAD, TRAINER_PRELOAD

    by_name = (
        [f"hpo.trainer.tasks.{t.module}" for t in TASKS.values()] + PRELOAD + ENTRYPOINT_PRELOAD
    )
    by_name += TRAINER_PRELOAD  # hpo.integrations: imported by users, and preloaded by name
    reached, todo = set(), ["hpo.__main__", *(name for name in by_name if name in by_module)]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo.extend(_shipped_imports(by_module[module], modules))
        # Importing a module runs every package above it (hpo.config.loader: hpo, hpo.config).
        parts = module.split(".")
        todo.extend(".".join(parts[:end]) for end in range(1, len(parts)))
    assert len(reached) > 30  # the walk works
    assert sorted(modules - reached) == []
