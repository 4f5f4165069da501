"""The trainer's errors: bad data, a model that cannot load, a device that is not there.

Each is the user's to fix; `hpo` maps them to one line and exit code 2.
"""


class TrainerError(Exception):
    """Bad trainer input or an unusable environment that the user can fix."""


class DataError(TrainerError):
    """A dataset file is missing, unreadable or does not match the config."""


class ModelError(TrainerError):
    """A model or tokenizer cannot be loaded or built."""


class DeviceError(TrainerError):
    """The configured device is not available on this host."""
