"""The search space against the size of the training set (issue 42: 160 examples, a batch of
512, one optimizer step per trial and not a word): the default space fitted to small data, a
WARNING for each way a trial would take too few steps, and the whole path through `hpo run`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.config.data_size import (
    SMALL_DATA_LR_LOW,
    fit_default_space,
    small_batch_choices,
    step_warnings,
)
from hpo.config.loader import parse_config
from hpo.config.schema import DEFAULT_BATCH_CHOICES, Config
from tests.conftest import (
    easy_rows,
    run_hpo,
    run_study,
    tiny_config,
    write_config,
    write_csv,
)


def config_of(data: tuple[Path, Path], space: dict[str, Any] | None, **training: Any) -> Config:
    raw = tiny_config(*data, training=training)
    if space is None:
        del raw["search_space"]
    else:
        raw["search_space"] = space
    return parse_config(raw, base_dir=Path("."))


def test_the_default_space_is_fitted_to_a_small_training_set(
    easy_data: tuple[Path, Path],
) -> None:
    """160 examples: the default batches become those leaving at least 10 steps an epoch and
    the learning rate starts where a few dozen steps learn; the line says what and why."""
    config = config_of(easy_data, None)
    said = fit_default_space(config, 160)
    assert config.search_space["effective_batch_size"].choices == [1, 2, 4, 8, 16]
    low = config.search_space["learning_rate"].low
    assert low == SMALL_DATA_LR_LOW and config.search_space["learning_rate"].high == 1e-3
    assert said is not None and "160 training examples" in said and "[1, 2, 4, 8, 16]" in said
    assert "set search_space.effective_batch_size" in said
    assert step_warnings(config, 160) == []  # nothing left to warn of
    middle = config_of(easy_data, None)
    fit_default_space(middle, 1000)
    assert middle.search_space["effective_batch_size"].choices == [4, 8, 16, 32, 64]


def test_normal_data_and_the_users_own_space_are_left_as_they_are(
    easy_data: tuple[Path, Path],
) -> None:
    config = config_of(easy_data, None)
    assert fit_default_space(config, 5120) is None  # 512 still makes 10 steps an epoch
    assert config.search_space["effective_batch_size"].choices == DEFAULT_BATCH_CHOICES
    assert config.search_space["learning_rate"].low == 1e-6
    own = config_of(
        easy_data, {"effective_batch_size": {"type": "categorical", "choices": [64, 512]}}
    )
    assert fit_default_space(own, 160) is None
    assert own.search_space["effective_batch_size"].choices == [64, 512]
    assert own.search_space["learning_rate"].low == 1e-6  # the default: not fitted alone
    grid = tiny_config(*easy_data, study={"sampler": {"type": "grid"}, "n_trials": 5})
    grid["search_space"] = {"learning_rate": {"type": "categorical", "choices": [1e-4]}}
    assert fit_default_space(parse_config(grid, base_dir=Path(".")), 160) is None
    assert small_batch_choices(1, 5) == [1]
    assert small_batch_choices(300, 5) == [16, 32, 64, 128, 256]


def test_a_batch_larger_than_the_training_set_is_one_warning_naming_the_numbers(
    easy_data: tuple[Path, Path],
) -> None:
    own = config_of(
        easy_data,
        {"effective_batch_size": {"type": "categorical", "choices": [8, 512]}},
        epochs=3,
        evals_per_epoch=1,
    )
    (line,) = step_warnings(own, 160)
    assert "has 160 examples, but an effective batch can be 512" in line
    assert "1 optimizer step an epoch, 3 in all" in line
    assert "keep search_space.effective_batch_size at most 16" in line


def test_a_trial_of_few_steps_is_warned_of(easy_data: tuple[Path, Path]) -> None:
    few = config_of(
        easy_data,
        {"effective_batch_size": {"type": "int", "low": 8, "high": 64}},
        epochs=2,
        evals_per_epoch=1,
    )
    (line,) = step_warnings(few, 160)  # 64: 3 steps an epoch, 6 in all
    assert "effective batch of 64 on the 160 training examples takes only 6 optimizer steps" in line
    assert "(3 an epoch x 2 epochs)" in line and "raise training.epochs" in line
    few.search_space["epochs"] = dataclasses.replace(
        few.search_space["effective_batch_size"], type="int", low=1, high=5
    )
    (line,) = step_warnings(few, 160)  # the fewest epochs searched
    assert "takes only 3 optimizer steps (3 an epoch x 1 epochs)" in line
    capped = config_of(
        easy_data,
        {"effective_batch_size": {"type": "categorical", "choices": [8]}},
        epochs=5,
        max_steps=4,
        evals_per_epoch=1,
    )
    assert step_warnings(capped, 160) == []  # a short max_steps is meant (a smoke test)
    assert step_warnings(config_of(easy_data, None, epochs=1, evals_per_epoch=1), 100_000) == []


def test_fewer_steps_an_epoch_than_evaluations_is_one_warning(
    easy_data: tuple[Path, Path],
) -> None:
    """An epoch of 5 steps cannot hold 8 evenly spaced evaluations: its trials evaluate after
    every step and their evaluation numbers mean other points of training."""
    config = config_of(
        easy_data,
        {"effective_batch_size": {"type": "categorical", "choices": [8, 32]}},
        epochs=3,
        evals_per_epoch=8,
    )
    (line,) = step_warnings(config, 150)
    assert "effective batch above 18 (up to 32)" in line
    assert "fewer optimizer steps than training.evals_per_epoch (8)" in line
    assert "evaluate after every step (5 an epoch)" in line


@pytest.mark.slow
def test_a_study_on_160_rows_with_the_default_space_says_so_and_trains_steps(
    tmp_path: Path,
) -> None:
    """The new user's study through `hpo run`: no search_space, 160 examples. One WARNING line
    says how the default space was fitted; every trial takes at least 10 optimizer steps with
    a learning rate from 1e-5 and records where its evaluations fell."""
    train = write_csv(tmp_path / "train.csv", easy_rows(160, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(32, 2))
    raw = tiny_config(
        train, evaluation, study={"n_trials": 3}, training={"epochs": 1, "evals_per_epoch": 2}
    )
    del raw["search_space"]
    url = f"sqlite:///{tmp_path / 's.db'}"
    done = run_study(write_config(tmp_path / "c.yaml", raw), url, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    fitted = [line for line in done.stderr.splitlines() if "default search space is fitted" in line]
    assert len(fitted) == 1 and "WARNING" in fitted[0] and "160 training examples" in fitted[0]
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert len(trials) == 3
    for trial in trials:
        assert trial.params["effective_batch_size"] <= 16
        assert trial.params["learning_rate"] >= SMALL_DATA_LR_LOW
        assert trial.user_attrs["optimizer_steps"] >= 10
        epochs = trial.user_attrs["evaluation_epochs"]
        assert len(epochs) == 2 and epochs[-1] == 1.0 and abs(epochs[0] - 0.5) <= 0.05
    # The config (unfitted: it names no data size) still enqueues into its study.
    queued = run_hpo(
        "enqueue",
        "--study",
        "s",
        "--config",
        "c.yaml",
        "--storage",
        url,
        "--params",
        '{"effective_batch_size": 8}',
        cwd=tmp_path,
    )
    assert queued.returncode == 0, queued.stderr[-3000:]


def test_the_warning_goes_to_the_log_at_the_workers_start(
    easy_data: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from hpo.commands.run import _fit_to_data_size

    config = config_of(
        easy_data,
        {"effective_batch_size": {"type": "categorical", "choices": [512]}},
        evals_per_epoch=1,
    )
    with caplog.at_level(logging.WARNING, logger="hpo"):
        _fit_to_data_size(config, 160)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "160 examples, but an effective batch can be 512" in caplog.records[0].getMessage()
