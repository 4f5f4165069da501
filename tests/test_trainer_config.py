"""Trainer settings: values far past any real run are refused up front, each with its bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpo.trainer.config import (
    MAX_BATCH_SIZE,
    MAX_EPOCHS,
    MAX_EVALS_PER_EPOCH,
    MAX_LENGTH,
    MAX_NUM_WORKERS,
    MAX_STEPS,
    DataConfig,
    TrainingConfig,
)
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    ("key", "bound"),
    [
        ("epochs", MAX_EPOCHS),
        ("evals_per_epoch", MAX_EVALS_PER_EPOCH),
        ("effective_batch_size", MAX_BATCH_SIZE),
        ("physical_batch_size", MAX_BATCH_SIZE),
        ("eval_batch_size", MAX_BATCH_SIZE),
        ("batch_search_start", MAX_BATCH_SIZE),
        ("batch_search_max", MAX_BATCH_SIZE),
        ("max_steps", MAX_STEPS),
        ("num_workers", MAX_NUM_WORKERS),
    ],
)
def test_training_values_past_their_bound_are_refused(key: str, bound: int) -> None:
    assert not [p for p in TrainingConfig(**{key: bound}).problems() if p[0] == key]
    too_many = bound + 1
    assert (key, too_many, f"must be at most {bound}") in TrainingConfig(
        **{key: too_many}
    ).problems()


def test_the_bounds_are_the_documented_ones() -> None:
    assert (MAX_EPOCHS, MAX_EVALS_PER_EPOCH, MAX_BATCH_SIZE) == (10_000, 10_000, 2**20)
    assert (MAX_STEPS, MAX_NUM_WORKERS, MAX_LENGTH) == (10**9, 256, 2**20)


def test_a_billion_epochs_is_refused() -> None:
    problems = TrainingConfig(epochs=1_000_000_000).problems()
    assert problems == [("epochs", 1_000_000_000, "must be at most 10000")]


def test_max_length_past_its_bound_is_refused() -> None:
    config = DataConfig(train_file="t.csv", eval_file="e.csv", max_length=MAX_LENGTH + 1)
    assert config.problems() == [("max_length", MAX_LENGTH + 1, f"must be at most {MAX_LENGTH}")]
    assert DataConfig(train_file="t.csv", eval_file="e.csv", max_length=MAX_LENGTH).problems() == []


def test_a_search_space_past_a_bound_is_refused(easy_data: tuple[Path, Path]) -> None:
    from hpo.config.loader import parse_config
    from hpo.errors import ConfigError

    raw: dict[str, Any] = tiny_config(*easy_data)
    raw["search_space"]["epochs"] = {"type": "int", "low": 1, "high": 10**9}
    with pytest.raises(
        ConfigError, match=r"search_space.epochs: value 1000000000(\.0)? must be at most 10000"
    ):
        parse_config(raw, base_dir=Path("."))
