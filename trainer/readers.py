"""Data files in, columns out: CSV, JSONL, Parquet and `save_to_disk` folders read as lists per
column, with the checks that make a broken file one clear DataError (its line, what to fix).
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from hpo.trainer.errors import DataError

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
