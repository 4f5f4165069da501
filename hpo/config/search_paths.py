"""What a search space may name: the config fields a trial may vary, by dotted path, why every
other field may not, and the name each parameter has in the study. The one place that decides,
and the one place a trial's values are set on those fields (with_params: values to a TrainJob).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpo.config.paths import model_location
from hpo.trainer.config import DataConfig, ModelConfig, PeftSettings, TrainingConfig, TrainJob

if TYPE_CHECKING:
    from hpo.config.schema import Config

# The config sections a trial's parameters change, by the name a dotted path begins with.
SECTIONS: dict[str, Any] = {"model": ModelConfig, "data": DataConfig, "training": TrainingConfig}
# Sections within a section, whose fields are searched by their whole path (model.peft.r).
SUBSECTIONS: dict[str, Any] = {"model.peft": PeftSettings}

# Every searchable field: each changes what a trial learns (or how fast, for a throughput
# objective), and hpo prepares what it needs per trial. Adding one is declaring it here (and
# whatever applies it in the trainer): e.g. "model.peft.r" once model.peft exists.
SEARCHABLE = (
    "training.effective_batch_size",
    "training.learning_rate",
    "training.weight_decay",
    "training.warmup_ratio",
    "training.lr_schedule",
    "training.epochs",
    "training.label_smoothing",
    "training.max_grad_norm",
    "training.adam_beta1",
    "training.adam_beta2",
    "training.adam_epsilon",
    "training.class_weights",
    "training.gradient_checkpointing",
    # Each model brings its tokenizer, token cache entry and physical batch (hpo.trial.task).
    "model.name_or_path",
    "model.dropout",
    # Truncation trades context for speed: each length has its token cache entry and batch key.
    "data.max_length",
    # LoRA on or off (none: full fine-tuning), and its settings (the batch key holds r and
    # whether there is dropout: what changes the adapter's memory).
    "model.peft.method",
    "model.peft.r",
    "model.peft.alpha",
    "model.peft.dropout",
)
# Older names, the same parameter as the path they lead to.
ALIASES = {"model.gradient_checkpointing": "training.gradient_checkpointing"}

_HARDWARE = "how the run uses the hardware, not what it learns: the same for every trial"
_SPLIT = (
    "how a step is split to fit memory, not what it computes: search training.effective_batch_size"
)
_BUDGET = (
    "the trial's budget or how often it is measured: the pruner compares trials at the "
    "same evaluations; search training.epochs"
)
_DATA = "which data is read: a study compares its trials on one data set"
_FILE = "a file path: the same for every trial"
# Why each other field of a section is not searchable (tests check that every field has a say).
NOT_SEARCHABLE = {
    "training.seed": "the seed is luck, not a setting: a search over it finds a lucky seed; "
    "`hpo retrain` measures the spread over seeds",
    "training.entrypoint": "the training function: the same for every trial",
    "training.threshold": "applies to predictions only: every value trains the same model",
    "training.distributed": "the GPUs each trial trains on: the workers are laid out by it",
    **dict.fromkeys(
        (
            "training.physical_batch_size",
            "training.eval_batch_size",
            "training.batch_search_start",
            "training.batch_search_max",
            "training.batch_safety_margin",
        ),
        _SPLIT,
    ),
    **dict.fromkeys(
        ("training.max_steps", "training.evals_per_epoch", "training.early_stopping_patience"),
        _BUDGET,
    ),
    **dict.fromkeys(
        (
            "training.log_every_steps",
            "training.precision",
            "training.tf32",
            "training.device",
            "training.num_workers",
            "model.attn_implementation",
            "model.compile",
            "model.compile_scope",
            "model.cuda_graphs",
        ),
        _HARDWARE,
    ),
    "model.config": "an inline model config; search model.name_or_path over saved models",
    "model.factory": "your function that builds the model, the same for every trial: it reads "
    "each trial's searched settings from its request (request.model.dropout, ...)",
    "model.peft": "a section: search its fields, model.peft.method (lora or none), "
    "model.peft.r, model.peft.alpha, model.peft.dropout",
    "model.peft.target_modules": "a list of layer names tied to the model's family: the same "
    "for every trial",
    "model.tokenizer": "a file path; each model.name_or_path choice loads its own tokenizer",
    **dict.fromkeys(
        ("data.train_file", "data.eval_file", "data.test_file", "data.cache_dir"), _FILE
    ),
    **dict.fromkeys(
        (
            "data.text_column",
            "data.text_pair_column",
            "data.label_column",
            "data.train_split",
            "data.eval_split",
            "data.test_split",
            "data.label_separator",
            "data.prompt_column",
            "data.completion_column",
            "data.max_row_mib",
        ),
        _DATA,
    ),
}
_NOT_A_SECTION = {
    "study": "study settings say how the search runs, not what a trial trains",
    "task": "a study trains one task",
    "search_space": "the search space cannot search itself",
}


def param_name(path: str) -> str:
    """The parameter's name in the study: a training field's own name (`learning_rate`, as
    studies have always named it), any other field's dotted path (`model.dropout`)."""
    path = ALIASES.get(path, path)
    section, _, field = path.partition(".")
    return field if section == "training" else path


