"""What a run keeps in its checkpoint folder, by name, without torch: hpo's worker loop, which
never imports torch, drops a finished trial's resume state through drop_resume_state."""

import contextlib
import re
import shutil
from pathlib import Path

STATE_FILE = "checkpoint.pt"  # the resume state: model, optimizer, schedule, RNG, progress
BEST_MODEL_DIR = "best-model"  # the best evaluation's model (a symlink to its newest version)
# A sharded run's (strategy fsdp) weights and optimizer state, each rank's share, as folders
# `sharded-state.<step>` written by torch.distributed.checkpoint; the state file names one.
SHARDED_STATE_DIR = "sharded-state"
# The only names a state file may give its folder (a state fetched from the artifact store is
# not trusted to name a path outside the trial's folder).
SHARDED_NAME = re.compile(rf"{SHARDED_STATE_DIR}\.[0-9]+")
# Folders `.upload-stage-<id>` of hard links to a sharded state and its state file, while the
# trial process uploads them to the artifact store (hpo.trial.sharded_upload).
UPLOAD_STAGE = ".upload-stage"


def drop_resume_state(folder: Path) -> None:
    """Remove a run's resume state from its checkpoint folder (its best model stays); a state
    already gone, or a folder that cannot be written, is left as it is."""
    with contextlib.suppress(OSError):
        (folder / STATE_FILE).unlink(missing_ok=True)
    drop_sharded_states(folder)
    drop_stages(folder)


def drop_sharded_states(folder: Path, keep: str | None = None) -> None:
    """Remove a sharded run's checkpoint folders but `keep` (the one its state file names)."""
    with contextlib.suppress(OSError):
        for path in folder.glob(f"{SHARDED_STATE_DIR}.*"):
            if path.name != keep and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


def drop_stages(folder: Path) -> None:
    """Remove the folders of links that uploads of a sharded state made (or a killed one left)."""
    with contextlib.suppress(OSError):
        for stage in folder.glob(f"{UPLOAD_STAGE}-*"):
            shutil.rmtree(stage, ignore_errors=True)
