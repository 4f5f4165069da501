"""A store anyone on the shared mount (or with the bucket's keys) may write to: no name read
from it (a manifest's version, key or path, a listing, a symbolic link) makes hpo read, write
or delete outside the store, or outside the trial's own prefix (issue 42)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState, create_trial

from hpo.storage.artifacts import (
    ArtifactStore,
    FileBackend,
    S3Backend,
    UntrustedArtifact,
)
from hpo.study.kept_models import remove_unneeded_artifacts
from hpo.trial.folders import study_folder_name
from tests.conftest import run_hpo

STUDY = study_folder_name("s")
FOLDER = "trial-0"
SECRET = b"the victim's own file, outside the store\n"


@pytest.fixture
def layout(tmp_path: Path) -> Iterator[tuple[ArtifactStore, Path, Path]]:
    """A file store at tmp/store holding trial-0's best model, and tmp/victim/keep.txt beside
    the store: what a forged name would reach."""
    root = tmp_path / "store"
    store = ArtifactStore(f"file://{root}", FileBackend(root))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights" * 100)
    store.publish(STUDY, FOLDER, "best-model", model)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(SECRET)
    yield store, root, victim


def _manifest_path(root: Path, folder: str = FOLDER) -> Path:
    return root / STUDY / folder / "best-model.manifest.json"


def _forge(root: Path, change: Callable[[dict[str, Any]], None], folder: str = FOLDER) -> None:
    path = _manifest_path(root, folder)
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _escape_to_victim(raw: dict[str, Any]) -> None:
    """The review's manifest: its version climbs out of the store, its one file is the
    victim's, listed with its real size and sha256 (so a fetch's check passes)."""
    raw["version"] = "../../../../victim"
    prefix = f"{raw['study']}/{raw['folder']}/best-model/../../../../victim/"
    digest = hashlib.sha256(SECRET).hexdigest()
    raw["files"] = [
        {"path": "keep.txt", "key": prefix + "keep.txt", "size": len(SECRET), "sha256": digest}
    ]


def _trial(number: int, value: float) -> FrozenTrial:
    made = create_trial(
        state=TrialState.COMPLETE,
        value=value,
        params={"x": 0.5},
        distributions={"x": FloatDistribution(0, 1)},
    )
    made.number = number
    return made


def test_a_version_that_leads_out_of_the_store_is_refused_and_nothing_outside_is_touched(
    layout: tuple[ArtifactStore, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, root, victim = layout
    _forge(root, _escape_to_victim)

    with pytest.raises(UntrustedArtifact) as caught:
        store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
    said = str(caught.value)
    assert f"{STUDY}/{FOLDER}/best-model.manifest.json names the version '../../../../victim'" in (
        said
    )
    assert "\n" not in said and not (tmp_path / "out").exists()

    # A later trial beats trial 0: the workers' cleanup would remove trial 0's model.
    trials = [_trial(0, 0.1), _trial(1, 0.9)]
    with caplog.at_level(logging.WARNING):
        removed = remove_unneeded_artifacts(store, "s", trials, [StudyDirection.MAXIMIZE])
    assert removed == []
    assert (victim / "keep.txt").read_bytes() == SECRET
    assert _manifest_path(root).is_file()  # nothing deleted, the manifest included
    assert "trial-0/best-model stays in the artifact store" in caplog.text
    with pytest.raises(UntrustedArtifact):
        store.remove(STUDY, FOLDER)
    assert (victim / "keep.txt").read_bytes() == SECRET


def _set(field: str, value: object, entry: int | None = None) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        (raw if entry is None else raw["files"][entry])[field] = value

    return change


def _version_and_keys(version: object) -> Callable[[dict[str, Any]], None]:
    """A version, and every file's key made to agree with it (as a careful forger would)."""

    def change(raw: dict[str, Any]) -> None:
        raw["version"] = version
        for entry in raw["files"]:
            entry["key"] = f"{raw['study']}/{raw['folder']}/best-model/{version}/{entry['path']}"

    return change


