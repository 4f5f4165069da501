"""LoRA through peft: a built model wrapped so that only an adapter (and the task's head) trains,
the adapter's weights read and put back for checkpoints, and the checks a config gets first.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpo.trainer.config import PeftSettings
from hpo.trainer.errors import ModelError
from hpo.trainer.tasks import auto_model_class, task_info

if TYPE_CHECKING:
    from peft import LoraConfig

# peft's TaskType for the transformers class that builds a task's model. The type decides the
# PeftModel class: a classification type puts the new head (`classifier`, `score`) in
# modules_to_save, so it trains fully and is saved with the adapter.
PEFT_TASK_TYPES = {
    "AutoModelForSequenceClassification": "SEQ_CLS",
    "AutoModelForTokenClassification": "TOKEN_CLS",
    "AutoModelForCausalLM": "CAUSAL_LM",
}
# The head peft trains whole for a classification type (modules_to_save), never a LoRA target.
HEAD_NAMES = ("classifier", "score")
# The loader class peft offers for each type: it builds the base model and loads the adapter.
PEFT_AUTO_CLASSES = {
    "SEQ_CLS": "AutoPeftModelForSequenceClassification",
    "TOKEN_CLS": "AutoPeftModelForTokenClassification",
    "CAUSAL_LM": "AutoPeftModelForCausalLM",
}


def peft_task_type(task: str) -> str:
    """peft's TaskType name for `task`; ModelError for a task whose model class it has none for."""
    auto_model = task_info(task).auto_model
    if auto_model not in PEFT_TASK_TYPES:
        raise ModelError(
            f"model.peft: the task {task} ({auto_model}) has no peft task type; "
            "remove model.peft to fine-tune the whole model"
        )
    return PEFT_TASK_TYPES[auto_model]


def auto_target_modules(model_type: str, linear_names: list[str] | None = None) -> list[str]:
    """The attention projections peft adapts by default in a model of `model_type`; ModelError
    naming what to set for a family peft does not know."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as KNOWN

    targets = KNOWN.get(model_type)
    if not isinstance(targets, list):  # unknown, or a regular expression peft keeps for a few
        seen = f" (its linear layers: {', '.join(linear_names)})" if linear_names else ""
        raise ModelError(
            f"model.peft.target_modules: auto knows no attention layers of model type "
            f"{model_type!r}; set model.peft.target_modules to the names of the layers to adapt"
            f"{seen}, e.g. [q_proj, v_proj]"
        )
    return list(targets)


def lora_config(settings: PeftSettings, task: str, model_type: str) -> LoraConfig:
    """peft's LoraConfig for `settings` on a model of `model_type` trained for `task`."""
    from peft import LoraConfig, TaskType

    targets = settings.target_modules
    return LoraConfig(
        task_type=TaskType[peft_task_type(task)],
        r=settings.r,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft says int; alpha / r is a float
        lora_dropout=settings.dropout,
        target_modules=auto_target_modules(model_type) if targets == "auto" else list(targets),
    )


def wrap_model(model: Any, settings: PeftSettings, task: str) -> torch.nn.Module:
    """`model` with a LoRA adapter: every base weight frozen, the adapter (and the task's head)
    trainable."""
    from peft import get_peft_model

    if getattr(model, "is_activation_checkpointing", False):
        # Frozen embeddings give checkpointed blocks inputs without grad, and no gradient would
        # reach the adapters inside them: the embeddings' output must ask for one.
        model.enable_input_require_grads()
    config = lora_config(settings, task, model.config.model_type)
    return get_peft_model(model, config)


def check_targets(settings: PeftSettings, model: torch.nn.Module, task: str) -> None:
    """Every name in `settings.target_modules` (or auto's) names a layer of `model` that LoRA can
    adapt, and peft itself accepts the adapter: checked on a model built on the meta device,
    before any trial, which peft's injection changes (build one for the check alone).
    ModelError naming the target and the layers that would be accepted."""
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    linear = linear_layer_names(model)
    if settings.target_modules == "auto":
        targets = auto_target_modules(model_type, linear)
    else:
        targets = settings.target_modules
    names = [name for name, _ in model.named_modules()]
    unknown = [t for t in targets if not any(_matches(n, t) for n in names)]
    if unknown:
        raise ModelError(
            f"model.peft.target_modules: {', '.join(map(repr, unknown))} names no layer of the "
            f"model ({model_type}); its linear layers: {', '.join(linear)}"
        )
    head = HEAD_NAMES if peft_task_type(task) in ("SEQ_CLS", "TOKEN_CLS") else ()
    adaptable = [name for name in adaptable_layer_names(model) if name not in head]
    accepted = f"name layers LoRA adapts; in this model ({model_type}): {', '.join(adaptable)}"
    refused = _unadaptable(model, targets)
    if refused:
        raise ModelError(
            f"model.peft.target_modules: {refused}, which LoRA cannot adapt (only linear, "
            f"embedding and convolution layers); {accepted}"
        )
    _check_peft_accepts(settings, task, model, accepted)


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a name in target_modules: the module's whole name, or its last parts."""
    return module_name == target or module_name.endswith(f".{target}")


