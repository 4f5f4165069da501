"""The multi-label task: label lists from JSONL and separated CSV cells, "no label" rows, bad
cells refused by row, BCE summed per example, F1 and subset accuracy as scikit-learn computes
them at the threshold, the best constant label set as the chance level, and a study through
`hpo run` end to end."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpo.trainer.batching import collate
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig
from hpo.trainer.data import PreparedData, TokenizedSplit
from hpo.trainer.errors import DataError
from hpo.trainer.model import build_model, load_tokenizer
from hpo.trainer.tasks import make_task, prepare_data
from hpo.trainer.tasks.multi_label import best_constant_scores, multi_label_metrics
from tests.conftest import MINILM_TOKENIZER, TINY_BERT, tiny_config, write_config, write_csv
from tests.task_study import run_task_study

TASK = "multi_label_classification"
MODEL = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
CUES = {
    "food": ["pasta", "soup", "bread"],
    "money": ["bank", "price", "tax"],
    "music": ["song", "guitar", "concert"],
    "sports": ["goal", "match", "coach"],
}
FILLER = ["the", "a", "today", "was", "in", "town", "people", "said", "new"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(MODEL)


def topic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """None to three topics a row, each named by one of its cue words among fillers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topics = sorted(rng.sample(list(CUES), rng.choice((0, 1, 1, 2, 2, 3))))
        words = rng.choices(FILLER, k=rng.randint(2, 6)) + [rng.choice(CUES[t]) for t in topics]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "topics": topics})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _prepare(
    tmp_path: Path, tokenizer: Any, train: Path, evaluation: Path, separator: str = "|"
) -> PreparedData:
    config = DataConfig(
        train_file=str(train),
        eval_file=str(evaluation),
        label_column="topics",
        label_separator=separator,
        max_length=32,
        cache_dir=str(tmp_path / "cache"),
    )
    return prepare_data(config, tokenizer, TASK)


def test_label_lists_and_separated_cells_become_multi_hot_rows(
    tmp_path: Path, tokenizer: Any
) -> None:
    train = write_csv(
        tmp_path / "t.csv",
        [
            {"text": "soup and tax", "topics": "food|money"},
            {"text": "a goal", "topics": " sports "},
            {"text": "a song", "topics": "music|music"},
        ],
    )
    evaluation = write_jsonl(
        tmp_path / "e.jsonl",
        [
            {"text": "bread", "topics": ["food"]},
            {"text": "nothing", "topics": []},
            {"text": "a bank match", "topics": "money|sports"},
        ],
    )
    data = _prepare(tmp_path, tokenizer, train, evaluation)
    assert data.label_names == ["food", "money", "music", "sports"]
    assert data.train.labels is not None and data.train.labels.dtype == np.float32
    assert data.train.labels.tolist() == [[1, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]
    assert data.eval.labels is not None
    assert data.eval.labels.tolist() == [[1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]]
    batch = collate(data.eval, np.array([2, 0]), data.pad_token_id)
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]


def test_integer_labels_rank_as_numbers_and_the_separator_is_a_setting(
    tmp_path: Path, tokenizer: Any
) -> None:
    train = write_csv(
        tmp_path / "t.csv", [{"text": "a", "topics": "10;2"}, {"text": "b", "topics": "9"}]
    )
    evaluation = write_jsonl(tmp_path / "e.jsonl", [{"text": "c", "topics": [2, 10.0]}])
    data = _prepare(tmp_path, tokenizer, train, evaluation, separator=";")
    assert data.label_names == ["2", "9", "10"]
    assert data.eval.labels is not None and data.eval.labels.tolist() == [[1, 0, 1]]
    # Another separator reads the same files otherwise, not from the cache of the first.
    with pytest.raises(DataError, match=re.escape("(training labels: ['10;2', '9'])")):
        _prepare(tmp_path, tokenizer, train, evaluation, separator="|")


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([{"text": "x", "topics": None}], "row 2 of column 'topics' has no labels; give them"),
        ([{"text": "x"}], "row 2 of column 'topics' has no labels; give them"),
        ([{"text": "x", "topics": "food||money"}], "row 2 of column 'topics' has an empty label"),
        ([{"text": "x", "topics": ["food", ""]}], "row 2 of column 'topics' has an empty label"),
        ([{"text": "x", "topics": 3.5}], "row 2 of column 'topics' is 3.5, not a list of labels"),
        ([{"text": "x", "topics": [True]}], "row 2 of column 'topics' has the label True"),
        ([{"text": "x", "topics": ["cars"]}], "row 2 has the label 'cars', which no training row"),
    ],
    ids=[
        "null",
        "absent",
        "empty between separators",
        "empty in a list",
        "number",
        "boolean",
        "not in training",
    ],
)
def test_a_bad_cell_in_jsonl_is_refused_by_row(
    tmp_path: Path, tokenizer: Any, rows: list[dict[str, Any]], expected: str
) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", topic_rows(8, 0))
    evaluation = write_jsonl(tmp_path / "e.jsonl", [{"text": "y", "topics": ["food"]}, *rows])
    with pytest.raises(DataError, match="^" + re.escape(f"{evaluation}: {expected}")):
        _prepare(tmp_path, tokenizer, train, evaluation)


