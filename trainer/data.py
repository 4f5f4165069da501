"""Labelled text in, padded tensors out: table loading, label mapping, cached tokenization,
length-grouped optimizer steps split into balanced micro-batches, and dynamic padding.

What a row's target is (a class, a number, a tag per word) is the task's to say
(`trainer.tasks`); this module stores and batches whatever it encoded.
"""

from __future__ import annotations

import csv
import dataclasses
import decimal
import hashlib
import json
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.digests import content_sha256, hpo_cache_root
from trainer.errors import DataError
from trainer.text_window import heads, window_chars

CACHE_FORMAT_VERSION = 3  # 3: targets of any task; 2: a folder of .npy files; 1: one .npz
# Steps per shuffled pool that is sorted by length before it is cut into steps.
STEPS_PER_LENGTH_POOL = 16


@dataclass
class TokenizedSplit:
    """Variable-length token ids stored flat, with per-example offsets, and the targets: one
    per example (`labels`) or one per token (`token_labels`), as the task encoded them."""

    ids: np.ndarray  # int32, all examples concatenated
    offsets: np.ndarray  # int64, examples + 1
    type_ids: np.ndarray | None  # int8, same layout as ids, for models with segment embeddings
    # Per example: int64 class ids, float32 numbers, or float32 multi-hot rows [examples, labels].
    labels: np.ndarray | None
    # Per token, same layout as ids: int64 targets, -100 where a token counts for nothing.
    token_labels: np.ndarray | None = None
    # The cache entry these arrays are memory-mapped from, if any. A split from the cache is
    # pickled (to a trial process) as this path alone: the receiver maps the same files, so
    # the pages are shared by every process of the host instead of copied into each.
    cached_at: Path | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __reduce__(self) -> tuple[Any, ...]:
        if self.cached_at is not None and self.cached_at.is_dir():
            return (_load_split, (self.cached_at,))
        arrays = (self.ids, self.offsets, self.type_ids, self.labels, self.token_labels)
        # Copies: a memory-mapped array whose files are gone pickles as plain data.
        return (TokenizedSplit, tuple(None if a is None else np.asarray(a) for a in arrays))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class PreparedData:
    """Both splits, tokenized, and the names of the model's outputs in id order (classes,
    tags; none where the task's outputs have no names)."""

    train: TokenizedSplit
    eval: TokenizedSplit
    label_names: list[str]
    pad_token_id: int
    task: str = "sequence_classification"

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def with_eval_in_training(data: PreparedData) -> PreparedData:
    """Train on both splits (a final model trained on every labelled example); the evaluation
    split stays as it is, so its metric is no longer a held-out one."""
    train, held = data.train, data.eval

    def joined_array(name: str) -> np.ndarray | None:
        first, second = getattr(train, name), getattr(held, name)
        return None if first is None or second is None else np.concatenate([first, second])

    joined = TokenizedSplit(
        ids=np.concatenate([train.ids, held.ids]),
        offsets=np.concatenate([train.offsets, held.offsets[1:] + train.offsets[-1]]),
        type_ids=joined_array("type_ids"),
        labels=joined_array("labels"),
        token_labels=joined_array("token_labels"),
    )
    return dataclasses.replace(data, train=joined)


# -- reading tables ------------------------------------------------------------------------------


MIB = 2**20
# A CSV wider than Excel's widest sheet (16,384 columns) is no table of texts: refused before a
# row is read, since every row is parsed into as many fields as the header has.
MAX_CSV_COLUMNS = 16_384


def read_table(
    path: str,
    split: str,
    keep: Collection[str] | None = None,
    max_row_bytes: int = 16 * MIB,
) -> dict[str, list[Any]]:
    """Columns of a CSV, JSONL, Parquet file or `save_to_disk` folder, as lists: those named in
    `keep` (the others are never stored), or all. A CSV row or JSONL line longer than
    `max_row_bytes` is refused before it is read whole."""
    location = Path(path)
    if not location.exists():
        raise DataError(f"data file {path} not found; check data.train_file / data.eval_file")
    try:
        return _read_location(location, split, keep, max_row_bytes)
    except DataError:
        raise
    except UnicodeDecodeError as e:
        raise DataError(f"cannot read {path}: {_undecodable_line(location)}") from e
    except (OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"cannot read {path}: {reason}; is it a valid {location.suffix} file?"
        ) from e


