"""Values checked against the search space: a configuration to try (study.enqueue, `hpo
enqueue`), what a define-by-run search space returns, and one value for one setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpo.config import search_paths
from hpo.config.convert import clip, convert, described, did_you_mean, show, shown_key
from hpo.config.paths import looks_local, path_exists, resolved_path
from hpo.config.schema import Config
from hpo.config.space import ParamSpec, applies
from hpo.trainer.tasks import TASKS


def check_enqueue(config: Config, problems: list[str]) -> None:
    """study.enqueue: each configuration checked against the search space (the grid sampler's
    whole), or, for a define-by-run function's, its form only; kept by the study names."""
    grid = config.study.sampler.type == "grid"
    for index, params in enumerate(config.study.enqueue):
        where = f"study.enqueue[{index}]"
        if config.search_space_function is not None:
            checked = check_function_params(params, where, problems)
        else:
            checked = check_params(config.search_space, params, where, problems, complete=grid)
        config.study.enqueue[index] = checked


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
            hint = did_you_mean(key, space) if isinstance(key, str) else ""
            problems.append(
                f"{where}.{shown_key(key)}: not in the search space{hint}; its "
                f"parameters: {', '.join(space)}"
            )
            continue
        if name in checked:
            problems.append(
                f"{where}.{shown_key(key)}: the same parameter as another key; give it once"
            )
            continue
        ok, setting, rule = convert(value, setting_type(name), f"{where}.{name}.", [])
        if not ok:
            problems.append(f"{where}.{name}: got {show(value)}; must be {rule}")
            continue
        outside = why_outside(space[name], setting)
        if outside:
            problems.append(f"{where}.{name}: got {show(value)}; {outside}")
            continue
        checked[name] = setting
    for name in checked:
        when = space[name].when
        if when and not applies(space[name], checked):
            said = ", ".join(f"{k} in {show(v)}" for k, v in when.items())
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


def why_outside(spec: ParamSpec, value: Any) -> str:
    """Why the search space cannot hold `value`; empty if it can."""
    if spec.type == "categorical":
        choices = spec.choices or []
        return "" if value in choices else f"must be one of the choices {show(choices)}"
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
            problems.append(f"{where}: key {show(key)} is not text; quote it")
        elif not isinstance(value, (str, int, float, bool, type(None))):
            problems.append(
                f"{where}.{key}: got {show(value)}; must be a single value (a "
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
            f"{spec} returned {described(params)}; expected a dict of parameter "
            "name to value, e.g. {'learning_rate': 3e-5}"
        )
    problems: list[str] = []
    checked: dict[str, Any] = {}
    user_function = config.training.entrypoint is not None
    for key, value in params.items():
        where = f"{spec} returned {shown_key(key)}"
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
        ok, setting, rule = convert(value, setting_type(name), "", [])
        if not ok:
            problems.append(f"{where}: got {show(value)}; must be {rule}")
            continue
        broken = [] if user_function else setting_problems(config, name, setting)
        if broken:
            problems.append(f"{where}: value {show(value)} {broken[0]}")
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


def setting_type(name: str) -> Any:
    """The type annotation of the field a parameter sets; Any for a parameter of the user's
    own training function (training.entrypoint), which hpo does not type."""
    try:
        return search_paths.field_hint(name)
    except KeyError:
        return Any


def setting_problems(config: Config, name: str, value: Any) -> list[str]:
    """What the field's own rules say of `value` (a model choice: also that it exists)."""
    section, field = search_paths.field_of(name)
    if (section, field) == ("model", "name_or_path") and isinstance(value, str):
        resolved = resolved_path(Path(config.base_dir), value)
        if looks_local(value) and not path_exists(resolved):
            return [
                f"not found (looked for {clip(str(resolved), 200)}); paths are relative "
                "to the config file"
            ]
    if not isinstance(value, (str, int, float, bool, type(None))):
        return ["is not a single value (Optuna's choices are numbers, text, true/false, null)"]
    changed = search_paths.with_value(getattr(config, section), section, field, value)
    return search_paths.field_problems(changed, section, field)
