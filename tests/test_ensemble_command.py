"""`hpo ensemble` and ensembles in `hpo predict` / `hpo.load_model` (issue 44): a tiny 3-trial
study's kept models stacked, end to end; the second run reads the feature cache (no member
predicts again); the saved folder predicts as its meta-learner on the members' outputs; every
refusal is one line, exit code 2.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hpo
from hpo.ensemble import EnsembleReport, load_ensemble, stack_features
from tests.conftest import easy_rows, read_csv, tiny_config, write_config, write_csv

Main = Callable[[list[str]], int]


def _refused(hpo_main: Main, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert hpo_main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpo: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _study(
    tmp_path: Path, easy_data: tuple[Path, Path], hpo_main: Main, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Path]:
    """A 3-trial study that keeps every trial's model (study.keep_models: 3; by default a
    study keeps only the best one's). Its trials train in the worker for two steps: the
    members need only be real, not good."""
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 3,
            "keep_models": 3,
            "pruner": {"type": "none"},
            "trial_isolation": "none",
            "checkpoint_dir": str(tmp_path / "c"),
            "artifact_store": f"file://{tmp_path / 'store'}",
        },
        training={"max_steps": 2, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    run = ["run", "--study", "s", "--config", str(config), "--storage", url, "--quiet"]
    assert hpo_main(run) == 0
    return url, config


def _model_folders(folders: list[Path], config: dict[str, Any]) -> list[str]:
    """Model folders that hold only a config.json of `config`, as paths to give the CLI."""
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
    return [str(folder) for folder in folders]


def _member_outputs(folder: Path, rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    saved = load_ensemble(folder)
    outputs = {}
    for name, path in saved.members.items():
        model = hpo.load_model(path)
        answers = model.predict(rows)
        outputs[name] = np.array([[a["probabilities"][n] for n in model.labels] for a in answers])
    return outputs


def test_a_study_s_top_models_stack_cache_and_predict(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, config = _study(tmp_path, easy_data, hpo_main, monkeypatch)
    ensemble = ["ensemble", "--study", "s", "--storage", url, "--top", "3"]
    capsys.readouterr()
    out = tmp_path / "ens"
    assert hpo_main([*ensemble, "--learner", "logistic_regression", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    for line in ("best single member", "soft voting", "greedy selection", "stacking: "):
        assert line in table, table
    assert "measured: 5-fold CV" in table
    assert (out / "ensemble.json").is_file() or (out / "config.json").is_file()
    assert (out / "ENSEMBLE.md").is_file() and (out / "ensemble_card.json").is_file()

    # The second run reads every member's predictions from the cache: no Predictor is built.
    import hpo.trainer.inference

    def no_forward(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a member predicted again: the feature cache was not read")

    # Stacking forced to win, so the folder is a stacked ensemble whatever the tiny models score.
    honest = EnsembleReport.choice
    monkeypatch.setattr(EnsembleReport, "choice", property(lambda r: "stacking"))
    from hpo.ensemble import stacking

    def no_fit(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a meta-learner was fitted again: the ensemble cache was not read")

    with monkeypatch.context() as patched:
        patched.setattr(hpo.trainer.inference.Predictor, "__init__", no_forward)
        stacked = tmp_path / "stacked"
        assert hpo_main([*ensemble, "--learner", "logistic_regression", "--out", str(stacked)]) == 0
    assert "saved: the stacked model (logistic_regression)" in capsys.readouterr().out
    with hpo.open_study("s", url) as study:  # the Python API, from the cache too
        with monkeypatch.context() as patched:
            patched.setattr(hpo.trainer.inference.Predictor, "__init__", no_forward)
            # The stack the run before fitted and saved is read back: nothing is fitted.
            patched.setattr(stacking, "_tuned", no_fit)
            scores = study.ensemble(tmp_path / "api", top=3, learners=["logistic_regression"])
    assert scores["saved"] == "stacking" and scores["measured_on"] == "cross_validation"
    assert (scores["folder"] / "ensemble.json").is_file()
    assert sorted(p.name for p in (stacked / "members").iterdir()) == sorted(
        load_ensemble(stacked).members
    )

    # hpo predict --model ENSEMBLE: the meta-learner applied to the members' outputs.
    rows = easy_rows(12, 7)
    source, predictions = write_csv(tmp_path / "in.csv", rows), tmp_path / "p.csv"
    args = ["predict", "--model", str(stacked), "--input", str(source), "--out", str(predictions)]
    assert hpo_main(args) == 0
    saved = load_ensemble(stacked)
    assert saved.model is not None
    expected = saved.model.predict(
        stack_features(_member_outputs(stacked, rows), saved.model.members)
    )
    written = read_csv(predictions)
    got = np.array(
        [[float(r["probabilities.neg"]), float(r["probabilities.pos"])] for r in written]
    )
    np.testing.assert_allclose(got, expected, atol=1e-6)
    model = hpo.load_model(stacked)
    assert [a["label"] for a in model.predict(rows)] == [r["label"] for r in written]

    # --features embedding: the meta-learner reads the members' mean-pooled hidden states, at
    # build time and when the folder predicts.
    embedded = tmp_path / "embedded"
    by_embedding = [*ensemble, "--features", "embedding", "--pca", "4", "--out", str(embedded)]
    assert hpo_main([*by_embedding, "--learner", "logistic_regression"]) == 0
    assert load_ensemble(embedded).record["features"]["kind"] == "embedding"
    answers = hpo.load_model(embedded).predict(rows)
    import torch

    from hpo.commands.features import member_embeddings, stacked_embeddings

    by_members = load_ensemble(embedded)
    assert by_members.model is not None
    pooled = {
        name: member_embeddings(hpo.trainer.inference.Predictor(path, torch.device("cpu")), rows)
        for name, path in by_members.members.items()
    }
    expected = by_members.model.predict(stacked_embeddings(pooled, by_members.model.members))
    got = np.array([[a["probabilities"]["neg"], a["probabilities"]["pos"]] for a in answers])
    np.testing.assert_allclose(got, expected, atol=1e-5)

    # With data.test_file every candidate is scored there, and the table says so.
    test_file = write_csv(tmp_path / "data" / "test.csv", easy_rows(40, 3))
    import yaml

    raw = yaml.safe_load(config.read_text())
    raw["data"]["test_file"] = str(test_file)
    with_test = write_config(tmp_path / "t.yaml", raw)
    on_test = [*ensemble, "--config", str(with_test), "--out", str(tmp_path / "t")]
    assert hpo_main([*on_test, "--learner", "logistic_regression"]) == 0
    assert "measured: test split" in capsys.readouterr().out

    # Members of one base architecture: the greedy soup is built, scored on the test split and
    # shown beside; whatever wins, the folder predicts (a soup or a member: a plain folder).
    monkeypatch.setattr(EnsembleReport, "choice", honest)  # scores decide
    souped = tmp_path / "souped"
    with_soup = [*ensemble, "--config", str(with_test), "--soup", "greedy", "--out", str(souped)]
    assert hpo_main([*with_soup, "--learner", "logistic_regression"]) == 0
    said = capsys.readouterr().out
    assert "greedy soup (" in said and "greedy soup: scored on the test split" in said, said
    assert len(hpo.load_model(souped).predict(rows)) == len(rows)

    # Refusals, one line each, nothing written: a member changed, a pickle as meta-learner.
    damaged = tmp_path / "damaged"
    shutil.copytree(stacked, damaged)
    member = next((damaged / "members").iterdir())
    weights = next(member.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    err = _refused(hpo_main, capsys, *args[:2], str(damaged), *args[3:])
    assert "sha256" in err and member.name in err
    shutil.rmtree(member)
    assert "is missing" in _refused(hpo_main, capsys, *args[:2], str(damaged), *args[3:])

    pickled = tmp_path / "pickled"
    shutil.copytree(stacked, pickled)
    import pickle

    (pickled / "meta_learner.skops").write_bytes(pickle.dumps({"estimators": []}))
    assert "not a skops file" in _refused(hpo_main, capsys, *args[:2], str(pickled), *args[3:])

    # A member whose folder is not on this host is fetched from the study's artifact store.
    import optuna

    trials = optuna.load_study(study_name="s", storage=url).trials
    kept = Path(trials[0].user_attrs["best_model"])  # a link to the best checkpoint
    shutil.rmtree(kept.resolve())
    kept.unlink(missing_ok=True)
    fetched = tmp_path / "fetched"
    assert hpo_main([*ensemble, "--learner", "logistic_regression", "--out", str(fetched)]) == 0
    assert "best single member" in capsys.readouterr().out
    card = json.loads((fetched / "ensemble_card.json").read_text())
    assert f"trial-{trials[0].number}" in card["member_scores"], card["member_scores"]
    assert not list(tmp_path.glob(".fetched.*"))  # the fetched copies removed

    err = _refused(hpo_main, capsys, *ensemble[:-2], "--top", "1", "--out", str(tmp_path / "x"))
    assert "at least 2 members" in err
    assert not (tmp_path / "x").exists()


def test_hostile_members_and_data_files_are_refused_in_one_line_before_any_prediction(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hpo.commands.ensemble_members import _given_folders

    # Kept trial models: every one a `best-model`.
    binary = {"id2label": {"0": "neg", "1": "pos"}}
    members = _model_folders([tmp_path / p / "best-model" for p in ("a", "b")], binary)
    assert list(_given_folders(tuple(members))) == ["a-best-model", "b-best-model"]
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    out = str(tmp_path / "out")
    ensemble = ["ensemble", "--config", str(config), "--out", out, "--from-retrain"]

    def refused(*folders: str, config: Path = config) -> str:
        return _refused(hpo_main, capsys, *ensemble[:2], str(config), *ensemble[3:], *folders)

    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert "the same folder as" in refused(*members, str(tmp_path / "link" / "best-model"))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert "not a model folder" in refused(members[0], str(tmp_path / "loop"))
    for name, content, said in (
        ("empty.csv", b"", "has no rows"),
        ("header.csv", b"text,label\n", "has no rows"),
        ("latin.csv", "text,label\ncaf\xe9,pos\n".encode("latin-1"), "not UTF-8 text"),
    ):
        (tmp_path / name).write_bytes(content)
        raw = tiny_config(easy_data[0], tmp_path / name)
        assert said in refused(*members, config=write_config(tmp_path / f"{name}.yaml", raw))
    raw = tiny_config(easy_data[0], write_csv(tmp_path / "v.csv", [{"text": "a", "label": "x"}]))
    raw.update(task="regression")
    raw["study"]["metric"] = "rmse"
    for folder in members:
        (Path(folder) / "config.json").write_text("{}")
    regression = write_config(tmp_path / "r.yaml", raw)
    assert "row 1's label 'x' is not a number" in refused(*members, config=regression)
    assert not Path(out).exists()


def test_a_pca_larger_than_the_features_is_said_on_the_card() -> None:
    from hpo.commands.ensemble import _pca_notes

    features = np.zeros((40, 6))  # 3 members x 2 classes
    assert _pca_notes(4000, features) == [
        "--pca 4000: the features have 6 columns; 6 components kept at most"
    ]
    assert _pca_notes(6, features) == [] == _pca_notes(None, features)


def test_causal_lm_stacking_is_refused_in_one_line(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    members = _model_folders([tmp_path / "a", tmp_path / "b"], {})
    raw = tiny_config(*easy_data)
    raw["task"] = "causal_lm"
    raw["data"] = {
        **raw["data"],
        "prompt_column": "text",
        "completion_column": "label",
    }
    raw["study"]["metric"] = "eval_loss"
    config = write_config(tmp_path / "c.yaml", raw)
    out = tmp_path / "out"
    args = ["ensemble", "--from-retrain", *members, "--config", str(config), "--out", str(out)]
    err = _refused(hpo_main, capsys, *args)
    assert "causal_lm" in err and "soup" in err
    assert not out.exists()


def test_taggers_are_combined_by_averaging_their_word_probabilities(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    import hpo.trainer.inference
    from hpo.commands import token_ensemble
    from hpo.commands.features import word_probabilities
    from hpo.trainer.config import ModelConfig
    from hpo.trainer.model import build_model
    from tests.conftest import MINILM_TOKENIZER, TINY_BERT
    from tests.test_predict import _save

    tags = ["B-PER", "I-PER", "O"]
    members = []
    for seed, name in enumerate("abc"):  # members that differ: a seed each
        folder = _save(tmp_path / name, "token_classification", tags)
        model = build_model(
            ModelConfig(tokenizer=MINILM_TOKENIZER, config=dict(TINY_BERT)),
            tags,
            seed,
            task="token_classification",
        )
        model.save_pretrained(folder)
        members.append(str(folder))
    from hpo.ensemble import weights_sha256

    assert len({weights_sha256(Path(m)) for m in members}) == 3
    rows = [
        {"text": "Ada Lovelace wrote notes", "tags": "B-PER I-PER O O"},
        {"text": "the meal", "tags": "O O"},
        {"text": "Grace Hopper", "tags": "B-PER I-PER"},
    ]
    evaluation = write_csv(tmp_path / "eval.csv", rows)
    raw = tiny_config(easy_data[0], evaluation)
    raw["task"] = "token_classification"
    raw["data"] = {**raw["data"], "label_column": "tags"}
    raw["study"]["metric"] = "f1"
    config = write_config(tmp_path / "c.yaml", raw)
    out = tmp_path / "tagged"
    args = ["ensemble", "--from-retrain", *members, "--config", str(config), "--out", str(out)]
    capsys.readouterr()
    assert hpo_main(args) == 0
    said = capsys.readouterr().out
    assert "average of token probabilities" in said and "measured: on the evaluation split" in said
    assert (out / "ensemble.json").is_file() == ("saved: the average" in said)

    # The average saved (forced to win): it tags as the members' mean probabilities do.
    monkeypatch.setattr(token_ensemble, "average_wins", lambda averaged, best: True)
    out = tmp_path / "averaged"
    assert hpo_main([*args[:-1], str(out)]) == 0
    if True:
        model = hpo.load_model(out)
        answers = model.predict(rows)
        each = [
            word_probabilities(
                hpo.trainer.inference.Predictor(Path(m), torch.device("cpu")), rows, tags
            )
            for m in members
        ]
        mean = np.mean(each, axis=0)
        flat = [tag for a in answers for tag in a["tags"]]
        assert flat == [tags[i] for i in mean.argmax(axis=1)]

    # A test file whose tags are not one per word: said, never scored word against other tag.
    short = write_csv(tmp_path / "short.csv", [{"text": "Ada Lovelace wrote", "tags": "B-PER O"}])
    test_file = ["--test-file", str(short)]
    err = _refused(hpo_main, capsys, *args[:-1], str(tmp_path / "short"), *test_file)
    assert "2 tags for 3 words" in err and not (tmp_path / "short").exists()


def test_labels_and_member_outputs_of_multi_label_and_regression_read_as_arrays(
    tmp_path: Path,
) -> None:
    from hpo.commands.ensemble import DataFiles, _labels
    from hpo.commands.predict import answers_array

    where = tmp_path / "eval.csv"
    tagged = DataFiles("multi_label_classification", where, None, "label", "|")
    rows = [{"label": "a|c"}, {"label": "b"}, {"label": ""}]
    np.testing.assert_array_equal(
        _labels(rows, tagged, ["a", "b", "c"], where), [[1, 0, 1], [0, 1, 0], [0, 0, 0]]
    )
    valued = DataFiles("regression", where, None, "score")
    assert _labels([{"score": "1.5"}, {"score": 2}], valued, [], where).tolist() == [1.5, 2.0]
    answers = [{"labels": ["b"], "probabilities": {"b": 0.9, "a": 0.2}}]
    np.testing.assert_allclose(
        answers_array(answers, "multi_label_classification", ["a", "b"]), [[0.2, 0.9]]
    )
    assert answers_array([{"value": 3.0}], "regression", []).tolist() == [3.0]
    with pytest.raises(hpo.HPOError, match="label 'z' is none of the members'"):
        _labels([{"label": "z"}], tagged, ["a", "b"], where)


def test_a_soup_is_saved_on_its_evaluation_score_and_the_card_says_how_it_was_chosen() -> None:
    from hpo.commands.ensemble import _soup_wins, card_json, card_markdown, table
    from hpo.commands.soup import SoupResult
    from hpo.ensemble import Split, evaluate_ensemble
    from tests.test_ensemble import LR, complementary

    labels, members = complementary(150, 0)
    test_labels, test_members = complementary(150, 1)
    report = evaluate_ensemble(
        "sequence_classification",
        Split(members, labels),
        Split(test_members, test_labels),
        learners=LR,
    )
    assert report.choice == "stacking"
    chosen = report.chosen_by.stacking  # out of fold on the evaluation split
    # The soup is compared where stacking was chosen, never on the test split.
    best_on_test = SoupResult("uniform", 1.0, "test_split", ["a", "b"], evaluation_score=0.0)
    assert not _soup_wins(report, best_on_test)
    worst_on_test = SoupResult(
        "uniform", 0.0, "test_split", ["a", "b"], evaluation_score=chosen + 0.01
    )
    assert _soup_wins(report, worst_on_test)

    folders = {"a": Path("a"), "b": Path("b")}
    card = card_json(report, folders, best_on_test, saved="stacking")
    assert card["saved"]["kind"] == "stacking" and card["saved"]["score"] == report.stacked_score
    assert card["saved_score"] == report.stacked_score
    assert card["chosen_by"]["stacking"] == chosen
    assert card["saved"]["chosen"].startswith(
        "chosen by 5-fold cross-validation on the evaluation split: stacking (logistic_regression)"
    )
    souped = card_json(report, folders, worst_on_test, saved="soup")
    assert souped["saved"]["kind"] == "soup" and souped["saved"]["score"] == 0.0
    assert "soup scored" in souped["saved"]["chosen"]
    text = card_markdown(report, worst_on_test, saved="soup")
    assert "Saved: the uniform soup of 2 members" in text and "accuracy 0.0000" in text
    said = table(report, "stacking")
    assert "saved: the stacked model (logistic_regression)\n  chosen by 5-fold" in said, said


def test_the_folder_members_are_fetched_into_is_new_and_removed_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named as the old code named its fetch folder (by the pid: one a killed run
    left, or the user's) is neither fetched into nor removed; hpo's own is removed."""
    from hpo.commands import ensemble as command
    from hpo.errors import HPOError

    theirs = tmp_path / f".ens.{os.getpid()}.members"
    (theirs / "trial-3").mkdir(parents=True)
    used: list[Path] = []

    def fails(request: Any, study: Any, out: Path, fetched: Path) -> Any:
        used.append(fetched)
        raise HPOError("the store is down")

    monkeypatch.setattr(command, "_build", fails)
    with pytest.raises(HPOError, match="the store is down"):
        command.build_ensemble(command.EnsembleRequest(out=str(tmp_path / "ens")))
    assert (theirs / "trial-3").is_dir() and used[0] != theirs and not used[0].exists()