def field_hint(name: str) -> Any:
    """The type annotation of the field a parameter sets (model.peft.r: PeftSettings' r)."""
    section, field = field_of(name)
    sub, dot, leaf = field.partition(".")
    if dot:
        return typing.get_type_hints(SUBSECTIONS[f"{section}.{sub}"])[leaf]
    return typing.get_type_hints(SECTIONS[section])[field]


def with_params(
    config: Config, params: Mapping[str, Any], *, bound_batch_search: bool = True
) -> TrainJob:
    """The trainer's input: the config's data, model, training settings and task, with each
    of `params` set on the field its name leads to (a trial's sampled or enqueued values, by
    their study names or search paths: `learning_rate` and `training.learning_rate` both set
    training.learning_rate). The one place sampled values become a job: a trial's training,
    its batch-size cache key, the checks of each model choice before a study, retrain's runs.

    The learning rate's path from the YAML to AdamW, through the files that read or set it,
    none visited twice: hpo/config/loader.py (parse_config: search_space.learning_rate, a
    ParamSpec) -> hpo/trial/search_space.py (suggest: Optuna's suggest_float, the trial's
    params, which the trial process machinery carries unchanged) -> hpo/trial/training.py
    (train_trial: with_params) -> here (with_value: TrainJob.training.learning_rate) ->
    trainer/loop.py (Trainer: make_optimizer) -> trainer/step.py (torch.optim.AdamW(lr=...)).

    `bound_batch_search`: an automatic physical batch is searched no further than the study's
    largest effective batch needs (batch_search_bound); False keeps the config's own
    training.batch_search_max (`hpo batch-size`, which probes as far as the config allows)."""
    sections = {name: getattr(config, name) for name in SECTIONS}
    for name, value in params.items():
        section, field = field_of(name)
        if (section, field) == ("model", "name_or_path") and isinstance(value, str):
            value = model_location(value, config.base_dir)  # relative to the config's folder
        sections[section] = with_value(sections[section], section, field, value)
    training = sections["training"]
    if bound_batch_search and training.physical_batch_size == "auto":
        # The same bound for every trial of the study, so they share one search (its cache
        # key holds the bound: a later study with larger batches searches further).
        bound = batch_search_bound(config)
        training = dataclasses.replace(training, batch_search_max=bound)
    return TrainJob(sections["data"], sections["model"], training, config.task)


def largest_effective_batch(config: Config) -> int:
    """The largest effective batch a trial of this study can ask for: the search space's
    largest choice or high end, else training.effective_batch_size."""
    largest = config.training.effective_batch_size
    for name, spec in config.search_space.items():
        if field_of(name) != ("training", "effective_batch_size"):
            continue
        if spec.choices is not None:
            largest = max(int(choice) for choice in spec.choices)
        elif spec.high is not None:
            largest = int(spec.high)
    return largest


