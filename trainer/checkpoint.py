"""Checkpoints of a training run, so that a run stopped by preemption or a crash resumes where it
was: model, optimizer, scheduler, position in the epoch, RNG states and the evaluations so far.

Writes are atomic (a temporary file, then a rename). A write that fails (disk full, unwritable
folder) is reported, never raised: the run goes on without that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint.pt"
BEST_MODEL_DIR = "best-model"


@dataclass
class CheckpointStore:
    """Where one trial's checkpoints live; `resume` says whether to load one that is there."""

    directory: Path
    resume: bool = False
    # Least seconds between two resume states written at evaluations (0: at every one). A stop
    # request always writes one; the best model is written when a state is, and at the end.
    interval_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0  # spent writing, so a trial shows what its checkpoints cost
    last_state_at: float = field(default_factory=time.monotonic)

    def state_due(self) -> bool:
        return time.monotonic() - self.last_state_at >= self.interval_s

    @property
    def state_path(self) -> Path:
        return self.directory / STATE_FILE

    @property
    def best_model_path(self) -> Path:
        return self.directory / BEST_MODEL_DIR

    def save_state(self, state: dict[str, Any]) -> bool:
        """Write the resume state atomically; False (and the reason in `errors`) on failure."""
        self.last_state_at = time.monotonic()
        return self._guarded("checkpoint", lambda: _atomic_torch_save(state, self.state_path))

    def save_best_model(
        self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
    ) -> bool:
        """The weights of the run's best evaluation (`state_dict`, or the model's own),
        loadable with `from_pretrained`."""
        return self._guarded(
            "best model", lambda: _atomic_save_pretrained(model, self.directory, state_dict)
        )

    def save_tokenizer(self, tokenizer: Any) -> bool:
        """Beside the best model, so that the folder is all a user needs to load it."""
        return self._guarded("tokenizer", lambda: tokenizer.save_pretrained(self.best_model_path))

    def load_state(self, fingerprint: str) -> dict[str, Any] | None:
        """The saved state of this very job, or None (none saved, unreadable or another job)."""
        if not self.resume or not self.state_path.is_file():
            return None
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError, ValueError) as e:
            log.warning("checkpoint %s unreadable (%s); starting over", self.state_path, e)
            return None
        if state.get("fingerprint") != fingerprint:
            log.warning("checkpoint %s is of another job; starting over", self.state_path)
            return None
        return state

    def drop_state(self) -> None:
        """The run finished: its resume state is no longer needed (the best model stays)."""
        try:
            self.state_path.unlink(missing_ok=True)
        except OSError as e:  # e.g. the folder was never usable: nothing to drop
            log.debug("cannot remove %s: %s", self.state_path, e)

    def _guarded(self, what: str, write: Any) -> bool:
        started = time.perf_counter()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write()
            return True
        except OSError as e:
            reason = f"{what} not written to {self.directory}: {e.strerror or e}"
            log.warning("%s; training goes on without it", reason)
            self.errors.append(reason)
            return False
        finally:
            self.seconds += time.perf_counter() - started


def job_fingerprint(parts: dict[str, Any]) -> str:
    """Identifies what a checkpoint belongs to: a resumed run must be the same job."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_torch_save(state: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_save_pretrained(
    model: torch.nn.Module, directory: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    tmp = directory / f".{BEST_MODEL_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state_dict)  # type: ignore[operator]
        old = directory / f".{BEST_MODEL_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        target = directory / BEST_MODEL_DIR
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
