"""`hpo ensemble` on small real studies of each kind (issue 44): LoRA members fetched from the
artifact store, repointed at the base model as this host has it, and souped as adapters; the
test split given at ensemble time or recorded by the study (unchanged, changed, gone);
multi-label and regression ensembles saved and read back by `hpo predict`. Every refusal is one
line, exit code 2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import torch

import hpo
from hpo.ensemble import EnsembleReport, load_ensemble
from tests.conftest import easy_rows, read_csv, tiny_config, write_config, write_csv
from tests.test_peft import lora_config, tiny_pretrained  # noqa: F401  (a fixture)
from tests.test_task_multi_label import CUES, topic_rows, write_jsonl
from tests.test_task_regression import scored_rows

Main = Callable[[list[str]], int]
# The studies only make members for `hpo ensemble`: real ones, not good ones. Trials train in
# the worker (no trial process to start) for two steps.
TWO_KEPT = {"n_trials": 2, "keep_models": 2, "pruner": {"type": "none"}, "trial_isolation": "none"}
SHORT = {"max_steps": 2, "evals_per_epoch": 1}


def _refused(hpo_main: Main, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert hpo_main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpo: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _run_study(tmp_path: Path, hpo_main: Main, raw: dict[str, Any], name: str = "s") -> str:
    raw["study"].update(
        {
            **TWO_KEPT,
            "checkpoint_dir": str(tmp_path / "host-a" / "checkpoints"),
            "artifact_store": f"file://{tmp_path / 'store'}",
        }
    )
    raw["training"].update(SHORT)
    config = write_config(tmp_path / f"{name}.yaml", raw)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    run = ["run", "--study", name, "--config", str(config), "--storage", url, "--quiet"]
    assert hpo_main(run) == 0
    return url


def _stacking_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacking saved whatever tiny models score: the folder is then an ensemble to read back."""
    monkeypatch.setattr(EnsembleReport, "choice", property(lambda r: "stacking"))


# -- LoRA members from the store ---------------------------------------------------------------


