"""Checkpoints of a training run, so that a run stopped by preemption or a crash resumes where it
was: model, optimizer, scheduler, position in the epoch, RNG states and the evaluations so far.

Writes are atomic (a temporary file, then a rename). A write that fails (disk full, unwritable
folder) is reported, never raised: the run goes on without that checkpoint. A state is read with
`weights_only=True`: a file in a shared folder holds tensors and plain values, never code to run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpo.trainer.files import BEST_MODEL_DIR, STATE_FILE
from hpo.trainer.peft_adapters import save_head_config

log = logging.getLogger(__name__)

# best-model is a symlink to the newest of these folders, so it can be swapped atomically.
_VERSION = re.compile(rf"\.{BEST_MODEL_DIR}\.v([0-9]+)")


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
    # Called after each state ("state", its file) or best model ("best-model", its folder) is
    # written, e.g. to copy it where other hosts can reach it; it must not block for long.
    on_saved: Callable[[str, Path], None] | None = None
    # Creates `directory` when it is missing (OSError when it cannot): the caller's own way, e.g.
    # with a marker that says who made it. Without one, a plain mkdir.
    make_directory: Callable[[Path], None] | None = None
    # The directory was there (at the start, or at a write): if it is missing later, something
    # else removed it.
    _was_there: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._was_there = self.directory.is_dir()

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
        saved = self._guarded("checkpoint", lambda: _atomic_torch_save(state, self.state_path))
        return self._saved("state", self.state_path, saved)

    def save_best_model(
        self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
    ) -> bool:
        """The weights of the run's best evaluation (`state_dict`, or the model's own),
        loadable with `from_pretrained`."""
        saved = self._guarded(
            "best model", lambda: _atomic_save_pretrained(model, self.directory, state_dict)
        )
        return self._saved("best-model", self.best_model_path, saved)

    def adopt_best_model(self, folder: Path) -> None:
        """Make `folder` (complete, inside this trial's directory, e.g. downloaded from another
        host) the best model, swapped in as a new version. OSError when the disk refuses."""
        version = f".{BEST_MODEL_DIR}.v{_newest_version(self.directory) + 1}"
        folder.rename(self.directory / version)
        previous = _point_best_model_at(self.directory, version)
        _remove_versions(self.directory, keep=(version, previous))

    def save_tokenizer(self, tokenizer: Any) -> bool:
        """Beside the best model, so that the folder is all a user needs to load it."""
        return self._guarded("tokenizer", lambda: tokenizer.save_pretrained(self.best_model_path))

    def load_state(self, fingerprint: str) -> dict[str, Any] | None:
        """The saved state of this very job, or None (none saved, unreadable or another job)."""
        if not self.resume or not self.state_path.is_file():
            return None
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning(
                "checkpoint %s refused: it holds more than tensors and plain values, and "
                "loading it could run code (%s); starting over",
                self.state_path,
                reason,
            )
            return None
        except (OSError, RuntimeError, EOFError, ValueError) as e:
            log.warning("checkpoint %s unreadable (%s); starting over", self.state_path, e)
            return None
        if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
            log.warning("checkpoint %s is of another job; starting over", self.state_path)
            return None
        return state

    def drop_old_versions(self) -> None:
        """The run finished: the best model's earlier versions go. Its resume state stays until
        its end is recorded (hpo drops it then: a crash before that resumes from it)."""
        if not self.still_there():
            return
        try:
            _remove_versions(self.directory, keep=_current_version(self.directory))
        except OSError as e:  # e.g. the folder was never usable: nothing to drop
            log.debug("cannot clean %s: %s", self.directory, e)

    def _saved(self, kind: str, path: Path, saved: bool) -> bool:
        if saved and self.on_saved is not None:
            self.on_saved(kind, path)
        return saved

    def _ensure_directory(self) -> None:
        """The directory, made again if it vanished since the run began (a cleanup job, an rm
        of the wrong folder)."""
        if not self.still_there():
            if self.make_directory is not None:
                self.make_directory(self.directory)
            else:
                self.directory.mkdir(parents=True, exist_ok=True)
        self._was_there = True

    def still_there(self) -> bool:
        """Whether the directory is there; if it was once and is no more, something else
        removed it, with what it held: the errors say so (once)."""
        if self.directory.is_dir():
            self._was_there = True
            return True
        if self._was_there:
            self._was_there = False
            self.errors.append(
                f"{self.directory} was removed while the run trained (by "
                "something else than the run): the checkpoint and best model it "
                "held are lost"
            )
            log.warning("%s", self.errors[-1])
        return False

    def _guarded(self, what: str, write: Any) -> bool:
        started = time.perf_counter()
        try:
            self._ensure_directory()
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
    """Every RNG state a run draws from, as tensors and plain values (weights_only loads it)."""
    version, internal, gauss_next = random.getstate()
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    numpy_state = [str(name), np.asarray(keys).tolist(), int(position), int(has_gauss)]
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss_next],
        "numpy": [*numpy_state, float(cached_gaussian)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state(
        (name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian)
    )
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
    """Write the model into a new version folder, then point best-model at it: a reader finds a
    complete best model at every instant. The version before stays, for a reader that resolved
    best-model just before the swap; older ones go."""
    version = f".{BEST_MODEL_DIR}.v{_newest_version(directory) + 1}"
    tmp = directory / f".{BEST_MODEL_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp, state_dict=state_dict)  # type: ignore[operator]
            save_head_config(model, str(tmp))
        else:  # a module of the user's factory (model.factory): its weights, and how to load them
            save_state_dict(model, tmp, state_dict)
        tmp.rename(directory / version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = _point_best_model_at(directory, version)
    _remove_versions(directory, keep=(version, previous))


STATE_DICT_FILE = "model_state_dict.pt"
STATE_DICT_NOTE = "HPO_MODEL.md"


def save_state_dict(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    """A torch.nn.Module that is no transformers model: its state_dict (torch.save), with a
    note on how it loads, since no `from_pretrained` can rebuild it."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = state_dict if state_dict is not None else model.state_dict()
    torch.save({k: v.detach().cpu() for k, v in weights.items()}, folder / STATE_DICT_FILE)
    (folder / STATE_DICT_NOTE).write_text(
        f"# A model of {type(model).__module__}.{type(model).__qualname__}\n\n"
        f"`{STATE_DICT_FILE}` holds its state_dict (it is no transformers model, so it has no "
        "`from_pretrained`). Build the module with your model.factory, then:\n\n"
        f"    model.load_state_dict(torch.load('{STATE_DICT_FILE}', weights_only=True))\n",
        encoding="utf-8",
    )