def batch_search_bound(config: Config) -> int:
    """The largest physical batch worth a probe: the study's largest effective batch before
    the safety margin takes its share (the margin's cut of this bound still holds that batch).
    A search past it finds sizes no trial can use: 21 probes and 40 s up to 2,836 on an H200
    for a space whose largest batch was 256 (issue 42)."""
    training = config.training
    needed = math.ceil(largest_effective_batch(config) / training.batch_safety_margin)
    return max(1, min(training.batch_search_max, needed))


def with_value(settings: Any, section: str, field: str, value: Any) -> Any:
    """`settings` (a section) with `field` set to `value`; a field of a sub-section
    (peft.r) is set on it, built from its defaults where the config has none."""
    sub, dot, leaf = field.partition(".")
    if not dot:
        return dataclasses.replace(settings, **{field: value})
    inner = getattr(settings, sub) or SUBSECTIONS[f"{section}.{sub}"]()
    return dataclasses.replace(settings, **{sub: dataclasses.replace(inner, **{leaf: value})})


def field_problems(settings: Any, section: str, field: str) -> list[str]:
    """What the rules of the field's own section (or sub-section) say of its value."""
    sub, dot, leaf = field.partition(".")
    owner, key = (getattr(settings, sub), leaf) if dot else (settings, field)
    return [rule for name, _, rule in owner.problems() if name == key]


def field_of(name: str) -> tuple[str, str]:
    """The section and field a parameter sets: `learning_rate` is training's; `seed` too (the
    seed `hpo retrain` adds to a search space of its own)."""
    section, dot, field = ALIASES.get(name, name).partition(".")
    return (section, field) if dot else ("training", name)


def resolve(name: Any) -> tuple[str | None, str]:
    """A search-space key as the parameter's study name, or None and why it is refused (a
    did-you-mean, or why the field is not searchable, and what is)."""
    if not isinstance(name, str):
        return None, "unknown parameter; name a config field by its dotted path"
    path = ALIASES.get(name, name if "." in name else f"training.{name}")
    if path in SEARCHABLE:
        return param_name(path), ""
    section, _, field = path.partition(".")
    if path in NOT_SEARCHABLE:
        return None, f"not searchable: {NOT_SEARCHABLE[path]}{_nearby(section, field)}"
    top = "study" if name in _fields("study") else name.split(".")[0]  # `storage:`: study's
    if top in _NOT_A_SECTION:
        return None, f"not searchable: {_NOT_A_SECTION[top]}"
    if name in SECTIONS:
        return None, f"a section, not a field: name the field by its path, e.g. {SEARCHABLE[0]}"
    if field in _fields(section):
        return None, "not searchable"  # a field with no say in NOT_SEARCHABLE (tests refuse it)
    return None, f"unknown parameter{_did_you_mean(name)}; searchable: {', '.join(SEARCHABLE)}"


def _nearby(section: str, field: str) -> str:
    """The searchable fields of `section` nearest to `field`: what the user may have meant."""
    fields = [p.partition(".")[2] for p in SEARCHABLE if p.startswith(f"{section}.")]
    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.5)
    if not close and len(fields) <= 3:  # a small section: all of it
        close = fields
    if not close:
        return ""
    return f"; searchable in {section}: {', '.join(f'{section}.{f}' for f in close)}"


def _did_you_mean(name: str) -> str:
    """The nearest searchable path, or short training name if the key was short."""
    candidates = [*SEARCHABLE, *ALIASES, *(param_name(p) for p in SEARCHABLE)]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fields(section: str) -> list[str]:
    from hpo.config.schema import StudyConfig  # the schema imports nothing of this module

    cls = SECTIONS.get(section) or {"study": StudyConfig}.get(section)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []


def accepted_names() -> list[str]:
    """Every key a search space accepts: the dotted paths, their aliases, the short names."""
    short = [param_name(p) for p in SEARCHABLE if p.startswith("training.")]
    return [*SEARCHABLE, *ALIASES, *short]
