"""hpo: hyperparameter optimisation for fine-tuning transformer models.

What user code may import is exported here and listed in `hpo.__all__`: the Python API
(`hpo.run`, `hpo.open_study`), the plug-in surface (the training context a training function
gets, the task classes to subclass, the model request a model factory gets, the shapes of a
metrics function and a define-by-run search space) and the errors. `hpo.integrations` (e.g.
`hpo.integrations.transformers`) is public too. Everything else, every module under hpo/,
trainer/ and storage/, is internal and may move or change without notice: import from `hpo`.

Kept import-light: the CLI reports a bad config before torch, transformers or Optuna load, and
`import hpo` costs a script nothing. Each name loads its module on first use.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `hpo` starts fast

# Each public name and the module that defines it, imported when the name is first used.
_PUBLIC = {
    "run": "hpo.api",
    "open_study": "hpo.api",
    "load_model": "hpo.api",
    "Study": "hpo.api",
    "Trial": "hpo.api",
    "RunResult": "hpo.api",
    "HPOError": "hpo.errors",
    "ConfigError": "hpo.errors",
    "DataError": "hpo.errors",
    "DeviceError": "hpo.errors",
    "ModelError": "hpo.errors",
    "StorageError": "hpo.errors",
    "TrainerError": "hpo.errors",
    # The plug-in surface: what hpo hands the user's code, and what it may subclass.
    "TrainingContext": "hpo.plugins.context",
    "TrainingFunction": "hpo.plugins.entrypoint",
    "MetricsFunction": "hpo.plugins.protocols",
    "SearchSpaceFunction": "hpo.plugins.protocols",
    "ModelRequest": "hpo.trainer.model_factory",
    "Task": "hpo.trainer.tasks.base",
    "TokenTask": "hpo.trainer.tasks.base",
    "SequenceClassification": "hpo.trainer.tasks.sequence_classification",
    "MultiLabelClassification": "hpo.trainer.tasks.multi_label",
    "Regression": "hpo.trainer.tasks.regression",
    "TokenClassification": "hpo.trainer.tasks.token_classification",
    "CausalLM": "hpo.trainer.tasks.causal_lm",
}

__all__ = [
    "CausalLM",
    "ConfigError",
    "DataError",
    "DeviceError",
    "HPOError",
    "MetricsFunction",
    "ModelError",
    "ModelRequest",
    "MultiLabelClassification",
    "Regression",
    "RunResult",
    "SearchSpaceFunction",
    "SequenceClassification",
    "StorageError",
    "Study",
    "Task",
    "TokenClassification",
    "TokenTask",
    "TrainerError",
    "TrainingContext",
    "TrainingFunction",
    "Trial",
    "__version__",
    "load_model",
    "open_study",
    "run",
]

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from typing import Any

    __version__: str
    from hpo.api import RunResult, Study, Trial, load_model, open_study, run
    from hpo.errors import (
        ConfigError,
        DataError,
        DeviceError,
        HPOError,
        ModelError,
        StorageError,
        TrainerError,
    )
    from hpo.plugins.context import TrainingContext
    from hpo.plugins.entrypoint import TrainingFunction
    from hpo.plugins.protocols import MetricsFunction, SearchSpaceFunction
    from hpo.trainer.model_factory import ModelRequest
    from hpo.trainer.tasks.base import Task, TokenTask
    from hpo.trainer.tasks.causal_lm import CausalLM
    from hpo.trainer.tasks.multi_label import MultiLabelClassification
    from hpo.trainer.tasks.regression import Regression
    from hpo.trainer.tasks.sequence_classification import SequenceClassification
    from hpo.trainer.tasks.token_classification import TokenClassification


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the package's metadata (hpo/version.py), read on first use
        from hpo.version import hpo_version

        globals()[name] = hpo_version()
        return globals()[name]
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, "__version__"})
