"""The one exception tree of hpo. The CLI turns an `HPOError` into one line and exit code 2.

Every message says what is wrong and what to do about it.
"""


class HPOError(Exception):
    """Bad input or an unusable environment that the user can fix."""


class ConfigError(HPOError):
    """The YAML config breaks one or more rules; `problems` lists every one of them."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"{source}: {len(problems)} {noun}; fix them and run again:\n{lines}")


class DataError(HPOError):
    """A dataset file is missing, unreadable or does not match the config."""


class ModelError(HPOError):
    """A model or tokenizer cannot be loaded or built."""


class StorageError(HPOError):
    """The study database cannot be reached or used. Messages never contain a password."""