def _read_location(
    location: Path, split: str, keep: Collection[str] | None, max_row_bytes: int
) -> dict[str, list[Any]]:
    if location.is_dir():
        table = _read_saved_dataset(location, split)
    elif location.suffix.lower() == ".csv":
        return _read_csv(location, keep, max_row_bytes)
    elif location.suffix.lower() in (".jsonl", ".json"):
        table = _read_jsonl(location, max_row_bytes)
    elif location.suffix.lower() == ".parquet":
        table = _read_parquet(location)
    else:
        raise DataError(
            f"data file {location} has an unsupported format; use .csv, .jsonl, .parquet "
            "or a folder written by datasets' save_to_disk"
        )
    return table if keep is None else {k: v for k, v in table.items() if k in keep}


def table_columns(path: str, split: str) -> list[str]:
    """Every column of a data file, for a message that lists them (of a CSV, its header)."""
    location = Path(path)
    if location.suffix.lower() == ".csv" and location.is_file():
        with location.open(newline="", encoding="utf-8-sig") as handle:
            lines = _WatchedLines(handle, location, _CSV_FIELD_LIMIT)
            return _csv_names(next(lines.rows(csv.reader(lines)), None), location)
    return list(read_table(path, split))


# A CSV field may be a whole document: csv's own limit (128 KiB) would refuse it.
_CSV_FIELD_LIMIT = 2**31 - 1


def _read_csv(path: Path, keep: Collection[str] | None, max_row_bytes: int) -> dict[str, list[Any]]:
    """Every field as the text it is (a CSV holds only text; whole_number_labels reads numbers
    later). Blank lines are skipped, a short row's missing fields are empty, a column with no
    name is called "Unnamed: N" (as pandas names it). Read with the csv module: importing
    pandas cost every worker one to three seconds of CPU. With `keep`, only those columns are
    stored: a header of thousands of columns costs no more than the row that holds it."""
    csv.field_size_limit(_CSV_FIELD_LIMIT)
    with path.open(newline="", encoding="utf-8-sig") as handle:
        lines = _WatchedLines(handle, path, max_row_bytes)
        reader = csv.reader(lines)
        rows = lines.rows(reader)
        try:
            names = _csv_names(next(rows, None), path)
            kept = [(i, name) for i, name in enumerate(names) if keep is None or name in keep]
            columns: dict[str, list[Any]] = {name: [] for _, name in kept}
            too_wide: tuple[int, int] | None = None  # the first row with more fields than names
            for row, values in enumerate(rows, start=1):
                if len(values) > len(names) and too_wide is None:
                    too_wide = (row, len(values))
                for index, name in kept:  # a short row's missing fields are empty
                    columns[name].append(values[index] if index < len(values) else "")
        except csv.Error as e:
            raise DataError(f"cannot read {path}: {e} (line {reader.line_num})") from e
    if lines.ended_inside_a_row:
        raise DataError(
            f"{path}: the quoted field that starts on line {lines.row_start} is never closed; "
            'close its quote, and write a quote inside a quoted text as two ("")'
        )
    if too_wide is not None:
        raise DataError(
            f"{path}: row {too_wide[0]} has {too_wide[1]} fields, the header "
            f"{len(names)}; quote a text that holds a comma"
        )
    return columns


def _csv_names(header: list[str] | None, path: Path) -> list[str]:
    """A CSV's column names from its header row, checked."""
    if header is None:
        raise DataError(
            f"{path} is empty: a CSV file starts with a header row that "
            "names its columns (text,label, say)"
        )
    _check_csv_header(header, path)
    return [name if name else f"Unnamed: {index}" for index, name in enumerate(header)]


def _check_csv_header(header: list[str], path: Path) -> None:
    if len(header) == 1 and "\t" in header[0]:  # one column can hold no text and label anyway
        raise DataError(
            f"{path}: the header is one column, {header[0][:80]!r}, with tabs in it: the file is "
            "tab-separated (TSV); hpo reads .csv files separated by commas: convert it to CSV "
            "or to .jsonl"
        )
    if len(header) > MAX_CSV_COLUMNS:
        raise DataError(
            f"{path}: the header has {len(header):,} columns, more than hpo reads "
            f"({MAX_CSV_COLUMNS:,}); keep the text and label columns (and what the task reads)"
        )
    _check_unique_columns(header, path)


