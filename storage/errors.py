"""The storage layer's one error: the study database cannot be reached or used.

`hpo` maps it to one line and exit code 2. Messages never contain a password.
"""


class StorageError(Exception):
    """The study database cannot be reached or used. Messages never contain a password."""
