"""What a run keeps in its checkpoint folder, by name, without torch: hpo's worker loop, which
never imports torch, drops a finished trial's resume state through drop_resume_state."""

import contextlib
from pathlib import Path

STATE_FILE = "checkpoint.pt"  # the resume state: model, optimizer, schedule, RNG, progress
BEST_MODEL_DIR = "best-model"  # the best evaluation's model (a symlink to its newest version)


def drop_resume_state(folder: Path) -> None:
    """Remove a run's resume state from its checkpoint folder (its best model stays); a state
    already gone, or a folder that cannot be written, is left as it is."""
    with contextlib.suppress(OSError):
        (folder / STATE_FILE).unlink(missing_ok=True)