def _remove_versions(directory: Path, keep: tuple[str | None, ...]) -> None:
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if _VERSION.fullmatch(path.name) and path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


def _current_version(directory: Path) -> tuple[str | None, ...]:
    link = directory / BEST_MODEL_DIR
    return (os.readlink(link),) if link.is_symlink() else ()


def _newest_version(directory: Path) -> int:
    numbers = (_VERSION.fullmatch(p.name) for p in directory.iterdir())
    return max((int(m.group(1)) for m in numbers if m), default=0)


def _point_best_model_at(directory: Path, version: str) -> str | None:
    """Replace the best-model symlink with one to `version` in one rename; returns the version
    it pointed at before."""
    link = directory / BEST_MODEL_DIR
    previous = os.readlink(link) if link.is_symlink() else None
    if previous is None and link.is_dir():
        # A folder an older hpo wrote: moved aside once, the only moment without a best model.
        previous = f".{BEST_MODEL_DIR}.v0"
        shutil.rmtree(directory / previous, ignore_errors=True)
        link.rename(directory / previous)
    tmp_link = directory / f".{BEST_MODEL_DIR}.{os.getpid()}.link"
    tmp_link.unlink(missing_ok=True)
    os.symlink(version, tmp_link)  # relative: the trial folder may be moved or mounted elsewhere
    os.replace(tmp_link, link)
    return previous


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
