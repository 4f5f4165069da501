"""What a user asks of hpo's workflows, typed: built by the command line (hpo.cli, from its
flags) and by the Python API (hpo.run) alike, and taken as they are by the commands.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """`hpo run --study ... --config ...` or hpo.run(...): a worker on a study. Each option is
    the flag's (or argument's) value, None where it was left out."""

    study: str
    """The study's name as given (check_inputs checks it and takes its NFC form)."""
    config: ConfigSource | None = None
    """A YAML file, or (hpo.run) a mapping of the same sections; None: the demo config."""
    storage: str | None = None
    n_trials: int | None = None
    budget_device_hours: float | None = None
    timeout: float | None = None
    trial_timeout: float | None = None
    device: str | None = None
    gpus: str | None = None
    """--gpus as typed: "auto", "none" or GPU ids "0,1"."""
    workers_per_gpu: int | str | None = None
    """A number, or "auto"."""
    artifact_store: str | None = None
    tracking: str | None = None
    allow_changed_setup: bool = False
    entrypoint: str | None = None
    """training.entrypoint set over the config's (hpo.run's `entrypoint`)."""
    quiet: bool = False
    """No progress line (hpo.run, `hpo run --quiet`)."""
    in_notebook: bool = False
    """hpo.run in a Jupyter kernel: a second interrupt is not an exit (it would end the
    kernel and the user's session with it)."""
    from_python: bool = False
    """Asked by hpo.run: messages name the options as its arguments (n_trials, not
    --n-trials), and a changed setup is refused in its words."""
    own_process: bool = False
    """This process is the `hpo` command alone: its trial processes may come from a copy of it
    (hpo.trial.worker_copy)."""
    argv: tuple[str, ...] = ()
    """The `hpo` arguments each worker process runs with, when one is started per GPU."""
    worker_flags: tuple[str, ...] = ()
    """Added to `argv` for those worker processes (retrain's --as-worker)."""
    worker_env: Mapping[str, str] | None = None
    """Set in those worker processes' environment (hpo.run's storage: never on a command
    line, where `ps` shows it)."""
    started: float = dataclasses.field(default_factory=time.monotonic)
    """time.monotonic() when the command started: --timeout counts from here."""

    def option(self, name: str) -> str:
        """How the user wrote option `name` (n_trials): `--n-trials` on the command line,
        `n_trials` to hpo.run."""
        return name if self.from_python else f"--{name.replace('_', '-')}"


@dataclasses.dataclass(frozen=True)
class RetrainRequest:
    """`hpo retrain`: a final model from study `run.study`, trained by workers asked as `run`
    asks (its config, storage, device, GPUs, tracking)."""

    run: RunRequest
    out: Path | None = None
    """The final model's folder; None: hpo-final-<study> here."""
    top: int = 3
    seeds: int = 3
    full_data: bool = False
    register: str | None = None
    """A name in MLflow's model registry, or None."""
    as_worker: bool = False
    """A worker process that the retrain of several GPUs started: it runs queued runs only."""
