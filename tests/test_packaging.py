"""What the package imports is what it declares: an undeclared import works only where another
package happens to pull it in."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys

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
    names = {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0] for spec in project["dependencies"]}
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
