"""A study's checkpoint folder removed under it (a cleanup job, an rm of the wrong folder, a wiped
scratch disk): hpo makes its own folder again, with its markers, and says loudly what the study
lost; a folder hpo did not make is still never taken over."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo import live
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trial.folders import STUDY_MARKER, TRIAL_MARKER, prepare_trial_folder, study_folder_name
from tests.conftest import tiny_config, write_config


def test_a_checkpoint_folder_removed_during_a_trial_is_made_again_for_the_next_ones(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    root = tmp_path / "checkpoints"
    study = {
        "n_trials": 3,
        "trial_isolation": "none",
        "checkpoint_dir": str(root),
        "checkpoint_interval": 0,
        "pruner": {"type": "none"},
    }
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config(*easy_data, study=study, training={"epochs": 1, "evals_per_epoch": 3}),
    )
    folder = root / study_folder_name("s")
    save_state = CheckpointStore.save_state
    removed: list[Path] = []

    def save_then_lose_the_folder(self: CheckpointStore, state: dict[str, Any]) -> bool:
        saved = save_state(self, state)
        if not removed:  # after trial 0's first evaluation (of three): a cleanup job strikes
            shutil.rmtree(folder)
            removed.append(self.directory)
        return saved

    monkeypatch.setattr(CheckpointStore, "save_state", save_then_lose_the_folder)
    # No live line: its default stream is the sys.stderr of when hpo.live was imported,
    # pytest's capture of the collection, closed by now.
    monkeypatch.setattr(live, "start", lambda: None)
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert hpo_main(["run", "--study", "s", "--config", str(config), "--storage", url]) == 0
    summary = capsys.readouterr().out

    first, *later = optuna.load_study(study_name="s", storage=url).trials
    assert removed == [folder / "trial-0"]
    for trial in later:  # on main: "... exists and hpo did not make it for this study"
        assert "checkpoint_error" not in trial.user_attrs, trial.user_attrs["checkpoint_error"]
        assert "best_model" in trial.user_attrs
    assert "was removed while the run trained" in first.user_attrs["checkpoint_error"]
    kept = list(folder.glob("trial-*"))  # the best trial's
    assert (folder / STUDY_MARKER).is_file() and kept
    assert all((trial / TRIAL_MARKER).is_file() for trial in kept)
    assert "WARNING: checkpoints not written or not stored for 1 trial" in summary
    assert "the latest, trial #0" in summary

    # Then the best trial's folder goes too (a scratch disk wiped after the study): said by
    # hpo best and hpo status, not a path to nothing.
    best = optuna.load_study(study_name="s", storage=url).best_trial
    shutil.rmtree(folder / f"trial-{best.number}")
    assert hpo_main(["best", "--study", "s", "--storage", url]) == 0
    assert hpo_main(["status", "--study", "s", "--storage", url]) == 0
    shown = capsys.readouterr().out
    assert shown.count(f"WARNING: the model of trial #{best.number} is gone") == 2
    assert "model: " not in shown  # no path to a folder that is not there
    assert "WARNING: checkpoints not written or not stored for 1 trial" in shown


def test_a_trial_folder_removed_between_writes_is_made_again_by_the_callers_maker(
    tmp_path: Path,
) -> None:
    made: list[Path] = []

    def make(folder: Path) -> None:
        made.append(folder)
        folder.mkdir(parents=True)

    directory = tmp_path / "study" / "trial-0"
    directory.mkdir(parents=True)
    store = CheckpointStore(directory, make_directory=make)
    assert store.save_state({"step": 1})
    shutil.rmtree(tmp_path / "study")
    assert store.save_state({"step": 2}) and store.save_state({"step": 3})
    assert made == [directory] and (directory / "checkpoint.pt").is_file()
    assert len(store.errors) == 1 and "was removed while the run trained" in store.errors[0]

    shutil.rmtree(directory)  # gone at the end, with no write after: still said
    store.drop_old_versions()
    assert len(store.errors) == 2 and made == [directory] and not directory.exists()


def test_a_vanished_trial_folder_is_made_again_with_markers_never_over_a_users_folder(
    tmp_path: Path,
) -> None:
    from hpo.trial.folders import trial_folder_maker

    root = tmp_path / study_folder_name("s")
    folder = prepare_trial_folder(root, "s", "trial-0")
    shutil.rmtree(root)
    trial_folder_maker("s")(folder)
    assert prepare_trial_folder(root, "s", "trial-1").is_dir()  # the study folder is hpo's
    assert (folder / TRIAL_MARKER).is_file()

    shutil.rmtree(root)
    root.mkdir()  # someone else's folder of the same name, since
    (root / "notes.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match="hpo did not make it"):
        trial_folder_maker("s")(folder)
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def test_a_study_folder_another_worker_is_marking_is_recognised(tmp_path: Path) -> None:
    root = tmp_path / study_folder_name("s")
    root.mkdir()  # made a moment ago by another worker, which writes its marker next

    def mark() -> None:
        time.sleep(0.3)
        (root / STUDY_MARKER).write_text('{"study": "s"}', encoding="utf-8")

    other = threading.Thread(target=mark)
    other.start()
    try:
        assert prepare_trial_folder(root, "s", "trial-0").is_dir()
    finally:
        other.join()


def test_an_empty_folder_without_marker_is_refused_after_a_short_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.trial import folders as checkpoints

    monkeypatch.setattr(checkpoints, "MARKER_WAIT_S", 0.2)
    root = tmp_path / study_folder_name("s")
    root.mkdir()
    started = time.monotonic()
    with pytest.raises(FileExistsError, match="hpo did not make it"):
        prepare_trial_folder(root, "s", "trial-0")
    assert 0.2 <= time.monotonic() - started < 2
    assert list(root.iterdir()) == []


def test_a_best_model_that_cannot_be_had_is_named_with_the_reason(tmp_path: Path) -> None:
    from hpo.trial.folders import missing_model

    here = tmp_path / "trial-3" / "best-model"
    here.mkdir(parents=True)
    gone = str(tmp_path / "trial-4" / "best-model")
    assert missing_model(3, {"best_model": str(here), "checkpoint_s": 0.1}) is None
    assert missing_model(4, {"best_model": gone, "best_model_uri": "s3://b/p/m"}) is None
    assert "trial #4 is gone" in str(missing_model(4, {"best_model": gone}))
    refused = {"checkpoint_s": 0.0, "checkpoint_error": "no checkpoints for this trial: x"}
    assert (
        missing_model(5, refused) == "trial #5 has no saved model: no checkpoints for this trial: x"
    )
    assert "folder was lost" in str(missing_model(6, {"checkpoint_s": 0.2}))
    assert missing_model(7, {}) is None  # checkpoints off, or a plain Optuna study: nothing lost


def test_hpo_best_warns_instead_of_naming_a_model_that_is_not_there(tmp_path: Path) -> None:
    from hpo.reports.text import best_text

    gone = str(tmp_path / "trial-3" / "best-model")
    attrs = {"best_model": gone, "checkpoint_s": 0.1}
    missing = f"the model of trial #3 is gone: {gone} is not on this host"
    best = {
        "study": "s",
        "number": 3,
        "value": 0.9,
        "params": {},
        "user_attrs": attrs,
        "model_missing": missing,
    }
    text = best_text(best)
    assert "WARNING: the model of trial #3 is gone" in text and "\nmodel:" not in text