def test_an_empty_csv_cell_is_refused_and_names_the_way_to_say_no_label(
    tmp_path: Path, tokenizer: Any
) -> None:
    train = write_csv(
        tmp_path / "t.csv", [{"text": "soup", "topics": "food"}, {"text": "nothing", "topics": ""}]
    )
    evaluation = write_jsonl(tmp_path / "e.jsonl", topic_rows(4, 1))
    with pytest.raises(DataError) as caught:
        _prepare(tmp_path, tokenizer, train, evaluation)
    assert str(caught.value) == (
        f"{train}: row 2 of column 'topics' is empty; write its labels separated by '|'. An "
        "empty CSV cell looks like a forgotten label: for a row with none of the labels, use "
        "JSONL or Parquet with an empty list []"
    )


def test_data_without_any_label_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    nothing = write_jsonl(tmp_path / "none.jsonl", [{"text": t, "topics": []} for t in "ab"])
    some = write_jsonl(tmp_path / "some.jsonl", topic_rows(8, 0))
    with pytest.raises(DataError, match=f"^{nothing}: no row of column 'topics' has a label"):
        _prepare(tmp_path, tokenizer, nothing, some)
    with pytest.raises(DataError, match=f"^{nothing}: every row has an empty list of labels"):
        _prepare(tmp_path, tokenizer, some, nothing)


def test_the_loss_is_bce_summed_over_labels_per_example_as_transformers_means_it() -> None:
    task = make_task(TASK, DataConfig(), TrainingConfig())
    model = build_model(MODEL, ["a", "b", "c"], seed=0, task=TASK).eval()
    assert model.config.problem_type == "multi_label_classification"
    assert model.config.num_labels == 3 and model.config.id2label == {0: "a", 1: "b", 2: "c"}
    labels = torch.tensor([[1.0, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1]])
    output = model(input_ids=torch.randint(1000, 2000, (4, 6)), labels=labels)
    loss = task.loss_sum(output.logits, labels)
    p = output.logits.sigmoid()
    expected = -(labels * p.log() + (1 - labels) * (1 - p).log()).sum()
    torch.testing.assert_close(loss, expected)
    assert task.units(labels) == 4  # examples: the mean loss is per example, over its labels
    # transformers' loss for the multi-label problem type is the mean over every label.
    torch.testing.assert_close(loss / task.units(labels), output.loss * 3)
    assert task.worst_case_labels(2, 64, 3).shape == (2, 3)


def test_the_fresh_head_answers_each_labels_share_of_the_training_rows() -> None:
    task = make_task(TASK, DataConfig(), TrainingConfig())
    model = build_model(MODEL, ["a", "b", "c"], seed=0, task=TASK).eval()
    labels = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=np.float32)
    task.prepare_model(model, TokenizedSplit(np.zeros(4, np.int32), np.arange(5), None, labels))
    with torch.no_grad():
        model.classifier.weight.zero_()  # what is left is the bias alone
        shares = model(input_ids=torch.randint(1000, 2000, (2, 5))).logits.sigmoid()
    torch.testing.assert_close(shares[0], torch.tensor([0.75, 0.25, 1e-4]), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        (0.5, [False, True, True]),
        (0.3, [False, True, True]),
        (0.8, [False, False, True]),
        (0.1, [True, True, True]),
    ],
)
def test_predictions_are_the_labels_at_or_above_the_threshold(
    threshold: float, expected: list[bool]
) -> None:
    logits = torch.logit(torch.tensor([[0.2, 0.5, 0.8]], dtype=torch.float64))
    task = make_task(TASK, DataConfig(), TrainingConfig(threshold=threshold))
    predicted = task.eval_outputs(logits, torch.zeros(1, 3))["predictions"]
    assert predicted.tolist() == [expected]