class _WatchedLines:
    """A CSV file's lines as csv.reader takes them, noting whether the file ended inside a row
    (a quoted field left open: csv.reader would return the rest of the file as that field),
    and refusing a row longer than `max_row_bytes` before more of it is read."""

    def __init__(self, handle: Any, path: Path, max_row_bytes: int) -> None:
        self._handle = handle
        self._path = path
        self._max_row_bytes = max_row_bytes
        self._line = 0
        self._taken = 0  # lines the reader took since it returned its last row
        self._row_bytes = 0  # their length
        self._rows = 0  # rows returned, the header included
        self.row_start = 1  # the line where the row being read began
        self.ended_inside_a_row = False

    def __iter__(self) -> _WatchedLines:
        return self

    def __next__(self) -> str:
        # At most one character past the limit: a character is at least a byte.
        line: str = self._handle.readline(self._max_row_bytes + 1)
        if not line:
            if self._taken > 0:  # asked for more lines to end a row: no more came
                self.ended_inside_a_row = True
            raise StopIteration
        self._line += 1
        if self._taken == 0:
            self.row_start = self._line
            self._row_bytes = 0
        self._taken += 1
        self._row_bytes += utf8_length(line)
        if self._row_bytes > self._max_row_bytes:
            raise row_too_long(self._path, self._where(), self._max_row_bytes)
        return line

    def _where(self) -> str:
        row = f"row {self._rows}" if self._rows else "the header"
        return f"{row} (from line {self.row_start})"

    def rows(self, reader: Any) -> Iterator[list[str]]:
        """The reader's rows, blank lines left out (a line of spaces too, as pandas did). A
        quoted empty field ("") is a row: the empty text of a one-column file, as csv writes it."""
        for values in reader:
            self._taken = 0
            if values and not (len(values) == 1 and values[0].isspace()):
                self._rows += 1
                yield values


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8 (an ASCII text's length is its size: no copy to count it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def row_too_long(path: Path, where: str, max_row_bytes: int) -> DataError:
    return DataError(
        f"{path}: {where} is longer than {max_row_bytes / MIB:g} MiB (data.max_row_mib), so it "
        "is not read: no max_length uses a text that long; shorten or drop it, or raise "
        "data.max_row_mib"
    )


def _read_parquet(path: Path) -> dict[str, list[Any]]:
    import pyarrow.parquet as pq

    _check_unique_columns(pq.read_schema(path).names, path)
    return dict(pq.read_table(path).to_pydict())


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json.loads would keep the last silently)."""
    row: dict[str, Any] = {}
    for key, value in pairs:
        if key in row:
            raise _RepeatedKey(key)
        row[key] = value
    return row


def _read_jsonl(path: Path, max_row_bytes: int) -> dict[str, list[Any]]:
    """One JSON object per line; a key missing from a row reads as None."""
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        # At most one character past the limit: a character is at least a byte.
        lines = iter(lambda: handle.readline(max_row_bytes + 1), "")
        for number, line in enumerate(lines, start=1):
            if utf8_length(line) > max_row_bytes:
                raise row_too_long(path, f"line {number}", max_row_bytes)
            if line.strip():
                rows.append(_json_row(line, number, path))
    names = dict.fromkeys(key for row in rows for key in row)
    return {name: [row.get(name) for row in rows] for name in names}


def _json_row(line: str, number: int, path: Path) -> dict[str, Any]:
    try:
        row = json.loads(line, object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise DataError(
            f"{path}: line {number} has the key {e.key!r} more than once; "
            "give each column its own name"
        ) from e
    except json.JSONDecodeError as e:
        raise DataError(
            f"cannot read {path}: line {number} is not valid JSON ({e.msg}); "
            "a .jsonl file holds one JSON object per line"
        ) from e
    if not isinstance(row, dict):
        raise DataError(f"{path}: line {number} is not a JSON object; write one object per row")
    return row


def _check_unique_columns(names: list[str], path: Path) -> None:
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise DataError(
            f"{path}: column names {repeated} appear more than once; give each column its own "
            "name (or drop the extra ones)"
        )


def _undecodable_line(path: Path) -> str:
    """Where a text file stops being UTF-8, for a message the user can act on."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (
                    f"line {number} is not valid UTF-8 (byte 0x{line[e.start]:02x} at column "
                    f"{e.start + 1}); save the file as UTF-8"
                )
    return "it is not valid UTF-8; save the file as UTF-8"


