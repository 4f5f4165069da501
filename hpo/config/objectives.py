"""What a study optimises, checked against the task: study.metric and study.direction, the
task's default metric, and the metrics of the user's own (a metrics function, a task class).
"""

from __future__ import annotations

import typing
from typing import Any

from hpo.config.convert import show
from hpo.config.schema import Config
from hpo.trainer.config import ENTRYPOINT
from hpo.trainer.tasks import DEFAULT_TASK, METRIC_DIRECTIONS, TASKS, is_task_path
from hpo.trainer.user_metrics import EXAMPLE_TASKS


def default_metric_of_task(raw: dict[Any, Any]) -> None:
    """A config that names a task but no study.metric optimises the task's default metric
    (accuracy is only sequence classification's)."""
    task, study = raw.get("task"), raw.get("study")
    if (
        not isinstance(task, str)
        or task not in TASKS
        or not (study is None or isinstance(study, dict))
        or task == DEFAULT_TASK
    ):
        return
    if study is None or "metric" not in study:
        raw["study"] = {**(study or {}), "metric": TASKS[task].default_metric}


def pop_user_objectives(raw: dict[Any, Any]) -> tuple[Any, Any] | None:
    """With `metrics: package.module:name` or a task class of the user's, study.metric may name
    their own metrics, which the study section's rules do not know: such a metric and its
    direction are taken out here (the task's default metric stands in) and checked by
    check_user_objectives (a task class's, again when hpo run imports it)."""
    study, task = raw.get("study"), raw.get("task", DEFAULT_TASK)
    user_task = isinstance(task, str) and is_task_path(task)
    if not (isinstance(raw.get("metrics"), str) or user_task) or not isinstance(study, dict):
        return None
    metric = study.get("metric")
    names = [metric] if isinstance(metric, str) else metric
    if not isinstance(names, list) or all(n in METRIC_DIRECTIONS for n in names):
        return None  # hpo's own metrics: the study section's rules apply
    study = dict(study)
    given = study.pop("metric"), study.pop("direction", None)
    study["metric"] = TASKS[task if task in TASKS else DEFAULT_TASK].default_metric
    raw["study"] = study
    return given


def check_metrics_function(
    config: Config, objectives: tuple[Any, Any] | None, problems: list[str]
) -> None:
    """`metrics:` names a function by import path, for a task with a target per example; a
    study.metric hpo does not know is one of its names, so study.direction must say which way
    each metric improves (an hpo metric's direction, if given, must be its own)."""
    spec = config.metrics
    if not isinstance(spec, str) or not ENTRYPOINT.fullmatch(spec):
        problems.append(
            f"metrics: got {show(spec)}; must be your function as "
            "`package.module:name`, e.g. my_metrics:f2"
        )
    if config.task not in EXAMPLE_TASKS and not is_task_path(config.task):
        problems.append(
            f"metrics: the task {config.task} has a target per token; a metrics "
            f"function works with {', '.join(EXAMPLE_TASKS)}"
        )
    if objectives is not None:
        check_user_objectives(config, objectives, problems)


def check_user_objectives(config: Config, objectives: tuple[Any, Any], problems: list[str]) -> None:
    """study.metric naming metrics hpo does not know (a metrics function's, a task class's):
    study.direction must say which way each improves; hpo's own keep their direction."""
    metric, direction = objectives
    names = [metric] if isinstance(metric, str) else metric
    if not all(isinstance(n, str) and n.strip() for n in names) or len(set(names)) < len(names):
        problems.append(f"study.metric: got {show(metric)}; name each metric once")
        return
    given = _directions(direction, len(names))
    if given is None:
        unknown = [n for n in names if n not in METRIC_DIRECTIONS]
        problems.append(
            f"study.direction: got {show(direction)}; {', '.join(unknown)} "
            f"{'is' if len(unknown) == 1 else 'are'} not hpo's: give minimize or "
            f"maximize for each metric ({', '.join(names)})"
        )
        return
    for name, way in zip(names, given, strict=True):
        if name in METRIC_DIRECTIONS and way != METRIC_DIRECTIONS[name]:
            problems.append(f"study.direction: metric {name} must be {METRIC_DIRECTIONS[name]}d")
            return
    if names[0] == "samples_per_s":
        problems.append(
            "study.metric: must begin with an evaluation metric: it picks the best evaluation"
        )
        return
    config.study.metric = typing.cast(Any, metric)
    config.study.direction = typing.cast(Any, direction)


def set_user_objectives(config: Config, metric: Any, direction: Any, problems: list[str]) -> None:
    """study.metric: the name (or names) of what the function reports; study.direction: one
    each, required (hpo cannot know whether the user's metric is better high or low)."""
    names = [metric] if isinstance(metric, str) else metric
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(n, str) and n.strip() for n in names)
    ):
        problems.append(
            f"study.metric: got {show(metric)}; with training.entrypoint, name the "
            "metric your function reports (ctx.report), e.g. val_loss"
        )
        return
    if len(set(names)) < len(names):
        problems.append(f"study.metric: got {show(names)}; lists a metric twice")
        return
    if _directions(direction, len(names)) is None:
        problems.append(
            f"study.direction: got {show(direction)}; with training.entrypoint give "
            f"minimize or maximize for each metric ({', '.join(names)})"
        )
        return
    config.study.metric = typing.cast(Any, metric)
    config.study.direction = typing.cast(Any, direction)


def _directions(direction: Any, count: int) -> list[str] | None:
    """study.direction as a list of `count` directions (one name stands for a list of one), or
    None when it is not minimize or maximize for each metric."""
    given = [direction] if isinstance(direction, str) else direction
    if (
        not isinstance(given, list)
        or len(given) != count
        or not all(d in ("minimize", "maximize") for d in given)
    ):
        return None
    return given


def check_pruned_objective(config: Config, problems: list[str]) -> None:
    """study.pruner.objective: one of several objectives, reported at each evaluation, and a
    pruner to judge it. Checked once study.metric is final (a metrics function's names are
    set after the sections are built)."""
    name, objectives = config.study.pruner.objective, config.study.objectives
    if name is None:
        return
    given = f"study.pruner.objective: got {show(name)}"
    if len(objectives) == 1:
        problems.append(
            f"{given}; only for several objectives (study.metric is one, which the pruner "
            "judges already): leave it out"
        )
    elif name not in objectives:
        problems.append(f"{given}; must be one of study.metric's: {', '.join(objectives)}")
    elif name == "samples_per_s":
        problems.append(
            f"{given}; a trial's throughput is measured once, at its end: name an evaluation "
            f"metric of study.metric, e.g. {objectives[0]}"
        )
    elif config.study.pruner.type == "none" and config.study.pruner.patience is None:
        problems.append(
            f"{given}; pruner type none prunes nothing: set type (e.g. median) or leave "
            "objective out"
        )