def test_metrics_agree_with_scikit_learn() -> None:
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(0)
    truth = rng.random((83, 6)) < [0.5, 0.3, 0.1, 0.05, 0.6, 0.0]  # label 5 never true
    predicted = truth ^ (rng.random((83, 6)) < 0.2)
    predicted[:, 3] = False  # label 3 never predicted
    predicted[:, 5] = False  # label 5 absent from both: no F1, left out of the macro average
    predicted[:7] = truth[:7]
    task = make_task(TASK, DataConfig(), TrainingConfig())
    batches = [slice(0, 30), slice(30, 31), slice(31, 83)]
    outputs = {
        "predictions": [predicted[b] for b in batches],
        "labels": [truth[b].astype(np.float32) for b in batches],
    }
    metrics = task.metrics(outputs, eval_loss=1.5, label_names=list("abcdef"))
    expected = {
        "micro_f1": f1_score(truth, predicted, average="micro"),
        "macro_f1": f1_score(truth, predicted, average="macro", zero_division=np.nan),
        "subset_accuracy": accuracy_score(truth, predicted),
        "eval_loss": 1.5,
    }
    assert set(metrics) == set(task.info.metrics)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name


def test_the_chance_level_is_the_best_constant_label_set() -> None:
    rng = np.random.default_rng(1)
    truth = rng.random((50, 4)) < [0.7, 0.45, 0.2, 0.0]
    truth[:9] = [True, True, False, False]  # a most common label set
    task = make_task(TASK, DataConfig(), TrainingConfig())
    split = TokenizedSplit(np.zeros(50, np.int32), np.arange(51), None, truth.astype(np.float32))
    chance = task.chance_levels(split, list("abcd"))
    # Every constant label set, tried: the chance level is the best of them, metric by metric,
    # so also no worse than predicting nothing or each label's majority.
    constants = [
        np.broadcast_to(np.array(s, bool), truth.shape)
        for s in itertools.product([False, True], repeat=4)
    ]
    scores = [multi_label_metrics(c, truth) for c in constants]
    for name in ("micro_f1", "macro_f1", "subset_accuracy"):
        assert chance[name] == pytest.approx(max(s[name] for s in scores), abs=1e-12), name
    assert chance == {**best_constant_scores(truth), "eval_loss": chance["eval_loss"]}
    # The loss of answering each label's share as its probability (a label never true: 0).
    share = torch.tensor(truth.mean(axis=0).clip(1e-12, 1 - 1e-12))
    constant = torch.logit(share).expand(50, 4)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        constant, torch.tensor(truth, dtype=torch.float64), reduction="sum"
    )
    assert chance["eval_loss"] == pytest.approx(bce.item() / 50, abs=1e-6)


@pytest.mark.parametrize(
    ("section", "key", "value", "rule"),
    [
        ("training", "threshold", 0.0, "must be in (0, 1)"),
        ("training", "threshold", 1.0, "must be in (0, 1)"),
        ("data", "label_separator", "", "must not be empty"),
    ],
)
def test_a_threshold_or_separator_that_cannot_work_is_refused(
    section: str, key: str, value: Any, rule: str
) -> None:
    config = TrainingConfig(**{key: value}) if section == "training" else DataConfig(**{key: value})
    assert any(k == key and rule in why for k, _, why in config.problems())


def test_an_empty_csv_cell_through_the_cli_is_one_line_and_writes_nothing(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"text": "soup", "topics": "food"}, {"text": "x", "topics": ""}]
    train = write_csv(tmp_path / "t.csv", rows)
    evaluation = write_jsonl(tmp_path / "e.jsonl", topic_rows(4, 1))
    raw = tiny_config(
        train, evaluation, study={"metric": "micro_f1"}, data={"label_column": "topics"}
    )
    raw["task"] = TASK
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert hpo_main(["run", "--study", "s", "--config", str(config), "--storage", url]) == 2
    err = capsys.readouterr().err
    assert f"{train}: row 2 of column 'topics' is empty; write its labels separated by" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hpo.db").exists()


def test_a_multi_label_study_end_to_end(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "data"
    folder.mkdir()
    data = (
        write_jsonl(folder / "train.jsonl", topic_rows(256, 1)),
        write_jsonl(folder / "eval.jsonl", topic_rows(32, 2)),
    )
    # eval_loss: early F1 is 0 for any learning rate (the fresh head predicts no label), the
    # loss of a learning model falls from the first steps.
    run = run_task_study(
        tmp_path, hpo_main, capsys, TASK, data, "eval_loss", data={"label_column": "topics"}
    )

    assert run.study.direction.name == "MINIMIZE"
    truth = np.array([[t in row["topics"] for t in CUES] for row in topic_rows(32, 2)])
    chance = make_task(TASK, DataConfig(), TrainingConfig()).chance_levels(
        TokenizedSplit(np.zeros(32, np.int32), np.arange(33), None, truth.astype(np.float32)),
        list(CUES),
    )
    assert run.resumed.value is not None and run.resumed.value < 0.9 * chance["eval_loss"]

    model = AutoModelForSequenceClassification.from_pretrained(run.model_dir)
    assert model.config.problem_type == "multi_label_classification"
    assert list(model.config.id2label.values()) == list(CUES)
