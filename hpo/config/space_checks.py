"""The search space checked as a whole: each key resolved to a parameter, each spec typed,
every value it can take a valid setting, conditions that can hold, a grid that is finite.
"""

from __future__ import annotations

import math
from typing import Any

from hpo.config import search_paths
from hpo.config.convert import build, convert, described, show, shown_key
from hpo.config.param_checks import setting_problems, setting_type, why_outside
from hpo.config.schema import Config
from hpo.config.space import ParamSpec, default_search_space, has_conditions, sampling_order
from hpo.trainer.config import ENTRYPOINT
from hpo.trainer.tasks import TASKS


def build_search_space(raw: Any, problems: list[str]) -> dict[str, ParamSpec]:
    """Each key resolved to its parameter's name (search_paths: `learning_rate` and
    `training.learning_rate` are one parameter), each spec typed; conditions are checked once
    every parameter is known (_check_conditions)."""
    space = default_search_space()
    if raw is None:
        return space
    if not isinstance(raw, dict):
        problems.append(
            f"search_space: got {described(raw)}; must be a mapping of parameter name to spec"
        )
        return space
    given: dict[str, str] = {}
    for name, spec in raw.items():
        key = f"search_space.{shown_key(name)}"
        param, why = search_paths.resolve(name)
        if param is None:
            problems.append(f"{key}: {why}")
            continue
        if param in given:
            problems.append(f"{key}: the same parameter as {given[param]}; give it once")
            continue
        given[param] = shown_key(name)
        if spec is None:
            problems.append(
                f"{key}: is empty; give its spec, e.g. {{type: float, low: 1.0e-5, high: 1.0e-3}}, "
                "or remove the entry to use the default"
            )
            continue
        space[param] = build(ParamSpec, spec, key + ".", problems)
    return space


def defaults_kept(raw: Any) -> list[str]:
    """The default space's parameters that the config's search_space does not set."""
    given = {search_paths.resolve(name)[0] for name in raw} if isinstance(raw, dict) else set()
    return [name for name in default_search_space() if name not in given]


def build_user_space(raw: Any, problems: list[str]) -> dict[str, ParamSpec]:
    """The training function's parameters, by the names it reads from ctx.params."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(
            f"search_space: got {described(raw)}; must be a mapping of parameter name to spec"
        )
        return {}
    space: dict[str, ParamSpec] = {}
    for name, spec in raw.items():
        key = f"search_space.{shown_key(name)}"
        if not isinstance(name, str) or not name.isidentifier():
            problems.append(
                f"{key}: a parameter's name must be a Python identifier, e.g. "
                "hidden_size (your function reads ctx.params[name])"
            )
        elif not isinstance(spec, dict):
            problems.append(
                f"{key}: got {described(spec)}; give its spec, e.g. "
                "{type: float, low: 1.0e-5, high: 1.0e-3}"
            )
        else:
            space[name] = build(ParamSpec, spec, key + ".", problems)
    return space


def set_space_function(config: Config, spec: str, problems: list[str]) -> None:
    """`search_space: package.module:name`: the user's define-by-run function samples each
    trial's parameters (imported and checked before any trial, by hpo run)."""
    if not ENTRYPOINT.fullmatch(spec):
        problems.append(
            f"search_space: got {show(spec)}; must be a mapping of parameter name to "
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


def check_search_space(config: Config, problems: list[str]) -> None:
    """Every value a parameter can take must itself be a valid setting of its field.

    Categorical choices are converted to the setting's type here (YAML 1.1 reads `1e-4` as a
    string, `32.0` is a float), so a trial receives the same values the range check saw."""
    for name, spec in config.search_space.items():
        hint = setting_type(name)
        if spec.type == "float" and hint is int:
            problems.append(
                f"search_space.{name}: got type float; {name} is a whole number, "
                "use type: int or categorical"
            )
            continue
        converted = []
        for value in spec.values_for_bounds():
            ok, setting, rule = convert(value, hint, f"search_space.{name}.", [])
            if not ok:
                problems.append(f"search_space.{name}: value {show(value)} must be {rule}")
                break
            broken = setting_problems(config, name, setting)
            if broken:
                problems.append(f"search_space.{name}: value {show(value)} {broken[0]}")
                break
            converted.append(setting)
        else:
            if spec.type == "categorical":
                _set_choices(spec, name, converted, problems)
    if not problems:
        problems.extend(_search_conflicts(config))
    if not problems:
        _check_conditions(config.search_space, problems)


def check_user_space(config: Config, problems: list[str]) -> None:
    """The space of a training function's own parameters (training.entrypoint): each `when`
    names parameters of the space (a parameter whose condition does not hold is not in
    ctx.params); effective_batch_size is split by hpo into physical batches: whole numbers
    >= 1. (The grid sampler's check is the loader's, for either kind of space.)"""
    _check_conditions(config.search_space, problems, user_function=True)
    batch = config.search_space.get("effective_batch_size")
    if batch is None:
        return
    for value in batch.values_for_bounds():
        ok, converted, _ = convert(value, int, "", [])
        if not ok or converted < 1:
            problems.append(
                f"search_space.effective_batch_size: value {show(value)} must be a positive integer"
            )
            return
    if batch.type == "float":
        problems.append("search_space.effective_batch_size: got type float; use int or categorical")
    elif batch.type == "categorical":
        batch.choices = [int(v) for v in batch.choices or []]


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
            problems.append(f"{where}.{shown_key(key)}: {why}")
            continue
        if param == name:
            problems.append(f"{where}.{shown_key(key)}: a parameter cannot depend on itself")
            continue
        if param not in space:
            problems.append(
                f"{where}.{shown_key(key)}: {param} is not searched; a condition names "
                f"a parameter of the search space ({', '.join(space)})"
            )
            continue
        if space[param].type == "float":
            # Sampled from a continuum: one value of it (learning_rate: 0.001) is never drawn,
            # so the parameter would never be searched.
            problems.append(
                f"{where}.{shown_key(key)}: got {show(value)}; {param} is a float "
                "parameter, and a condition on its value never holds; name a "
                f"categorical or int parameter, or make {param} categorical "
                "(type: categorical, choices: [...])"
            )
            continue
        allowed = []
        for item in value if isinstance(value, list) else [value]:
            hint = Any if user_function else setting_type(param)
            ok, setting, _ = convert(item, hint, f"{where}.", [])
            outside = why_outside(space[param], setting if ok else item)
            if outside:
                problems.append(
                    f"{where}.{shown_key(key)}: got {show(item)}; {param} never takes it: {outside}"
                )
                break
            allowed.append(setting)
        conditions[param] = allowed
    return conditions


def check_searched_for_task(config: Config, problems: list[str]) -> None:
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


def check_grid(config: Config, problems: list[str]) -> None:
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


def _set_choices(spec: ParamSpec, name: str, choices: list[Any], problems: list[str]) -> None:
    repeated = [c for i, c in enumerate(choices) if c in choices[:i]]
    if repeated:
        problems.append(
            f"search_space.{name}.choices: {show(repeated[0])} is listed twice (after "
            "conversion to a number); list each value once"
        )
    spec.choices = choices
