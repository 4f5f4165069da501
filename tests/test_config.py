"""Config loading: every shipped YAML loads; every problem in a bad one is reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpo.config import DEFAULT_BATCH_CHOICES, load_config, parse_config
from hpo.errors import ConfigError
from tests.conftest import REPO, tiny_config, write_config

SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted(
    (REPO / "bench" / "configs").glob("*.yaml")
)


def test_configs_folder_is_not_empty() -> None:
    names = {p.name for p in SHIPPED}
    assert {"demo.yaml", "nli-minilm.yaml", "bert-base-nli.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert {"effective_batch_size", "learning_rate"} <= set(config.search_space)
    assert Path(config.data.train_file).is_file()
    assert Path(config.data.eval_file).is_file()


def test_defaults_fill_the_search_space(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    del raw["search_space"]
    config = parse_config(raw, base_dir=Path("."))
    batch = config.search_space["effective_batch_size"]
    lr = config.search_space["learning_rate"]
    assert batch.type == "categorical" and batch.choices == DEFAULT_BATCH_CHOICES
    assert (lr.low, lr.high, lr.log) == (1e-6, 1e-3, True)
    assert config.study.pruner.type == "median"
    assert config.study.resolved_direction == "maximize"


def test_yaml_exponent_without_dot_is_a_number(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # YAML 1.1 reads 1e-6 as the string "1e-6"; users write it that way all the time.
    text = write_config(tmp_path / "c.yaml", tiny_config(*easy_data)).read_text()
    assert "low: 0.001" in text
    text = text.replace("low: 0.001", "low: 1e-6")
    path = tmp_path / "c2.yaml"
    path.write_text(text)
    assert load_config(path).search_space["learning_rate"].low == 1e-6


def test_all_problems_reported_at_once(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(
        *easy_data,
        study={"metrc": "accuracy", "n_trials": "many"},
        training={"physical_batch_size": 0, "epochs": 1.5},
    )
    raw["search_space"] = {
        "learning_rate": {"type": "float", "low": 0, "high": 1e-3, "log": True},
        "weight_decay": {"type": "float", "low": 0.3, "high": 0.1},
        "effective_batch_size": {"type": "categorical", "choices": []},
        "lerning_rate": {"type": "float", "low": 1e-5, "high": 1e-4},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=Path("."))
    text = "\n".join(caught.value.problems)
    expected = [
        "study.metrc: unknown key (did you mean 'metric'?)",
        "study.n_trials: got 'many'; must be an integer or null",
        "training.physical_batch_size: got 0; must be a positive integer",
        "training.epochs: got 1.5; must be an integer",
        "search_space.learning_rate.low: got 0.0; must be > 0 for a log-scale parameter",
        "search_space.weight_decay.low: got 0.3; must be <= high (0.1)",
        "search_space.effective_batch_size.choices: got []; a categorical parameter needs",
        "search_space.lerning_rate: unknown parameter (did you mean 'learning_rate'?)",
    ]
    for line in expected:
        assert line in text
    assert len(caught.value.problems) == len(expected)


def test_search_space_values_must_be_valid_settings(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    raw["search_space"]["effective_batch_size"] = {"type": "categorical", "choices": [32, -4]}
    raw["search_space"]["learning_rate"] = {"type": "float", "low": -1e-3, "high": 1e-3}
    raw["search_space"]["epochs"] = {"type": "float", "low": 1, "high": 3}
    raw["search_space"]["warmup_ratio"] = {"type": "categorical", "choices": [0.1, "lots"]}
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=Path("."))
    text = "\n".join(caught.value.problems)
    assert "search_space.epochs: got type float; epochs is a whole number" in text
    assert "search_space.warmup_ratio: value 'lots' must be a number" in text
    assert "search_space.effective_batch_size: value -4 must be a positive integer" in text
    assert "search_space.learning_rate: value -0.001 must be > 0" in text


def test_missing_data_file_and_wrong_direction(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data, study={"metric": "eval_loss", "direction": "maximize"})
    raw["data"]["train_file"] = "nowhere/train.csv"
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=tmp_path)
    text = "\n".join(caught.value.problems)
    assert "data.train_file: 'nowhere/train.csv' not found" in text
    assert "metric eval_loss must be minimized" in text


def test_relative_paths_resolve_against_the_config_folder(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    train, evaluation = easy_data
    raw = tiny_config(Path("data/train.csv"), Path("data/eval.csv"))
    config = parse_config(raw, base_dir=train.parent.parent)
    assert Path(config.data.train_file) == train
    assert Path(config.data.eval_file) == evaluation


def test_model_needs_exactly_one_source(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    raw["model"]["name_or_path"] = "org/model"
    with pytest.raises(ConfigError, match="give exactly one of name_or_path or config"):
        parse_config(raw, base_dir=Path("."))


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("study: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
