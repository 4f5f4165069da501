"""Which trial checkpoint folders a study keeps: those a trial may still resume from (running or
queued attempts) and the best trial's model; the rest are removed as trials finish.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo.config import Config

DEFAULT_CHECKPOINT_DIR = "hpo-checkpoints"


def checkpoint_root(config: Config, study_name: str) -> Path:
    base = Path(config.study.checkpoint_dir or DEFAULT_CHECKPOINT_DIR).expanduser()
    return base.resolve() / study_name


def folder_name(trial: FrozenTrial | optuna.Trial) -> str:
    """Every attempt of one configuration shares the first attempt's folder."""
    return f"trial-{trial.user_attrs.get('first_attempt', trial.number)}"


def remove_stale_checkpoints(study: optuna.Study, root: Path) -> list[Path]:
    """Remove the folders no trial needs any more; returns them."""
    if not root.is_dir():
        return []
    # Listed before the trials are read: a folder that appears meanwhile is never touched.
    folders = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("trial-")]
    trials = study.get_trials(deepcopy=False)
    keep = {folder_name(t) for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        keep.add(folder_name(study.best_trial))
    removed = [p for p in folders if p.name not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