def test_lora_members_from_the_store_are_put_on_this_hosts_base_and_souped(
    tmp_path: Path,
    tiny_pretrained: Path,  # noqa: F811
    easy_data: tuple[Path, Path],
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from peft.utils import load_peft_weights

    from hpo.commands import ensemble

    # The study trains on host A's copy of the base model; its kept adapters go to the store.
    base_a = tmp_path / "host-a" / "base"
    shutil.copytree(tiny_pretrained, base_a)
    url = _run_study(tmp_path, hpo_main, lora_config(base_a, *easy_data), "lora")
    shutil.rmtree(tmp_path / "host-a")  # this host is another: no kept folder, no base there
    base_b = tmp_path / "host-b" / "base"
    shutil.copytree(tiny_pretrained, base_b)
    ens = ["ensemble", "--study", "lora", "--storage", url, "--top", "2"]

    # The study's record names host A's base, gone here: refused, naming what to give.
    out = tmp_path / "ens"
    err = _refused(hpo_main, capsys, *ens, "--out", str(out))
    assert "LoRA adapter on the base model" in err and str(base_a) in err, err
    assert "--config" in err and not out.exists() and not list(tmp_path.glob(".ens.*"))

    # With this host's config, the adapters are put on host B's base.
    here = lora_config(base_b, *easy_data)
    config = write_config(tmp_path / "here.yaml", here)
    with monkeypatch.context() as patched:
        _stacking_wins(patched)
        stack = [*ens, "--config", str(config), "--learner", "logistic_regression"]
        assert hpo_main([*stack, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "saved: the stacked model" in said, said
    saved = load_ensemble(out)
    for member in saved.members.values():
        adapter = json.loads((member / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(base_b)
    rows = easy_rows(6, 9)
    source = write_csv(tmp_path / "in.csv", rows)
    written = tmp_path / "p.csv"
    args = ["predict", "--model", str(out), "--input", str(source), "--out", str(written)]
    assert hpo_main(args) == 0
    assert [r["label"] for r in read_csv(written)] and len(read_csv(written)) == len(rows)

    # The model card names each fetched member by its store reference, not a temporary folder.
    card = json.loads((out / "ensemble_card.json").read_text())
    trials = [t.number for t in optuna.load_study(study_name="lora", storage=url).trials]
    for name, source_ref in card["members"].items():
        assert isinstance(source_ref, dict), card["members"]
        assert name == f"trial-{source_ref['trial']}" and source_ref["trial"] in trials
        assert source_ref["store"].startswith(f"file://{tmp_path / 'store'}")
        assert len(source_ref["sha256"]) == 64
        assert source_ref["sha256"] in {m["sha256"] for m in saved.record["members"]}
    text = (out / "ENSEMBLE.md").read_text() + json.dumps(card)
    assert ".members" not in text and "trial #" in text, text

    # The uniform soup of the adapters: their weights averaged, saved as an adapter on host
    # B's base (forced to win), and hpo predict reads it.
    souped = tmp_path / "souped"
    monkeypatch.setattr(ensemble, "_soup_wins", lambda report, soup: True)
    soup_args = [*ens, "--config", str(config), "--soup", "uniform", "--out", str(souped)]
    assert hpo_main([*soup_args, "--learner", "logistic_regression"]) == 0
    said = capsys.readouterr().out
    assert "uniform soup (2 members, one model)" in said and "saved: the uniform soup" in said
    assert "a LoRA adapter on their base model" in said, said
    assert json.loads((souped / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        str(base_b)
    )
    each = [load_peft_weights(str(folder)) for folder in saved.members.values()]
    soup = load_peft_weights(str(souped))
    assert set(soup) == set(each[0])
    for key, value in soup.items():
        torch.testing.assert_close(value, (each[0][key] + each[1][key]) / 2)
    assert any(not torch.equal(each[0][k], each[1][k]) for k in soup)  # two different members
    souped_out = tmp_path / "souped.csv"
    assert hpo_main([*args[:2], str(souped), *args[3:6], str(souped_out)]) == 0
    assert len(read_csv(souped_out)) == len(rows)
    assert len(hpo.load_model(souped).predict(rows)) == len(rows)

    # The greedy soup through the Python API: the mean of the adapters it kept.
    with hpo.open_study("lora", url) as study:
        greedy = study.ensemble(
            tmp_path / "greedy",
            top=2,
            config=config,
            soup="greedy",
            learners=["logistic_regression"],
        )
    assert greedy["saved"] == "soup" and "greedy soup (" in greedy["table"]
    kept = json.loads((tmp_path / "greedy" / "ensemble_card.json").read_text())["soup"]["members"]
    by_name = dict(zip(saved.members, each, strict=True))
    mean = {k: sum(by_name[n][k] for n in kept) / len(kept) for k in soup}
    for key, value in load_peft_weights(str(tmp_path / "greedy")).items():
        torch.testing.assert_close(value, mean[key])


def test_adapters_of_other_bases_or_mixed_with_whole_models_make_no_soup(tmp_path: Path) -> None:
    from hpo.commands.soup import _not_souped

    def folder(name: str, base: str | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text("{}")
        if base is not None:
            (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        return path

    a, b, c, whole = (
        folder("a", "/m/x"),
        folder("b", "/m/x"),
        folder("c", "/m/y"),
        folder("w", None),
    )
    assert _not_souped({"a": a, "b": b}) is None
    assert _not_souped({"w": whole}) is None
    mixed = _not_souped({"a": a, "w": whole})
    assert mixed is not None and "'a' is a LoRA adapter and 'w' a whole model" in mixed
    other = _not_souped({"a": a, "c": c})
    assert other is not None and "other base models (/m/x, /m/y)" in other


# -- the test split ----------------------------------------------------------------------------


def test_the_test_split_given_at_ensemble_time_or_recorded_by_the_study(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hpo.commands.ensemble_members import checked_test_file
    from hpo.config.loader import parse_config
    from hpo.study.setup_record import TEST_FILE_ATTR, setup_record

    test_file = write_csv(tmp_path / "data" / "test.csv", easy_rows(24, 5))
    raw = tiny_config(*easy_data, data={"test_file": str(test_file)})
    assert not any("test_file" in key for key in setup_record(parse_config(raw, tmp_path)))
    url = _run_study(tmp_path, hpo_main, raw)
    attrs = optuna.load_study(study_name="s", storage=url).user_attrs
    assert attrs[TEST_FILE_ATTR]["path"] == str(test_file)
    assert len(attrs[TEST_FILE_ATTR]["sha256"]) == 64

    ens = ["ensemble", "--study", "s", "--storage", url, "--top", "2"]
    ens += ["--learner", "logistic_regression"]

    def built(*extra: str) -> str:
        out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
        capsys.readouterr()
        assert hpo_main([*ens, *extra, "--out", str(out)]) == 0
        return capsys.readouterr().out

    # Recorded and unchanged: scored there, with no --config.
    assert "measured: test split" in built()
    # Changed since: cross-validated, and said why.
    test_file.write_text(test_file.read_text() + "the meal was good,pos\n")
    said = built()
    assert "measured: 5-fold CV" in said
    assert f"scored by 5-fold CV: the study's test file {test_file} changed" in said, said
    test_file.unlink()
    assert f"the study's test file {test_file} is missing" in built()
    # --test-file: a split given now.
    given = write_csv(tmp_path / "given.csv", easy_rows(20, 6))
    said = built("--test-file", str(given))
    assert "measured: test split" in said and "the study's test file" not in said
    with hpo.open_study("s", url) as study:
        scores = study.ensemble(
            tmp_path / "api", top=2, learners=["logistic_regression"], test_file=given
        )
    assert scores["measured_on"] == "test_split"

    for bad, why in ((tmp_path / "nope.csv", "no such file"), (raw_file(tmp_path), "not a .csv")):
        err = _refused(
            hpo_main, capsys, *ens, "--test-file", str(bad), "--out", str(tmp_path / "x")
        )
        assert err.startswith(f"hpo: error: --test-file {bad}: {why}"), err
        assert not (tmp_path / "x").exists()
    with pytest.raises(hpo.HPOError, match="--test-file"):
        checked_test_file(str(tmp_path / "nope.csv"))


def raw_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("text,label\n")
    return path


# -- multi-label and regression, end to end ---------------------------------------------------


def test_a_multi_label_ensemble_is_saved_and_predicts_label_sets(
    tmp_path: Path,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    train = write_jsonl(data / "train.jsonl", topic_rows(64, 1))
    evaluation = write_jsonl(data / "eval.jsonl", topic_rows(40, 2))
    raw = tiny_config(train, evaluation, data={"label_column": "topics"})
    raw["task"] = "multi_label_classification"
    raw["study"]["metric"] = "eval_loss"
    url = _run_study(tmp_path, hpo_main, raw)
    out = tmp_path / "ens"
    _stacking_wins(monkeypatch)
    args = ["ensemble", "--study", "s", "--storage", url, "--top", "2", "--out", str(out)]
    assert hpo_main([*args, "--learner", "logistic_regression"]) == 0
    assert "saved: the stacked model" in capsys.readouterr().out
    assert load_ensemble(out).task == "multi_label_classification"

    rows = [{"text": row["text"]} for row in topic_rows(7, 3)]
    source, written = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "p.jsonl"
    predict = ["predict", "--model", str(out), "--input", str(source), "--out", str(written)]
    assert hpo_main(predict) == 0
    answers = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(answers) == len(rows)
    for answer in answers:
        assert set(answer["probabilities"]) == set(CUES)
        assert set(answer["labels"]) <= set(CUES)
    model = hpo.load_model(out)
    again = model.predict(rows)
    probabilities = np.array([[a["probabilities"][c] for c in CUES] for a in again])
    assert probabilities.shape == (len(rows), len(CUES))
    assert ((probabilities >= 0) & (probabilities <= 1)).all()


def test_a_regression_ensemble_is_saved_and_predicts_one_value_a_row(
    tmp_path: Path,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    train = write_csv(data / "train.csv", scored_rows(64, 1))
    evaluation = write_csv(data / "eval.csv", scored_rows(24, 2))
    raw = tiny_config(train, evaluation, data={"label_column": "score"})
    raw["task"] = "regression"
    raw["study"]["metric"] = "rmse"
    url = _run_study(tmp_path, hpo_main, raw)
    out = tmp_path / "ens"
    _stacking_wins(monkeypatch)
    args = ["ensemble", "--study", "s", "--storage", url, "--top", "2", "--out", str(out)]
    assert hpo_main(args) == 0
    assert "saved: the stacked model (ridge)" in capsys.readouterr().out

    rows = [{"text": row["text"]} for row in scored_rows(7, 3)]
    source, written = write_csv(tmp_path / "in.csv", rows), tmp_path / "p.csv"
    predict = ["predict", "--model", str(out), "--input", str(source), "--out", str(written)]
    assert hpo_main(predict) == 0
    values = [float(r["value"]) for r in read_csv(written)]
    assert len(values) == len(rows) and all(np.isfinite(values))
    again = [a["value"] for a in hpo.load_model(out).predict(rows)]
    np.testing.assert_allclose(again, values, rtol=1e-5)


def test_a_recorded_test_file_the_members_cannot_read_is_said_not_used(tmp_path: Path) -> None:
    from hpo.commands.ensemble_members import recorded_test_file
    from hpo.study.setup_record import TEST_FILE_ATTR
    from hpo.trainer.digests import content_sha256

    assert recorded_test_file({}) == (None, None)
    assert recorded_test_file({TEST_FILE_ATTR: "not a record"}) == (None, None)
    table = tmp_path / "test.parquet"
    table.write_bytes(b"PAR1")
    folder = tmp_path / "dataset"
    folder.mkdir()
    for path in (table, folder):
        record = {TEST_FILE_ATTR: {"path": str(path), "sha256": content_sha256(path)}}
        found, note = recorded_test_file(record)
        assert found is None and note is not None and "not a .csv or .jsonl file" in note
        assert "--test-file" in note
    good = write_csv(tmp_path / "test.csv", easy_rows(4, 1))
    record = {TEST_FILE_ATTR: {"path": str(good), "sha256": content_sha256(good)}}
    assert recorded_test_file(record) == (good, None)
