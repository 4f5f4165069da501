"""The user's model factory (`model.factory: package.module:name`): what it is called with, and
what its model must give back. Any torch.nn.Module whose forward returns logits: a transformers
model, or a module of the user's returning an object or dict with `logits` (and perhaps a
`loss`, which hpo ignores: the task's loss trains), or a tuple `(loss, logits)` / `(logits,)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpo.trainer.config import ModelConfig, TrainingConfig


class ModelFactoryError(Exception):
    """The user's factory raised (its error is the cause) or returned what is not a module."""


class ModelOutputError(TypeError):
    """A model's forward returned what holds no logits."""


@dataclass(frozen=True)
class ModelRequest:
    """What a model factory is called with (`factory(request)`), one call per model hpo builds
    (each trial's, the batch finder's): build the model for these labels and settings, with
    freshly initialised weights (torch's seed is set before the call)."""

    label_names: list[str]  # the outputs' names in id order ([] for a regression's one number)
    num_labels: int  # how many outputs the head needs
    head: dict[str, Any]  # the task's head settings for a transformers config (num_labels, ...)
    vocab_size: int  # the tokenizer's: rows the token embeddings need
    max_length: int  # data.max_length: the longest input the model sees
    task: str  # the config's task: a built-in's name, or a task class by import path
    model: ModelConfig  # the trial's model settings (model.dropout sampled, name_or_path, config)
    training: TrainingConfig  # the trial's training settings (learning_rate sampled, seed)


def load_factory(spec: str) -> Callable[[ModelRequest], Any]:
    """The factory `spec` names (`package.module:name`; its module already importable)."""
    module_name, _, name = spec.partition(":")
    factory: Callable[[ModelRequest], Any] = getattr(importlib.import_module(module_name), name)
    return factory


def call_factory(spec: str, request: ModelRequest) -> torch.nn.Module:
    """The model the factory builds, checked: a torch.nn.Module. ModelFactoryError when it
    raises (the user's error its cause) or returns anything else."""
    factory = load_factory(spec)
    try:
        model = factory(request)
    except Exception as e:
        raise ModelFactoryError(f"{spec} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise ModelFactoryError(
            f"{spec} returned {type(model).__name__}; expected a torch.nn.Module (a transformers "
            "model, or a module whose forward returns logits: an object or dict with `logits`, "
            "or a tuple (loss, logits))"
        )
    return model


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's forward: `.logits` (transformers' ModelOutput), `["logits"]`, the
    last of a tuple `(loss, logits)` or the only one of `(logits,)`, or a tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        logits = output.get("logits")
    elif isinstance(output, (tuple, list)) and 1 <= len(output) <= 2:
        logits = output[-1]
    else:
        logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ModelOutputError(
            f"the model's forward returned {type(output).__name__}; expected logits: a tensor, "
            "an object or dict with `logits` (a tensor), or a tuple (loss, logits)"
        )
    return logits
