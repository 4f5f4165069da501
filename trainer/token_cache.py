"""Tokenization with an on-disk cache: both splits of a run read, checked, encoded by the task
and stored once per data file, tokenizer and settings (`prepare_splits`), then memory-mapped.

What a row's target is (a class, a number, a tag per word) is the task's to say
(`hpo.trainer.tasks`); this module tokenizes and stores whatever it encoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Protocol

from hpo.trainer.config import DataConfig
from hpo.trainer.data import PreparedData, TokenizedSplit, flat_split, load_split, save_split
from hpo.trainer.digests import content_sha256, hpo_cache_root
from hpo.trainer.errors import DataError
from hpo.trainer.readers import MIB, read_table, table_columns
from hpo.trainer.text_window import heads, window_chars

CACHE_FORMAT_VERSION = 3  # 3: targets of any task; 2: a folder of .npy files; 1: one .npz


class RowEncoder(Protocol):
    """What prepare_splits needs of a task (trainer.tasks.base.Task has it all)."""

    @property
    def name(self) -> str: ...

    def config_name(self) -> str: ...

    def required_columns(self) -> list[str]: ...

    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]: ...

    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit: ...

    def cache_parts(self) -> dict[str, Any]: ...

    def check_split(self, split: TokenizedSplit, source: str) -> None: ...


def prepare_splits(config: DataConfig, tokenizer: Any, task: RowEncoder) -> PreparedData:
    """Load and encode both splits for `task`, reusing the on-disk cache when nothing changed.
    trainer.tasks.prepare_data is the usual way in (a task by name)."""
    keep = _named_columns(config, task)
    limit = config.max_row_mib * MIB
    train_table = read_table(config.train_file, config.train_split, keep, limit)
    eval_table = read_table(config.eval_file, config.eval_split, keep, limit)
    for table, (source, part) in (
        (train_table, (config.train_file, config.train_split)),
        (eval_table, (config.eval_file, config.eval_split)),
    ):
        for column in task.required_columns():
            if column not in table:
                raise DataError(
                    f"{source}: no column {column!r} (columns: "
                    f"{sorted(table_columns(source, part))}); {_column_setting(config, column)}"
                )
        if not any(len(values) for values in table.values()):
            raise DataError(f"{source}: no rows; the file is empty")
    label_names = task.label_names(train_table, config.train_file)
    splits = []
    for table, where in (
        (train_table, (config.train_file, config.train_split)),
        (eval_table, (config.eval_file, config.eval_split)),
    ):
        split = _tokenize_cached(config, tokenizer, table, where, label_names, task)
        task.check_split(split, where[0])
        splits.append(split)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # GPT-2-like tokenizers have none: pads are masked out, any id does
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return PreparedData(splits[0], splits[1], label_names, int(pad_id), task.config_name())


def _named_columns(config: DataConfig, task: RowEncoder) -> set[str]:
    """The columns a run reads: those the data settings name and those the task requires."""
    named = {
        getattr(config, f.name) for f in dataclasses.fields(config) if f.name.endswith("_column")
    }
    return {name for name in named if name is not None} | set(task.required_columns())


def _column_setting(config: DataConfig, column: str) -> str:
    """The data setting that names `column`, for a message that says what to set."""
    for field_ in dataclasses.fields(config):
        if field_.name.endswith("_column") and getattr(config, field_.name) == column:
            return f"set data.{field_.name}"
    return "check the data settings"


def _tokenize_cached(
    config: DataConfig,
    tokenizer: Any,
    table: dict[str, list[Any]],
    source: tuple[str, str],
    label_names: list[str],
    task: RowEncoder,
) -> TokenizedSplit:
    """`source` is (path, split); the split matters only for saved DatasetDict folders."""
    key = _cache_key(config, tokenizer, source, label_names, task.cache_parts())
    path = cache_dir(config) / key
    if path.is_dir():
        try:
            return load_split(path)
        except (OSError, ValueError):
            # A damaged entry is rebuilt below. Processes that map it keep their pages.
            shutil.rmtree(path, ignore_errors=True)
    save_split(task.encode(table, source[0], tokenizer, label_names), path)
    return load_split(path)


def tokenize_texts(
    tokenizer: Any, texts: list[str], pairs: list[str] | None, max_length: int
) -> TokenizedSplit:
    """Texts (or text pairs) tokenized and truncated to `max_length`, stored flat, no targets.
    Each text is cut first to what `max_length` tokens can reach (`hpo.trainer.text_window`)."""
    chars = window_chars(tokenizer, max_length)
    encoded = tokenizer(
        heads(texts, chars),
        None if pairs is None else heads(pairs, chars),
        truncation=True,
        max_length=max_length,
        padding=False,
        return_attention_mask=False,
    )
    return flat_split(encoded["input_ids"], encoded.get("token_type_ids"))


def cache_dir(config: DataConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    return hpo_cache_root() / "tokenized"


def _cache_key(
    config: DataConfig,
    tokenizer: Any,
    source: tuple[str, str],
    label_names: list[str],
    task_parts: dict[str, Any],
) -> str:
    digest = hashlib.sha256()
    parts = {
        "version": CACHE_FORMAT_VERSION,
        # Hashed once per version of the file (trainer.digests); the study's record reuses it.
        "data": content_sha256(Path(source[0])),
        "split": source[1],
        "columns": [config.text_column, config.text_pair_column, config.label_column],
        "max_length": config.max_length,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "labels": label_names,
        "task": task_parts,
    }
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything that decides the token ids: the full tokenizer definition."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        # Calling the tokenizer sets these; max_length is part of the cache key on its own.
        definition.pop("truncation", None)
        definition.pop("padding", None)
    else:
        definition = tokenizer.get_vocab()
    text = f"{type(tokenizer).__name__}\n{json.dumps(definition, sort_keys=True)}"
    return hashlib.sha256(text.encode()).hexdigest()