def _read_saved_dataset(folder: Path, split: str) -> dict[str, list[Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(
            f"{folder} is a folder but not one written by datasets' save_to_disk"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"{folder} has splits {sorted(loaded)}, not {split!r}; "
                "set data.train_split / data.eval_split"
            )
        loaded = loaded[split]
    return dict(loaded.to_dict())


# -- labels and texts ----------------------------------------------------------------------------


def label_vocabulary(raw_labels: list[Any], source: str, column: str = "label") -> list[str]:
    """Label names in id order: distinct integers in increasing order, or distinct strings
    sorted. An integer label is named by its value as a string and its id is its rank, so
    labels {0, 200000000} are two classes, not 200000001. Labels of mixed types (1 and "pos",
    1 and True) or fractional numbers are refused, not turned into extra classes."""
    _check_no_missing(raw_labels, source)
    raw_labels = whole_number_labels(raw_labels)
    kinds = _label_kinds(raw_labels, source, column)
    if kinds == {"integer"}:
        names = [str(value) for value in sorted({int(v) for v in raw_labels})]
    else:
        names = sorted({label_name(v) for v in raw_labels})
    if len(names) < 2:
        raise DataError(
            f"{source}: every row of column {column!r} has the label {names[0]!r}; a classifier "
            "needs at least two classes: add examples of another label or set data.label_column"
        )
    return names


def label_name(value: Any) -> str:
    """A label's class name: 7, 7.0 and "7" are all "7"."""
    if _label_kind(value) == "integer":
        return str(int(value))
    return str(value)


_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+(\.0+)?")


def whole_number_labels(raw_labels: list[Any]) -> list[Any]:
    """A column whose every label is text written as a whole number ("1", "1.0": a CSV holds
    only text) holds those numbers, as a JSONL or Parquet column of them would: "1" and "1.0"
    are one class, ranked as numbers. Any other column is left as it is (codes such as "1",
    "2" and "other", or "1.5", stay class names)."""
    texts = [v.strip() for v in raw_labels if isinstance(v, str)]
    if len(texts) != len(raw_labels) or not all(_WHOLE_NUMBER.fullmatch(t) for t in texts):
        return raw_labels
    return [int(decimal.Decimal(t)) for t in texts]


def _label_kind(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "boolean"
    if isinstance(value, (int, np.integer)):
        return "integer"
    if isinstance(value, (float, np.floating)):
        return "integer" if float(value).is_integer() else "fractional"
    return "string"


def _label_kinds(raw_labels: list[Any], source: str, column: str) -> set[str]:
    first: dict[str, tuple[int, Any]] = {}
    for row, value in enumerate(raw_labels, start=1):
        kind = _label_kind(value)
        first.setdefault(kind, (row, value))
    if "fractional" in first:
        row, value = first["fractional"]
        raise DataError(
            f"{source}: row {row} of column {column!r} has the label {value!r}, a fractional "
            "number; hpo trains classifiers: labels must be class names or integers"
        )
    if len(first) > 1:
        seen = ", ".join(f"{value!r} (row {row}, {kind})" for kind, (row, value) in first.items())
        raise DataError(
            f"{source}: column {column!r} mixes label types: {seen}; give every label the same "
            "type (all strings or all integers)"
        )
    return set(first)


def encode_labels(raw_labels: list[Any], label_names: list[str], source: str) -> np.ndarray:
    _check_no_missing(raw_labels, source)
    index = {name: i for i, name in enumerate(label_names)}
    names = [label_name(v) for v in whole_number_labels(raw_labels)]
    unknown = sorted(set(names) - set(index))
    if unknown:
        raise DataError(
            f"{source}: labels {unknown[:5]} never appear in the training data "
            f"(training labels: {label_names[:10]}); fix the data or add examples of them"
        )
    return np.array([index[name] for name in names], dtype=np.int64)


def _check_no_missing(values: list[Any], source: str) -> None:
    for row, value in enumerate(values, start=1):
        if value is None or value == "":
            raise DataError(f"{source}: row {row} has no label; fill it in or drop the row")
        if isinstance(value, float) and np.isnan(value):  # JSON's NaN, a float column's
            raise DataError(
                f"{source}: row {row} has the label NaN, which names no class; give its class "
                "or drop the row"
            )


def text_column(table: dict[str, list[Any]], column: str, source: str, key: str) -> list[str]:
    if column not in table:
        raise DataError(
            f"{source}: no column {column!r} (columns: {sorted(table)}); set data.{key}"
        )
    texts = table[column]
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise DataError(f"{source}: row {row + 1} of column {column!r} is not text: {text!r}")
    return texts


# -- tokenization with an on-disk cache ----------------------------------------------------------


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
            return _load_split(path)
        except (OSError, ValueError):
            # A damaged entry is rebuilt below. Processes that map it keep their pages.
            shutil.rmtree(path, ignore_errors=True)
    _save_split(task.encode(table, source[0], tokenizer, label_names), path)
    return _load_split(path)


def tokenize_texts(
    tokenizer: Any, texts: list[str], pairs: list[str] | None, max_length: int
) -> TokenizedSplit:
    """Texts (or text pairs) tokenized and truncated to `max_length`, stored flat, no targets.
    Each text is cut first to what `max_length` tokens can reach (`trainer.text_window`)."""
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


def flat_split(
    input_ids: list[list[int]], token_type_ids: list[list[int]] | None
) -> TokenizedSplit:
    """Per-example token id lists stored flat, with their offsets."""
    lengths = np.fromiter((len(x) for x in input_ids), dtype=np.int64, count=len(input_ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter((t for x in input_ids for t in x), dtype=np.int32, count=int(offsets[-1]))
    type_ids = None
    if token_type_ids is not None:
        flat = (t for x in token_type_ids for t in x)
        type_ids = np.fromiter(flat, dtype=np.int8, count=int(offsets[-1]))
    return TokenizedSplit(ids, offsets, type_ids, None)


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


# Each array of a split, with the types it may have (the first for ids, offsets and type ids).
_SPLIT_ARRAYS: dict[str, tuple[type, ...]] = {
    "ids": (np.int32,),
    "offsets": (np.int64,),
    "type_ids": (np.int8,),
    "labels": (np.int64, np.float32),
    "token_labels": (np.int64,),
}
_OPTIONAL_ARRAYS = ("type_ids", "labels", "token_labels")


def _save_split(split: TokenizedSplit, path: Path) -> None:
    """One .npy file per array in a folder that appears whole (written aside, then renamed),
    so concurrent workers never read a half-written entry; the first writer's entry stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        for name, dtypes in _SPLIT_ARRAYS.items():
            array = getattr(split, name)
            if array is not None:
                if array.dtype not in dtypes:
                    array = np.asarray(array, dtype=dtypes[0])
                np.save(aside / f"{name}.npy", array)
        try:
            aside.rename(path)
        except OSError:
            if not path.is_dir():  # not another worker's entry, written first: a real failure
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _load_split(path: Path) -> TokenizedSplit:
    """A cache entry, memory-mapped read-only; ValueError when its files do not fit together."""
    arrays: dict[str, np.ndarray | None] = {}
    for name, dtypes in _SPLIT_ARRAYS.items():
        file = path / f"{name}.npy"
        if name in _OPTIONAL_ARRAYS and not file.exists():
            arrays[name] = None
            continue
        array = np.load(file, mmap_mode="r", allow_pickle=False)
        if array.dtype not in dtypes or not 1 <= array.ndim <= (2 if name == "labels" else 1):
            raise ValueError(f"{file}: {array.dtype}[{array.ndim}d], not a {name} array")
        arrays[name] = array
    ids, offsets, type_ids, labels, token_labels = (arrays[name] for name in _SPLIT_ARRAYS)
    assert ids is not None and offsets is not None
    if offsets[0] != 0 or offsets[-1] != len(ids):
        raise ValueError(f"{path}: offsets do not match ids")
    if labels is not None and len(labels) != len(offsets) - 1:
        raise ValueError(f"{path}: labels do not match offsets")
    for name, array in (("type_ids", type_ids), ("token_labels", token_labels)):
        if array is not None and len(array) != len(ids):
            raise ValueError(f"{path}: {name} do not match ids")
    return TokenizedSplit(ids, offsets, type_ids, labels, token_labels, cached_at=path)


# -- batching ------------------------------------------------------------------------------------


def split_micro_batches(indices: np.ndarray, grad_accum_steps: int) -> list[np.ndarray]:
    """Balanced micro-batches: sizes differ by at most one, none empty."""
    parts = min(grad_accum_steps, len(indices))
    return [part for part in np.array_split(indices, parts) if len(part)]


def plan_epoch(
    lengths: np.ndarray, effective_batch_size: int, grad_accum_steps: int, seed: int, epoch: int
) -> list[list[np.ndarray]]:
    """Optimizer steps of one epoch, each a list of micro-batches of example indices.

    Examples are shuffled, sorted by length within pools of STEPS_PER_LENGTH_POOL steps and cut
    into steps, so each step pads little; the order of steps is then shuffled across the epoch.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    pool = effective_batch_size * STEPS_PER_LENGTH_POOL
    steps: list[np.ndarray] = []
    for start in range(0, len(order), pool):
        chunk = order[start : start + pool]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        steps.extend(
            chunk[i : i + effective_batch_size] for i in range(0, len(chunk), effective_batch_size)
        )
    rng.shuffle(steps)
    return [split_micro_batches(step, grad_accum_steps) for step in steps]


def eval_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Evaluation in length order: the least padding, deterministic."""
    order = np.argsort(lengths, kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@dataclass(frozen=True)
class Padding:
    """How wide a batch is padded: its longest example, rounded up to `multiple` (8 feeds
    tensor cores), or with `buckets` to the next of 32, 48, 64, 96, 128, 192, ... (two widths per
    octave, at most a third of padding): a compiled model then sees a handful of shapes, so its
    recompiles are few and bounded. Never wider than `cap` (the data's max_length)."""

    multiple: int = 1
    buckets: bool = False
    cap: int | None = None

    def width(self, longest: int) -> int:
        if self.buckets:
            width = 32
            while width < longest:
                width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
        else:
            width = -(-longest // self.multiple) * self.multiple
        return max(longest, min(width, self.cap)) if self.cap is not None else width


class BatchCollator(torch.utils.data.Dataset):
    """`dataset[indices]` is one dynamically padded batch, so DataLoader workers do the padding."""

    def __init__(self, split: TokenizedSplit, pad_token_id: int, padding: Padding) -> None:
        self.split = split
        self.pad_token_id = pad_token_id
        self.padding = padding

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, indices: Any) -> dict[str, torch.Tensor]:
        return collate(self.split, np.asarray(indices), self.pad_token_id, self.padding)


def collate(
    split: TokenizedSplit, indices: np.ndarray, pad_token_id: int, padding: Padding = Padding()
) -> dict[str, torch.Tensor]:
    starts, ends = split.offsets[indices], split.offsets[indices + 1]
    lengths = ends - starts
    width = padding.width(int(lengths.max()))
    input_ids = np.full((len(indices), width), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(indices), width), dtype=np.int64)
    type_ids = (
        np.zeros((len(indices), width), dtype=np.int64) if split.type_ids is not None else None
    )
    token_labels = split.token_labels
    labels = (
        np.full((len(indices), width), -100, dtype=np.int64)
        if token_labels is not None
        else np.asarray(split.labels)[indices]
    )
    for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
        n = end - start
        input_ids[row, :n] = split.ids[start:end]
        mask[row, :n] = 1
        if type_ids is not None and split.type_ids is not None:
            type_ids[row, :n] = split.type_ids[start:end]
        if token_labels is not None:
            labels[row, :n] = token_labels[start:end]
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }
    if type_ids is not None:
        batch["token_type_ids"] = torch.from_numpy(type_ids)
    return batch
