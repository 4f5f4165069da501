"""Model and tokenizer loading: package-shipped folders, inline configs, clear failures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpo.trainer.config import ModelConfig
from hpo.trainer.errors import ModelError
from hpo.trainer.model import (
    _ask_hub,
    _hub_options,
    build_model,
    check_model_config,
    load_tokenizer,
    model_fingerprint,
    resolve_location,
)
from tests.conftest import MINILM_TOKENIZER, TINY_BERT


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


def test_inline_config_is_built_on_the_training_device() -> None:
    # Initialised where it trains (on a GPU, BERT-base's random init on the CPU took 1.6 s of
    # every trial's startup); the meta device stands in for a GPU here.
    config = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
    model = build_model(config, ["x", "y"], seed=3, device=torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    on_cpu = build_model(config, ["x", "y"], seed=3)
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}


def test_a_local_model_that_is_no_model_folder_is_said_plainly(tmp_path: Path) -> None:
    """Not transformers' words ("should have a model_type key", "not a valid JSON file")."""
    with pytest.raises(ModelError, match="has no config.json; point model.name_or_path at"):
        check_model_config(ModelConfig(name_or_path=str(tmp_path)))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file; set model.name_or_path to the folder"):
        check_model_config(ModelConfig(name_or_path=str(tmp_path / "weights.bin")))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="check that the folder holds a transformers model"):
        check_model_config(ModelConfig(name_or_path=str(tmp_path)))
    assert ("name_or_path", " ", "is empty; give the model's folder or name") in ModelConfig(
        name_or_path=" "
    ).problems()


def test_hub_name_without_a_hub_is_one_clear_message() -> None:
    with pytest.raises(ModelError) as caught:
        check_model_config(ModelConfig(name_or_path="someorg/some-model-that-is-not-here"))
    message = str(caught.value)
    assert "not a local folder and the model hub could not provide it" in message
    assert "set model.name_or_path to its folder" in message


@pytest.fixture
def hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """No HF_HUB_OFFLINE, and a hub that does not answer; returns the names asked about."""
    import huggingface_hub

    asked: list[str] = []

    def model_info(name: str, timeout: float) -> None:
        asked.append(name)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    _ask_hub.cache_clear()
    yield asked
    _ask_hub.cache_clear()


def test_an_unreachable_hub_is_asked_once_then_the_cache_serves(
    hub_unreachable: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    cached = {("org/cached", "config.json"): "/cache/config.json"}
    monkeypatch.setattr(
        huggingface_hub, "try_to_load_from_cache", lambda name, file: cached.get((name, file))
    )
    assert _hub_options("org/cached", "model") == {"local_files_only": True}
    assert _hub_options("org/cached", "model") == {"local_files_only": True}
    assert hub_unreachable == ["org/cached"]  # asked once per process, not per load
    with pytest.raises(ModelError, match="not a local folder and the model hub could not provide"):
        _hub_options("org/not-cached", "model")


def test_a_local_folder_or_offline_mode_asks_no_hub(
    hub_unreachable: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _hub_options(str(tmp_path), "model") == {}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _hub_options("org/model", "model") == {}
    assert hub_unreachable == []


def test_unknown_architecture() -> None:
    with pytest.raises(ModelError, match="cannot load model config"):
        check_model_config(ModelConfig(config={"model_type": "not_a_model"}, tokenizer="x"))


@pytest.mark.parametrize(
    "settings",
    [
        {"hidden_size": "abc"},
        {"layer_norm_eps": "tiny"},
        {"num_attention_heads": 3},
        {"hidden_size": -64},
    ],  # a negative size: torch's RuntimeError, once a traceback
)
def test_a_bad_inline_config_value_is_a_model_error_naming_the_inline_config(
    settings: dict[str, object],
) -> None:
    config = ModelConfig(config={**TINY_BERT, **settings}, tokenizer="x")
    with pytest.raises(ModelError, match="inline model.config") as caught:
        check_model_config(config)
    assert "model hub" not in str(caught.value)


def test_a_model_that_built_once_on_this_host_is_not_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The meta-device build costs each worker the model code's imports: a marker in hpo's
    cache of the host spares the next worker on the same model, and only that model."""
    import hpo.trainer.model as model_module

    built: list[str] = []
    real = model_module.auto_model_class

    def counting(task: str) -> object:
        built.append(task)
        return real(task)

    monkeypatch.setattr(model_module, "auto_model_class", counting)
    monkeypatch.setenv("HPO_CACHE_DIR", str(tmp_path / "cache"))
    config = ModelConfig(config=dict(TINY_BERT), tokenizer="x")
    check_model_config(config)
    check_model_config(config)
    assert built == ["sequence_classification"]
    check_model_config(config, task="regression")  # another head: built
    check_model_config(ModelConfig(config={**TINY_BERT, "num_hidden_layers": 2}, tokenizer="x"))
    assert len(built) == 3
    bad = ModelConfig(config={**TINY_BERT, "num_attention_heads": 3}, tokenizer="x")
    for _ in range(2):  # a build that failed is never remembered
        with pytest.raises(ModelError, match="inline model.config"):
            check_model_config(bad)
    assert len(built) == 5
    assert len(list((tmp_path / "cache" / "model-checks").iterdir())) == 3


def test_a_model_with_fewer_positions_than_max_length_is_refused_before_any_trial() -> None:
    """Every trial of it failed on a tensor size mismatch, and the run exited 0."""
    config = ModelConfig(config={**TINY_BERT, "max_position_embeddings": 16}, tokenizer="x")
    with pytest.raises(ModelError, match=r"data.max_length is 48 but the model holds at most 16"):
        check_model_config(config, max_length=48)
    check_model_config(config, max_length=16)
    roberta = {
        "model_type": "roberta",
        "max_position_embeddings": 514,
        "pad_token_id": 1,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 128,
    }
    check_model_config(ModelConfig(config=roberta, tokenizer="x"), max_length=512)
    with pytest.raises(ModelError, match="at most 512 positions"):  # numbered from pad + 1
        check_model_config(ModelConfig(config=roberta, tokenizer="x"), max_length=514)
    deberta = {
        "model_type": "deberta-v2",
        "max_position_embeddings": 512,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "position_biased_input": False,
        "relative_attention": True,
    }
    relative = ModelConfig(config=deberta, tokenizer="x", attn_implementation="eager")
    check_model_config(relative, max_length=1024)  # relative positions: no such limit


def test_a_checkpoint_fine_tuned_for_another_number_of_labels_gets_a_fresh_head() -> None:
    """data/models/tiny-bert was saved with a 2-label head; a 3-label task loads its body and
    starts its own head (transformers refused with a raw error before)."""
    from safetensors.torch import load_file

    folder = Path(__file__).parents[1] / "data" / "models" / "tiny-bert"
    saved = load_file(folder / "model.safetensors")
    model = build_model(ModelConfig(name_or_path=str(folder)), ["a", "b", "c"], seed=0)
    assert model.classifier.weight.shape[0] == 3
    body = model.state_dict()
    for name, tensor in saved.items():
        if not name.startswith("classifier"):
            assert torch.equal(body[name], tensor), name
