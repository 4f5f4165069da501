"""hpo: hyperparameter optimisation for fine-tuning transformer models.

Kept import-light: the CLI reports a bad config before torch, transformers or Optuna load, and
`import hpo` costs a script nothing. The Python API (hpo.api: `hpo.run`, `hpo.open_study`) and
the errors load on first use of their names.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `hpo` starts fast
__version__ = "0.1.0"

# Each public name and the module that defines it, imported when the name is first used.
_PUBLIC = {
    "run": "hpo.api",
    "open_study": "hpo.api",
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
}

__all__ = [
    "ConfigError",
    "DataError",
    "DeviceError",
    "HPOError",
    "ModelError",
    "RunResult",
    "StorageError",
    "Study",
    "TrainerError",
    "Trial",
    "__version__",
    "open_study",
    "run",
]

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from typing import Any

    from hpo.api import RunResult, Study, Trial, open_study, run
    from hpo.errors import (
        ConfigError,
        DataError,
        DeviceError,
        HPOError,
        ModelError,
        StorageError,
        TrainerError,
    )


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
