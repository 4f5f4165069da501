"""Where a study's trial checkpoints live, and which of them it keeps: those a trial may still
resume from (running or queued attempts) and the best trial's model (in a retrain study, each
configuration's best run's); the rest are removed as trials finish. A model is removed only
while one at least as good is known to be there (kept_models decides, for folders and store).

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
import shutil
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.config.schema import Config
from hpo.trial.front import FrontRule, as_rule, best_of, rule_for
from storage.artifacts import ArtifactStore, UntrustedArtifact
from trainer.files import BEST_MODEL_DIR

# Which trials' models are best: hpo's rule (hpo.trial.front), or the study's directions alone.
Rule = FrontRule | Sequence[StudyDirection]

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
        if not _is_ours(folder, marker) and not _marked_soon(folder, marker):
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
        if _is_ours(folder, marker):
            return True
        if any(not p.name.endswith(".tmp") for p in folder.iterdir()):
            return False
        time.sleep(0.05)
    return _is_ours(folder, marker)


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


def remove_stale_checkpoints(study: optuna.Study, root: Path) -> list[Path]:
    """Remove the trial folders no trial of `study` needs any more; returns them."""
    trials = study.get_trials(deepcopy=False)
    return remove_unneeded_folders(root, study.study_name, trials, rule_for(study))


def remove_unneeded_folders(
    root: Path, study_name: str, trials: list[FrozenTrial], rule: Rule
) -> list[Path]:
    """Remove the trial folders in `root` that none of `trials` needs: not a running or queued
    attempt's, not one whose model kept_models keeps. Folders are listed before `trials` was
    read by the caller or after: one that appears meanwhile belongs to a RUNNING trial either
    way."""
    if not _is_ours(root, {"study": study_name}):
        return []
    folders = [p for p in root.iterdir() if _is_trial_folder(p, study_name)]
    with_model = {p.name for p in folders if holds_model(p)}
    keep = _active_folders(trials) | kept_models(trials, rule, with_model)
    removed = [p for p in folders if p.name not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def holds_model(folder: Path) -> bool:
    """Whether a trial folder holds a best model a user can load: `best-model` (through its
    link) a folder with a file in it. A link to nothing, or an emptied folder, is no model."""
    model = folder / BEST_MODEL_DIR
    try:
        return model.is_dir() and any(p.is_file() for p in model.iterdir())
    except OSError:
        return False


def remove_unneeded_artifacts(
    store: ArtifactStore, study_name: str, trials: list[FrozenTrial], rule: Rule
) -> list[str]:
    """The artifact store's counterpart of remove_unneeded_folders: a resume state stays while
    its trial runs or is queued, a best model also while kept_models keeps it (judged by the
    models whole in the store); the rest goes, only what hpo's manifests list. Returns the
    artifacts removed ("trial-3/state"). One whose manifest hpo will not trust
    (UntrustedArtifact) is left as it is, with a warning. Raises ArtifactStoreError when the
    store fails."""
    study = study_folder_name(study_name)
    active = _active_folders(trials)
    # The store is listed after `trials` was read: a folder of a trial started since is in no
    # set below, and is left alone (it was once removed while its trial ran).
    known = {folder_name(t) for t in trials}
    stored = {f: kinds for f, kinds in store.folders(study).items() if f in known}
    models = active | kept_models(trials, rule, _models_in_store(store, study, stored, trials))
    removed = []
    for folder, kinds in sorted(stored.items()):
        for kind in kinds:
            if folder in (active if kind == "state" else models):
                continue
            try:
                store.remove(study, folder, (kind,))
            except UntrustedArtifact as e:  # one forged manifest holds up no other artifact
                log.warning("%s/%s stays in the artifact store: %s", folder, kind, e)
                continue
            removed.append(f"{folder}/{kind}")
    return removed


def _models_in_store(
    store: ArtifactStore, study: str, stored: Mapping[str, list[str]], trials: list[FrozenTrial]
) -> set[str]:
    """The folders of complete trials whose best model is in the store whole (one manifest read
    and one listing each: after a cleanup, few folders hold a model)."""
    complete = {folder_name(t) for t in trials if t.state == TrialState.COMPLETE}
    candidates = [f for f, kinds in stored.items() if f in complete and "best-model" in kinds]
    return {folder for folder in candidates if store.intact(study, folder, "best-model")}


def _active_folders(trials: list[FrozenTrial]) -> set[str]:
    """The folders of running and queued attempts: a retry may resume from them."""
    return {folder_name(t) for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)}


def kept_models(trials: list[FrozenTrial], rule: Rule, with_model: Collection[str]) -> set[str]:
    """The trial folders whose best model stays: the one place that decides it, for this host's
    folders and for the artifact store alike. `with_model`: the folders where a model is known
    to be there whole (on this disk, or in the store).

    The best trials' folders stay (those `hpo best` names; in a retrain study each
    configuration's best run's too), and so do the best of the trials whose model is there:
    when the best trial's model was lost (its folder removed by hand, a wiped disk), the
    trials tied with it, or the next best, keep theirs. So a model is removed only while a model
    at least as good is there, and a study that saved a model always ends with one."""
    rule = as_rule(rule)
    keep: set[str] = set()
    for group in _model_groups(trials):
        there = [t for t in group if folder_name(t) in with_model]
        for trials_of in (group, there):
            keep |= {folder_name(t) for t in best_trials(trials_of, rule)}
            if "retrain_config" in group[0].user_attrs:
                # hpo retrain saves the best run on the first objective (retrain.best_run).
                best_run = best_on_first_objective(trials_of, rule.directions[0])
                keep |= {folder_name(t) for t in best_run}
    return keep


def _model_groups(trials: list[FrozenTrial]) -> list[list[FrozenTrial]]:
    """Trials whose best model is kept apart: a search's trials are one group; a retrain
    study's runs are grouped by configuration (each configuration's best run may become the
    final model), its full-data run alone."""
    groups: dict[tuple[object, bool], list[FrozenTrial]] = {}
    for trial in trials:
        key = (trial.user_attrs.get("retrain_config"), bool(trial.user_attrs.get("full_data")))
        groups.setdefault(key, []).append(trial)
    return list(groups.values())


def best_trials(trials: list[FrozenTrial], rule: Rule) -> list[FrozenTrial]:
    """The best complete trial, or with several objectives the Pareto front by hpo's rule
    (hpo.trial.front; directions alone: plain Pareto dominance)."""
    rule = as_rule(rule)
    done = [
        (t, t.values)
        for t in trials
        if t.state == TrialState.COMPLETE
        and t.values is not None
        and len(t.values) == len(rule.directions)
    ]
    return best_of(done, rule)


def best_on_first_objective(
    trials: list[FrozenTrial], direction: StudyDirection
) -> list[FrozenTrial]:
    """The complete trial best on the first objective, the earliest of equals; none if no
    trial completed."""
    sign = 1.0 if direction == StudyDirection.MAXIMIZE else -1.0
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    return [min(done, key=lambda t: (-sign * t.values[0], t.number))] if done else []


def _is_trial_folder(path: Path, study_name: str) -> bool:
    if not _TRIAL_FOLDER.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
        return False
    return _is_ours(path, {"study": study_name, "folder": path.name})


def _is_ours(folder: Path, expected: dict[str, str]) -> bool:
    """Whether `folder` carries hpo's marker with exactly these contents."""
    marker = folder / (TRIAL_MARKER if "folder" in expected else STUDY_MARKER)
    if folder.is_symlink() or not marker.is_file() or marker.is_symlink():
        return False
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")) == expected)
    except (OSError, ValueError):
        return False
