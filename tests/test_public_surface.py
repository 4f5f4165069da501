"""What user code may import: every name in `hpo.__all__` (and `hpo.integrations`). Each one
imports, `import hpo` alone stays light, and the examples import nothing else of hpo's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hpo
from tests.conftest import REPO

HEAVY = ("torch", "transformers", "optuna")


@pytest.mark.parametrize("name", sorted(set(hpo.__all__) - {"__version__"}))
def test_every_public_name_imports(name: str) -> None:
    value = getattr(hpo, name)
    assert value is not None
    assert name in dir(hpo)


def test_the_task_classes_are_the_built_in_ones_users_subclass() -> None:
    from hpo.trainer.tasks import sequence_classification

    assert hpo.SequenceClassification is sequence_classification.SequenceClassification
    for task in (hpo.SequenceClassification, hpo.Regression, hpo.MultiLabelClassification):
        assert issubclass(task, hpo.Task)
    for task in (hpo.TokenClassification, hpo.CausalLM):
        assert issubclass(task, hpo.TokenTask)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'TrialProcess'"):
        hpo.TrialProcess  # noqa: B018


def _type_checking_names() -> set[str]:
    """The names hpo/__init__.py imports for type checkers (its `if TYPE_CHECKING:` block)."""
    tree = ast.parse((REPO / "hpo" / "__init__.py").read_text(encoding="utf-8"))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
        if node.test.id == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_all_lists_each_lazy_name_and_type_checkers_see_each() -> None:
    public = set(hpo.__all__) - {"__version__"}
    assert public == set(hpo._PUBLIC)
    assert public <= _type_checking_names()


def test_import_hpo_alone_loads_no_torch_transformers_or_optuna() -> None:
    code = (
        "import sys, hpo; hpo.__version__; hpo.ConfigError; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _internal_imports(path: Path, root: Path = REPO) -> list[str]:
    """The modules of hpo, trainer or storage that `path` imports, other than `hpo` itself and
    `hpo.integrations` (public)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            public = name == "hpo" or name.split(".")[:2] == ["hpo", "integrations"]
            if name.split(".")[0] in ("hpo", "trainer", "storage") and not public:
                found.append(f"{path.relative_to(root)}: {name}")
    return found


def test_the_examples_import_only_from_hpo() -> None:
    examples = sorted((REPO / "examples").rglob("*.py"))
    assert examples
    assert [found for path in examples for found in _internal_imports(path)] == []


def test_an_internal_import_in_an_example_is_found(tmp_path: Path) -> None:
    example = tmp_path / "example.py"
    example.write_text(
        "import hpo\nfrom hpo import TrainingContext\nfrom hpo.integrations import transformers\n"
        "def f():\n    from hpo.trainer.tasks.base import Task\n    import hpo.trial.process\n"
    )
    assert _internal_imports(example, tmp_path) == [
        "example.py: hpo.trainer.tasks.base",
        "example.py: hpo.trial.process",
    ]
