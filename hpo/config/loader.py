"""The YAML loader of a study config: the file read into the typed sections of schema.py,
validated up front, every problem reported at once.

Relative paths in the file are resolved against the folder that holds the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from hpo.config import search_paths
from hpo.config.schema import (
    Config,
    ParamSpec,
    applies,
    default_search_space,
    has_conditions,
    sampling_order,
)
from hpo.errors import ConfigError
from storage.url import sqlite_file_relative_to
from trainer.config import ENTRYPOINT
from trainer.tasks import DEFAULT_TASK, METRIC_DIRECTIONS, TASKS, is_task_path
from trainer.user_metrics import EXAMPLE_TASKS

# The demo config, where hpo runs from its repository (an editable install); a wheel has none.
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def load_config(path: str | Path) -> Config:
    """Read, type-check and validate a config file; raises ConfigError listing every problem."""
    if not str(path).strip():  # Path("") is the working folder
        raise ConfigError([f"the config path is empty; {config_hint()}"])
    path = Path(path)
    if not path.is_file():
        what = (
            "a folder, not a file"
            if path.is_dir()
            else "not a regular file"
            if path.exists()
            else "no such file"
        )
        raise ConfigError([f"{path}: {what}; {config_hint()}"])
    raw = _read_yaml(path)
    return parse_config(raw if raw is not None else {}, base_dir=path.parent, source=str(path))


def config_hint() -> str:
    """What to pass instead, true in the folder hpo runs in: the demo config by a path that
    reaches it from there, or, where hpo is installed without it, where to find one."""
    if not DEMO_CONFIG.is_file():
        return "pass --config with a YAML file (an example: configs/demo.yaml in hpo's sources)"
    try:
        shown = DEMO_CONFIG.relative_to(Path.cwd())
    except ValueError:  # not under the working folder
        shown = DEMO_CONFIG
    return f"pass --config with a YAML file such as {shown}"


def _read_yaml(path: Path) -> Any:
    """The file's YAML; any way it cannot be read is one ConfigError line."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # a SafeLoader
    except (yaml.YAMLError, ValueError, RecursionError, OSError) as e:
        raise ConfigError([_unreadable(e)], str(path)) from e