def _path_and_key(path: str) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        entry = raw["files"][0]
        entry["path"] = path
        entry["key"] = f"{raw['study']}/{raw['folder']}/best-model/{raw['version']}/{path}"

    return change


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_version_and_keys(".."), "names the version '..'"),
        (_version_and_keys("a/../../b"), "names the version 'a/../../b'"),
        (_version_and_keys("/etc"), "names the version '/etc'"),
        (_version_and_keys("v\\..\\.."), "names the version"),
        (_version_and_keys("v\x00"), "names the version"),
        (_version_and_keys(""), "names the version ''"),
        (_set("version", 7), "names the version 7"),
        (_path_and_key("../../x"), "outside its version"),
        (_path_and_key("a//b"), "outside its version"),
        (_path_and_key("./x"), "outside its version"),
        (_set("key", "/etc/passwd", 0), "outside its version"),
        (_set("key", 3, 0), "is not text"),
        (_set("size", "7", 0), "no size in bytes or no sha256"),
        (_set("sha256", "../x", 0), "no size in bytes or no sha256"),
        (_set("folder", "trial-1"), "belongs to another trial"),
        (_path_and_key("model.safetensors"), "names one file twice"),
        (_path_and_key("model.safetensors/x/y"), "a file as a folder of another"),
    ],
)
def test_every_name_in_a_manifest_must_be_one_hpo_writes(
    layout: tuple[ArtifactStore, Path, Path],
    tmp_path: Path,
    change: Callable[[dict[str, Any]], None],
    said: str,
) -> None:
    store, root, _ = layout
    _forge(root, change)
    before = sorted(p for p in root.rglob("*"))
    for act in (
        lambda: store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out"),
        lambda: store.remove(STUDY, FOLDER),
    ):
        with pytest.raises(UntrustedArtifact) as caught:
            act()
        assert said in str(caught.value) and "\n" not in str(caught.value)
        assert str(caught.value).startswith(f"file://{root}/{STUDY}/{FOLDER}/best-model.manifest")
    assert sorted(p for p in root.rglob("*")) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key",
    ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a/", "a\\..\\b", "a\x00b", "", "~/x"],
)
def test_the_file_store_takes_no_key_that_could_lead_out(
    layout: tuple[ArtifactStore, Path, Path], key: str
) -> None:
    _, root, victim = layout
    files = FileBackend(root)
    for act in (
        lambda: files.read(key),
        lambda: files.write(key, b"x"),
        lambda: files.delete([f"{STUDY}/{FOLDER}/best-model.manifest.json", key]),
    ):
        with pytest.raises(UntrustedArtifact, match="refused"):
            act()
    assert (victim / "keep.txt").read_bytes() == SECRET
    assert _manifest_path(root).is_file()  # the good key of a refused batch stays too


def test_the_s3_store_takes_no_key_that_could_lead_out(
    s3: dict[str, str],
) -> None:
    import boto3

    client = boto3.client("s3")
    client.put_object(Bucket="hpo", Key="other/keep.txt", Body=SECRET)
    backend = S3Backend("hpo", "studies")
    for key in ("../other/keep.txt", "x/../../other/keep.txt", "/other/keep.txt", "a//b"):
        with pytest.raises(UntrustedArtifact, match="refused"):
            backend.read(key)
        with pytest.raises(UntrustedArtifact, match="refused"):
            backend.write(key, b"x")
        with pytest.raises(UntrustedArtifact, match="refused"):
            backend.delete([key])
        with pytest.raises(UntrustedArtifact, match="refused"):
            list(backend.list(key))
    assert client.get_object(Bucket="hpo", Key="other/keep.txt")["Body"].read() == SECRET
    assert [o["Key"] for o in client.list_objects_v2(Bucket="hpo")["Contents"]] == [
        "other/keep.txt"
    ]


