"""Where a config's files are: relative paths (data files, checkpoints, a SQLite study, local
models) resolved against the folder that holds the config file.
"""

from __future__ import annotations

from pathlib import Path

from hpo.config.convert import clip, show
from hpo.config.schema import Config
from hpo.storage.url import sqlite_file_relative_to


def resolve_paths(config: Config, base_dir: Path, problems: list[str], paths_from: str) -> None:
    data = config.data
    for key in ("train_file", "eval_file", "test_file"):
        if not getattr(data, key):
            continue  # reported as required by DataConfig.problems
        resolved = resolved_path(base_dir, getattr(data, key))
        if not path_exists(resolved):
            problems.append(
                f"data.{key}: {show(getattr(data, key))} not found (looked for "
                f"{clip(str(resolved), 200)}); paths are relative to {paths_from}"
            )
        setattr(data, key, str(resolved))
    if config.study.checkpoint_dir is not None:
        config.study.checkpoint_dir = str(resolved_path(base_dir, config.study.checkpoint_dir))
    if isinstance(config.study.storage, str):
        config.study.storage = sqlite_file_relative_to(config.study.storage, base_dir)
    for source in config.study.warm_start.source_list() if config.study.warm_start else []:
        if source.storage is not None:  # as study.storage: relative to the config file
            source.storage = sqlite_file_relative_to(source.storage, base_dir)
    model = config.model
    for key in ("name_or_path", "tokenizer"):
        value = getattr(model, key)
        if value is not None and looks_local(value):
            resolved = resolved_path(base_dir, value)
            if not path_exists(resolved):
                problems.append(
                    f"model.{key}: {show(value)} not found (looked for "
                    f"{clip(str(resolved), 200)}); paths are relative to {paths_from}"
                )
            setattr(model, key, str(resolved))


def resolved_path(base_dir: Path, location: str) -> Path:
    """`location` relative to the config's folder, `~` expanded where it names a known user."""
    path = base_dir / location
    try:
        return path.expanduser()
    except RuntimeError:  # `~nosuchuser/...`: left as written, reported as not found
        return path


def path_exists(path: Path) -> bool:
    """Path.exists() that answers no for a name the OS refuses (too long, a NUL byte) instead of
    raising."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def looks_local(location: str) -> bool:
    """A filesystem path rather than `pkg://...` or a hub name such as `org/model`."""
    if "://" in location:
        return False
    return location.startswith((".", "/", "~")) or location.count("/") > 1


def model_location(value: str, base_dir: str) -> str:
    """A model choice as the trainer loads it: a local path made absolute against the config's
    folder; `pkg://...` and hub names unchanged."""
    return str(resolved_path(Path(base_dir), value)) if looks_local(value) else value
