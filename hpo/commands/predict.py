"""`hpo predict` and `hpo.load_model`: a saved model (a final model of hpo retrain, a kept trial's
model, a LoRA adapter, a soup) answers the rows of a CSV or JSONL file in the training data's
shape. The file is read and the answers written in chunks (memory bounded on any number of
rows); the answers go to a file beside --out, renamed in at the end: never half a file.
The forward itself is trainer.inference's.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from hpo.errors import DataError, HPOError

if TYPE_CHECKING:
    import torch

    from hpo.trainer.inference import Predictor

log = logging.getLogger("hpo")

SUFFIXES = (".csv", ".jsonl")
ROW_ID = "row"  # the id column without --id-column: the row's number, from 1
CHUNK_BATCHES = 8  # batches read at once: sorted by length within them, so they pad little
_CSV_FIELD_LIMIT = 2**31 - 1  # a CSV field may be a whole document
MULTI_LABEL_THRESHOLD = 0.5  # a stacked multi-label ensemble says a label from this probability


@dataclass(frozen=True)
class PredictRequest:
    """`hpo predict --model DIR --input FILE --out FILE`."""

    model: str
    input: str
    out: str
    id_column: str | None = None
    batch_size: int = 32
    device: str = "auto"
    quiet: bool = False


class Model:
    """A saved model, loaded: `predict(rows)` answers each row (a dict holding the text columns
    its training data had) with a dict: `label` and `probabilities` (a classifier), `labels` over
    the threshold and `probabilities` (multi-label), `value` (regression), `tags` and `scores`,
    one per word (token classification).

        model = hpo.load_model("hpo-final-demo")
        model.predict([{"text": "a lovely meal"}])  # [{"label": "pos", "probabilities": ...}]
    """

    def __init__(self, predictor: Predictor) -> None:
        self._predictor = predictor

    @property
    def task(self) -> str:
        """The model's task: sequence_classification, multi_label_classification, regression
        or token_classification."""
        return self._predictor.settings.task

    @property
    def labels(self) -> list[str]:
        """The names of its outputs in id order (classes, tags); [] for regression."""
        return list(self._predictor.labels)

    @property
    def columns(self) -> list[str]:
        """The columns each row must hold: the text column (and the pair's)."""
        return self._predictor.settings.columns

    @property
    def label_separator(self) -> str:
        return self._predictor.settings.label_separator

    def predict(self, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each row's prediction, in the rows' order (in batches: any number of rows)."""
        return list(self.answers(rows))

    def answers(self, rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Each row's prediction as the rows are read (a chunk at a time)."""
        return predict_rows(self._predictor, rows)

    def __repr__(self) -> str:
        return f"<hpo model {self._predictor.folder} ({self.task}, {len(self.labels)} labels)>"


def load_model(
    folder: str | os.PathLike[str], *, device: str = "auto", batch_size: int = 32, flag: str = ""
) -> Model:
    """The model saved in `folder`; HPOError (ModelError) in one line when it is none. `flag`:
    how messages name `folder` (--model)."""
    from hpo.trainer.device import resolve_device
    from hpo.trainer.inference import Predictor

    where = Path(folder)
    named = f"{flag} {where}" if flag else f"model folder {where}"
    if not where.is_dir():
        what = "is a file" if where.exists() else "does not exist"
        raise HPOError(
            f"{named} {what}; give the folder hpo retrain --out or hpo best --download wrote"
        )
    if batch_size < 1:
        raise HPOError(f"batch_size {batch_size}: give a whole number of rows, at least 1")
    if (where / "ensemble.json").is_file():
        return EnsembleModel(where, resolve_device(device, "--device"), batch_size)
    return Model(Predictor(where, resolve_device(device, "--device"), batch_size))


def predict_rows(predictor: Predictor, rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each row's prediction, reading `rows` a chunk at a time (CHUNK_BATCHES batches): no more
    than a chunk is held, however many rows come."""
    chunk_rows = predictor.batch_size * CHUNK_BATCHES
    source = iter(rows)
    first = 1
    while True:
        chunk = [row for _, row in zip(range(chunk_rows), source, strict=False)]
        if not chunk:
            return
        yield from predictor.predict(chunk, first_row=first)
        first += len(chunk)


def predict_command(request: PredictRequest) -> int:
    """`hpo predict`: checks first (the files, then the model), then the rows streamed."""
    source, out = Path(request.input), Path(request.out)
    check_files(source, out)
    started = time.perf_counter()
    model = load_model(
        request.model, device=request.device, batch_size=request.batch_size, flag="--model"
    )
    try:
        with input_rows(source) as (columns, rows):
            _check_columns(columns, model, request.id_column, source)
            id_name = request.id_column or ROW_ID
            count = _write_aside(out, _with_ids(rows, request.id_column), id_name, model)
    except DataError as e:  # a row that cannot be read or predicted: said with the file's name
        raise DataError(f"--input {source}: {e}") from e
    seconds = time.perf_counter() - started
    if not request.quiet:
        print(f"hpo: {count} predictions of {model.task} in {out} ({seconds:.1f} s)")
    return 0


def check_files(source: Path, out: Path) -> None:
    """--input a CSV or JSONL file that is there, --out one to write in a folder that is."""
    if source.suffix.lower() not in SUFFIXES:
        raise HPOError(f"--input {source}: unknown kind of file; give a .csv or .jsonl file")
    if not source.is_file():
        raise HPOError(f"--input {source}: no such file")
    if out.suffix.lower() not in SUFFIXES:
        raise HPOError(f"--out {out}: name a .csv or .jsonl file (its suffix picks the format)")
    if not out.parent.is_dir():
        raise HPOError(f"--out {out}: no such folder {str(out.parent)!r}; create it first")
    if out.exists() and not out.is_file():
        raise HPOError(f"--out {out}: exists and is not a file; name a file to write")
    if out.exists() and out.resolve() == source.resolve():
        raise HPOError(f"--out {out} is the --input file; name another file")


# -- the input, a row at a time -----------------------------------------------------------------


@contextlib.contextmanager
def input_rows(source: Path) -> Iterator[tuple[list[str] | None, Iterator[dict[str, Any]]]]:
    """The file's column names (a CSV's header, a JSONL file's first object's keys) and its
    rows, read as they are asked for."""
    is_csv = source.suffix.lower() == ".csv"
    with source.open(newline="" if is_csv else None, encoding="utf-8-sig") as handle:
        if is_csv:
            csv.field_size_limit(_CSV_FIELD_LIMIT)
            reader = csv.DictReader(handle)
            with _utf8_only():
                header = list(reader.fieldnames or [])
            yield header, _csv_rows(reader)
        else:
            rows = _jsonl_rows(handle)
            first = next(rows, None)
            columns = list(first) if first is not None else None  # no rows: none to check
            yield columns, _chained(first, rows)


@contextlib.contextmanager
def _utf8_only() -> Iterator[None]:
    try:
        yield
    except UnicodeDecodeError as e:
        raise DataError(
            f"not UTF-8 text (byte {e.object[e.start : e.start + 1]!r}); save the file as UTF-8"
        ) from e


def _csv_rows(reader: csv.DictReader) -> Iterator[dict[str, Any]]:
    try:
        with _utf8_only():
            yield from reader
    except csv.Error as e:
        raise DataError(f"{e} (line {reader.line_num})") from e


def _jsonl_rows(handle: IO[str]) -> Iterator[dict[str, Any]]:
    with _utf8_only():
        yield from _jsonl_objects(handle)


def _jsonl_objects(handle: IO[str]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        # ValueError: not JSON, or a number of 5,000 digits; RecursionError: [[[[... nested deep
        except (ValueError, RecursionError) as e:
            reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e).split(":")[0]
            raise DataError(
                f"line {number} is not valid JSON ({reason}); a .jsonl file holds one JSON "
                "object per line"
            ) from e
        if not isinstance(row, dict):
            raise DataError(f"line {number} is not a JSON object; write one per row")
        yield row


def _chained(first: dict[str, Any] | None, rest: Iterator[dict[str, Any]]) -> Iterator[dict]:
    if first is not None:
        yield first
        yield from rest


def _check_columns(
    columns: list[str] | None, model: Model, id_column: str | None, source: Path
) -> None:
    """The text columns the model reads (and --id-column) are in the file (None: a JSONL file
    of no rows)."""
    if columns is None:
        return
    has = ", ".join(repr(c) for c in columns) or "none"
    for column in model.columns:
        if column not in columns:
            raise HPOError(
                f"--input {source} has no column {column!r}, which the model reads its text "
                f"from (the file's columns: {has}); rename that column, or give rows shaped as "
                "the model's training data"
            )
    if id_column is not None and id_column not in columns:
        raise HPOError(
            f"--id-column {id_column!r}: no such column in {source} (its columns: {has})"
        )


def _with_ids(
    rows: Iterator[dict[str, Any]], id_column: str | None
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(id, row) of each row: --id-column's value, else the row's number."""
    for number, row in enumerate(rows, start=1):
        yield (row.get(id_column) if id_column is not None else number), row


# -- the output, written aside -------------------------------------------------------------------


def _write_aside(
    out: Path, rows: Iterator[tuple[Any, dict[str, Any]]], id_name: str, model: Model
) -> int:
    """Every row's prediction into a file beside `out`, renamed to `out` once whole; how many."""
    try:
        handle, aside = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise HPOError(f"--out {out}: cannot write there ({e.strerror or e})") from e
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as file:
            count = _write_rows(file, out, rows, id_name, model)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(aside, 0o666 & ~umask)  # as any new file, not mkstemp's owner-only mode
        os.replace(aside, out)
    except OSError as e:
        Path(aside).unlink(missing_ok=True)
        raise HPOError(f"--out {out}: cannot write it ({e.strerror or e})") from e
    except BaseException:  # a bad row, a stop: no half file stays
        Path(aside).unlink(missing_ok=True)
        raise
    return count


def _write_rows(
    file: IO[str],
    out: Path,
    rows: Iterator[tuple[Any, dict[str, Any]]],
    id_name: str,
    model: Model,
) -> int:
    """Each row's id and prediction as a JSONL line or a CSV row; how many rows."""
    ids: collections.deque[Any] = collections.deque()  # of the rows read, not yet answered

    def texts() -> Iterator[dict[str, Any]]:
        for row_id, row in rows:
            ids.append(row_id)
            yield row

    writer: csv.DictWriter | None = None
    count = 0
    for answer in model.answers(texts()):
        row_id = ids.popleft()
        count += 1
        if id_name in answer:
            raise HPOError(
                f"--id-column {id_name!r}: the predictions have a column of that name; "
                "rename the file's id column"
            )
        if out.suffix.lower() == ".jsonl":
            file.write(json.dumps({id_name: row_id, **answer}, ensure_ascii=False) + "\n")
            continue
        flat = {id_name: row_id, **flat_answer(answer, model.label_separator)}
        if writer is None:
            writer = csv.DictWriter(file, fieldnames=list(flat))
            writer.writeheader()
        writer.writerow(flat)
    if writer is None and out.suffix.lower() == ".csv":  # no rows: still a CSV, with a header
        csv.writer(file).writerow([id_name])
    return count


def flat_answer(answer: dict[str, Any], separator: str) -> dict[str, Any]:
    """A prediction as one CSV row, in the training data's shape: probabilities as a column per
    label (`probabilities.NAME`), labels joined by the label separator, tags by spaces."""
    flat: dict[str, Any] = {}
    for key, value in answer.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{name}": v for name, v in value.items()})
        elif isinstance(value, list):
            joiner = separator if key == "labels" else " "
            flat[key] = joiner.join("" if v is None else str(v) for v in value)
        else:
            flat[key] = value
    return flat


# -- a saved ensemble (ensemble.json): each member's forward, then the meta-learner ------------


def answers_array(answers: Sequence[dict[str, Any]], task: str, order: list[str]) -> np.ndarray:
    """Predictor answers as an array: probabilities [rows, classes] in `order`, or values."""
    import numpy as np

    if task == "regression":
        return np.asarray([a["value"] for a in answers], dtype=np.float64)
    if task not in ("sequence_classification", "multi_label_classification"):
        from hpo.ensemble import check_stackable

        check_stackable(task)
    return np.asarray(
        [[a["probabilities"][name] for name in order] for a in answers], dtype=np.float64
    ).reshape(len(answers), len(order))


class EnsembleModel(Model):
    """A stacked ensemble: `predict(rows)` answers as a single model of its task does."""

    def __init__(self, folder: Path, device: torch.device, batch_size: int = 32) -> None:
        from hpo.ensemble import load_ensemble
        from hpo.trainer.inference import Predictor

        self.folder = folder
        self.saved = load_ensemble(folder)
        self.predictors = {
            name: Predictor(path, device, batch_size) for name, path in self.saved.members.items()
        }
        super().__init__(next(iter(self.predictors.values())))
        for name, predictor in self.predictors.items():
            if sorted(predictor.labels) != sorted(self.labels):
                raise HPOError(
                    f"{folder}: member {name!r} predicts other classes than the first member; "
                    "build the ensemble again"
                )
        self._check_record()

    def _check_record(self) -> None:
        """The record says its members' task and outputs: an edited one would answer in another
        task's shape, or fail on the first row."""
        task, stacked = self.task, self.saved.model
        outputs = 1 if task == "regression" else len(self.labels)
        if (
            self.saved.task != task
            or (self.saved.kind == "average") != (task == "token_classification")
            or (stacked is not None and stacked.num_outputs != outputs)
        ):
            raise HPOError(
                f"{self.folder}: its record is not of its members ({task}, {outputs} outputs); "
                "build the ensemble again"
            )

    def answers(self, rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        stacked = self.saved.model
        first = self._predictor
        chunk_rows = first.batch_size * CHUNK_BATCHES
        source, start = iter(rows), 1
        while True:
            chunk = [row for _, row in zip(range(chunk_rows), source, strict=False)]
            if not chunk:
                return
            if self.saved.kind == "average":  # taggers: their word probabilities averaged
                yield from self._averaged_tags(chunk, start)
            elif stacked is None:  # the best member alone
                yield from first.predict(chunk, first_row=start)
            else:
                blended = self._blended(stacked, chunk, start)
                yield from (self._answer(row) for row in blended)
            start += len(chunk)

    def _blended(self, stacked: Any, chunk: list[dict[str, Any]], first_row: int) -> np.ndarray:
        features = self._features(stacked, chunk, first_row)
        try:
            return np.asarray(stacked.predict(features))
        # scikit-learn's "X has 6 features, but ... is expecting 9"; an estimator of the skops
        # file that is not a fitted learner of this task (a scaler, a string, other classes).
        except (ValueError, TypeError, AttributeError, IndexError) as e:
            raise HPOError(
                f"{self.folder}: its meta-learner does not read its members' features "
                f"({str(e).splitlines()[0][:200]}); build the ensemble again"
            ) from e

    def _averaged_tags(self, chunk: list[dict[str, Any]], first_row: int) -> list[dict[str, Any]]:
        """Each word's tag of the members' mean probabilities; None for the words max_length
        cut off (as a single tagger answers)."""
        import numpy as np

        from hpo.commands.features import row_words, word_probabilities

        mean = np.mean(
            [
                word_probabilities(p, chunk, self.labels, first_row)
                for p in self.predictors.values()
            ],
            axis=0,
        )
        kept = [len(words) for words in self._predictor._words(chunk, first_row)]
        column, at, answers = self._predictor.settings.text_column, 0, []
        for row, count in zip(chunk, kept, strict=True):
            n = len(row_words(row, column))
            rows = mean[at : at + n]
            at += n
            tags = [
                self.labels[int(np.argmax(r))] if i < count else None for i, r in enumerate(rows)
            ]
            scores = [float(np.max(r)) if i < count else None for i, r in enumerate(rows)]
            answers.append({"tags": tags, "scores": scores})
        return answers

    def _features(self, stacked: Any, chunk: list[dict[str, Any]], first_row: int) -> np.ndarray:
        """What the meta-learner reads: the members' probabilities (values), or their
        mean-pooled embeddings side by side; a forward per member."""
        from hpo.ensemble import stack_features

        if stacked.settings.kind == "embedding":
            from hpo.commands.features import member_embeddings, stacked_embeddings

            pooled = {
                name: member_embeddings(p, chunk, first_row) for name, p in self.predictors.items()
            }
            return stacked_embeddings(pooled, stacked.members)
        outputs = {
            name: answers_array(p.predict(chunk, first_row=first_row), self.task, self.labels)
            for name, p in self.predictors.items()
        }
        return stack_features(outputs, stacked.members)

    def _answer(self, outputs: np.ndarray) -> dict[str, Any]:
        import numpy as np

        if self.task == "regression":
            return {"value": float(np.asarray(outputs).reshape(-1)[0])}
        named = {name: float(p) for name, p in zip(self.labels, outputs, strict=True)}
        if self.task == "multi_label_classification":
            chosen = [n for n, p in named.items() if p >= MULTI_LABEL_THRESHOLD]
            return {"labels": chosen, "probabilities": named}
        return {"label": self.labels[int(np.argmax(outputs))], "probabilities": named}

    def __repr__(self) -> str:
        kind, count = self.saved.kind, len(self.predictors)
        return f"<hpo ensemble {self.folder} ({self.task}, {kind} of {count} members)>"
