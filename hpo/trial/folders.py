"""Where a study's trial checkpoints live: the study's folder and each trial's, made and marked
as hpo's own (which of them a study keeps: hpo.study.kept_models).

A study name is data, never a path: the study's folder is a slug of the name plus a hash of it,
always directly inside the checkpoint root, and hpo removes only folders that carry its own
marker for that very study.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from hpo.config.schema import Config

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_DIR = "hpo-checkpoints"
STUDY_MARKER = ".hpo-study"
TRIAL_MARKER = ".hpo-trial"
_TRIAL_FOLDER = re.compile(r"trial-[0-9]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
SLUG_CHARS = 40
# How long a folder found without hpo's marker may still be getting it: another worker (or
# trial process) that created it a moment ago writes the marker next.
MARKER_WAIT_S = 2.0


def study_folder_name(study_name: str) -> str:
    """A folder name for any study name: readable, unique, one path component, never `.`/`..`."""
    slug = _UNSAFE.sub("_", study_name).strip("._-")[:SLUG_CHARS] or "study"
    digest = hashlib.sha256(study_name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{slug}-{digest}"


def checkpoint_root(config: Config, study_name: str) -> Path:
    base = Path(config.study.checkpoint_dir or DEFAULT_CHECKPOINT_DIR).expanduser()
    return base.resolve() / study_folder_name(study_name)


def folder_name(trial: FrozenTrial | optuna.Trial) -> str:
    """Every attempt of one configuration shares the first attempt's folder."""
    return f"trial-{int(trial.user_attrs.get('first_attempt', trial.number))}"


def prepare_trial_folder(root: Path, study_name: str, folder: str) -> Path:
    """Create the trial's folder with hpo's markers (study and trial), so cleanup knows it is
    hpo's own. A folder already there is used only if hpo made it for this study (a retry's);
    anything else there, a symlink included, is left alone: FileExistsError. OSError when the
    disk refuses."""
    _claim(root, {"study": study_name}, parents=True)
    return _claim(root / folder, {"study": study_name, "folder": folder})


def trial_folder_maker(study_name: str) -> Callable[[Path], None]:
    """For a trial's CheckpointStore: its folder, should it vanish while the trial trains (a
    cleanup job, an rm of the wrong folder), made again the way prepare_trial_folder makes it,
    markers included, so that every later trial of the study still has checkpoints. A folder
    that hpo did not make is never taken over (FileExistsError)."""
    return functools.partial(_remake_trial_folder, study_name)


def _remake_trial_folder(study_name: str, folder: Path) -> None:
    prepare_trial_folder(folder.parent, study_name, folder.name)


def _claim(folder: Path, marker: dict[str, str], parents: bool = False) -> Path:
    try:
        folder.mkdir(parents=parents)
    except FileExistsError:
        if not is_ours(folder, marker) and not _marked_soon(folder, marker):
            raise FileExistsError(
                f"{folder} exists and hpo did not make it for this study; hpo will not write "
                "into it (move it away, or set study.checkpoint_dir elsewhere)"
            ) from None
        return folder
    name = TRIAL_MARKER if "folder" in marker else STUDY_MARKER
    # Written aside, then renamed: a worker that finds the folder meanwhile never reads half.
    aside = folder / f".{name}.{os.getpid()}.tmp"
    aside.write_text(json.dumps(marker), encoding="utf-8")
    os.replace(aside, folder / name)
    return folder


def _marked_soon(folder: Path, marker: dict[str, str]) -> bool:
    """An empty folder may be one that another process made a moment ago, its marker on the
    way: it gets MARKER_WAIT_S to appear. Anything else is not hpo's."""
    deadline = time.monotonic() + MARKER_WAIT_S
    while not folder.is_symlink() and folder.is_dir() and time.monotonic() < deadline:
        if is_ours(folder, marker):
            return True
        if any(not p.name.endswith(".tmp") for p in folder.iterdir()):
            return False
        time.sleep(0.05)
    return is_ours(folder, marker)


def missing_model(number: int, attrs: Mapping[str, Any]) -> str | None:
    """Why trial `number`'s best model (from its user attributes `attrs`) cannot be had, in a
    sentence; None when it can (in its folder on this host, or in the artifact store), or when
    the trial never had checkpoints (study.checkpoints off, or a plain Optuna study)."""
    if attrs.get("best_model_uri") or attrs.get("entrypoint"):
        return None  # a training function (training.entrypoint) keeps its own model
    model, error = attrs.get("best_model"), attrs.get("checkpoint_error")
    if isinstance(model, str) and model:
        if Path(model).is_dir():
            return None
        return (
            f"the model of trial #{number} is gone: {model} is not on this host (removed "
            "since the trial ended, or on another host's disk)"
        )
    if error:
        return f"trial #{number} has no saved model: {error}"
    if "checkpoint_s" in attrs:  # it had a checkpoint folder, and no model came out of it
        return f"trial #{number} has no saved model: its checkpoint folder was lost"
    return None


def is_trial_folder(path: Path, study_name: str) -> bool:
    if not _TRIAL_FOLDER.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
        return False
    return is_ours(path, {"study": study_name, "folder": path.name})


def is_ours(folder: Path, expected: dict[str, str]) -> bool:
    """Whether `folder` carries hpo's marker with exactly these contents."""
    marker = folder / (TRIAL_MARKER if "folder" in expected else STUDY_MARKER)
    if folder.is_symlink() or not marker.is_file() or marker.is_symlink():
        return False
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")) == expected)
    except (OSError, ValueError):
        return False
