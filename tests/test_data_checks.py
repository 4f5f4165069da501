"""Settings that only the prepared data can decide (the number of labels, the largest token id),
checked by hpo run before the first trial: one line, exit code 2, nothing written. Before, each
trial failed with the same error and the run exited 0 with a study of failed trials."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_BERT, tiny_config, write_config

CASES = [
    (
        "class weights for too few labels",
        {"training": {"class_weights": [1.0]}},
        "config: training.class_weights: got [1.0]; has 1 weights for 2 labels ['neg', 'pos']; "
        "give one weight per label, in this order, or `balanced`",
    ),
    (
        "vocabulary smaller than the tokenizer's",
        {"model": {"config": {**TINY_BERT, "vocab_size": 100}}},
        "but the model has only 100 (model.config.vocab_size): model.tokenizer does not match "
        "the model; set model.config.vocab_size to at least",
    ),
]


@pytest.mark.parametrize(("kind", "change", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_setting_the_data_refutes_is_one_line_before_any_trial(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
    kind: str,
    change: dict[str, Any],
    expected: str,
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data, **change))
    database = tmp_path / "study.db"
    code = hpo_main(
        ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
    )
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("hpo: error:")]
    assert len(errors) == 1 and expected in errors[0], err[-3000:]
    assert "Traceback" not in err and "trial 0" not in err
    assert not database.exists()  # nothing written


def test_weights_for_every_label_pass() -> None:
    """The check refuses only what is wrong: a weight per label, or `balanced`, trains."""
    from hpo.trainer.config import TrainingConfig

    assert TrainingConfig(class_weights=[1.0, 2.0]).data_problems(["neg", "pos"]) == []
    assert TrainingConfig(class_weights="balanced").data_problems(["neg", "pos"]) == []
