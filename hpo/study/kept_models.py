"""Which trial checkpoints a study keeps: those a trial may still resume from (running or
queued attempts) and the best trial's model (in a retrain study, each configuration's best
run's); the rest are removed as trials finish. A model is removed only while one at least as
good is known to be there (kept_models decides, for folders and store).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.storage.artifacts import ArtifactStore, UntrustedArtifact
from hpo.study.front import FrontRule, as_rule, best_of, rule_for
from hpo.trainer.files import BEST_MODEL_DIR
from hpo.trial.folders import folder_name, is_ours, is_trial_folder, study_folder_name

# Which trials' models are best: hpo's rule (hpo.study.front), or the study's directions alone.
Rule = FrontRule | Sequence[StudyDirection]
# The study's user attribute: how many best trials keep their model (study.keep_models).
KEEP_ATTR = "keep_models"


def models_kept(study: optuna.Study) -> int:
    """study.keep_models as its latest worker recorded it; 1 for a study that never said."""
    value = study.user_attrs.get(KEEP_ATTR, 1)
    return value if isinstance(value, int) and value >= 1 else 1


log = logging.getLogger(__name__)


def remove_stale_checkpoints(study: optuna.Study, root: Path) -> list[Path]:
    """Remove the trial folders no trial of `study` needs any more; returns them."""
    trials = study.get_trials(deepcopy=False)
    return remove_unneeded_folders(
        root, study.study_name, trials, rule_for(study), models_kept(study)
    )


def remove_unneeded_folders(
    root: Path, study_name: str, trials: list[FrozenTrial], rule: Rule, top: int = 1
) -> list[Path]:
    """Remove the trial folders in `root` that none of `trials` needs: not a running or queued
    attempt's, not one whose model kept_models keeps. Folders are listed before `trials` was
    read by the caller or after: one that appears meanwhile belongs to a RUNNING trial either
    way."""
    if not is_ours(root, {"study": study_name}):
        return []
    folders = [p for p in root.iterdir() if is_trial_folder(p, study_name)]
    with_model = {p.name for p in folders if holds_model(p)}
    keep = _active_folders(trials) | kept_models(trials, rule, with_model, top)
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
    store: ArtifactStore, study_name: str, trials: list[FrozenTrial], rule: Rule, top: int = 1
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
    there = _models_in_store(store, study, stored, trials)
    models = active | kept_models(trials, rule, there, top)
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


def kept_models(
    trials: list[FrozenTrial], rule: Rule, with_model: Collection[str], top: int = 1
) -> set[str]:
    """The trial folders whose best model stays: the one place that decides it, for this host's
    folders and for the artifact store alike. `with_model`: the folders where a model is known
    to be there whole (on this disk, or in the store).

    The best trials' folders stay (those `hpo best` names; in a retrain study each
    configuration's best run's too), and so do the best of the trials whose model is there:
    when the best trial's model was lost (its folder removed by hand, a wiped disk), the
    trials tied with it, or the next best, keep theirs. So a model is removed only while a model
    at least as good is there, and a study that saved a model always ends with one.

    With `top` above 1 (study.keep_models), the `top` trials best on the first objective whose
    model is there keep theirs too: the members `hpo ensemble` stacks."""
    rule = as_rule(rule)
    keep: set[str] = set()
    for group in _model_groups(trials):
        there = [t for t in group if folder_name(t) in with_model]
        if top > 1:
            keep |= {folder_name(t) for t in _top_on_first_objective(there, rule, top)}
        for trials_of in (group, there):
            keep |= {folder_name(t) for t in best_trials(trials_of, rule)}
            if "retrain_config" in group[0].user_attrs:
                # hpo retrain saves the best run on the first objective (retrain.best_run).
                best_run = best_on_first_objective(trials_of, rule.directions[0])
                keep |= {folder_name(t) for t in best_run}
    return keep


def _top_on_first_objective(
    trials: list[FrozenTrial], rule: FrontRule, top: int
) -> list[FrozenTrial]:
    """The `top` complete trials best on the first objective, the earliest of equals first."""
    sign = 1.0 if rule.directions[0] == StudyDirection.MAXIMIZE else -1.0
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    return sorted(done, key=lambda t: (-sign * t.values[0], t.number))[:top]


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
    (hpo.study.front; directions alone: plain Pareto dominance)."""
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
