"""The errors the `hpo` CLI turns into one line and exit code 2; a traceback only with --debug.

`trainer/` and `storage/` own their errors (they import nothing from `hpo`); they are named here
so that the CLI maps one tuple, `USER_ERRORS`. Every message says what is wrong and what to do.
"""

from hpo.storage.errors import StorageError
from hpo.storage.url import mask_text
from hpo.trainer.errors import DataError, DeviceError, ModelError, TrainerError


class HPOError(Exception):
    """Bad input or an unusable environment that the user can fix."""


class ConfigError(HPOError):
    """The YAML config breaks one or more rules; `problems` lists every one of them. One problem
    is one line; several are a count and a line each."""

    SHOWN = 20  # a file of 5,000 bad keys gets 20 lines and a count, not 5,000 lines

    def __init__(self, problems: list[str], source: str = "config") -> None:
        # A value shown back may hold a password: `storage: [postgresql://u:secret@h/db]`.
        problems = [mask_text(p) for p in problems]
        self.problems = problems
        if len(problems) == 1:  # one problem, one line
            super().__init__(f"{source}: {problems[0]}")
            return
        shown = [f"  - {p}" for p in problems[: self.SHOWN]]
        if len(problems) > self.SHOWN:
            shown.append(f"  - ... and {len(problems) - self.SHOWN} more")
        lines = "\n".join(shown)
        super().__init__(f"{source}: {len(problems)} problems; fix them and run again:\n{lines}")


# Every error that is the user's to fix: one line and exit code 2.
USER_ERRORS = (HPOError, TrainerError, StorageError)

__all__ = [
    "USER_ERRORS",
    "ConfigError",
    "DataError",
    "DeviceError",
    "HPOError",
    "ModelError",
    "StorageError",
    "TrainerError",
]