@pytest.mark.parametrize(("tags", "words"), [(5, "holds int, not tags"), (None, "holds no tags")])
def test_a_tagger_row_without_tags_is_one_line(tags: Any, words: str) -> None:
    from hpo.commands.token_ensemble import _tags
    from hpo.errors import HPOError

    with pytest.raises(HPOError, match=words):
        _tags([{"text": "Ada", "tags": tags}], "tags", ["B-PER", "O"], Path("test.jsonl"))


@pytest.mark.parametrize("config", ["{", "[1]", '{"id2label": {"a": "pos"}}', '{"id2label": [1]}'])
def test_a_first_member_whose_config_has_no_labels_by_id_is_one_line(
    tmp_path: Path, config: str
) -> None:
    from hpo.commands.ensemble_members import labels_by_id
    from hpo.errors import HPOError

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(HPOError, match="config.json has no labels by id") as caught:
        labels_by_id(tmp_path)
    assert "\n" not in str(caught.value)


def test_hpo_predict_on_an_edited_ensemble_is_exit_code_2_and_one_line(
    tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_ensemble import saved_stack

    folder, _, _ = saved_stack(tmp_path)
    record = json.loads((folder / "ensemble.json").read_text())
    del record["members"][0]["folder"]  # was a KeyError traceback
    (folder / "ensemble.json").write_text(json.dumps(record))
    given = write_csv(tmp_path / "in.csv", [{"text": "good"}])
    out = tmp_path / "out.csv"
    args = ["predict", "--model", str(folder), "--input", str(given), "--out", str(out)]
    assert "without its name, folder and sha256" in _refused(hpo_main, capsys, *args)
    assert not out.exists() and not list(tmp_path.glob(".out.csv.*"))