def test_an_s3_manifest_whose_version_leads_out_is_refused(
    tmp_path: Path,
    s3: dict[str, str],
) -> None:
    import boto3

    client = boto3.client("s3")
    client.put_object(Bucket="hpo", Key="victim/keep.txt", Body=SECRET)
    store = ArtifactStore("s3://hpo/studies")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    store.publish(STUDY, FOLDER, "best-model", tmp_path / "model")
    key = f"studies/{STUDY}/{FOLDER}/best-model.manifest.json"
    raw = json.loads(client.get_object(Bucket="hpo", Key=key)["Body"].read())
    _escape_to_victim(raw)  # ../../../../victim from studies/<study>/trial-0/best-model
    client.put_object(Bucket="hpo", Key=key, Body=json.dumps(raw).encode())

    with pytest.raises(UntrustedArtifact, match="names the version '../../../../victim'"):
        store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
    removed = remove_unneeded_artifacts(
        store, "s", [_trial(0, 0.1), _trial(1, 0.9)], [StudyDirection.MAXIMIZE]
    )
    assert removed == [] and not (tmp_path / "out").exists()
    assert client.get_object(Bucket="hpo", Key="victim/keep.txt")["Body"].read() == SECRET


# -- symbolic links in a file:// store ----------------------------------------------------------


def _version_folder(root: Path) -> Path:
    raw = json.loads(_manifest_path(root).read_text())
    return root / STUDY / FOLDER / "best-model" / raw["version"]


def test_a_version_folder_linked_out_of_the_store_is_neither_read_nor_emptied(
    layout: tuple[ArtifactStore, Path, Path], tmp_path: Path
) -> None:
    """The manifest is hpo's own; its version folder was swapped for a link to a folder outside
    that holds the same files (or the victim's, named as the model's)."""
    store, root, _ = layout
    version = _version_folder(root)
    elsewhere = tmp_path / "elsewhere"
    version.rename(elsewhere)
    version.symlink_to(elsewhere)

    with pytest.raises(UntrustedArtifact, match="symbolic link") as caught:
        store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()
    with pytest.raises(UntrustedArtifact, match="symbolic link"):
        store.remove(STUDY, FOLDER)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["config.json", "model.safetensors"]
    assert version.is_symlink()


def test_a_file_linked_out_of_the_store_is_neither_read_nor_deleted(
    layout: tuple[ArtifactStore, Path, Path], tmp_path: Path
) -> None:
    store, root, victim = layout
    weights = _version_folder(root) / "model.safetensors"
    (victim / "model.safetensors").write_bytes(weights.read_bytes())
    weights.unlink()
    weights.symlink_to(victim / "model.safetensors")

    with pytest.raises(UntrustedArtifact, match="symbolic link"):
        store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
    with pytest.raises(UntrustedArtifact, match="symbolic link"):
        store.remove(STUDY, FOLDER)
    assert (victim / "model.safetensors").read_bytes() == b"weights" * 100
    assert weights.is_symlink()  # a link hpo did not make stays


def test_a_study_folder_linked_out_of_the_store_is_not_listed_written_or_cleaned(
    tmp_path: Path,
) -> None:
    """A study's folder that is a link to another store's copy of it: listing it, cleaning it
    and publishing into it are refused (one line), and nothing there changes."""
    other = ArtifactStore(f"file://{tmp_path / 'other'}", FileBackend(tmp_path / "other"))
    (tmp_path / "state.pt").write_bytes(b"state")
    other.publish(STUDY, FOLDER, "state", tmp_path / "state.pt")
    outside = sorted(p for p in (tmp_path / "other").rglob("*"))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / STUDY).symlink_to(tmp_path / "other" / STUDY)
    store = ArtifactStore(f"file://{tmp_path / 'store'}", FileBackend(tmp_path / "store"))

    for act in (
        lambda: store.folders(STUDY),
        lambda: store.size(STUDY),
        lambda: remove_unneeded_artifacts(store, "s", [_trial(1, 0.5)], [StudyDirection.MAXIMIZE]),
        lambda: store.publish(STUDY, "trial-1", "state", tmp_path / "state.pt"),
    ):
        with pytest.raises(UntrustedArtifact, match="symbolic link"):
            act()
    assert sorted(p for p in (tmp_path / "other").rglob("*")) == outside


