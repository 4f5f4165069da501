"""The config file's JSON Schema, for editors that complete and check YAML as users type (the
VS Code YAML extension, JetBrains IDEs): derived from the config's dataclasses and their field
docs, so it cannot drift from what `hpo.config.loader` loads. `hpo config schema` prints it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Literal

from hpo.config.schema import Config
from hpo.config.search_paths import accepted_names
from hpo.config.space import ParamSpec
from hpo.trainer.config import ENTRYPOINT

SCHEMA_DIALECT = "http://json-schema.org/draft-07/schema#"
SCHEMA_ID = "https://hpo.invalid/config.schema.json"  # a name for editors; nothing is served
# Fields of the dataclasses that are hpo's own bookkeeping, not keys of the file.
NOT_KEYS = frozenset({"source", "base_dir", "search_space_function", "default_params"})
SPACE_FUNCTION = {
    "type": "string",
    "pattern": "^" + ENTRYPOINT.pattern + "$",
    "description": "Your define-by-run function, `package.module:name`: it receives the Optuna "
    "trial and returns the parameters.",
}


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of a study config file."""
    schema = _object_schema(Config)
    schema["properties"]["search_space"] = {"description": _search_space_schema()["description"]}
    schema.update(_entrypoint_or_not(schema))
    return {
        "$schema": SCHEMA_DIALECT,
        "$id": SCHEMA_ID,
        "title": "hpo study config",
        **schema,
        "definitions": {"param": _object_schema(ParamSpec)},
    }


def schema_text() -> str:
    return json.dumps(config_schema(), indent=2, sort_keys=False) + "\n"


def _entrypoint_or_not(schema: dict[str, Any]) -> dict[str, Any]:
    """A config with training.entrypoint names the user's own metric and parameters; any
    other, hpo's metrics and searchable settings (draft-07 if/then/else)."""
    study = schema["properties"]["study"]["properties"]
    hpo_metric = study["metric"]
    study["metric"] = {"description": hpo_metric.get("description", "")}
    user_metric = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    user_space = {
        "description": "Your training function's parameters (ctx.params), by name; or "
        "`package.module:name`, your define-by-run function that samples them.",
        "anyOf": [
            {"type": "object", "additionalProperties": {"$ref": "#/definitions/param"}},
            SPACE_FUNCTION,
        ],
    }
    entrypoint_set = {
        "required": ["training"],
        "properties": {
            "training": {
                "required": ["entrypoint"],
                "properties": {"entrypoint": {"type": "string"}},
            }
        },
    }
    return {
        "if": entrypoint_set,
        "then": {
            "properties": {
                "study": {"properties": {"metric": user_metric}},
                "search_space": user_space,
            }
        },
        "else": {
            "properties": {"search_space": {"anyOf": [_search_space_schema(), SPACE_FUNCTION]}},
            # `metrics: package.module:name` or `task: package.module:ClassName`: study.metric
            # may name the function's or the task class's metrics
            "if": {
                "anyOf": [
                    {"required": ["metrics"], "properties": {"metrics": {"type": "string"}}},
                    {"required": ["task"], "properties": {"task": SPACE_FUNCTION}},
                ]
            },
            "then": {"properties": {"study": {"properties": {"metric": user_metric}}}},
            "else": {"properties": {"study": {"properties": {"metric": hpo_metric}}}},
        },
    }


def _search_space_schema() -> dict[str, Any]:
    spec = {"$ref": "#/definitions/param"}
    return {
        "type": "object",
        "description": "The parameters to tune, each a spec, by dotted path (training fields "
        "also by their own name); those left out keep their default (effective_batch_size and "
        "learning_rate are always searched).",
        "properties": {name: spec for name in accepted_names()},
        "additionalProperties": False,
    }


def _object_schema(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in NOT_KEYS:
            continue
        schema = _type_schema(hints[field.name])
        help_text = field.metadata.get("help")
        if help_text:
            schema["description"] = help_text
        default = _default(field)
        if default is not dataclasses.MISSING:
            schema["default"] = default
        properties[field.metadata.get("key", field.name)] = schema
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    return schema


def _default(field: dataclasses.Field) -> Any:
    """The field's default as JSON, or MISSING where it has none JSON can hold."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return dataclasses.MISSING
    if dataclasses.is_dataclass(value):
        return dataclasses.MISSING  # a section: its own properties carry the defaults
    if isinstance(value, float) and not math.isfinite(value):
        return dataclasses.MISSING
    try:
        json.dumps(value)
    except TypeError:
        return dataclasses.MISSING
    return value


def _type_schema(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(option) for option in typing.get_args(hint)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return {"type": "array", "items": _type_schema(item)}
    if origin is dict:
        args = typing.get_args(hint)
        values = _type_schema(args[1]) if args else {}
        return {"type": "object", "additionalProperties": values}
    if dataclasses.is_dataclass(hint):
        return _object_schema(hint)
    return dict(_SCALARS[hint])


# Only the annotations the loader converts (hpo.config.convert); another fails loudly.
_SCALARS: dict[Any, dict[str, Any]] = {
    Any: {},
    type(None): {"type": "null"},
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
}
