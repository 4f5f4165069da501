"""Which trials' models a study keeps when the best trial's model is lost (its folder removed by
hand, a wiped disk, an object gone from the store): a model is removed only while one at least
as good is there, so trials tied with the lost one keep theirs, and the study always ends with
a saved model when any trial saved one (issue 42, the tied trials)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState, create_trial

from hpo import live
from hpo.storage.artifacts import ArtifactStore, FileBackend
from hpo.storage.engine import open_storage
from hpo.storage.url import StorageURL
from hpo.study.kept_models import (
    holds_model,
    kept_models,
    remove_stale_checkpoints,
    remove_unneeded_artifacts,
)
from hpo.study.trials import StudyTrials
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trial.folders import prepare_trial_folder, study_folder_name
from tests.conftest import tiny_config, write_config

MAX = [StudyDirection.MAXIMIZE]
X = {"x": FloatDistribution(0, 1)}


def _complete(number: int, *values: float, **attrs: Any) -> FrozenTrial:
    trial = create_trial(
        state=TrialState.COMPLETE,
        values=list(values),
        params={"x": 0.5},
        distributions=X,
        user_attrs=attrs,
    )
    trial.number = number
    return trial


def _folders(*numbers: int) -> set[str]:
    return {f"trial-{n}" for n in numbers}


# -- the rule, one place ------------------------------------------------------------------------


def test_a_tied_trial_keeps_its_model_while_the_best_trials_model_is_gone() -> None:
    trials = [_complete(0, 0.9), _complete(1, 0.9), _complete(2, 0.9), _complete(3, 0.5)]
    # Every model there: the first of the tied trials stands for them, the rest go.
    assert kept_models(trials, MAX, _folders(0, 1, 2, 3)) == _folders(0)
    # Trial 0's model lost: trial 1, as good, keeps its model (trial 0's folder stays named).
    assert kept_models(trials, MAX, _folders(1, 2, 3)) == _folders(0, 1)
    # Every tied model lost: the next best there keeps its own.
    assert kept_models(trials, MAX, _folders(3)) == _folders(0, 3)
    assert kept_models(trials, MAX, set()) == _folders(0)


def test_keep_models_keeps_the_top_trials_whose_model_is_there() -> None:
    trials = [_complete(0, 0.7), _complete(1, 0.9), _complete(2, 0.8), _complete(3, 0.5)]
    assert kept_models(trials, MAX, _folders(0, 1, 2, 3)) == _folders(1)
    assert kept_models(trials, MAX, _folders(0, 1, 2, 3), top=3) == _folders(1, 2, 0)
    # Trial 2's model lost: the next one there stands in; the best's folder stays named.
    assert kept_models(trials, MAX, _folders(0, 1, 3), top=3) == _folders(1, 0, 3)
    minimize = [StudyDirection.MINIMIZE]
    assert kept_models(trials, minimize, _folders(0, 1, 2, 3), top=2) == _folders(3, 0)


def test_with_several_objectives_a_trial_only_the_lost_model_beat_keeps_its_own() -> None:
    two = [StudyDirection.MAXIMIZE, StudyDirection.MAXIMIZE]
    # #2 is beaten by #0 alone (#1 is less accurate than #2, and faster).
    trials = [_complete(0, 0.9, 1000.0), _complete(1, 0.8, 1500.0), _complete(2, 0.85, 900.0)]
    assert kept_models(trials, two, _folders(0, 1, 2)) == _folders(0, 1)
    assert kept_models(trials, two, _folders(1, 2)) == _folders(0, 1, 2)


def test_in_a_retrain_study_each_configuration_keeps_a_run_whose_model_is_there() -> None:
    runs = [
        _complete(0, 0.9, retrain_config=1),
        _complete(1, 0.9, retrain_config=1),
        _complete(2, 0.7, retrain_config=1),
    ]
    assert kept_models(runs, MAX, _folders(0, 1, 2)) == _folders(0)
    assert kept_models(runs, MAX, _folders(1, 2)) == _folders(0, 1)


# -- this host's folders ------------------------------------------------------------------------


def _with_model(root: Path, number: int) -> Path:
    """A trial folder as a trial leaves it: best-model a link to its versioned folder."""
    folder = prepare_trial_folder(root, "s", f"trial-{number}")
    (folder / ".best-model.v1").mkdir()
    (folder / ".best-model.v1" / "model.safetensors").write_bytes(b"weights")
    os.symlink(".best-model.v1", folder / "best-model")
    return folder


def _lose(folder: Path, how: str) -> None:
    if how == "folder removed":
        shutil.rmtree(folder)
    elif how == "model emptied":
        (folder / ".best-model.v1" / "model.safetensors").unlink()
    else:  # the link leads nowhere
        shutil.rmtree(folder / ".best-model.v1")


@pytest.mark.parametrize("how", ["folder removed", "model emptied", "link to nothing"])
def test_cleanup_keeps_a_tied_trials_folder_when_the_best_trials_model_is_lost(
    tmp_path: Path, how: str
) -> None:
    study = optuna.create_study(study_name="s", direction="maximize")
    root = tmp_path / study_folder_name("s")
    for number, value in enumerate((0.9, 0.9, 0.9, 0.5)):
        _with_model(root, number)
        study.add_trial(_complete(number, value))
    _lose(root / "trial-0", how)
    removed = remove_stale_checkpoints(study, root)
    # On main: trial-1 and trial-2 went too, and the study was left with no model at all.
    assert sorted(p.name for p in removed) == ["trial-2", "trial-3"]
    assert holds_model(root / "trial-1")


def test_a_worker_keeps_the_tied_model_through_its_own_cleanup(tmp_path: Path) -> None:
    """The worker's path: the cleanup before each new trial, under the study's lock."""
    storage = open_storage(StorageURL(f"sqlite:///{tmp_path / 'study.db'}", "test"))
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    root = tmp_path / study_folder_name("s")
    for number in range(3):
        _with_model(root, number)
        study.add_trial(_complete(number, 0.9))
    shutil.rmtree(root / "trial-0")
    trials = StudyTrials(study, storage, "w:1", budget=5, liveness=(1, 2, 2))
    assert trials.next_trial(root) is not None
    assert sorted(p.name for p in root.glob("trial-*")) == ["trial-1"]
    assert holds_model(root / "trial-1")
    assert trials.remove_stale_checkpoints(root) == []  # and it stays
    storage.engine.dispose()


# -- the artifact store -------------------------------------------------------------------------


def _store_with_tied_models(tmp_path: Path) -> tuple[ArtifactStore, str]:
    store = ArtifactStore("file://s", FileBackend(tmp_path / "store"))
    study = study_folder_name("s")
    for number in range(4):
        model = tmp_path / f"m{number}"
        model.mkdir()
        (model / "model.safetensors").write_bytes(b"weights %d" % number)
        store.publish(study, f"trial-{number}", "best-model", model)
    return store, study


def _objects(tmp_path: Path, study: str, folder: str) -> list[Path]:
    return sorted((tmp_path / "store" / study / folder / "best-model").rglob("*.safetensors"))


def test_a_model_in_the_store_is_whole_only_with_every_object_its_manifest_names(
    tmp_path: Path,
) -> None:
    store, study = _store_with_tied_models(tmp_path)
    assert store.intact(study, "trial-0", "best-model")
    assert not store.intact(study, "trial-9", "best-model")  # none published
    _objects(tmp_path, study, "trial-0")[0].unlink()
    assert not store.intact(study, "trial-0", "best-model")
    _objects(tmp_path, study, "trial-1")[0].write_bytes(b"cut")  # another size
    assert not store.intact(study, "trial-1", "best-model")
    (tmp_path / "store" / study / "trial-2" / "best-model.manifest.json").write_text("{")
    assert not store.intact(study, "trial-2", "best-model")  # a manifest hpo will not trust
    version = _objects(tmp_path, study, "trial-3")[0].parent
    version.rename(tmp_path / "elsewhere")
    version.symlink_to(tmp_path / "elsewhere")  # the same objects, through a link
    assert not store.intact(study, "trial-3", "best-model")


@pytest.mark.parametrize("how", ["manifest removed", "object removed"])
def test_the_store_keeps_a_tied_trials_model_when_the_best_trials_model_is_lost(
    tmp_path: Path, how: str
) -> None:
    store, study = _store_with_tied_models(tmp_path)
    if how == "manifest removed":
        store.remove(study, "trial-0", ("best-model",))
    else:
        _objects(tmp_path, study, "trial-0")[0].unlink()
    trials = [_complete(0, 0.9), _complete(1, 0.9), _complete(2, 0.9), _complete(3, 0.5)]
    removed = remove_unneeded_artifacts(store, "s", trials, MAX)
    # On main: trial-1's went too.
    assert removed == ["trial-2/best-model", "trial-3/best-model"]
    assert store.intact(study, "trial-1", "best-model")


# -- end to end ---------------------------------------------------------------------------------


def test_a_study_whose_best_trials_folder_is_lost_ends_with_a_tied_trials_model(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    hpo_main: Callable[[list[str]], int],
) -> None:
    root = tmp_path / "checkpoints"
    study = {
        "n_trials": 3,
        "trial_isolation": "none",
        "checkpoint_dir": str(root),
        "pruner": {"type": "none"},
    }
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config(*easy_data, study=study, training={"epochs": 1, "evals_per_epoch": 1}),
    )
    folder = root / study_folder_name("s")
    # Every trial scores the same: three tied trials.
    monkeypatch.setattr("hpo.trial.training._value", lambda trial, result, objectives: 0.5)
    save_best_model = CheckpointStore.save_best_model
    lost: list[Path] = []

    def save_then_lose_trial_0(self: CheckpointStore, *args: Any, **kwargs: Any) -> bool:
        if self.directory.name == "trial-1" and not lost:  # trial 0 is done: a user's rm
            shutil.rmtree(folder / "trial-0")
            lost.append(folder / "trial-0")
        return save_best_model(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "save_best_model", save_then_lose_trial_0)
    monkeypatch.setattr(live, "start", lambda: None)  # see test_checkpoint_loss
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert hpo_main(["run", "--study", "s", "--config", str(config), "--storage", url]) == 0

    trials = optuna.load_study(study_name="s", storage=url).trials
    assert [t.value for t in trials] == [0.5, 0.5, 0.5] and lost
    # On main: no trial folder was left, so no model.
    kept = sorted(p.name for p in folder.glob("trial-*") if holds_model(p))
    assert kept == ["trial-1"]
