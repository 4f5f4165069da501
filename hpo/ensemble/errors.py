"""The ensemble's one error: bad input to stacking, a soup, a cache or a saved ensemble. An
`HPOError`, so the CLI shows it as one line with exit code 2."""

from __future__ import annotations

import importlib.util

from hpo.errors import HPOError

# Stacking's meta-learners and their files: scikit-learn and skops, in the extra of that name.
EXTRA = "hpo[ensemble]"
_STACKING_MODULES = {"sklearn": "scikit-learn", "skops": "skops"}


class EnsembleError(HPOError):
    """Members or a saved ensemble that cannot be combined or loaded; the message says why and
    what to do."""


def require_stacking(what: str) -> None:
    """`what` (a stacked ensemble, its saved meta-learner) needs scikit-learn and skops: one
    line naming the extra when either is missing. Greedy selection and soups need neither."""
    missing = [p for m, p in _STACKING_MODULES.items() if importlib.util.find_spec(m) is None]
    if missing:
        raise EnsembleError(
            f"{what} needs {' and '.join(missing)}, not installed; pip install '{EXTRA}'"
        )