def test_a_pipe_in_the_store_is_refused_without_blocking(
    layout: tuple[ArtifactStore, Path, Path], tmp_path: Path
) -> None:
    store, root, _ = layout
    weights = _version_folder(root) / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    outcome: list[BaseException | None] = []

    def fetch() -> None:
        try:
            store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    reader = threading.Thread(target=fetch, daemon=True)  # a blocked open would never return
    reader.start()
    reader.join(30)
    assert outcome, "the fetch blocked on the pipe"
    assert isinstance(outcome[0], UntrustedArtifact) and "not a regular file" in str(outcome[0])


def test_a_forged_trial_folder_in_a_listing_is_left_out(
    layout: tuple[ArtifactStore, Path, Path],
) -> None:
    store, root, _ = layout
    # A folder name hpo never makes (a leading dot) holding a manifest-shaped file.
    forged = root / STUDY / ".hidden"
    forged.mkdir()
    (forged / "best-model.manifest.json").write_text("{}")
    assert store.folders(STUDY) == {FOLDER: ["best-model"]}


# -- end to end: `hpo best --download` through the real CLI ------------------------------------


def test_best_download_refuses_a_manifest_leading_out_of_the_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.set_user_attr("artifact_store", f"file://{root}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ArtifactStore(f"file://{root}").publish(STUDY, FOLDER, "best-model", model)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_bytes(SECRET)
    _forge(root, _escape_to_victim)

    done = run_hpo(
        "best", "--study", "s", "--storage", url, "--download", "dl", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "best model of trial #0 not downloaded" in lines[0]
    assert f"{STUDY}/{FOLDER}/best-model.manifest.json names the version" in lines[0]
    assert "sha256 checked" not in done.stdout
    assert not (tmp_path / "dl").exists() and not list(tmp_path.glob(".dl*"))
    assert (tmp_path / "victim" / "keep.txt").read_bytes() == SECRET


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("best-model/dcpconfig.json", "a folder other than a sharded state"),
        ("sharded-state.5/config.json", "a share stored under no name hpo gives one"),
    ],
)
def test_a_stored_sharded_state_holding_what_hpo_never_stores_is_refused(
    tmp_path: Path, name: str, why: str
) -> None:
    """A state artifact (its manifest in order) whose files hpo's upload of a sharded state
    never makes: the retry refuses it whole and its folder stays as it was."""
    from hpo.storage.artifacts import ArtifactTarget
    from hpo.trainer.checkpoint import CheckpointStore
    from hpo.trial.uploads import fetch_resume_state

    root = tmp_path / "store"
    store = ArtifactStore(f"file://{root}", FileBackend(root))
    forged = tmp_path / "forged"
    (forged / name).parent.mkdir(parents=True)
    (forged / name).write_text("{}")
    (forged / "checkpoint.pt").write_bytes(b"state")
    store.publish(STUDY, FOLDER, "state", forged)
    retry = CheckpointStore(tmp_path / "b" / FOLDER, resume=True)
    retry.directory.mkdir(parents=True)
    target = ArtifactTarget(store.url, STUDY, FOLDER)
    assert not fetch_resume_state(store, target, retry), why
    assert "refused" in retry.errors[0]
    assert sorted(p.name for p in retry.directory.iterdir()) == []


def test_a_state_naming_a_folder_out_of_the_trial_is_not_uploaded(tmp_path: Path) -> None:
    import torch

    from hpo.trial.sharded_upload import staged_state

    (tmp_path / "sharded-state.5").mkdir()
    torch.save({"sharded": "../victim"}, tmp_path / "checkpoint.pt")
    with pytest.raises(OSError, match="not a sharded folder hpo writes"):
        staged_state(tmp_path / "checkpoint.pt")
    assert not list(tmp_path.glob(".upload-stage-*"))
