"""Tokenized examples into optimizer steps: length-grouped steps split into balanced
micro-batches, evaluation batches in length order, and dynamic padding into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpo.trainer.data import TokenizedSplit

# Steps per shuffled pool that is sorted by length before it is cut into steps.
STEPS_PER_LENGTH_POOL = 16


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