def lora_layer_types() -> tuple[type, ...]:
    """The layer types peft's LoRA adapts (the list its refusal of any other type gives)."""
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    return (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D, nn.MultiheadAttention)


def adaptable_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's layers LoRA can adapt (query, value, dense...)."""
    types = lora_layer_types()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, types)})


def _unadaptable(model: torch.nn.Module, targets: list[str]) -> str:
    """The targets that name a layer LoRA cannot adapt (a LayerNorm, a whole block), each with
    the types it names, e.g. `'LayerNorm' names LayerNorm layers`; empty if none does."""
    types = lora_layer_types()
    found = []
    for target in targets:
        kinds = sorted(
            {
                type(m).__name__
                for n, m in model.named_modules()
                if _matches(n, target) and not isinstance(m, types)
            }
        )
        if kinds:
            found.append(f"{target!r} names {', '.join(kinds)} layers")
    return "; ".join(found)


def _check_peft_accepts(
    settings: PeftSettings, task: str, model: torch.nn.Module, accepted: str
) -> None:
    """peft's own injection of the adapter into `model` (on the meta device: no weights, in
    milliseconds), so that whatever else peft refuses is said now, not by every trial."""
    import warnings

    from peft import get_peft_model

    config = lora_config(settings, task, getattr(model.config, "model_type", "?"))
    try:
        with warnings.catch_warnings():
            # A trial's own injection gives peft's warnings (fan_in_fan_out set for GPT-2's
            # Conv1D...) where they belong: a dry run says them only once too often.
            warnings.simplefilter("ignore")
            get_peft_model(model, config)
    except ValueError as e:
        text = str(e).strip()
        reason = text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(e).__name__
        raise ModelError(
            f"model.peft.target_modules: got {settings.target_modules!r}; peft refuses the "
            f"adapter ({reason[:300]}); {accepted}"
        ) from e


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (query, value, dense...)."""
    names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    return sorted(names)


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (an adapter on a frozen base)."""
    peft = sys.modules.get("peft")  # not imported: no peft model, and a full run never pays it
    return peft is not None and isinstance(getattr(model, "_orig_mod", model), peft.PeftModel)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a peft model's head counts once (its frozen original and
    the trained copy in modules_to_save are two tensors, and the copy is what runs)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if ".original_module." not in n)
    return trainable, total


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint must hold to put the weights back: the adapter (and head) of a peft
    model, in peft's own keys; every weight of a model trained fully."""
    if not is_adapted(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_trained_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The inverse of trained_state, onto a freshly built model of the same job."""
    if not is_adapted(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    result: Any = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"adapter state does not fit the model: missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}"
        )


def best_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of the weights a best model is saved from: the trainable ones of a peft
    model (its save_pretrained keeps the adapter's and head's keys of a full state dict), all
    of a model trained fully."""
    state = model.state_dict()
    if is_adapted(model):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trainable}
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def save_head_config(model: torch.nn.Module, folder: str) -> None:
    """Beside a saved adapter, the base model's config with the task's head (its labels), so
    that the base loads with the head the adapter's copy replaces."""
    if is_adapted(model):
        adapted: Any = getattr(model, "_orig_mod", model)
        adapted.get_base_model().config.save_pretrained(folder)


# -- a saved adapter on another host -----------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(folder: Path) -> bool:
    """Whether `folder` holds a peft adapter (what a LoRA run saves) rather than a whole model."""
    return (folder / ADAPTER_CONFIG).is_file()


def point_at_base(folder: Path, base: str | None) -> str:
    """Make the adapter in `folder` name its base model as this host finds it (`base`, e.g. a
    `pkg://` location resolved here: the training host's path means nothing elsewhere), so that
    peft's AutoPeftModel loaders find it. `base` None: the one it names. Returns the base."""
    path = folder / ADAPTER_CONFIG
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # a copy cut short
        raise ModelError(f"{path} is unreadable ({e}); fetch the model again") from e
    if not isinstance(settings, dict):
        raise ModelError(f"{path} is not a LoRA adapter's config; fetch the model again")
    location = base or str(settings.get("base_model_name_or_path"))
    settings["base_model_name_or_path"] = location
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return location


def merge_adapter(folder: Path, base: str, task: str, out: Path) -> None:
    """A plain model in `out` (save_pretrained, with the tokenizer): the adapter in `folder`
    merged into the weights of `base`, with the head it trained. ModelError when the base
    cannot be loaded here."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(folder)  # the base's config with the task's head
        model = auto_model_class(task).from_pretrained(base, config=config)
        merged = PeftModel.from_pretrained(model, folder).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"cannot merge the adapter into its base model {base!r}: {reason[:300]}; is the "
            "base model there on this host?"
        ) from e
    merged.save_pretrained(out)
    for name in ("hpo_inference.json",):  # what hpo predict reads (trainer.inference)
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    if (folder / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(folder).save_pretrained(out)