def _unreadable(error: Exception) -> str:
    """What is wrong with a file that does not read as YAML, in one line."""
    if isinstance(error, UnicodeDecodeError):
        byte = error.object[error.start]
        return f"not UTF-8 text (byte {byte:#04x} at offset {error.start}); save it as UTF-8"
    if isinstance(error, OSError):  # permissions, an I/O error
        return f"cannot read the file ({error.strerror or error})"
    if isinstance(error, RecursionError):
        return "not valid YAML: lists or mappings nested hundreds deep; a config is a few levels"
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        # PyYAML's own text spans lines and quotes the file: `what (line L, column C)` instead.
        mark = error.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"not valid YAML: {_clip(error.problem, 200)}{where}"
    if isinstance(error, ValueError):  # YAML types it, Python cannot build it: 2024-13-45, 10**5000
        reason = _clip(str(error).split(";")[0], 120)
        return f"not valid YAML: a value cannot be read ({reason}); quote it if it is text"
    lines = str(error).strip().splitlines()
    return f"not valid YAML: {_clip(lines[0] if lines else type(error).__name__, 200)}"


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: PyYAML would keep the last one
    silently, so a setting the user can see in the file would not be the one used."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges; keys after it may override on purpose
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    problem=f"key {_show(key)} appears twice in one mapping; keep one",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def parse_config(
    raw: Any, base_dir: Path, source: str = "config", paths_from: str = "the config file"
) -> Config:
    """Build a Config from parsed YAML; raises ConfigError listing every problem. Relative
    paths are taken from `base_dir`, which `paths_from` names in a message."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError(
            [
                f"the file must hold a mapping of sections (study:, search_space:, model:, "
                f"data:, training:), got {_described(raw)}"
            ],
            source,
        )
    raw = dict(raw)
    if _entrypoint_of(raw) is not None:
        return _parse_entrypoint_config(raw, base_dir, source, paths_from)
    _default_metric_of_task(raw)
    user_objectives = _pop_user_objectives(raw)
    space_raw = raw.pop("search_space", None)
    _default_model_of_search(raw, space_raw)
    # search_space is built on its own below, but is a known key all the same: `search_spaces:`
    # must get its did-you-mean.
    config = _build(Config, raw, "", problems, skip={"source", "base_dir", "default_params"})
    config.source, config.base_dir = source, str(base_dir)
    if isinstance(space_raw, str):
        config.search_space, config.default_params = {}, []
        _set_space_function(config, space_raw, problems)
    else:
        config.search_space = _build_search_space(space_raw, problems)
        config.default_params = _defaults_kept(space_raw)
    if not 0 <= config.training.seed < 2**64:  # what numpy and torch.manual_seed both take
        problems.append(f"training.seed: got {_show(config.training.seed)}; must be in [0, 2**64)")
    if config.model.config is not None and config.model.factory is None:
        problems.extend(_inline_model_problems(config.model.config))
    if config.metrics is not None:
        _check_metrics_function(config, user_objectives, problems)
    elif user_objectives is not None:  # a task class of the user's names its own metrics
        _check_user_objectives(config, user_objectives, problems)
    if not problems:  # needs well-typed sections; its findings would be noise otherwise
        _check_search_space(config, problems)
    if not problems:
        _check_searched_for_task(config, problems)
    if not problems and config.study.sampler.type == "grid":
        _check_grid(config, problems)
    if not problems and config.search_space_function is not None:
        _check_function_enqueue(config, problems)
    elif not problems:
        grid = config.study.sampler.type == "grid"
        for index, params in enumerate(config.study.enqueue):
            where = f"study.enqueue[{index}]"
            config.study.enqueue[index] = check_params(
                config.search_space, params, where, problems, complete=grid
            )
    _resolve_paths(config, base_dir, problems, paths_from)
    if problems:
        raise ConfigError(problems, source)
    return config


def _entrypoint_of(raw: dict[Any, Any]) -> Any:
    training = raw.get("training")
    return training.get("entrypoint") if isinstance(training, dict) else None


# What a config with training.entrypoint leaves out: the user's function builds its own model
# and reads its own data, so hpo's settings for them would silently mean nothing.
_NOT_WITH_ENTRYPOINT = ("model", "data", "task", "metrics")


def _parse_entrypoint_config(
    raw: dict[Any, Any], base_dir: Path, source: str, paths_from: str
) -> Config:
    """A config whose trials call the user's training function: no model, data or task; the
    search space names the function's own parameters (effective_batch_size keeps its meaning:
    ctx.physical_batch_size and ctx.grad_accum_steps split it); study.metric is a metric the
    function reports, so its direction must be given."""
    problems: list[str] = []
    for key in _NOT_WITH_ENTRYPOINT:
        if raw.pop(key, None) is not None:
            problems.append(
                f"{key}: means nothing with training.entrypoint (your function "
                "builds its own model, reads its own data); leave it out"
            )
    study = raw.get("study")
    objectives: Any = None
    direction: Any = None
    if isinstance(study, dict):
        study = dict(study)
        objectives, direction = study.pop("metric", None), study.pop("direction", None)
        raw["study"] = study
    space_raw = raw.pop("search_space", None)
    skip = {"source", "base_dir", "default_params", *_NOT_WITH_ENTRYPOINT}
    config = _build(Config, raw, "", problems, skip=skip)
    config.source, config.base_dir = source, str(base_dir)
    config.default_params = []  # hpo adds no default space to a function's
    if isinstance(space_raw, str):
        config.search_space = {}
        _set_space_function(config, space_raw, problems)
    else:
        config.search_space = _build_user_space(space_raw, problems)
    _set_user_objectives(config, objectives, direction, problems)
    if not problems:
        _check_user_space(config, problems)
    if not problems and config.search_space_function is not None:
        _check_function_enqueue(config, problems)
    elif not problems:
        grid = config.study.sampler.type == "grid"
        for index, params in enumerate(config.study.enqueue):
            where = f"study.enqueue[{index}]"
            config.study.enqueue[index] = check_params(
                config.search_space, params, where, problems, complete=grid
            )
    _resolve_paths(config, base_dir, problems, paths_from)
    if problems:
        raise ConfigError(problems, source)
    return config


def _pop_user_objectives(raw: dict[Any, Any]) -> tuple[Any, Any] | None:
    """With `metrics: package.module:name` or a task class of the user's, study.metric may name
    their own metrics, which the study section's rules do not know: such a metric and its
    direction are taken out here (the task's default metric stands in) and checked by
    _check_user_objectives (a task class's, again when hpo run imports it)."""
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


def _check_metrics_function(
    config: Config, objectives: tuple[Any, Any] | None, problems: list[str]
) -> None:
    """`metrics:` names a function by import path, for a task with a target per example; a
    study.metric hpo does not know is one of its names, so study.direction must say which way
    each metric improves (an hpo metric's direction, if given, must be its own)."""
    spec = config.metrics
    if not isinstance(spec, str) or not ENTRYPOINT.fullmatch(spec):
        problems.append(
            f"metrics: got {_show(spec)}; must be your function as "
            "`package.module:name`, e.g. my_metrics:f2"
        )
    if config.task not in EXAMPLE_TASKS and not is_task_path(config.task):
        problems.append(
            f"metrics: the task {config.task} has a target per token; a metrics "
            f"function works with {', '.join(EXAMPLE_TASKS)}"
        )
    if objectives is not None:
        _check_user_objectives(config, objectives, problems)


def _check_user_objectives(
    config: Config, objectives: tuple[Any, Any], problems: list[str]
) -> None:
    """study.metric naming metrics hpo does not know (a metrics function's, a task class's):
    study.direction must say which way each improves; hpo's own keep their direction."""
    metric, direction = objectives
    names = [metric] if isinstance(metric, str) else metric
    if not all(isinstance(n, str) and n.strip() for n in names) or len(set(names)) < len(names):
        problems.append(f"study.metric: got {_show(metric)}; name each metric once")
        return
    given = _directions(direction, len(names))
    if given is None:
        unknown = [n for n in names if n not in METRIC_DIRECTIONS]
        problems.append(
            f"study.direction: got {_show(direction)}; {', '.join(unknown)} "
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


def _set_space_function(config: Config, spec: str, problems: list[str]) -> None:
    """`search_space: package.module:name`: the user's define-by-run function samples each
    trial's parameters (imported and checked before any trial, by hpo run)."""
    if not ENTRYPOINT.fullmatch(spec):
        problems.append(
            f"search_space: got {_show(spec)}; must be a mapping of parameter name to "
            "spec, or your function as `package.module:name`, e.g. "
            "my_space:space"
        )
        return
    config.search_space_function = spec
    if config.study.sampler.type == "grid":
        problems.append(
            f"study.sampler.type: grid needs a search space mapping (the grid "
            f"of {spec} is not known before it runs); use tpe or random"
        )


def _check_function_enqueue(config: Config, problems: list[str]) -> None:
    for index, params in enumerate(config.study.enqueue):
        config.study.enqueue[index] = check_function_params(
            params, f"study.enqueue[{index}]", problems
        )


def check_function_params(
    params: dict[Any, Any], where: str, problems: list[str]
) -> dict[str, Any]:
    """A configuration to try with a define-by-run search space: it names the Optuna parameters
    the function suggests (Optuna gives a suggest_* call of that name the enqueued value). hpo
    cannot know them before the function runs, so only their form is checked here; what the
    function returns is checked in the trial like any other."""
    if not params:
        problems.append(
            f"{where}: names no parameter; give the names your function suggests "
            "(trial.suggest_float(name, ...))"
        )
    for key, value in params.items():
        if not isinstance(key, str):
            problems.append(f"{where}: key {_show(key)} is not text; quote it")
        elif not isinstance(value, (str, int, float, bool, type(None))):
            problems.append(
                f"{where}.{key}: got {_show(value)}; must be a single value (a "
                "number, text, true/false, null)"
            )
    return dict(params)


def function_params(config: Config, params: Any, spec: str) -> dict[str, Any]:
    """What a define-by-run search space returned for a trial, as the parameters hpo trains
    with: each name one a YAML search space may name (resolved to its study name; a training
    function's own parameter needs only be an identifier), each value converted to the
    setting's type and valid for it. Raises ValueError with every problem found."""
    if not isinstance(params, dict):
        raise ValueError(
            f"{spec} returned {_described(params)}; expected a dict of parameter "
            "name to value, e.g. {'learning_rate': 3e-5}"
        )
    problems: list[str] = []
    checked: dict[str, Any] = {}
    user_function = config.training.entrypoint is not None
    for key, value in params.items():
        where = f"{spec} returned {_key(key)}"
        if user_function:
            name = key if isinstance(key, str) and key.isidentifier() else None
            why = "a parameter's name must be a Python identifier (ctx.params[name])"
        else:
            name, why = search_paths.resolve(key)
        if name is None:
            problems.append(f"{where}: {why}")
            continue
        if name in checked:
            problems.append(f"{where}: the same parameter as another key; give it once")
            continue
        ok, setting, rule = _convert(value, _field_hint(name), "", [])
        if not ok:
            problems.append(f"{where}: got {_show(value)}; must be {rule}")
            continue
        broken = [] if user_function else _setting_problems(config, name, setting)
        if broken:
            problems.append(f"{where}: value {_show(value)} {broken[0]}")
            continue
        checked[name] = setting
    if not user_function and not problems:
        unused = {search_paths.param_name(p) for p in _unused_settings(config.task)}
        problems.extend(
            f"{spec} returned {n}: means nothing for the task {config.task}"
            for n in checked
            if n in unused
        )
    if problems:
        raise ValueError("; ".join(problems))
    return checked


def _unused_settings(task: str) -> list[str]:
    info = TASKS.get(task)
    return list(info.unused_settings()) if info is not None else []


def _build_user_space(raw: Any, problems: list[str]) -> dict[str, ParamSpec]:
    """The training function's parameters, by the names it reads from ctx.params."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(
            f"search_space: got {_described(raw)}; must be a mapping of parameter name to spec"
        )
        return {}
    space: dict[str, ParamSpec] = {}
    for name, spec in raw.items():
        key = f"search_space.{_key(name)}"
        if not isinstance(name, str) or not name.isidentifier():
            problems.append(
                f"{key}: a parameter's name must be a Python identifier, e.g. "
                "hidden_size (your function reads ctx.params[name])"
            )
        elif not isinstance(spec, dict):
            problems.append(
                f"{key}: got {_described(spec)}; give its spec, e.g. "
                "{type: float, low: 1.0e-5, high: 1.0e-3}"
            )
        else:
            space[name] = _build(ParamSpec, spec, key + ".", problems)
    return space


def _check_user_space(config: Config, problems: list[str]) -> None:
    """effective_batch_size is split by hpo into physical batches: whole numbers >= 1; each
    `when` names parameters of the space (a parameter whose condition does not hold is not in
    ctx.params); the grid sampler gets a finite space."""
    _check_conditions(config.search_space, problems, user_function=True)
    if not problems and config.study.sampler.type == "grid":
        _check_grid(config, problems)
    batch = config.search_space.get("effective_batch_size")
    if batch is None:
        return
    for value in batch.values_for_bounds():
        ok, converted, _ = _convert(value, int, "", [])
        if not ok or converted < 1:
            problems.append(
                f"search_space.effective_batch_size: value {_show(value)} must be a "
                "positive integer"
            )
            return
    if batch.type == "float":
        problems.append("search_space.effective_batch_size: got type float; use int or categorical")
    elif batch.type == "categorical":
        batch.choices = [int(v) for v in batch.choices or []]


def _set_user_objectives(config: Config, metric: Any, direction: Any, problems: list[str]) -> None:
    """study.metric: the name (or names) of what the function reports; study.direction: one
    each, required (hpo cannot know whether the user's metric is better high or low)."""
    names = [metric] if isinstance(metric, str) else metric
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(n, str) and n.strip() for n in names)
    ):
        problems.append(
            f"study.metric: got {_show(metric)}; with training.entrypoint, name the "
            "metric your function reports (ctx.report), e.g. val_loss"
        )
        return
    if len(set(names)) < len(names):
        problems.append(f"study.metric: got {_show(names)}; lists a metric twice")
        return
    if _directions(direction, len(names)) is None:
        problems.append(
            f"study.direction: got {_show(direction)}; with training.entrypoint give "
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


def _check_searched_for_task(config: Config, problems: list[str]) -> None:
    """A searched setting the config's task ignores (label smoothing of a regression) would
    make trials that differ in nothing but their parameters' names."""
    info = TASKS.get(config.task)
    if info is None:
        return
    unused = {search_paths.param_name(path) for path in info.unused_settings()}
    for name in config.search_space:
        if search_paths.resolve(name)[0] in unused:
            problems.append(
                f"search_space.{name}: means nothing for the task {config.task}; leave it out"
            )


def _default_metric_of_task(raw: dict[Any, Any]) -> None:
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


def _default_model_of_search(raw: dict[Any, Any], space_raw: Any) -> None:
    """A search over model.name_or_path needs no model.name_or_path of its own: the first
    choice is the config's model (what `hpo batch-size` measures, say)."""
    model, space = raw.get("model"), space_raw
    if not isinstance(space, dict) or not (model is None or isinstance(model, dict)):
        return
    spec = next(
        (v for k, v in space.items() if search_paths.resolve(k)[0] == "model.name_or_path"), None
    )
    choices = spec.get("choices") if isinstance(spec, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], str):
        return
    if model is None or ("name_or_path" not in model and "config" not in model):
        raw["model"] = {**(model or {}), "name_or_path": choices[0]}


def _build_search_space(raw: Any, problems: list[str]) -> dict[str, ParamSpec]:
    """Each key resolved to its parameter's name (search_paths: `learning_rate` and
    `training.learning_rate` are one parameter), each spec typed; conditions are checked once
    every parameter is known (_check_conditions)."""
    space = default_search_space()
    if raw is None:
        return space
    if not isinstance(raw, dict):
        problems.append(
            f"search_space: got {_described(raw)}; must be a mapping of parameter name to spec"
        )
        return space
    given: dict[str, str] = {}
    for name, spec in raw.items():
        key = f"search_space.{_key(name)}"
        param, why = search_paths.resolve(name)
        if param is None:
            problems.append(f"{key}: {why}")
            continue
        if param in given:
            problems.append(f"{key}: the same parameter as {given[param]}; give it once")
            continue
        given[param] = _key(name)
        if spec is None:
            problems.append(
                f"{key}: is empty; give its spec, e.g. {{type: float, low: 1.0e-5, high: 1.0e-3}}, "
                "or remove the entry to use the default"
            )
            continue
        space[param] = _build(ParamSpec, spec, key + ".", problems)
    return space


def _defaults_kept(raw: Any) -> list[str]:
    """The default space's parameters that the config's search_space does not set."""
    given = {search_paths.resolve(name)[0] for name in raw} if isinstance(raw, dict) else set()
    return [name for name in default_search_space() if name not in given]


MAX_INLINE_MODEL_VALUES = 10_000


def _inline_model_problems(settings: dict[Any, Any]) -> list[str]:
    """model.config becomes keyword arguments of a transformers config: string keys, plain
    values, and a size a config can have (a YAML alias bomb expands to billions)."""
    found = []
    odd_keys = [key for key in settings if not isinstance(key, str)]
    if odd_keys:
        found.append(f"model.config: key {_show(odd_keys[0])} is not text; quote it")
    model_type = settings.get("model_type")
    if "model_type" in settings and not (isinstance(model_type, str) and model_type):
        found.append(f"model.config.model_type: got {_show(model_type)}; must be a name, e.g. bert")
    if _count_values(settings, MAX_INLINE_MODEL_VALUES) > MAX_INLINE_MODEL_VALUES:
        found.append(
            f"model.config: holds more than {MAX_INLINE_MODEL_VALUES} values (a YAML alias "
            "repeated?); a model config is a small mapping of settings"
        )
    return found


def _count_values(value: Any, limit: int) -> int:
    """Values in a nested YAML structure; counting stops just past `limit` (never expands)."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return 1
    count = 1
    for child in value:
        count += _count_values(child, limit - count)
        if count > limit:
            break
    return count


def _check_search_space(config: Config, problems: list[str]) -> None:
    """Every value a parameter can take must itself be a valid setting of its field.

    Categorical choices are converted to the setting's type here (YAML 1.1 reads `1e-4` as a
    string, `32.0` is a float), so a trial receives the same values the range check saw."""
    for name, spec in config.search_space.items():
        hint = _field_hint(name)
        if spec.type == "float" and hint is int:
            problems.append(
                f"search_space.{name}: got type float; {name} is a whole number, "
                "use type: int or categorical"
            )
            continue
        converted = []
        for value in spec.values_for_bounds():
            ok, setting, rule = _convert(value, hint, f"search_space.{name}.", [])
            if not ok:
                problems.append(f"search_space.{name}: value {_show(value)} must be {rule}")
                break
            broken = _setting_problems(config, name, setting)
            if broken:
                problems.append(f"search_space.{name}: value {_show(value)} {broken[0]}")
                break
            converted.append(setting)
        else:
            if spec.type == "categorical":
                _set_choices(spec, name, converted, problems)
    if not problems:
        problems.extend(_search_conflicts(config))
    if not problems:
        _check_conditions(config.search_space, problems)


def _field_hint(name: str) -> Any:
    """The type annotation of the field a parameter sets; Any for a parameter of the user's
    own training function (training.entrypoint), which hpo does not type."""
    try:
        return search_paths.field_hint(name)
    except KeyError:
        return Any


def _setting_problems(config: Config, name: str, value: Any) -> list[str]:
    """What the field's own rules say of `value` (a model choice: also that it exists)."""
    section, field = search_paths.field_of(name)
    if (section, field) == ("model", "name_or_path") and isinstance(value, str):
        resolved = _resolved(Path(config.base_dir), value)
        if _looks_local(value) and not _exists(resolved):
            return [
                f"not found (looked for {_clip(str(resolved), 200)}); paths are relative "
                "to the config file"
            ]
    if not isinstance(value, (str, int, float, bool, type(None))):
        return ["is not a single value (Optuna's choices are numbers, text, true/false, null)"]
    changed = search_paths.with_value(getattr(config, section), section, field, value)
    return search_paths.field_problems(changed, section, field)


def _search_conflicts(config: Config) -> list[str]:
    """Fixed settings that would override, or contradict, what a trial samples."""
    space, model = config.search_space, config.model
    found = []
    if "model.name_or_path" in space:
        if model.config is not None:
            found.append(
                "model.config: an inline model, but search_space searches model.name_or_path: "
                "list the model folders there, leave model.config out"
            )
        if model.tokenizer is not None:
            found.append(
                "model.tokenizer: set, but search_space searches model.name_or_path: each "
                "model loads its own tokenizer; leave model.tokenizer out"
            )
    if "gradient_checkpointing" in space and model.gradient_checkpointing:
        found.append(
            "model.gradient_checkpointing: true, but search_space searches "
            "training.gradient_checkpointing: a trial's false would not turn it off; "
            "leave model.gradient_checkpointing out"
        )
    return found


def _check_conditions(
    space: dict[str, ParamSpec], problems: list[str], user_function: bool = False
) -> None:
    """Each `when` names other searched parameters and values they can take (made lists, in
    the parameter's type); no cycle. The space is then reordered so conditions come first.
    `user_function`: the space of a training function's own parameters (training.entrypoint),
    named and typed as the user chose, not as hpo's settings."""
    for name, spec in space.items():
        if spec.when is None:
            continue
        where = f"search_space.{name}.when"
        if not spec.when:
            problems.append(
                f"{where}: names no condition; leave `when` out, or name a "
                "searched parameter and its value"
            )
            continue
        spec.when = _conditions(name, spec.when, space, where, problems, user_function)
    if problems:
        return
    try:
        order = sampling_order(space)
    except ValueError as e:
        problems.append(
            f"search_space: the conditions form a cycle ({e}); a parameter's "
            "`when` must name parameters decided before it"
        )
        return
    reordered = {name: space[name] for name in order}
    space.clear()
    space.update(reordered)


def _conditions(
    name: str,
    when: dict[Any, Any],
    space: dict[str, ParamSpec],
    where: str,
    problems: list[str],
    user_function: bool = False,
) -> dict[str, list[Any]]:
    conditions: dict[str, list[Any]] = {}
    for key, value in when.items():
        if user_function and isinstance(key, str) and key.isidentifier():
            param, why = key, ""
        elif user_function:
            param, why = None, "a parameter's name must be a Python identifier (ctx.params[name])"
        else:
            param, why = search_paths.resolve(key)
        if param is None:
            problems.append(f"{where}.{_key(key)}: {why}")
            continue
        if param == name:
            problems.append(f"{where}.{_key(key)}: a parameter cannot depend on itself")
            continue
        if param not in space:
            problems.append(
                f"{where}.{_key(key)}: {param} is not searched; a condition names "
                f"a parameter of the search space ({', '.join(space)})"
            )
            continue
        if space[param].type == "float":
            # Sampled from a continuum: one value of it (learning_rate: 0.001) is never drawn,
            # so the parameter would never be searched.
            problems.append(
                f"{where}.{_key(key)}: got {_show(value)}; {param} is a float "
                "parameter, and a condition on its value never holds; name a "
                f"categorical or int parameter, or make {param} categorical "
                "(type: categorical, choices: [...])"
            )
            continue
        allowed = []
        for item in value if isinstance(value, list) else [value]:
            hint = Any if user_function else _field_hint(param)
            ok, setting, _ = _convert(item, hint, f"{where}.", [])
            outside = _outside(space[param], setting if ok else item)
            if outside:
                problems.append(
                    f"{where}.{_key(key)}: got {_show(item)}; {param} never takes it: {outside}"
                )
                break
            allowed.append(setting)
        conditions[param] = allowed
    return conditions


def model_location(value: str, base_dir: str) -> str:
    """A model choice as the trainer loads it: a local path made absolute against the config's
    folder; `pkg://...` and hub names unchanged."""
    return str(_resolved(Path(base_dir), value)) if _looks_local(value) else value


MAX_GRID_POINTS = 1_000_000


def grid_points(spec: ParamSpec) -> list[Any] | None:
    """Every value of a finite dimension, for the grid sampler; None if it is continuous."""
    if spec.type == "categorical":
        return list(spec.choices or [])
    if spec.low is None or spec.high is None or (spec.type == "float" and spec.step is None):
        return None
    step = spec.step or 1
    count = math.floor((spec.high - spec.low) / step + 1e-9) + 1
    if count > MAX_GRID_POINTS:
        return None
    values = [spec.low + i * step for i in range(count)]
    return [int(v) for v in values] if spec.type == "int" else [round(v, 12) for v in values]


def _check_grid(config: Config, problems: list[str]) -> None:
    """The grid sampler tries each combination once: every dimension finite, and the budget
    no larger than the grid (more trials would repeat configurations)."""
    if has_conditions(config.search_space):
        conditional = next(name for name, spec in config.search_space.items() if spec.when)
        problems.append(
            f"search_space.{conditional}.when: the grid sampler tries every "
            "combination of every parameter, so it would train one configuration "
            "once per value of a parameter that does not apply; use tpe or random, "
            "or leave `when` out"
        )
        return
    size = 1
    for name, spec in config.search_space.items():
        points = grid_points(spec)
        if points is None:
            problems.append(
                f"search_space.{name}: the grid sampler needs a finite dimension; "
                "give it a step or choices"
            )
            return
        size *= len(points)
    if size > MAX_GRID_POINTS:
        problems.append(
            f"study.sampler.type: grid: the search space has {size} combinations, "
            f"more than {MAX_GRID_POINTS}; use tpe or coarser steps"
        )
    elif config.study.n_trials is not None and config.study.n_trials > size:
        problems.append(
            f"study.n_trials: got {config.study.n_trials}; the grid has {size} combinations "
            "and tries each once: set n_trials to at most that"
        )


def check_params(
    space: dict[str, ParamSpec],
    params: dict[Any, Any],
    where: str,
    problems: list[str],
    complete: bool = False,
) -> dict[str, Any]:
    """A configuration to try (`study.enqueue`, `hpo enqueue`): every key a parameter of the
    search space (a short or dotted name), every value one it can take, converted to the
    setting's type, and a conditional parameter only where its `when` holds; each problem
    found is appended to `problems`. Returns it keyed by the parameters' study names.
    `complete` (the grid sampler): every parameter of the space must be given."""
    checked: dict[str, Any] = {}
    if not params:
        problems.append(f"{where}: names no parameter; give at least one, e.g. learning_rate")
    for key, value in params.items():
        name = search_paths.resolve(key)[0] or key
        if name not in space:
            hint = _did_you_mean(key, space) if isinstance(key, str) else ""
            problems.append(
                f"{where}.{_key(key)}: not in the search space{hint}; its "
                f"parameters: {', '.join(space)}"
            )
            continue
        if name in checked:
            problems.append(f"{where}.{_key(key)}: the same parameter as another key; give it once")
            continue
        ok, setting, rule = _convert(value, _field_hint(name), f"{where}.{name}.", [])
        if not ok:
            problems.append(f"{where}.{name}: got {_show(value)}; must be {rule}")
            continue
        outside = _outside(space[name], setting)
        if outside:
            problems.append(f"{where}.{name}: got {_show(value)}; {outside}")
            continue
        checked[name] = setting
    for name in checked:
        when = space[name].when
        if when and not applies(space[name], checked):
            said = ", ".join(f"{k} in {_show(v)}" for k, v in when.items())
            problems.append(
                f"{where}.{name}: applies only when {said} (its `when`); give "
                "those values too, or leave it out"
            )
    missing = [n for n in space if n not in params and n not in checked]
    if complete and params and missing:
        problems.append(
            f"{where}: the grid sampler tries whole configurations: add {', '.join(missing)}"
        )
    return checked


def _outside(spec: ParamSpec, value: Any) -> str:
    """Why the search space cannot hold `value`; empty if it can."""
    if spec.type == "categorical":
        choices = spec.choices or []
        return "" if value in choices else f"must be one of the choices {_show(choices)}"
    low, high = spec.low, spec.high
    if low is None or high is None or isinstance(value, bool):
        return "must be a number"
    if not low <= value <= high:
        return f"must be within [{low:g}, {high:g}]"
    if spec.step is not None:
        steps = (value - low) / spec.step
        if abs(steps - round(steps)) > 1e-9 * max(1.0, abs(steps)):
            return f"must be {low:g} plus a whole number of steps of {spec.step:g}"
    return ""


def _set_choices(spec: ParamSpec, name: str, choices: list[Any], problems: list[str]) -> None:
    repeated = [c for i, c in enumerate(choices) if c in choices[:i]]
    if repeated:
        problems.append(
            f"search_space.{name}.choices: {_show(repeated[0])} is listed twice (after "
            "conversion to a number); list each value once"
        )
    spec.choices = choices


def _resolve_paths(config: Config, base_dir: Path, problems: list[str], paths_from: str) -> None:
    data = config.data
    for key in ("train_file", "eval_file"):
        if not getattr(data, key):
            continue  # reported as required by DataConfig.problems
        resolved = _resolved(base_dir, getattr(data, key))
        if not _exists(resolved):
            problems.append(
                f"data.{key}: {_show(getattr(data, key))} not found (looked for "
                f"{_clip(str(resolved), 200)}); paths are relative to {paths_from}"
            )
        setattr(data, key, str(resolved))
    if config.study.checkpoint_dir is not None:
        config.study.checkpoint_dir = str(_resolved(base_dir, config.study.checkpoint_dir))
    if isinstance(config.study.storage, str):
        config.study.storage = sqlite_file_relative_to(config.study.storage, base_dir)
    model = config.model
    for key in ("name_or_path", "tokenizer"):
        value = getattr(model, key)
        if value is not None and _looks_local(value):
            resolved = _resolved(base_dir, value)
            if not _exists(resolved):
                problems.append(
                    f"model.{key}: {_show(value)} not found (looked for "
                    f"{_clip(str(resolved), 200)}); paths are relative to {paths_from}"
                )
            setattr(model, key, str(resolved))


def _resolved(base_dir: Path, location: str) -> Path:
    """`location` relative to the config's folder, `~` expanded where it names a known user."""
    path = base_dir / location
    try:
        return path.expanduser()
    except RuntimeError:  # `~nosuchuser/...`: left as written, reported as not found
        return path


def _exists(path: Path) -> bool:
    """exists() that answers no for a name the OS refuses (too long, a NUL byte) instead of
    raising."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _looks_local(location: str) -> bool:
    """A filesystem path rather than `pkg://...` or a hub name such as `org/model`."""
    if "://" in location:
        return False
    return location.startswith((".", "/", "~")) or location.count("/") > 1


# -- generic typed loading -------------------------------------------------------------------


def _build(
    cls: Any,
    raw: Any,
    prefix: str,
    problems: list[str],
    skip: frozenset[str] | set[str] = frozenset(),
) -> Any:
    """Instantiate dataclass `cls` from a mapping, appending every problem found to `problems`.

    A section left out (or empty) is built from `{}` and checked like any other: its required
    keys are reported as missing, not discovered later by the code that needs them."""
    section = prefix.rstrip(".") or "the file"
    missing = f" (the {section}: section is missing or empty)" if raw is None and prefix else ""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: got {_described(raw)}; must be a mapping of keys")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    values: dict[str, Any] = {}
    failed = set()
    for key, value in raw.items():
        if key not in names:
            hint = _did_you_mean(key, names) if isinstance(key, str) else ""
            problems.append(f"{prefix}{_key(key)}: unknown key{hint}; known: {', '.join(names)}")
            continue
        ok, converted, rule = _convert(value, hints[key], f"{prefix}{key}.", problems)
        if ok:
            values[key] = converted
            continue
        failed.add(key)
        if rule:
            problems.append(f"{prefix}{key}: got {_show(value)}; must be {rule}")
    for name in names:  # absent sections are validated too
        if name not in raw and dataclasses.is_dataclass(hints[name]):
            values[name] = _build(hints[name], None, f"{prefix}{name}.", problems)
    instance = cls(**values)
    # Fields that failed conversion hold their defaults here: already reported, not again.
    for key, value, rule in getattr(instance, "problems", list)():
        if key in failed:
            continue
        if key in raw:
            problems.append(f"{prefix}{key}: got {_show(value)}; {rule}")
        else:
            problems.append(f"{prefix}{key}: {rule}{missing}")
    return instance


# Every user value in a message goes through _show: a YAML alias bomb ("billion laughs") or a
# 10 MB string must give a short line, never a repr the size of the expanded document.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxset = _SHORT_REPR.maxdict = 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60
_SHORT_REPR.maxlong = 40
MAX_SHOWN_CHARS = 80


def _show(value: Any) -> str:
    """A user value as YAML users know it (null, true), never longer than MAX_SHOWN_CHARS."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int) and value.bit_length() > 128:
        # repr() of an integer over 4300 digits raises; nobody needs its digits anyway.
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return _clip(_SHORT_REPR.repr(value), MAX_SHOWN_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(key: Any) -> str:
    """A mapping key for a message: a string as written, anything else as _show gives it."""
    return _clip(key, MAX_SHOWN_CHARS) if isinstance(key, str) else _show(key)


def _described(value: Any) -> str:
    """A value with the YAML word for its type, for a section that is not a mapping."""
    kinds = ((list, "a list"), (str, "the text"), (bool, ""), ((int, float), "the number"))
    kind = next((word for types_, word in kinds if isinstance(value, types_)), "")
    return f"{kind} {_show(value)}".strip()


def _convert(value: Any, hint: Any, prefix: str, problems: list[str]) -> tuple[bool, Any, str]:
    """Coerce `value` to the annotation `hint`; returns (ok, value, rule it broke)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return True, None, ""
        rules = []
        for option in options:
            if option is type(None):
                continue
            ok, converted, rule = _convert(value, option, prefix, problems)
            if ok:
                return True, converted, ""
            rules.append(rule)
        if type(None) in options:
            rules.append("null")
        return False, None, " or ".join(r for r in rules if r)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed:
            return True, value, ""
        return False, None, "one of " + ", ".join(str(a) for a in allowed)
    if origin is list:
        if not isinstance(value, list):
            return False, None, "a list"
        (item_hint,) = typing.get_args(hint) or (Any,)
        items = [_convert(v, item_hint, prefix, problems) for v in value]
        failed = [rule for ok, _, rule in items if not ok]
        if not failed:
            return True, [v for _, v, _ in items], ""
        return False, None, f"a list, each item {failed[0]}"
    if origin is dict:
        return (True, value, "") if isinstance(value, dict) else (False, None, "a mapping")
    if dataclasses.is_dataclass(hint):
        return True, _build(hint, value, prefix, problems), ""
    return _convert_scalar(value, hint)


def _convert_scalar(value: Any, hint: Any) -> tuple[bool, Any, str]:
    if hint is Any:
        return True, value, ""
    if hint is bool:
        return (True, value, "") if isinstance(value, bool) else (False, None, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        number = _as_float(value)  # 64.0, and `1e3`, which YAML 1.1 reads as a string
        if number is not None and number.is_integer():
            return True, int(number), ""
        return False, None, "an integer"
    if hint is float:
        number = _as_float(value)
        if number is None:
            return False, None, "a number"
        if not math.isfinite(number):
            return False, None, "a finite number"
        return True, number, ""
    if hint is str:
        return (True, value, "") if isinstance(value, str) else (False, None, "a string")
    raise TypeError(f"unsupported config annotation {hint!r}")


def _as_float(value: Any) -> float | None:
    """Numbers and numeric strings: YAML 1.1 reads `1e-6` (no dot) as a string."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, str) and "_" in value:
        return None  # float() reads "1_0" as 10; nobody means that
    try:
        return float(value)
    except (ValueError, OverflowError):  # not a number; an integer beyond the float range
        return None


def _did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
