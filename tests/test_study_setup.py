"""A study keeps what makes its trials comparable (issue 42, 7): a worker with other data, model,
max_length, evaluation schedule or pruner is refused, naming each difference, unless it is
allowed to change the setup, which the study then records and `hpo status` says."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.config.loader import parse_config
from hpo.config.schema import Config
from hpo.errors import ConfigError
from hpo.reports.status import setup_warnings
from hpo.storage.engine import StudyStorage, open_storage
from hpo.storage.url import StorageURL
from hpo.study.join import WORKERS_ATTR, open_study
from hpo.study.setup_record import (
    SETUP_ATTR,
    SETUP_CHANGES_ATTR,
    differences,
    setup_changes,
    setup_record,
)
from hpo.trainer.digests import content_sha256, file_sha256
from tests.conftest import easy_rows, run_hpo, tiny_config, write_config, write_csv


def _config(tmp_path: Path, raw: dict[str, Any]) -> Config:
    return parse_config(copy.deepcopy(raw), base_dir=tmp_path)


@pytest.fixture
def raw(easy_data: tuple[Path, Path]) -> dict[str, Any]:
    return tiny_config(*easy_data)


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[StudyStorage]:
    opened = open_storage(StorageURL(f"sqlite:///{tmp_path / 'setup.db'}", "--storage"))
    yield opened
    opened.engine.dispose()


def _other_train_file(tmp_path: Path) -> str:
    return str(write_csv(tmp_path / "other-train.csv", easy_rows(256, 7)))


def _changed(raw: dict[str, Any], section: str, key: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(raw)
    changed[section][key] = value
    return changed


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("study", "n_trials", 50),
        ("study", "storage", "sqlite:///elsewhere.db"),
        ("study", "timeout", 3600),
        ("training", "physical_batch_size", 2),
        ("training", "device", "auto"),
        (
            "study",
            "pruner",
            {"type": "median", "n_warmup_steps": 1, "margin": 0.0, "reduction_factor": 4},
        ),  # not a median pruner's setting
    ],
    ids=["n_trials", "storage", "timeout", "physical batch", "device", "unused pruner setting"],
)
def test_what_does_not_change_what_trials_compute_is_no_difference(
    tmp_path: Path, raw: dict[str, Any], section: str, key: str, value: Any
) -> None:
    before = setup_record(_config(tmp_path, raw))
    after = setup_record(_config(tmp_path, _changed(raw, section, key, value)))
    assert differences(before, after) == []


def test_the_same_data_at_another_path_is_no_difference(
    tmp_path: Path, raw: dict[str, Any]
) -> None:
    copied = shutil.copy(raw["data"]["train_file"], tmp_path / "copy-of-train.csv")
    before = setup_record(_config(tmp_path, raw))
    after = setup_record(_config(tmp_path, _changed(raw, "data", "train_file", str(copied))))
    assert differences(before, after) == []
    assert after["data.train_file"]["path"] == str(copied)  # each record keeps its own path


@pytest.mark.parametrize(
    ("section", "key", "value", "field"),
    [
        ("data", "max_length", 16, "data.max_length"),
        ("data", "text_column", "sentence", "data.text_column"),
        ("training", "evals_per_epoch", 3, "training.evals_per_epoch"),
        ("training", "max_steps", 5, "training.max_steps"),
        ("training", "epochs", 3, "training.epochs"),
        ("study", "pruner", {"type": "hyperband"}, "study.pruner.type"),
        (
            "study",
            "pruner",
            {"type": "median", "n_warmup_steps": 2, "margin": 0.0},
            "study.pruner.n_warmup_steps",
        ),
        ("model", "tokenizer", "bert-base-uncased", "model.tokenizer"),
    ],
    ids=[
        "max_length",
        "column",
        "evals_per_epoch",
        "max_steps",
        "epochs",
        "pruner type",
        "pruner warmup",
        "tokenizer",
    ],
)
def test_what_changes_the_trials_is_a_difference(
    tmp_path: Path, raw: dict[str, Any], section: str, key: str, value: Any, field: str
) -> None:
    before = setup_record(_config(tmp_path, raw))
    after = setup_record(_config(tmp_path, _changed(raw, section, key, value)))
    assert differences(before, after) == [field]


def test_other_data_or_another_model_is_a_difference(tmp_path: Path, raw: dict[str, Any]) -> None:
    before = setup_record(_config(tmp_path, raw))
    other_data = _changed(raw, "data", "train_file", _other_train_file(tmp_path))
    assert differences(before, setup_record(_config(tmp_path, other_data))) == ["data.train_file"]
    wider = {**raw["model"]["config"], "hidden_size": 128}
    other_model = _changed(raw, "model", "config", wider)
    assert differences(before, setup_record(_config(tmp_path, other_model))) == ["model.config"]


def test_a_searched_field_is_left_to_the_search_space_check(
    tmp_path: Path, raw: dict[str, Any]
) -> None:
    raw["search_space"]["data.max_length"] = {"type": "categorical", "choices": [16, 32]}
    raw["search_space"]["epochs"] = {"type": "int", "low": 1, "high": 3}
    record = setup_record(_config(tmp_path, raw))
    assert "data.max_length" not in record and "training.epochs" not in record
    assert "training.evals_per_epoch" in record


def test_a_file_is_hashed_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    data = tmp_path / "d.csv"
    data.write_text("text,label\na,pos\n", encoding="utf-8")
    assert file_sha256(data) == hashlib.sha256(data.read_bytes()).hexdigest()  # as sha256sum
    reads = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == data:
            reads.append(self)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    first = content_sha256(data)
    assert content_sha256(data) == first and reads == []  # the cache answers: not read again
    data.write_text("text,label\nb,neg\n", encoding="utf-8")  # same size, a new version
    reads.clear()  # write_text opened it
    assert content_sha256(data) != first and len(reads) == 1


def _trials_and_attrs(storage: StudyStorage, name: str) -> tuple[int, dict, dict]:
    study_id = storage.get_study_id_from_name(name)
    return (
        len(storage.get_all_trials(study_id)),
        storage.get_study_user_attrs(study_id),
        storage.get_study_system_attrs(study_id),
    )


def test_a_worker_with_other_data_is_refused_in_one_line_and_writes_nothing(
    tmp_path: Path, raw: dict[str, Any], storage: StudyStorage
) -> None:
    open_study(storage, "s", _config(tmp_path, raw))
    before = _trials_and_attrs(storage, "s")
    other = _changed(raw, "data", "train_file", _other_train_file(tmp_path))
    other = _changed(other, "data", "max_length", 16)
    other = _changed(other, "study", "n_trials", 9)  # would be recorded by a worker that joins
    with pytest.raises(ConfigError) as refused:
        open_study(storage, "s", _config(tmp_path, other))
    message = str(refused.value)
    assert "\n" not in message
    assert "data.max_length: the study's 32, this worker's 16" in message
    train = raw["data"]["train_file"]
    assert f"data.train_file: the study's {train} (sha256 {content_sha256(Path(train))[:12]})" in (
        message
    )
    assert "other-train.csv" in message
    assert "start a new study with --study NEW_NAME, or pass --allow-changed-setup" in message
    assert _trials_and_attrs(storage, "s") == before


def test_an_allowed_change_is_recorded_and_becomes_the_studys_setup(
    tmp_path: Path, raw: dict[str, Any], storage: StudyStorage
) -> None:
    open_study(storage, "s", _config(tmp_path, raw))
    other = _config(tmp_path, _changed(raw, "training", "evals_per_epoch", 4))
    open_study(storage, "s", other, allow_changed_setup=True)
    attrs = _trials_and_attrs(storage, "s")[1]
    (change,) = setup_changes(attrs)
    assert change["fields"] == {"training.evals_per_epoch": {"study": "2", "worker": "4"}}
    assert attrs[SETUP_ATTR]["training.evals_per_epoch"] == 4
    open_study(storage, "s", other)  # the study's setup now: joins without the flag
    assert len(setup_changes(_trials_and_attrs(storage, "s")[1])) == 1
    (warning,) = setup_warnings(setup_changes(attrs))
    assert "mixes setups: changed once" in warning and "training.evals_per_epoch" in warning


def test_a_study_of_an_older_hpo_gets_the_record_on_its_first_join(
    tmp_path: Path, raw: dict[str, Any], storage: StudyStorage
) -> None:
    open_study(storage, "s", _config(tmp_path, raw))
    study_id = storage.get_study_id_from_name("s")
    # An older hpo wrote no record: delete it as no attribute can be through Optuna's API.
    from sqlalchemy import text

    with storage.engine.begin() as connection:
        connection.execute(
            text("delete from study_user_attributes where study_id = :id and key = :key"),
            {"id": study_id, "key": SETUP_ATTR},
        )
    assert SETUP_ATTR not in storage.get_study_user_attrs(study_id)
    other = _changed(raw, "data", "train_file", _other_train_file(tmp_path))
    open_study(storage, "s", _config(tmp_path, other))  # not refused: nothing to compare with
    attrs = storage.get_study_user_attrs(study_id)
    assert attrs[SETUP_ATTR]["data.train_file"]["path"].endswith("other-train.csv")
    assert SETUP_CHANGES_ATTR not in attrs
    assert storage.get_study_system_attrs(study_id)[WORKERS_ATTR] == 2


def test_a_reordered_search_space_joins(
    tmp_path: Path, raw: dict[str, Any], storage: StudyStorage
) -> None:
    open_study(storage, "s", _config(tmp_path, raw))
    raw["search_space"] = dict(reversed(list(raw["search_space"].items())))
    open_study(storage, "s", _config(tmp_path, raw))


def test_another_train_file_is_refused_by_hpo_run_unless_allowed(
    tmp_path: Path, raw: dict[str, Any]
) -> None:
    """Through the real CLI: one trial on a.yaml; b.yaml reads another train file: exit 2, one
    line, no trial added; with --allow-changed-setup it joins and `hpo status` says so."""
    raw["study"].update(n_trials=1, trial_isolation="none")
    raw["training"].update(max_steps=2, evals_per_epoch=1)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    a = write_config(tmp_path / "a.yaml", raw)
    b = write_config(
        tmp_path / "b.yaml", _changed(raw, "data", "train_file", _other_train_file(tmp_path))
    )
    run = ("run", "--study", "S", "--storage", url, "--quiet")
    first = run_hpo(*run, "--config", str(a), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    refused = run_hpo(*run, "--config", str(b), cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hpo: error")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "data.train_file: the study's" in errors[0] and "other-train.csv" in errors[0]
    assert "--study NEW_NAME" in errors[0] and "--allow-changed-setup" in errors[0]
    assert len(optuna.load_study(study_name="S", storage=url).trials) == 1

    allowed = run_hpo(
        *run, "--config", str(b), "--n-trials", "2", "--allow-changed-setup", cwd=tmp_path
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    study = optuna.load_study(study_name="S", storage=url)
    assert len(study.trials) == 2
    (change,) = setup_changes(study.user_attrs)
    assert list(change["fields"]) == ["data.train_file"]
    status = run_hpo("status", "--study", "S", "--storage", url, cwd=tmp_path)
    assert "WARNING: the study mixes setups" in status.stdout + status.stderr, status
