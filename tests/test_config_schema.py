"""`hpo config schema`: the config's JSON Schema agrees with hpo's own loader (what one accepts
the other accepts, what one refuses the other refuses) on the shipped configs and bad ones."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hpo.config.json_schema import config_schema
from hpo.config.loader import parse_config
from hpo.errors import ConfigError
from tests.conftest import REPO, tiny_config


def _schema_accepts(raw: Any) -> bool:
    return jsonschema.Draft7Validator(config_schema()).is_valid(raw)


def _loader_accepts(raw: Any, base_dir: Path) -> bool:
    try:
        parse_config(copy.deepcopy(raw), base_dir)
    except ConfigError:
        return False
    return True


def test_the_schema_is_a_valid_draft7_schema() -> None:
    jsonschema.Draft7Validator.check_schema(config_schema())


SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "examples").glob("*/*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_follows_the_schema(path: Path) -> None:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    jsonschema.validate(raw, config_schema(), cls=jsonschema.Draft7Validator)


def _tiny(tmp_path: Path) -> dict[str, Any]:
    for name in ("train.csv", "eval.csv"):
        (tmp_path / name).write_text("text,label\na,0\n", encoding="utf-8")
    return tiny_config(tmp_path / "train.csv", tmp_path / "eval.csv")


BAD_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown top-level key": lambda c: c.update(search_spaces={}),
    "unknown study key": lambda c: c["study"].update(n_trial=3),
    "sampler not one of the list": lambda c: c["study"]["sampler"].update(type="bayes"),
    "a string for an integer": lambda c: c["training"].update(epochs="three"),
    "a number for a flag": lambda c: c["training"].update(compile=1),
    "a parameter that cannot be tuned": lambda c: c["search_space"].update(
        dropout={"type": "float", "low": 0.0, "high": 0.3}
    ),
    "a parameter spec with an unknown key": lambda c: c["search_space"]["learning_rate"].update(
        lo=1e-5
    ),
    "a section that is not a mapping": lambda c: c.update(training=[1, 2]),
}


def test_a_good_config_is_accepted_by_both(tmp_path: Path) -> None:
    raw = _tiny(tmp_path)
    assert _loader_accepts(raw, tmp_path)
    assert _schema_accepts(raw)


@pytest.mark.parametrize("edit", BAD_EDITS.values(), ids=BAD_EDITS.keys())
def test_a_bad_config_is_refused_by_both(tmp_path: Path, edit: Callable[[dict], None]) -> None:
    raw = _tiny(tmp_path)
    edit(raw)
    assert not _loader_accepts(raw, tmp_path)
    assert not _schema_accepts(raw)


def test_fields_carry_their_docs_and_defaults() -> None:
    study = config_schema()["properties"]["study"]["properties"]
    assert study["max_retries"]["default"] == 2
    assert "heartbeat" in study["grace_period"]["description"]
    training = config_schema()["properties"]["training"]["properties"]
    assert training["physical_batch_size"]["anyOf"] == [{"type": "integer"}, {"enum": ["auto"]}]


def test_the_command_prints_it(hpo_main: Callable[[list[str]], int], capsys: Any) -> None:
    assert hpo_main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == config_schema()
