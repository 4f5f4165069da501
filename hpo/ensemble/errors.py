"""The ensemble's one error: bad input to stacking, a soup, a cache or a saved ensemble. An
`HPOError`, so the CLI shows it as one line with exit code 2."""

from __future__ import annotations

from hpo.errors import HPOError


class EnsembleError(HPOError):
    """Members or a saved ensemble that cannot be combined or loaded; the message says why and
    what to do."""
