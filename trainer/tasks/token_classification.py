"""Token classification: a tag per word (named entities in BIO / IOB2 tags); cross-entropy on
the first sub-token of each word; entity-level precision, recall and F1 as seqeval computes
them, and token accuracy.

A row is a list of words and a list of their tags, of equal length: JSON lists in JSONL and
Parquet, or one cell each of words and of tags separated by spaces in a CSV. Only the first
sub-token of a word carries its tag; the others, the special tokens and the words that
`max_length` cuts off count for nothing (IGNORE), in the loss and in every metric alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hpo.trainer.data import TokenizedSplit, flat_split
from hpo.trainer.errors import DataError
from hpo.trainer.tasks.base import IGNORE, TokenTask
from hpo.trainer.text_window import cut_words, window_chars

OUTSIDE = "O"  # the tag of a word in no entity


class TokenClassification(TokenTask):
    name = "token_classification"

    # -- data ----------------------------------------------------------------------------------

    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]:
        _, tags = self._rows(table, source)
        names = sorted({tag for row in tags for tag in row} | {OUTSIDE})
        if names == [OUTSIDE]:
            raise DataError(
                f"{source}: every tag in column {self.data.label_column!r} is 'O'; a tagger "
                "needs entities to learn: add rows with B-/I- tags or set data.label_column"
            )
        return names

    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit:
        words, tags = self._rows(table, source)
        tag_ids = _tag_ids(tags, label_names, source, self.data.label_column)
        # The words max_length can reach, before tokenizing: one huge row costs a full one.
        chars = window_chars(tokenizer, self.data.max_length)
        words = [cut_words(row_words, chars) for row_words in words]
        encoded = _tokenize_words(tokenizer, words, self.data.max_length, source)
        token_labels = [
            _first_sub_token_labels(encoded.word_ids(i), row_tags)
            for i, row_tags in enumerate(tag_ids)
        ]
        split = flat_split(encoded["input_ids"], encoded.get("token_type_ids"))
        split.token_labels = np.fromiter(
            (t for row in token_labels for t in row), dtype=np.int64, count=len(split.ids)
        )
        return split

    def check_split(self, split: TokenizedSplit, source: str) -> None:
        if split.token_labels is not None and not np.any(split.token_labels != IGNORE):
            raise DataError(
                f"{source}: no word keeps a token after truncation to data.max_length="
                f"{self.data.max_length}; raise data.max_length"
            )

    def _rows(
        self, table: dict[str, list[Any]], source: str
    ) -> tuple[list[list[str]], list[list[str]]]:
        """Every row's words and tags, checked: lists of text of one length, BIO-shaped tags."""
        text, label = self.data.text_column, self.data.label_column
        words = [
            _cell_list(value, source, row, text, "words")
            for row, value in enumerate(table[text], start=1)
        ]
        tags = [
            _cell_list(value, source, row, label, "tags")
            for row, value in enumerate(table[label], start=1)
        ]
        for row, (row_words, row_tags) in enumerate(zip(words, tags, strict=True), start=1):
            if len(row_words) != len(row_tags):
                raise DataError(
                    f"{source}: row {row} has {len(row_words)} words but {len(row_tags)} tags; "
                    "give every word exactly one tag"
                )
            for position, tag in enumerate(row_tags, start=1):
                if not _bio_shaped(tag):
                    raise DataError(
                        f"{source}: row {row}, tag {position} of column {label!r} is {tag!r}, "
                        "not a BIO tag; use 'O' or B-/I- and a type (B-PER, I-PER)"
                    )
        return words, tags

    # -- evaluation ----------------------------------------------------------------------------

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"predictions": logits.argmax(dim=-1)}

    def metrics(
        self, outputs: dict[str, list[np.ndarray]], eval_loss: float, label_names: list[str]
    ) -> dict[str, float]:
        truth: list[np.ndarray] = []
        predicted: list[np.ndarray] = []
        for batch_predictions, batch_labels in zip(
            outputs["predictions"], outputs["labels"], strict=True
        ):
            for row_predictions, row_labels in zip(batch_predictions, batch_labels, strict=True):
                counted = row_labels != IGNORE
                truth.append(row_labels[counted])
                predicted.append(row_predictions[counted])
        return {**tag_metrics(truth, predicted, label_names), "eval_loss": eval_loss}

    def chance_levels(self, split: TokenizedSplit, label_names: list[str]) -> dict[str, float]:
        """Tagging every word with the most common tag (entity F1 0 when that is 'O')."""
        if split.token_labels is None:
            return {}
        labels = np.asarray(split.token_labels)
        counts = np.bincount(labels[labels != IGNORE], minlength=len(label_names))
        if counts.sum() == 0:
            return {}
        majority = int(np.argmax(counts))
        truth = [labels[a:b][labels[a:b] != IGNORE] for a, b in _spans(split.offsets)]
        constant = [np.full_like(row, majority) for row in truth]
        shares = counts[counts > 0] / counts.sum()
        # the mean loss of answering the tags' frequencies: their entropy, in nats
        entropy = float(-np.sum(shares * np.log(shares)))
        return {**tag_metrics(truth, constant, label_names), "eval_loss": entropy}

    # -- the batch finder ----------------------------------------------------------------------


