"""`hpo predict` and `hpo.load_model` (issue 44): a kept trial's model, a LoRA adapter (as it is,
and merged) and models of each task answer as a direct forward of the model does; the file is
streamed in chunks and written whole or not at all; every bad input is one line, exit code 2.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import torch

import hpo
from hpo.commands.predict import CHUNK_BATCHES, _jsonl_objects, predict_rows
from hpo.errors import DataError, HPOError, ModelError
from hpo.trainer.config import ModelConfig, PeftSettings
from hpo.trainer.inference import SETTINGS_FILE, InferenceSettings, save_settings
from hpo.trainer.model import build_model, load_tokenizer
from tests.conftest import (
    MINILM_TOKENIZER,
    TINY_BERT,
    easy_rows,
    read_csv,
    tiny_config,
    write_config,
    write_csv,
)

TEXTS = ["the meal was good", "awful room", "really very superb and lovely today", "poor"]


def _save(folder: Path, task: str, labels: list[str], **settings: Any) -> Path:
    """A tiny model of `task`, saved as a trial saves its best model."""
    model = build_model(
        ModelConfig(tokenizer=MINILM_TOKENIZER, config=dict(TINY_BERT)), labels, 0, task=task
    )
    model.save_pretrained(folder)
    load_tokenizer(ModelConfig(name_or_path=MINILM_TOKENIZER), task).save_pretrained(folder)
    save_settings(folder, InferenceSettings(task, max_length=32, **settings))
    return folder


def _logits(folder: Path, texts: list[str], task: str = "sequence_classification") -> np.ndarray:
    """The model's own forward, one row at a time (no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        rows = [model(**tokenizer(t, return_tensors="pt")).logits[0].numpy() for t in texts]
    return np.stack(rows)


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _refused(hpo_main: Callable, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """hpo predict ARGS: exit code 2 and one line, nothing written."""
    capsys.readouterr()  # what came before (a progress bar of saving a model)
    assert hpo_main(["predict", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpo: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# -- a kept trial's model, end to end ------------------------------------------------------------


def test_a_kept_trial_model_predicts_through_the_cli_as_its_direct_forward(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 1,
            "pruner": {"type": "none"},
            "checkpoint_dir": str(tmp_path / "c"),
            "trial_isolation": "none",  # the kept model is the point, not the trial's process
        },
        training={"max_steps": 2, "evals_per_epoch": 1},
    )
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    run = ["run", "--study", "s", "--config", str(write_config(tmp_path / "c.yaml", raw))]
    assert hpo_main([*run, "--storage", url, "--quiet"]) == 0
    folder = Path(
        optuna.load_study(study_name="s", storage=url).best_trial.user_attrs["best_model"]
    )
    saved = json.loads((folder / SETTINGS_FILE).read_text())  # written at training time
    assert saved["task"] == "sequence_classification" and saved["max_length"] == 32

    rows = [{"id": f"r{i}", "text": t, "label": "ignored"} for i, t in enumerate(TEXTS)]
    expected = _softmax(_logits(folder, TEXTS))
    source, out = write_csv(tmp_path / "in.csv", rows), tmp_path / "out.csv"
    args = ["predict", "--model", str(folder), "--input", str(source), "--out", str(out)]
    assert hpo_main([*args, "--id-column", "id", "--batch-size", "3"]) == 0
    assert f"4 predictions of sequence_classification in {out}" in capsys.readouterr().out
    written = read_csv(out)
    assert list(written[0]) == ["id", "label", "probabilities.neg", "probabilities.pos"]
    assert [r["id"] for r in written] == ["r0", "r1", "r2", "r3"]
    got = np.array(
        [[float(r["probabilities.neg"]), float(r["probabilities.pos"])] for r in written]
    )
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert [r["label"] for r in written] == [["neg", "pos"][i] for i in expected.argmax(axis=1)]

    jsonl = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    assert (
        hpo_main(
            [
                "predict",
                "--model",
                str(folder),
                "--input",
                str(jsonl),
                "--out",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["row"] for line in lines] == [1, 2, 3, 4]  # the row's number without --id-column
    probabilities = [[line["probabilities"]["neg"], line["probabilities"]["pos"]] for line in lines]
    np.testing.assert_allclose(probabilities, expected, atol=1e-5)


def test_the_api_loads_a_model_and_predicts_rows(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", "sequence_classification", ["neg", "pos"])
    model = hpo.load_model(folder)
    assert (model.task, model.labels, model.columns) == (
        "sequence_classification",
        ["neg", "pos"],
        ["text"],
    )
    answers = model.predict({"text": t} for t in TEXTS)
    expected = _softmax(_logits(folder, TEXTS))
    got = [[a["probabilities"]["neg"], a["probabilities"]["pos"]] for a in answers]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert "load_model" in hpo.__all__


# -- every task ------------------------------------------------------------------------------


def test_a_multi_label_model_gives_each_labels_probability_and_those_over_the_threshold(
    tmp_path: Path,
) -> None:
    folder = _save(tmp_path / "m", "multi_label_classification", ["a", "b", "c"], threshold=0.5)
    answers = hpo.load_model(folder).predict([{"text": t} for t in TEXTS])
    chances = 1 / (1 + np.exp(-_logits(folder, TEXTS)))
    for answer, row in zip(answers, chances, strict=True):
        np.testing.assert_allclose(list(answer["probabilities"].values()), row, atol=1e-5)
        assert answer["labels"] == [n for n, p in zip("abc", row, strict=True) if p >= 0.5]


def test_a_regression_model_gives_a_value(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", "regression", [])
    model = hpo.load_model(folder)
    assert model.labels == []
    values = [a["value"] for a in model.predict([{"text": t} for t in TEXTS])]
    np.testing.assert_allclose(values, _logits(folder, TEXTS)[:, 0], atol=1e-5)


def test_a_tagger_gives_a_tag_per_word_and_none_past_max_length(
    tmp_path: Path, hpo_main: Callable[[list[str]], int]
) -> None:
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tags = ["B-PER", "I-PER", "O"]
    folder = _save(tmp_path / "m", "token_classification", tags)
    words = [["Ada", "Lovelace", "wrote", "notes"], ["the", "meal"], ["word"] * 40]
    source = write_csv(tmp_path / "in.csv", [{"text": " ".join(w)} for w in words])
    assert (
        hpo_main(
            [
                "predict",
                "--model",
                str(folder),
                "--input",
                str(source),
                "--out",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model = AutoModelForTokenClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for row_words, answer in zip(words, answers, strict=True):
        encoded = tokenizer(row_words, is_split_into_words=True, truncation=True, max_length=32)
        with torch.no_grad():
            logits = model(**encoded.convert_to_tensors("pt", prepend_batch_axis=True)).logits[0]
        first = {w: i for i, w in reversed(list(enumerate(encoded.word_ids()))) if w is not None}
        expected = [
            tags[int(logits[first[w]].argmax())] if w in first else None
            for w in range(len(row_words))
        ]
        assert answer["tags"] == expected and len(answer["scores"]) == len(row_words)
    assert answers[2]["tags"][-1] is None  # 40 words do not fit in 32 tokens


def test_a_lora_adapter_predicts_on_its_base_as_it_is_and_merged(tmp_path: Path) -> None:
    from hpo.trainer.peft_adapters import merge_adapter, save_head_config

    base = _save(tmp_path / "base", "sequence_classification", ["neg", "pos"])
    settings = PeftSettings(r=4, target_modules=["query", "value"])
    config = ModelConfig(name_or_path=str(base), peft=settings)
    model = build_model(config, ["neg", "pos"], 1)
    with torch.no_grad():  # a trained adapter: LoRA's B starts at zero, which changes nothing
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.5)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    save_head_config(model, str(adapter))
    load_tokenizer(ModelConfig(name_or_path=str(base))).save_pretrained(adapter)
    save_settings(adapter, InferenceSettings("sequence_classification", max_length=32))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(base)))
    with torch.no_grad():
        model.eval()
        direct = [model(**tokenizer(t, return_tensors="pt")).logits[0].numpy() for t in TEXTS]
    expected = _softmax(np.stack(direct))
    merged = tmp_path / "merged"
    merge_adapter(adapter, str(base), "sequence_classification", merged)
    assert (merged / SETTINGS_FILE).is_file()
    for folder in (adapter, merged):
        answers = hpo.load_model(folder).predict([{"text": t} for t in TEXTS])
        got = [[a["probabilities"]["neg"], a["probabilities"]["pos"]] for a in answers]
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert not np.allclose(expected, _softmax(_logits(base, TEXTS)), atol=1e-3)  # not the base


def test_a_folder_without_settings_is_read_from_its_config_and_defaults(tmp_path: Path) -> None:
    """A soup, or a model of an hpo before issue 44: the head's class and problem_type say the
    task, the text column is `text`."""
    folder = _save(tmp_path / "m", "regression", [])
    (folder / SETTINGS_FILE).unlink()
    model = hpo.load_model(folder)
    assert (model.task, model.columns) == ("regression", ["text"])
    assert len(model.predict([{"text": "good"}])) == 1


# -- streamed ---------------------------------------------------------------------------------


def test_rows_are_read_a_chunk_at_a_time(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", "sequence_classification", ["neg", "pos"])
    model = hpo.load_model(folder, batch_size=2)
    chunk = 2 * CHUNK_BATCHES
    read = 0

    def rows() -> Iterator[dict[str, str]]:
        nonlocal read
        for row in easy_rows(200, 3):
            read += 1
            yield row

    answered = 0
    for _ in predict_rows(model._predictor, rows()):
        answered += 1
        assert read - answered < chunk, "read ahead of the chunk being answered"
    assert answered == read == 200


def test_a_file_of_many_rows_is_streamed_in_order_and_written_whole(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _save(tmp_path / "m", "sequence_classification", ["neg", "pos"])
    # 402 rows: 12 chunks of 32 rows (CHUNK_BATCHES batches of 4) and a partial one.
    rows = [{"n": str(i), "text": r["text"]} for i, r in enumerate(easy_rows(402, 4))]
    source, out = write_csv(tmp_path / "in.csv", rows), tmp_path / "out.csv"
    args = ["predict", "--model", str(folder), "--input", str(source), "--out", str(out)]
    assert hpo_main([*args, "--id-column", "n", "--batch-size", "4"]) == 0
    assert [r["n"] for r in read_csv(out)] == [str(i) for i in range(402)]
    # A bad row deep in the file: one line, and neither the file nor a part of it is left.
    out.unlink()
    _jsonl(tmp_path / "bad.jsonl", [{"text": "good"}] * 300 + [{"txt": "x"}])
    bad = ["predict", "--model", str(folder), "--input", str(tmp_path / "bad.jsonl")]
    err = _refused(hpo_main, capsys, *bad[1:], "--out", str(out))
    assert f"--input {tmp_path / 'bad.jsonl'}: row 301 has no text in column 'text'" in err
    (tmp_path / "bad.jsonl").write_text('{"text": "good"}\n{"text": \n')
    err = _refused(hpo_main, capsys, *bad[1:], "--out", str(out))
    assert "bad.jsonl: line 2 is not valid JSON" in err
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == []


# -- refusals ---------------------------------------------------------------------------------


def test_every_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _save(tmp_path / "m", "sequence_classification", ["neg", "pos"])
    source = write_csv(tmp_path / "in.csv", [{"review": "good", "label": "pos"}])
    good = write_csv(tmp_path / "good.csv", [{"text": "good"}])
    out = str(tmp_path / "out.csv")

    def refused(model: Path | str, given: Path | str = good, to: str = out) -> str:
        return _refused(hpo_main, capsys, "--model", str(model), "--input", str(given), "--out", to)

    assert "--model" in refused(tmp_path / "nowhere") and "does not exist" in refused(
        tmp_path / "nowhere"
    )
    (tmp_path / "empty").mkdir()
    assert "not a model folder (no config.json)" in refused(tmp_path / "empty")
    assert "no column 'text'" in refused(folder, source) and "'review', 'label'" in refused(
        folder, source
    )
    assert "unknown kind of file" in refused(folder, tmp_path / "in.parquet")
    assert "no such folder" in refused(folder, good, str(tmp_path / "no" / "out.csv"))
    assert "--id-column 'id'" in _refused(
        hpo_main,
        capsys,
        "--model",
        str(folder),
        "--input",
        str(good),
        "--out",
        out,
        "--id-column",
        "id",
    )
    latin = tmp_path / "latin.csv"
    latin.write_bytes("text\ncaf\xe9\n".encode("latin-1"))
    assert "not UTF-8 text" in refused(folder, latin)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "does not exist" in refused(loop)
    device = ["--model", str(folder), "--input", str(good), "--out", out, "--device", "tpu"]
    assert "--device is 'tpu', not a device" in _refused(hpo_main, capsys, *device)

    damaged = _save(tmp_path / "damaged", "sequence_classification", ["neg", "pos"])
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "model.safetensors is damaged" in refused(damaged)
    weights.unlink()
    assert "no weights" in refused(damaged)
    (folder / "config.json").write_text("{not json")
    (folder / SETTINGS_FILE).unlink()
    assert "config.json is unreadable" in refused(folder)

    causal = _save(tmp_path / "causal", "sequence_classification", ["neg", "pos"])
    (causal / SETTINGS_FILE).unlink()
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    assert "does not generate text" in refused(causal)
    assert not Path(out).exists() and not list(tmp_path.glob(".out.csv.*"))


def test_a_final_model_without_settings_takes_the_threshold_of_its_card(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", "multi_label_classification", ["a", "b"], threshold=0.5)
    (folder / SETTINGS_FILE).unlink()
    for threshold, labels in ((0.999, []), (0.001, ["a", "b"])):
        card = {"task": "multi_label_classification", "training": {"threshold": threshold}}
        (folder / "hpo_model_card.json").write_text(json.dumps(card))
        answer = hpo.load_model(folder).predict([{"text": "good"}])[0]
        assert answer["labels"] == labels, answer


def test_a_pair_model_reads_both_text_columns(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _save(tmp_path / "m", "sequence_classification", ["no", "yes"])
    settings = InferenceSettings("sequence_classification", "premise", "hypothesis", 32)
    save_settings(folder, settings)
    model = hpo.load_model(folder)
    assert model.columns == ["premise", "hypothesis"]
    pairs = [("a man sleeps", "nobody sleeps"), ("the meal was good", "food")]
    answers = model.predict([{"premise": p, "hypothesis": h} for p, h in pairs])
    direct = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = [
            direct(**tokenizer(p, h, return_tensors="pt")).logits[0].numpy() for p, h in pairs
        ]
    got = [[a["probabilities"]["no"], a["probabilities"]["yes"]] for a in answers]
    np.testing.assert_allclose(got, _softmax(np.stack(logits)), atol=1e-5)
    with pytest.raises(hpo.DataError, match="row 1 has no text in column 'hypothesis'"):
        model.predict([{"premise": "a man sleeps"}])


@pytest.mark.parametrize("line", ["[" * 100_000, '{"id": ' + "9" * 5000 + "}"])
def test_a_jsonl_line_nested_too_deep_or_of_a_huge_number_is_one_line(line: str) -> None:
    with pytest.raises(DataError, match="line 2 is not valid JSON") as caught:
        list(_jsonl_objects(io.StringIO('{"text": "a"}\n' + line + "\n")))
    assert "\n" not in str(caught.value)


def test_a_stack_whose_record_is_not_of_its_members_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """An edited ensemble.json (another task, a trillion outputs, a member left out) is refused
    before or at the first row, and so is a meta-learner that is no learner (of trusted types):
    never an IndexError, a MemoryError, an AttributeError or another task's answer."""
    import skops.io
    from sklearn.preprocessing import StandardScaler

    from hpo.ensemble import Split, evaluate_ensemble, save_ensemble
    from tests.test_ensemble import LR, complementary

    folders = {n: _save(tmp_path / n, "sequence_classification", ["x", "y", "z"]) for n in "ab"}
    labels, outputs = complementary(200, 8)
    report = evaluate_ensemble("sequence_classification", Split(outputs, labels), learners=LR)
    folder = save_ensemble(tmp_path / "ens", report, folders, copy_members=True)
    saved = json.loads((folder / "ensemble.json").read_text())
    assert hpo.load_model(folder).predict([{"text": "nice"}])[0]["label"] in ("x", "y", "z")
    for key, value in {"task": "regression", "num_outputs": 10**12, "kind": "average"}.items():
        (folder / "ensemble.json").write_text(json.dumps({**saved, key: value}))
        with pytest.raises(HPOError, match="its record is not of its members"):
            hpo.load_model(folder)
    (folder / "ensemble.json").write_text(json.dumps({**saved, "members": saved["members"][:1]}))
    with pytest.raises(HPOError, match="does not read its members' features"):
        hpo.load_model(folder).predict([{"text": "nice"}])
    (folder / "ensemble.json").write_text(json.dumps(saved))
    scaler = StandardScaler().fit(np.zeros((2, 6)))  # of trusted types, but no classifier
    skops.io.dump({"estimators": [scaler], "params": []}, folder / "meta_learner.skops")
    with pytest.raises(HPOError, match="does not read its members' features"):
        hpo.load_model(folder).predict([{"text": "nice"}])


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"max_length": "32"}, "max_length is '32', not a number of tokens"),
        ({"max_length": -5}, "max_length is -5"),
        ({"threshold": None}, "threshold is None, not a probability"),
        ({"label_separator": 5}, "label_separator is 5, not text"),
        ({"text_column": ["text"]}, "text_column is ['text'], not text"),
    ],
)
def test_an_edited_settings_file_is_damaged_in_one_line(
    tmp_path: Path, edit: dict[str, Any], words: str
) -> None:
    """A soup's or a member's hpo_inference.json edited: one line naming the value, not a
    TypeError, an OverflowError or an AttributeError on the first row."""
    from hpo.trainer.inference import read_settings

    saved = {"task": "multi_label_classification", "max_length": 32, "threshold": 0.5}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**saved, **edit}))
    with pytest.raises(ModelError, match="damaged") as caught:
        read_settings(tmp_path)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_max_length_past_the_models_positions_is_refused_when_loaded(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", "sequence_classification", ["neg", "pos"])
    settings = json.loads((folder / SETTINGS_FILE).read_text())
    (folder / SETTINGS_FILE).write_text(json.dumps({**settings, "max_length": 10**12}))
    with pytest.raises(ModelError, match="holds at most 64 positions"):
        hpo.load_model(folder)


@pytest.mark.parametrize("config", ["[1]", "{not json"])
def test_a_damaged_adapter_config_is_one_line_when_loaded_or_repointed(
    tmp_path: Path, config: str
) -> None:
    """A soup's adapter_config.json edited, or one fetched from a store another can write: one
    line, not an AttributeError or a JSONDecodeError traceback."""
    from hpo.trainer.peft_adapters import point_at_base

    folder = _save(tmp_path / "m", "sequence_classification", ["neg", "pos"])
    (folder / "adapter_model.safetensors").write_bytes(b"adapter")
    (folder / "adapter_config.json").write_text(config)
    for load in (lambda: hpo.load_model(folder), lambda: point_at_base(folder, None)):
        with pytest.raises(ModelError, match="adapter_config.json") as caught:
            load()
        assert "\n" not in str(caught.value)
