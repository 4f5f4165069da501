"""The YAML loader of a study config: a file read (load_config) and its mapping built into
the typed sections of schema.py (parse_config, also for a mapping given in code), validated up
front, every problem reported at once. The checks live beside it: the search space
(space_checks), values against it (param_checks), the objectives (objectives), paths (paths),
typed conversion (convert).

Relative paths in the file are resolved against the folder that holds the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hpo.config import search_paths
from hpo.config.convert import build, clip, described, show
from hpo.config.notify import NotifyConfig, hide_notify_secrets
from hpo.config.objectives import (
    check_metrics_function,
    check_pruned_objective,
    check_user_objectives,
    default_metric_of_task,
    pop_user_objectives,
    set_user_objectives,
)
from hpo.config.param_checks import check_enqueue
from hpo.config.paths import resolve_paths
from hpo.config.schema import Config
from hpo.config.space_checks import (
    build_search_space,
    build_user_space,
    check_grid,
    check_search_space,
    check_searched_for_task,
    check_user_space,
    defaults_kept,
    set_space_function,
)
from hpo.errors import ConfigError

# The demo config: package data in an installed wheel (setup.py lays it out under hpo/_demo/ as
# in the repository), else the repository's own (a checkout, an editable install).
_SHIPPED_DEMO = Path(__file__).resolve().parents[1] / "_demo" / "configs" / "demo.yaml"
_CHECKOUT_DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
DEMO_CONFIG = _SHIPPED_DEMO if _SHIPPED_DEMO.is_file() else _CHECKOUT_DEMO


def load_config(path: str | Path, entrypoint: str | None = None) -> Config:
    """Read, type-check and validate a config file; raises ConfigError listing every problem.
    `entrypoint`: training.entrypoint set over the file's (hpo.run's argument)."""
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
    raw = with_entrypoint(raw if raw is not None else {}, entrypoint)
    return parse_config(raw, base_dir=path.parent, source=str(path))


def with_entrypoint(raw: Any, entrypoint: str | None) -> Any:
    """A parsed config with training.entrypoint set to `entrypoint` (unless None)."""
    if entrypoint is None or not isinstance(raw, dict):
        return raw
    training = raw.get("training")
    kept = training if isinstance(training, dict) else {}
    return {**raw, "training": {**kept, "entrypoint": entrypoint}}


def load_notify(path: str | Path) -> NotifyConfig:
    """Only the study.notify section of a config file (a watcher's, `hpo status --watch
    --notify`): the rest of the file is the workers' business."""
    path = Path(path)
    raw = _read_yaml(path)
    raw = raw if isinstance(raw, dict) else {}
    hide_notify_secrets(raw)
    study = raw.get("study")
    section = study.get("notify") if isinstance(study, dict) else None
    if section is None:
        problem = "study.notify: missing; give its urls (see configs/template.yaml)"
        raise ConfigError([problem], str(path))
    problems: list[str] = []
    notify = build(NotifyConfig, section, "study.notify.", problems)
    if problems:
        raise ConfigError(problems, str(path))
    return notify


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
        return f"not valid YAML: {clip(error.problem, 200)}{where}"
    if isinstance(error, ValueError):  # YAML types it, Python cannot build it: 2024-13-45, 10**5000
        reason = clip(str(error).split(";")[0], 120)
        return f"not valid YAML: a value cannot be read ({reason}); quote it if it is text"
    lines = str(error).strip().splitlines()
    return f"not valid YAML: {clip(lines[0] if lines else type(error).__name__, 200)}"


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
                    problem=f"key {show(key)} appears twice in one mapping; keep one",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def parse_config(
    raw: Any, base_dir: Path, source: str = "config", paths_from: str = "the config file"
) -> Config:
    """Build a Config from parsed YAML (a file's, read by load_config, or a mapping of the
    caller's: the one way either becomes a Config); raises ConfigError listing every problem.
    Relative paths are taken from `base_dir`, which `paths_from` names in a message."""
    if not isinstance(raw, dict):
        raise ConfigError(
            [
                f"the file must hold a mapping of sections (study:, search_space:, model:, "
                f"data:, training:), got {described(raw)}"
            ],
            source,
        )
    raw = dict(raw)
    hide_notify_secrets(raw)  # before any message could show them, a wrong one's included
    problems: list[str] = []
    sections = _hpo_trained if _entrypoint_of(raw) is None else _function_trained
    config = sections(raw, base_dir, source, problems)
    check_pruned_objective(config, problems)
    # Both need a well-formed space; their findings would be noise otherwise.
    if not problems and config.study.sampler.type == "grid":
        check_grid(config, problems)
    if not problems:
        check_enqueue(config, problems)
    resolve_paths(config, base_dir, problems, paths_from)
    if problems:
        raise ConfigError(problems, source)
    return config


def _hpo_trained(raw: dict[Any, Any], base_dir: Path, source: str, problems: list[str]) -> Config:
    """The sections of a config whose trials hpo's trainer trains: typed, and checked together
    (the search space against the settings it varies, the metric against the task)."""
    default_metric_of_task(raw)
    user_objectives = pop_user_objectives(raw)
    space_raw = raw.pop("search_space", None)
    _default_model_of_search(raw, space_raw)
    # search_space is built on its own below, but is a known key all the same: `search_spaces:`
    # must get its did-you-mean.
    config = build(Config, raw, "", problems, skip={"source", "base_dir", "default_params"})
    config.source, config.base_dir = source, str(base_dir)
    if isinstance(space_raw, str):
        config.search_space, config.default_params = {}, []
        set_space_function(config, space_raw, problems)
    else:
        config.search_space = build_search_space(space_raw, problems)
        config.default_params = defaults_kept(space_raw)
    if not 0 <= config.training.seed < 2**64:  # what numpy and torch.manual_seed both take
        problems.append(f"training.seed: got {show(config.training.seed)}; must be in [0, 2**64)")
    if config.model.config is not None and config.model.factory is None:
        problems.extend(_inline_model_problems(config.model.config))
    if config.metrics is not None:
        check_metrics_function(config, user_objectives, problems)
    elif user_objectives is not None:  # a task class of the user's names its own metrics
        check_user_objectives(config, user_objectives, problems)
    if not problems:  # needs well-typed sections; its findings would be noise otherwise
        check_search_space(config, problems)
    if not problems:
        check_searched_for_task(config, problems)
    return config


def _entrypoint_of(raw: dict[Any, Any]) -> Any:
    training = raw.get("training")
    return training.get("entrypoint") if isinstance(training, dict) else None


# What a config with training.entrypoint leaves out: the user's function builds its own model
# and reads its own data, so hpo's settings for them would silently mean nothing.
_NOT_WITH_ENTRYPOINT = ("model", "data", "task", "metrics")


def _function_trained(
    raw: dict[Any, Any], base_dir: Path, source: str, problems: list[str]
) -> Config:
    """The sections of a config whose trials call the user's training function: no model, data
    or task; the search space names the function's own parameters (effective_batch_size keeps
    its meaning: ctx.physical_batch_size and ctx.grad_accum_steps split it); study.metric is a
    metric the function reports, so its direction must be given."""
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
    config = build(Config, raw, "", problems, skip=skip)
    config.source, config.base_dir = source, str(base_dir)
    config.default_params = []  # hpo adds no default space to a function's
    if isinstance(space_raw, str):
        config.search_space = {}
        set_space_function(config, space_raw, problems)
    else:
        config.search_space = build_user_space(space_raw, problems)
    set_user_objectives(config, objectives, direction, problems)
    if not problems:
        check_user_space(config, problems)
    return config


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


MAX_INLINE_MODEL_VALUES = 10_000


def _inline_model_problems(settings: dict[Any, Any]) -> list[str]:
    """model.config becomes keyword arguments of a transformers config: string keys, plain
    values, and a size a config can have (a YAML alias bomb expands to billions)."""
    found = []
    odd_keys = [key for key in settings if not isinstance(key, str)]
    if odd_keys:
        found.append(f"model.config: key {show(odd_keys[0])} is not text; quote it")
    model_type = settings.get("model_type")
    if "model_type" in settings and not (isinstance(model_type, str) and model_type):
        found.append(f"model.config.model_type: got {show(model_type)}; must be a name, e.g. bert")
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