def tag_metrics(
    truth: list[np.ndarray], predicted: list[np.ndarray], label_names: list[str]
) -> dict[str, float]:
    """Entity-level precision, recall and F1 (seqeval's default mode: conlleval's rules, micro
    average over entity types) and token accuracy, over rows of tag ids."""
    from seqeval.metrics.sequence_labeling import precision_recall_fscore_support

    names = np.asarray(label_names, dtype=object)
    true_tags = [names[row].tolist() for row in truth]
    predicted_tags = [names[row].tolist() for row in predicted]
    # zero_division=0 is seqeval's "warn" without the warning: no entity predicted scores 0.
    precision, recall, f1, _ = precision_recall_fscore_support(
        true_tags, predicted_tags, average="micro", zero_division=0
    )
    tokens = sum(len(row) for row in truth)
    correct = sum(int(np.sum(t == p)) for t, p in zip(truth, predicted, strict=True))
    return {
        "f1": float(f1),
        "precision": float(precision),
        "recall": float(recall),
        "token_accuracy": correct / tokens if tokens else float("nan"),
    }


def _spans(offsets: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))


def _cell_list(value: Any, source: str, row: int, column: str, what: str) -> list[str]:
    """A cell's words or tags: a list of strings, or one string of them separated by spaces
    (a CSV cell). Refused: an empty cell, an empty item, an item that is not text."""
    if isinstance(value, str):
        items: list[Any] = value.split()
    elif isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
    else:
        items = []
        if value is not None and not (isinstance(value, float) and np.isnan(value)):
            raise DataError(
                f"{source}: row {row} of column {column!r} is {value!r}, not a list of {what}; "
                f"write a JSON list of strings, or in a CSV the {what} separated by spaces"
            )
    if not items:
        raise DataError(
            f"{source}: row {row} has no {what} in column {column!r}; fill it in or drop the row"
        )
    for position, item in enumerate(items, start=1):
        if not isinstance(item, str) or not item.strip():
            kind = "empty" if isinstance(item, str) else f"{item!r}, not text"
            raise DataError(
                f"{source}: row {row}, item {position} of column {column!r} is {kind}; "
                f"each of the {what} must be a non-empty string (tags by name: 'B-PER', not ids)"
            )
    return [str(item) for item in items]


def _bio_shaped(tag: str) -> bool:
    return tag == OUTSIDE or (tag[:2] in ("B-", "I-") and len(tag) > 2)


def _tag_ids(
    tags: list[list[str]], label_names: list[str], source: str, column: str
) -> list[list[int]]:
    index = {name: i for i, name in enumerate(label_names)}
    for row, row_tags in enumerate(tags, start=1):
        for position, tag in enumerate(row_tags, start=1):
            if tag not in index:
                known = [name for name in label_names if name != OUTSIDE][:10]
                raise DataError(
                    f"{source}: row {row}, tag {position} of column {column!r} is {tag!r}, "
                    f"which the training data never has (its tags: {known}); fix the tag or "
                    "add training rows with it"
                )
    return [[index[tag] for tag in row_tags] for row_tags in tags]


def _tokenize_words(tokenizer: Any, words: list[list[str]], max_length: int, source: str) -> Any:
    """The rows' words tokenized as given (no splitting of ours), truncated to `max_length`."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "token_classification needs a fast tokenizer (one that maps tokens to words); "
            f"{type(tokenizer).__name__} is not: set model.tokenizer to a model with a "
            "tokenizer.json"
        )
    try:
        return tokenizer(
            words,
            is_split_into_words=True,
            truncation=True,
            max_length=max_length,
            padding=False,
            return_attention_mask=False,
        )
    except ValueError as e:  # a tokenizer that refuses input split into words
        raise DataError(f"{source}: the tokenizer cannot take words: {e}") from e


def _first_sub_token_labels(word_ids: list[int | None], tag_ids: list[int]) -> list[int]:
    """Each word's tag on its first sub-token; IGNORE on the rest and on special tokens."""
    labels: list[int] = []
    previous: int | None = None
    for word in word_ids:
        labels.append(IGNORE if word is None or word == previous else tag_ids[word])
        previous = word
    return labels


TASK = TokenClassification
