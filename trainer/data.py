"""Tokenized data: a split's token ids, offsets and targets stored flat (`TokenizedSplit`), both
splits of a run (`PreparedData`), and a split's folder of .npy files, which the token cache
writes and every process of a host memory-maps.

Reading files is `hpo.trainer.readers`, labels `hpo.trainer.labels`, tokenization and its cache
`hpo.trainer.token_cache`, steps and padding `hpo.trainer.batching`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


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
            return (load_split, (self.cached_at,))
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


# Each array of a split, with the types it may have (the first for ids, offsets and type ids).
_SPLIT_ARRAYS: dict[str, tuple[type, ...]] = {
    "ids": (np.int32,),
    "offsets": (np.int64,),
    "type_ids": (np.int8,),
    "labels": (np.int64, np.float32),
    "token_labels": (np.int64,),
}
_OPTIONAL_ARRAYS = ("type_ids", "labels", "token_labels")


def save_split(split: TokenizedSplit, path: Path) -> None:
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


def load_split(path: Path) -> TokenizedSplit:
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
