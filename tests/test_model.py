"""Model and tokenizer loading: package-shipped folders, inline configs, clear failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpo.errors import ModelError
from tests.conftest import MINILM_TOKENIZER, TINY_BERT
from trainer.config import ModelConfig
from trainer.model import (
    build_model,
    check_model_config,
    load_tokenizer,
    model_fingerprint,
    resolve_location,
)


def test_package_location_resolves_to_the_shipped_folder() -> None:
    folder = Path(resolve_location(MINILM_TOKENIZER))
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert resolve_location("/some/folder") == "/some/folder"


def test_missing_package_says_what_to_install() -> None:
    with pytest.raises(ModelError, match="Python package 'no_such_pkg_xyz' is not installed"):
        resolve_location("pkg://no_such_pkg_xyz/model")


def test_pretrained_minilm_gets_a_new_head() -> None:
    config = ModelConfig(name_or_path=MINILM_TOKENIZER)
    model = build_model(config, ["a", "b", "c"], seed=0)
    assert model.config.num_labels == 3 and model.config.id2label[2] == "c"
    assert model.config._attn_implementation == "sdpa"
    tokenizer = load_tokenizer(config)
    batch = tokenizer(["a man plays"], ["someone plays"], return_tensors="pt")
    with torch.inference_mode():
        assert model.eval()(**batch).logits.shape == (1, 3)


def test_inline_config_is_deterministic_per_seed() -> None:
    config = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
    a, b = (build_model(config, ["x", "y"], seed=3) for _ in range(2))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert model_fingerprint(config) == model_fingerprint(
        ModelConfig(config=dict(TINY_BERT), tokenizer="x")
    )


def test_missing_local_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="check that the folder holds a transformers model"):
        check_model_config(ModelConfig(name_or_path=str(tmp_path)))


def test_hub_name_without_a_hub_is_one_clear_message() -> None:
    with pytest.raises(ModelError) as caught:
        check_model_config(ModelConfig(name_or_path="someorg/some-model-that-is-not-here"))
    message = str(caught.value)
    assert "not a local folder and the model hub could not provide it" in message
    assert "set model.name_or_path to its folder" in message


def test_unknown_architecture() -> None:
    with pytest.raises(ModelError, match="cannot load model config"):
        check_model_config(ModelConfig(config={"model_type": "not_a_model"}, tokenizer="x"))
