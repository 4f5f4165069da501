"""A table's labels and texts, checked: the label vocabulary of a classifier (names in id order),
labels encoded as ids, and a text column read as text.
"""

from __future__ import annotations

import decimal
import re
from typing import Any

import numpy as np

from hpo.trainer.errors import DataError


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
