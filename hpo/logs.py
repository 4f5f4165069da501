"""Logging for the worker and its trial processes: one format, with the worker's GPU label when
several workers share a terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from hpo.storage.url import mask_text

# Set by `hpo run --gpus` for each worker it starts, e.g. "gpu1".
WORKER_LABEL_ENV = "HPO_WORKER_LABEL"


def worker_label() -> str | None:
    return os.environ.get(WORKER_LABEL_ENV) or None


class MaskingFormatter(logging.Formatter):
    """Every log line, traceback included, with a database password masked: a library's error
    (SQLAlchemy's "Could not parse SQLAlchemy URL from string ...") quotes the URL it got."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record))


def quiet_library_output() -> None:
    """What the libraries print that a worker's user does not want (unless they chose
    otherwise in the environment); before the libraries load."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # "Some weights were newly initialized" is expected for every fine-tuning run, and a
    # progress bar at every checkpoint ("Writing model shards") is noise in a worker's log.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # In a notebook without ipywidgets, tqdm.auto (which the libraries import) warns that it
    # falls back to text bars: nothing for the user of hpo.run to act on.
    warnings.filterwarnings("ignore", message="IProgress not found")
    # Read when the libraries load: where they already have (hpo's main called in a process
    # that imported transformers, as a notebook or a test does), said to them directly.
    transformers = sys.modules.get("transformers")
    if transformers is not None and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        transformers.utils.logging.disable_progress_bar()


def setup_logging(level: int) -> None:
    """Logging for hpo; the libraries are quietened without importing them (a config error
    is reported before torch, transformers or Optuna load)."""
    label = worker_label()
    prefix = f"{label} " if label else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        MaskingFormatter(
            # Studies run for days: every line says when (Optuna's own lines do too).
            f"%(asctime)s [{prefix}%(name)s %(levelname)s] %(message)s",
            datefmt="%Y-%m-%d %H:%M:%S",
        )
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # torch's own INFO lines (FakeTensor cache statistics at exit, compile notes) are for
    # torch's developers; --debug shows them, but never their DEBUG lines: a line per autograd
    # op per step (1,845 lines for one tiny trial), or every HTTP exchange of botocore's.
    # So are botocore's INFO lines ("Found credentials in environment variables", before every
    # S3 call's error): an artifact store's failure is one line of hpo's.
    # Apprise's INFO lines ("Sent JSON POST notification") are one per message: noise in a
    # worker's log; its failures are WARNINGs, and hpo says them too. wandb's INFO lines (each
    # run's init and finish, with its config) say what its own debug.log keeps.
    for library in ("torch", "botocore", "boto3", "s3transfer", "apprise", "wandb"):
        logging.getLogger(library).setLevel(
            logging.INFO if level <= logging.DEBUG else max(level, logging.WARNING)
        )
    quiet_library_output()
    # Heartbeats are marked experimental in Optuna; hpo relies on them on purpose.
    warnings.filterwarnings("ignore", message=r".*is experimental \(supported from")
    warnings.filterwarnings("ignore", message=r"Argument ``\w+`` is an experimental feature")
    if "optuna" in sys.modules:
        set_optuna_verbosity(level)


def set_optuna_verbosity(level: int) -> None:
    """Optuna resets its logger when imported: call this once it is. Optuna's messages then go
    through hpo's handler, in hpo's format (not a second format of Optuna's own)."""
    import optuna

    optuna.logging.set_verbosity(level)
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
