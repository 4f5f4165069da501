"""The site's reference pages, written from the code at every `mkdocs build` (mkdocs-gen-files):
the config from its JSON Schema (the schema's field docs, as `hpo config schema` prints them),
the command line from hpo's argparse parser, and the Python API from `hpo`'s public names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hpo, not whichever the environment installed
os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal: the same on every host

from hpo.cli.parser import build_parser  # noqa: E402
from hpo.config.json_schema import config_schema  # noqa: E402

CONFIG_INTRO = """# Config reference

A study config is a YAML file with the sections below (and, for your own code, `task:` and
`metrics:`). Relative paths in it are relative to the config file. Every problem in a file is
reported at once, naming the key, the value and the rule. Exponents may be written `1e-6` or
`1.0e-6`. `configs/template.yaml` is a complete minimal config to start from
([Your own data in five minutes](../getting-started/your-own-data.md)); `configs/demo.yaml`,
`configs/nli-minilm.yaml` and `configs/model-choice.yaml` are complete examples.

**In your editor**: `hpo config schema > hpo-config.schema.json` writes the config's JSON Schema
(every key with its type, default and description, derived from the same classes the loader
reads). With the VS Code YAML extension (or any editor on yaml-language-server), a first line
`# yaml-language-server: $schema=hpo-config.schema.json` in a config gives completion, hover docs
and red underlines for unknown keys and wrong types as you type. The schema checks shapes and
types; rules between keys (a `low` above its `high`, a metric the study cannot use) are checked
by hpo when it loads the file.

This page is generated from that schema, so it says what the code reads.
"""


def _type_of(spec: dict[str, Any]) -> str:
    if "enum" in spec:
        return ", ".join(f"`{value}`" for value in spec["enum"])
    if "anyOf" in spec:
        return " or ".join(_type_of(option) for option in spec["anyOf"])
    if "$ref" in spec:
        return spec["$ref"].rsplit("/", 1)[-1]
    kind = spec.get("type", "any")
    if kind == "array" and isinstance(spec.get("items"), dict):
        return f"list of {_type_of(spec['items'])}"
    return kind if isinstance(kind, str) else " or ".join(kind)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(properties: dict[str, Any], prefix: str) -> list[str]:
    rows = []
    for key, spec in properties.items():
        default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
        description = _cell(spec.get("description", ""))
        rows.append(f"| `{prefix}{key}` | {_cell(_type_of(spec))} | {default} | {description} |")
        # A section that may be left out (study.notify, tracking.mlflow): its keys too.
        options = [spec, *spec.get("anyOf", [])]
        nested = next(
            (o["properties"] for o in options if isinstance(o.get("properties"), dict)), None
        )
        if nested is not None:
            rows.extend(_rows(nested, f"{prefix}{key}."))
    return rows


def config_page() -> str:
    schema = config_schema()
    parts = [CONFIG_INTRO]
    for section, spec in schema["properties"].items():
        parts.append(f"## `{section}`\n")
        if spec.get("description"):
            parts.append(spec["description"] + "\n")
        if isinstance(spec.get("properties"), dict):
            parts.append("| key | type | default | description |\n| --- | --- | --- | --- |")
            parts.append("\n".join(_rows(spec["properties"], f"{section}.")) + "\n")
    param = schema["definitions"]["param"]
    parts.append("## A search-space parameter\n")
    parts.append(
        "Each entry of `search_space` (see [Search space](../concepts/search-space.md)).\n"
    )
    parts.append("| key | type | default | description |\n| --- | --- | --- | --- |")
    parts.append("\n".join(_rows(param["properties"], "")) + "\n")
    return "\n".join(parts)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_page() -> str:
    parser = build_parser()
    parts = [
        "# Command line reference\n",
        "Every `hpo` command and its options, as `hpo COMMAND --help` prints them. "
        "Generated from the parser.\n",
        "```text\n" + parser.format_help() + "```\n",
    ]
    for name, sub in _subcommands(parser).items():
        parts.append(f"## `hpo {name}`\n")
        parts.append("```text\n" + sub.format_help() + "```\n")
        for action_name, action in _subcommands(sub).items():
            parts.append(f"### `hpo {name} {action_name}`\n")
            parts.append("```text\n" + action.format_help() + "```\n")
    return "\n".join(parts)


def public_names() -> dict[str, str]:
    """`hpo._PUBLIC`: each public name (`hpo.__all__`) and the module that defines it."""
    import hpo

    names = dict(hpo._PUBLIC)
    missing = sorted(set(hpo.__all__) - set(names) - {"__version__"})
    if missing:
        raise SystemExit(f"hpo.__all__ names {missing}, which hpo._PUBLIC does not map")
    return names


def api_page() -> str:
    parts = [
        "# Python API reference\n",
        "Every name your code may import from `hpo` (`hpo.__all__`), as `from hpo import run, "
        "ConfigError`: these are promised; "
        "modules and names not listed here are internal and may move. Generated from the "
        "docstrings. See [Your own code](../guides/your-own-code.md) for how they fit "
        "together.\n",
    ]
    by_module: dict[str, list[str]] = {}
    for name, module in public_names().items():
        by_module.setdefault(module, []).append(name)
    for module, names in by_module.items():
        parts.append(f"## Defined in `{module}`\n")
        for name in sorted(names):
            parts.append(f"::: {module}.{name}\n    options:\n      heading_level: 3\n")
    return "\n".join(parts)


for path, text in {
    "reference/config.md": config_page(),
    "reference/cli.md": cli_page(),
    "reference/api.md": api_page(),
}.items():
    with mkdocs_gen_files.open(path, "w") as page:
        page.write(text)
