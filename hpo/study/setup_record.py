"""What makes a study's trials comparable (its data's sha256, model, task, max_length, evaluation
schedule, metric, pruner): recorded by the first worker, and every later worker must match it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from hpo.config.schema import Config
from hpo.errors import ConfigError
from hpo.storage.engine import StudyStorage
from hpo.study.sampling import pruner_settings
from hpo.trainer.digests import content_sha256

log = logging.getLogger(__name__)

SETUP_ATTR = "setup"  # the record: a field's dotted config path -> its value or file digest
# Each change a worker was allowed to make (`hpo run --allow-changed-setup`): when, and what.
SETUP_CHANGES_ATTR = "setup_changes"
# The held-out test file (data.test_file) of the latest worker that named one: {"path", "sha256"}.
# Not part of the setup a worker must match (a worker with another test file trains the same
# trials); `hpo ensemble --study` scores on it while it is there unchanged.
TEST_FILE_ATTR = "test_file"

# Which data is read, besides the files themselves (a file's columns, a multi-label separator).
_DATA_FIELDS = (
    "text_column",
    "text_pair_column",
    "label_column",
    "prompt_column",
    "completion_column",
    "label_separator",
)


def setup_record(config: Config) -> dict[str, Any]:
    """The study's record of what its trials share, as plain JSON values. A file or model folder
    is {"sha256", "path"}: only its content counts (another host's path to the same data
    matches). A searched field is left out: the search space check compares it."""
    record: dict[str, Any] = {
        "task": config.task,
        "study.metric": config.study.objectives,
        **{f"study.pruner.{k}": v for k, v in pruner_settings(config.study.pruner).items()},
    }
    if config.training.entrypoint is not None:  # the function reads its own data and model
        record["training.entrypoint"] = config.training.entrypoint
    else:
        record.update(_data_record(config))
        record.update(_model_record(config))
        # The pruner compares trials at the same evaluation number: the schedule numbers them.
        for name in ("evals_per_epoch", "epochs", "max_steps"):
            record[f"training.{name}"] = getattr(config.training, name)
    searched = {key if "." in key else f"training.{key}" for key in config.search_space}
    kept = {key: value for key, value in record.items() if key not in searched}
    return json.loads(json.dumps(kept))


def _data_record(config: Config) -> dict[str, Any]:
    data = config.data
    record: dict[str, Any] = {
        "data.train_file": _file_entry(data.train_file, data.train_split),
        "data.eval_file": _file_entry(data.eval_file, data.eval_split),
        "data.max_length": data.max_length,
    }
    record.update((f"data.{name}", getattr(data, name)) for name in _DATA_FIELDS)
    return record


def _file_entry(location: str, split: str) -> dict[str, Any] | None:
    """A data file's sha256 (read once per version of the file: the token cache key has
    already hashed it); a saved DatasetDict folder's digest and the split read from it."""
    if not location:
        return None
    path = Path(location)
    # Gone since the data was read (or never read: a caller of open_study's own): said so.
    digest = content_sha256(path) if path.exists() else None
    entry: dict[str, Any] = {"sha256": digest, "path": str(path)}
    if path.is_dir():
        entry["split"] = split
    return entry


def _model_record(config: Config) -> dict[str, Any]:
    model = config.model
    inline = None
    if model.config is not None:
        text = json.dumps(model.config, sort_keys=True, default=str)
        inline = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "path": "inline"}
    return {
        "model.name_or_path": _location_entry(model.name_or_path),
        "model.config": inline,
        "model.tokenizer": _location_entry(model.tokenizer),
        "model.factory": model.factory,
    }


def _location_entry(location: str | None) -> Any:
    """A model folder on this host by its files' content (the loader made it an absolute
    path; only the top level: what transformers reads, not a trainer's checkpoint folders);
    a hub id or a pkg:// location by its name."""
    if location is None or not Path(location).is_absolute() or not Path(location).is_dir():
        return location
    return {"sha256": content_sha256(Path(location), recursive=False), "path": location}


def test_file_record(config: Config) -> dict[str, Any] | None:
    """What TEST_FILE_ATTR records of this config's data.test_file (None: it names none)."""
    location = getattr(config.data, "test_file", None)
    if not location or config.training.entrypoint is not None:
        return None
    return _file_entry(location, config.data.test_split)


def differences(stored: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """The fields both records hold with another value (a file: another content). A field
    only one holds (recorded by another hpo version, or searched by one) is not compared."""
    return sorted(
        k for k in stored.keys() & record.keys() if _compared(stored[k]) != _compared(record[k])
    )


def _compared(value: Any) -> Any:
    if isinstance(value, dict) and "sha256" in value:
        return value["sha256"], value.get("split")
    return value


def shown(value: Any) -> str:
    """A record's value as a message shows it: a file by its path and short sha256."""
    if isinstance(value, dict) and "sha256" in value:
        split = f", split {value['split']}" if value.get("split") else ""
        digest = value["sha256"][:12] if value["sha256"] else "unknown: no such file"
        return f"{value['path']} (sha256 {digest}{split})"
    return json.dumps(value)


def check_setup(
    storage: StudyStorage,
    study_id: int,
    name: str,
    config: Config,
    record: dict[str, Any],
    allow_changed: bool,
    in_python: bool = False,
) -> None:
    """Record the study's setup (a new study, or one an older hpo made: no refusal), or check
    this worker's against it. A worker that differs is refused, writing nothing, unless
    `allow_changed`: then the change is recorded (SETUP_CHANGES_ATTR) and its setup becomes the
    study's. Call it under the study's lock."""
    attrs = storage.get_study_user_attrs(study_id)
    stored = attrs.get(SETUP_ATTR)
    if not isinstance(stored, dict):
        if "n_trials" in attrs:  # a worker joined before (open_study sets it): an older hpo
            log.info(
                "study %r has no record of its data and model (an older hpo made it): "
                "this worker's is recorded now",
                name,
            )
        storage.set_study_user_attr(study_id, SETUP_ATTR, record)
        return
    changed = differences(stored, record)
    if changed and not allow_changed:
        raise ConfigError([_refusal(name, stored, record, changed, in_python)], config.source)
    if changed:
        change = {
            "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "fields": {k: {"study": shown(stored[k]), "worker": shown(record[k])} for k in changed},
        }
        storage.set_study_user_attr(study_id, SETUP_CHANGES_ATTR, [*setup_changes(attrs), change])
        log.warning(
            "study %r: joined with another %s, as allowed; recorded in the study (hpo "
            "status says it mixes setups)",
            name,
            ", ".join(changed),
        )
    if changed or record.keys() - stored.keys():
        storage.set_study_user_attr(study_id, SETUP_ATTR, {**stored, **record})


def _refusal(
    name: str, stored: dict[str, Any], record: dict[str, Any], changed: list[str], in_python: bool
) -> str:
    fields = "; ".join(
        f"{k}: the study's {shown(stored[k])}, this worker's {shown(record[k])}" for k in changed
    )
    new, allow = (
        ("study='NEW_NAME'", "allow_changed_setup=True")
        if in_python
        else ("--study NEW_NAME", "--allow-changed-setup")
    )
    return (
        f"study {name!r} was set up otherwise, and its trials would not compare with this "
        f"worker's ({fields}); start a new study with {new}, or pass {allow} to join it "
        "anyway (recorded: hpo status then says the study mixes setups)"
    )


def setup_changes(user_attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """The changes of setup a study was allowed, oldest first (none for most studies)."""
    changes = user_attrs.get(SETUP_CHANGES_ATTR)
    return [c for c in changes if isinstance(c, dict)] if isinstance(changes, list) else []
