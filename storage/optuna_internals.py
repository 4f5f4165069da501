"""The one place hpo touches a private name of Optuna: its trial cache for RDB storages.

`optuna.create_study(storage=RDBStorage(...))` wraps the storage in `_CachedStorage`, so finished
trials are read once; hpo wraps the storage in its own class (outage retries) and so has to add
the cache itself. tests/test_study_trials.py::test_optunas_trial_cache_that_hpo_uses_is_still_there
breaks if an upgrade moves or changes it.
"""

from __future__ import annotations

import optuna
from optuna.storages import BaseStorage, RDBStorage


def cached(backend: RDBStorage) -> BaseStorage:
    """`backend` behind Optuna's own cache of finished trials, as Optuna itself uses it."""
    return optuna.storages._CachedStorage(backend)
