"""The storage layer's errors: the study database cannot be reached or used.

`hpo` maps them to one line: exit code 2, or 1 for an outage that outlasted its window.
Messages never contain a password.
"""


class StorageError(Exception):
    """The study database cannot be reached or used. Messages never contain a password."""


class DatabaseUnreachable(StorageError):
    """The study database, reached before, stayed unreachable for longer than the outage
    window: nothing the user typed is wrong, and the same command works once it is back."""
