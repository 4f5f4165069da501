"""The regression task: numbers read from CSV text and JSON numbers, bad targets refused by row,
summed squared error, metrics as scipy and scikit-learn compute them, the best constant as the
chance level, and a study through `hpo run` end to end."""

from __future__ import annotations

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
from tests.conftest import MINILM_TOKENIZER, TINY_BERT, read_csv, write_config, write_csv
from tests.task_study import run_task_study

TASK = "regression"
MODEL = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
WORDS = {"awful": 1.0, "poor": 2.0, "okay": 3.0, "good": 4.0, "superb": 5.0}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(MODEL)


def scored_rows(n: int, seed: int) -> list[dict[str, str]]:
    """A score that the one quality word says, among fillers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = rng.choice(list(WORDS))
        filler = rng.choices(["the", "room", "was", "really", "and", "food"], k=rng.randint(1, 5))
        rows.append({"text": " ".join([*filler, word]), "score": f"{WORDS[word]:.1f}"})
    return rows


def _prepare(tmp_path: Path, tokenizer: Any, train: Path, evaluation: Path) -> PreparedData:
    config = DataConfig(
        train_file=str(train),
        eval_file=str(evaluation),
        label_column="score",
        max_length=32,
        cache_dir=str(tmp_path / "cache"),
    )
    return prepare_data(config, tokenizer, TASK)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_targets_from_csv_text_and_json_numbers_are_float32_per_example(
    tmp_path: Path, tokenizer: Any
) -> None:
    train = write_csv(
        tmp_path / "t.csv",
        [
            {"text": "good", "score": "4"},
            {"text": "meh", "score": " 2.5 "},
            {"text": "bad", "score": "1e0"},
            {"text": "top", "score": "-0.25"},
        ],
    )
    evaluation = _write_jsonl(
        tmp_path / "e.jsonl",
        [
            {"text": "fine", "score": 3},
            {"text": "great", "score": 4.75},
        ],
    )
    data = _prepare(tmp_path, tokenizer, train, evaluation)
    assert data.label_names == [] and data.task == TASK
    assert data.train.labels is not None and data.train.labels.dtype == np.float32
    assert data.train.labels.tolist() == [4.0, 2.5, 1.0, -0.25]
    assert data.eval.labels is not None and data.eval.labels.tolist() == [3.0, 4.75]
    batch = collate(data.train, np.array([3, 1]), data.pad_token_id)
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == [-0.25, 2.5]


@pytest.mark.parametrize(
    ("cell", "row", "expected"),
    [
        ("nan", 2, "row 2 of column 'score' is 'nan', not a finite number"),
        ("-inf", 2, "row 2 of column 'score' is '-inf', not a finite number"),
        ("four", 2, "row 2 of column 'score' is 'four', not a number; a regression target is one"),
        ("", 2, "row 2 of column 'score' has no target; fill in a number or drop the row"),
        ("1e39", 2, "row 2 of column 'score' is '1e39', beyond what float32 holds"),
    ],
    ids=["nan", "infinite", "text", "missing", "past float32"],
)
def test_a_csv_cell_that_is_no_finite_number_is_refused_by_row(
    tmp_path: Path, tokenizer: Any, cell: str, row: int, expected: str
) -> None:
    train = write_csv(
        tmp_path / "t.csv", [{"text": "good", "score": "4"}, {"text": "bad", "score": cell}]
    )
    evaluation = write_csv(tmp_path / "e.csv", scored_rows(4, 1))
    with pytest.raises(DataError, match="^" + re.escape(f"{train}: {expected}")):
        _prepare(tmp_path, tokenizer, train, evaluation)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, "row 2 of column 'score' is True, not a number"),
        (None, "row 2 of column 'score' has no target"),
        (float("nan"), "row 2 of column 'score' is nan, not a finite number"),  # JSON's NaN
        ([4], "row 2 of column 'score' is [4], not a number"),
        ("n/a", "row 2 of column 'score' is 'n/a', not a number"),
    ],
    ids=["boolean", "null", "NaN", "list", "text"],
)
def test_a_json_value_that_is_no_number_is_refused_by_row(
    tmp_path: Path, tokenizer: Any, value: Any, expected: str
) -> None:
    train = write_csv(tmp_path / "t.csv", scored_rows(4, 0))
    evaluation = _write_jsonl(
        tmp_path / "e.jsonl", [{"text": "x", "score": 3}, {"text": "y", "score": value}]
    )
    with pytest.raises(DataError, match="^" + re.escape(f"{evaluation}: {expected}")):
        _prepare(tmp_path, tokenizer, train, evaluation)


def test_targets_that_never_vary_are_refused(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"text": t, "score": "3"} for t in ("good", "bad", "fine")]
    same = write_csv(tmp_path / "same.csv", rows)
    varied = write_csv(tmp_path / "varied.csv", scored_rows(8, 1))
    for train, evaluation in ((same, varied), (varied, same)):
        with pytest.raises(
            DataError,
            match=f"^{same}: every row of column 'score' has the target 3; a regression learns",
        ):
            _prepare(tmp_path, tokenizer, train, evaluation)


def test_the_loss_is_the_squared_error_summed_over_examples_as_transformers_means_it() -> None:
    task = make_task(TASK, DataConfig(), TrainingConfig())
    model = build_model(MODEL, [], seed=0, task=TASK).eval()
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    input_ids = torch.randint(1000, 2000, (5, 7))
    labels = torch.tensor([1.0, 2.5, 3.0, 4.0, 5.0])
    output = model(input_ids=input_ids, labels=labels)
    assert output.logits.shape == (5, 1)
    loss = task.loss_sum(output.logits, labels)
    expected = ((output.logits.squeeze(-1) - labels) ** 2).sum()
    torch.testing.assert_close(loss, expected)
    assert task.units(labels) == 5
    # transformers' own loss for problem_type regression is the mean: ours summed, per unit.
    torch.testing.assert_close(loss / task.units(labels), output.loss)
    assert task.worst_case_labels(3, 64, 0).shape == (3,)


def test_metrics_agree_with_scipy_and_scikit_learn() -> None:
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    rng = np.random.default_rng(0)
    truth = rng.integers(1, 6, size=97).astype(np.float32)  # many ties, for Spearman's ranks
    predicted = (truth + rng.normal(0, 0.8, size=97)).astype(np.float32)
    predicted[:10] = 3.0  # ties among the predictions too
    task = make_task(TASK, DataConfig(), TrainingConfig())
    # As evaluation hands them over: one array per batch.
    batches = [slice(0, 40), slice(40, 41), slice(41, 97)]
    outputs = {
        "predictions": [predicted[b] for b in batches],
        "labels": [truth[b] for b in batches],
    }
    metrics = task.metrics(outputs, eval_loss=0.5, label_names=[])
    t, p = truth.astype(np.float64), predicted.astype(np.float64)
    expected = {
        "mse": mean_squared_error(t, p),
        "rmse": mean_squared_error(t, p) ** 0.5,
        "mae": mean_absolute_error(t, p),
        "pearson": pearsonr(p, t).statistic,
        "spearman": spearmanr(p, t).statistic,
        "r2": r2_score(t, p),
        "eval_loss": 0.5,
    }
    assert set(metrics) == set(task.info.metrics)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name


def test_a_constant_prediction_has_no_correlation() -> None:
    task = make_task(TASK, DataConfig(), TrainingConfig())
    truth = np.array([1.0, 2.0, 4.0], dtype=np.float32)
    outputs = {"predictions": [np.full(3, 2.0, dtype=np.float32)], "labels": [truth]}
    metrics = task.metrics(outputs, eval_loss=1.0, label_names=[])
    assert np.isnan(metrics["pearson"]) and np.isnan(metrics["spearman"])
    assert metrics["mae"] == pytest.approx(1.0) and metrics["r2"] == pytest.approx(1 - 5 / (42 / 9))


def test_the_chance_level_is_the_best_constant_answer() -> None:
    task = make_task(TASK, DataConfig(), TrainingConfig())
    truth = np.array([1.0, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0], dtype=np.float32)
    split = TokenizedSplit(np.zeros(7, np.int32), np.arange(8), None, truth)
    chance = task.chance_levels(split, [])
    assert set(chance) == set(task.info.metrics)
    assert chance["r2"] == 0.0 and chance["pearson"] == 0.0 and chance["spearman"] == 0.0
    assert chance["eval_loss"] == chance["mse"] == pytest.approx(np.var(truth.astype(float)))
    assert chance["rmse"] == pytest.approx(chance["mse"] ** 0.5)
    # No constant does better: the mean for squared error, the median for absolute error,
    # and so no better a constant learnt from the training data (its mean).
    for constant in np.linspace(0, 6, 601):
        assert np.mean((truth - constant) ** 2) >= chance["mse"] - 1e-9
        assert np.mean(np.abs(truth - constant)) >= chance["mae"] - 1e-9


def test_bad_targets_through_the_cli_are_one_line_and_write_nothing(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import tiny_config

    train = write_csv(tmp_path / "t.csv", [*scored_rows(6, 0), {"text": "x", "score": "NaN"}])
    raw = tiny_config(
        train,
        write_csv(tmp_path / "e.csv", scored_rows(4, 1)),
        study={"metric": "rmse"},
        data={"label_column": "score"},
    )
    raw["task"] = TASK
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert hpo_main(["run", "--study", "s", "--config", str(config), "--storage", url]) == 2
    err = capsys.readouterr().err
    assert f"{train}: row 7 of column 'score' is 'NaN', not a finite number" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hpo.db").exists()


def test_a_regression_study_end_to_end(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path / "data"
    folder.mkdir()
    data = (
        write_csv(folder / "train.csv", scored_rows(256, 1)),
        write_csv(folder / "eval.csv", scored_rows(32, 2)),
    )
    run = run_task_study(
        tmp_path, hpo_main, capsys, TASK, data, "rmse", data={"label_column": "score"}
    )

    assert run.study.direction.name == "MINIMIZE"
    scores = np.array([float(row["score"]) for row in read_csv(data[1])])
    mean_rmse = float(np.sqrt(np.mean((scores - scores.mean()) ** 2)))  # the chance level
    assert run.resumed.value is not None and run.resumed.value < 0.6 * mean_rmse

    model = AutoModelForSequenceClassification.from_pretrained(run.model_dir)
    assert model.config.problem_type == "regression" and model.config.num_labels == 1
    tokens = AutoTokenizer.from_pretrained(run.model_dir)(
        ["the room was superb", "awful"], return_tensors="pt", padding=True
    )
    with torch.inference_mode():
        awful_to_superb = model.eval()(**tokens).logits.squeeze(-1).tolist()
    assert awful_to_superb[0] > awful_to_superb[1] + 1  # a score that follows the words
