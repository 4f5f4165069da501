"""Typed settings of the trainer: data, model and training loop.

Each field's `help` metadata is its documentation; `hpo.config.loader` loads YAML into
these classes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

# `package.module:name`: dotted Python identifiers, a colon, one identifier.
ENTRYPOINT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
Precision = Literal["auto", "fp32", "bf16", "fp16"]
CompileScope = Literal["auto", "blocks", "model"]
LRSchedule = Literal["linear", "cosine", "constant_with_warmup", "inverse_sqrt"]

# Upper bounds far above any real run, against typos and runaway values (epochs: 10**9): they
# also bound what a search space may sample, and no loop or allocation scales past them.
MAX_EPOCHS = 10_000
MAX_EVALS_PER_EPOCH = 10_000
MAX_BATCH_SIZE = 1_048_576  # examples in an optimizer step, micro-batch or evaluation batch
MAX_STEPS = 10**9
MAX_NUM_WORKERS = 256
MAX_LENGTH = 1_048_576  # tokens per example
# A CSV row or JSONL line, in MiB: csv's field limit (2**31 - 1 bytes) is the ceiling.
MAX_ROW_MIB = 2047
# Trials are scored on rows they never trained on; hpo does not split them off on its own.
EVAL_FILE_REQUIRED = (
    "is required: a path to held-out rows each trial is scored on, in train_file's formats; "
    "with one file, move about a tenth of its rows into another and name that here"
)
_TRAINING_BOUNDS = {
    "epochs": MAX_EPOCHS,
    "evals_per_epoch": MAX_EVALS_PER_EPOCH,
    "effective_batch_size": MAX_BATCH_SIZE,
    "physical_batch_size": MAX_BATCH_SIZE,
    "eval_batch_size": MAX_BATCH_SIZE,
    "batch_search_start": MAX_BATCH_SIZE,
    "batch_search_max": MAX_BATCH_SIZE,
    "max_steps": MAX_STEPS,
    "log_every_steps": MAX_STEPS,
    "num_workers": MAX_NUM_WORKERS,
}


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class DataConfig:
    """Where the labelled text lives and how to tokenize it."""

    train_file: str = _doc("Training data: .csv, .jsonl, .parquet or a `save_to_disk` folder.", "")
    eval_file: str = _doc("Evaluation data, same formats as train_file.", "")
    text_column: str = _doc("Column with the text (the premise for pairs).", "text")
    text_pair_column: str | None = _doc("Second text column for pair tasks (NLI hypothesis).")
    label_column: str = _doc("Column with the label: strings or integers.", "label")
    train_split: str = _doc("Split to read when train_file is a saved DatasetDict.", "train")
    eval_split: str = _doc("Split to read when eval_file is a saved DatasetDict.", "validation")
    test_file: str | None = _doc(
        "Optional test data, same formats as eval_file: rows no trial ever reads, kept for "
        "honest final scores (hpo ensemble scores every candidate there). Its path and sha256 "
        "are recorded in the study, not matched between workers."
    )
    test_split: str = _doc("Split to read when test_file is a saved DatasetDict.", "test")
    max_length: int = _doc("Tokens per example after truncation.", 128)
    label_separator: str = _doc(
        "multi_label_classification: what separates the labels in a CSV cell (JSONL and "
        "Parquet hold a list).",
        "|",
    )
    prompt_column: str | None = _doc(
        "causal_lm: column with the prompt; the loss counts only the completion's tokens."
    )
    completion_column: str | None = _doc(
        "causal_lm: column with the completion that follows the prompt (with prompt_column)."
    )
    cache_dir: str | None = _doc(
        "Tokenized-data cache; default $HPO_CACHE_DIR or ~/.cache/hpo/tokenized."
    )
    max_row_mib: int = _doc(
        "Longest CSV row or JSONL line read, in MiB; a file with a longer one is refused, naming "
        "it (a text is cut to what max_length can use anyway).",
        16,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if not self.train_file:
            found.append(("train_file", self.train_file, "is required: a path to the data"))
        if not self.eval_file:
            found.append(("eval_file", self.eval_file, EVAL_FILE_REQUIRED))
        if self.max_length < 2:
            found.append(("max_length", self.max_length, "must be at least 2"))
        found.extend(_above_bounds(self, {"max_length": MAX_LENGTH, "max_row_mib": MAX_ROW_MIB}))
        if self.max_row_mib < 1:
            found.append(("max_row_mib", self.max_row_mib, "must be at least 1"))
        if self.text_pair_column == self.text_column:
            found.append(
                ("text_pair_column", self.text_pair_column, "must differ from text_column")
            )
        for key in ("text_column", "text_pair_column"):  # the model would read the answer
            if getattr(self, key) == self.label_column:
                found.append((key, self.label_column, "must differ from label_column"))
        found.extend(self._prompt_problems())
        if not self.label_separator:
            found.append(("label_separator", self.label_separator, "must not be empty, e.g. |"))
        return found

    def _prompt_problems(self) -> list[tuple[str, Any, str]]:
        """prompt_column and completion_column come together (or neither: plain text)."""
        prompt, completion = self.prompt_column, self.completion_column
        if (prompt is None) != (completion is None):
            given, missing = ("prompt_column", "completion_column")
            if prompt is None:
                given, missing = missing, given
            rule = (
                f"is required with data.{given}: give both (the loss then counts the "
                "completion only), or neither to train on data.text_column"
            )
            return [(missing, None, rule)]
        if prompt is not None and prompt == completion:
            return [("completion_column", completion, "must differ from prompt_column")]
        return []


# LoRA's rank: past this an adapter is as large as the layers it adapts (BERT-large: 1024).
MAX_LORA_RANK = 4096


@dataclass
class PeftSettings:
    """Parameter-efficient fine-tuning: the model's weights stay frozen and a small adapter (with
    the task's head, where it has one) trains instead. `model.peft` absent: full fine-tuning."""

    method: Literal["lora", "none"] = _doc(
        "lora: low-rank updates of chosen layers; none: full fine-tuning (the value a search "
        "space samples to turn LoRA off).",
        "lora",
    )
    r: int = _doc("LoRA's rank: the inner size of each low-rank update (searchable).", 8)
    alpha: float = _doc(
        "LoRA's scale numerator: an update is multiplied by alpha / r (searchable).", 16.0
    )
    dropout: float = _doc("Dropout on the adapter's input, in [0, 1) (searchable).", 0.05)
    target_modules: list[str] | Literal["auto"] = _doc(
        "Names of the layers that get an adapter (a name matches a module whose dotted name ends "
        "with it); auto: the attention projections peft knows for the model's family.",
        "auto",
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if not 1 <= self.r <= MAX_LORA_RANK:
            found.append(("r", self.r, f"must be an integer in [1, {MAX_LORA_RANK}]"))
        if self.alpha <= 0:
            found.append(("alpha", self.alpha, "must be > 0"))
        if not 0 <= self.dropout < 1:
            found.append(("dropout", self.dropout, "must be in [0, 1)"))
        if isinstance(self.target_modules, list) and (
            not self.target_modules or not all(name.strip() for name in self.target_modules)
        ):
            rule = "must be auto or a list of layer names, e.g. [query, value]"
            found.append(("target_modules", self.target_modules, rule))
        return found


@dataclass
class ModelConfig:
    """Which model to fine-tune: a pretrained one by path or name, or one built from a config."""

    name_or_path: str | None = _doc(
        "Local folder, `pkg://<python package>/<folder>` (a model a package ships), or a hub name."
    )
    config: dict[str, Any] | None = _doc(
        "Inline transformers config (needs `model_type`); the model starts from random weights."
    )
    tokenizer: str | None = _doc("Tokenizer location, same forms as name_or_path; default: it.")
    attn_implementation: str = _doc("Attention kernel: sdpa, eager or flash_attention_2.", "sdpa")
    gradient_checkpointing: bool = _doc(
        "The older name of training.gradient_checkpointing; either turns it on.", False
    )
    dropout: float | None = _doc(
        "Dropout probability set on every dropout setting the model's config has (BERT's "
        "hidden and attention dropout, GPT-2's resid/embd/attn_pdrop, ...); null: the "
        "model's own."
    )
    compile: bool = _doc(
        "torch.compile the model: once per worker (its kept trial process), batch dimension "
        "dynamic, lengths padded to a few widths; trials record compile_graphs and compile_s.",
        False,
    )
    compile_scope: CompileScope = _doc(
        "With compile: `blocks` compiles the model's repeated layer (a transformer block) once "
        "and runs it for every layer, so compiling takes the time of one layer whatever the "
        "depth; `model` compiles the whole forward as one graph (faster steps on short "
        "sequences, minutes to compile a deep model); `auto`: the whole model up to 12 "
        "blocks (BERT-base and smaller), by blocks above.",
        "auto",
    )
    cuda_graphs: bool = _doc(
        "With compile on a GPU: the compiled forward and backward replay as CUDA graphs "
        "(torch.compile's reduce-overhead), one graph per batch shape: a step of short "
        "sequences, where launching kernels takes longer than running them, runs several "
        "times faster. Evaluation runs uncompiled (compile_scope: model) or by blocks; the "
        "graphs' memory is not in the batch search's probe, which its margin covers.",
        False,
    )
    peft: PeftSettings | None = _doc(
        "Train an adapter instead of every weight (LoRA); null or absent: full fine-tuning."
    )
    factory: str | None = _doc(
        "Your function that builds the model, `package.module:name`, called as "
        "factory(request) with a trainer.model_factory.ModelRequest (labels, vocab_size, the "
        "trial's model and training settings); it returns a transformers model or any "
        "torch.nn.Module whose forward(input_ids, attention_mask, ...) returns logits (an "
        "object or dict with `logits`, or a tuple (loss, logits)). name_or_path and config are "
        "then optional, handed to it; tokenizer (or name_or_path) says how text becomes ids."
    )

    @property
    def adapter(self) -> PeftSettings | None:
        """The LoRA settings in force; None for full fine-tuning (no model.peft, or method none)."""
        return self.peft if self.peft is not None and self.peft.method != "none" else None

    def adapter_record(self) -> dict[str, Any] | None:
        """What a study and each trial record of the adapter trained (method, base model);
        None for full fine-tuning."""
        adapter = self.adapter
        if adapter is None:
            return None
        return {"method": adapter.method, "base_model": self.name_or_path}

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if self.factory is not None:
            found.extend(self._factory_problems())
        elif (self.name_or_path is None) == (self.config is None):
            found.append(
                ("name_or_path", self.name_or_path, "give exactly one of name_or_path or config")
            )
        elif self.name_or_path is not None and not self.name_or_path.strip():
            found.append(
                ("name_or_path", self.name_or_path, "is empty; give the model's folder or name")
            )
        if self.config is not None and self.factory is None:
            if "model_type" not in self.config:
                found.append(("config", self.config, "needs a `model_type` key, e.g. bert"))
            if self.tokenizer is None:
                found.append(("tokenizer", None, "is required when the model is built from config"))
        if self.dropout is not None and not 0 <= self.dropout < 1:
            found.append(("dropout", self.dropout, "must be in [0, 1)"))
        if self.cuda_graphs and not self.compile:
            found.append(
                ("cuda_graphs", True, "needs model.compile: true (the graphs are torch.compile's)")
            )
        if self.compile_scope not in ("auto", "blocks", "model"):
            found.append(("compile_scope", self.compile_scope, "must be auto, blocks or model"))
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            found.append(
                (
                    "attn_implementation",
                    self.attn_implementation,
                    "must be sdpa, eager or flash_attention_2",
                )
            )
        if self.adapter is not None and self.config is not None and self.factory is None:
            # The adapter would be saved without the random weights it adapts: nobody could load it.
            found.append(
                (
                    "peft",
                    self.adapter.method,
                    "needs a pretrained model: save the model "
                    "built from model.config (save_pretrained) and give its folder as "
                    "model.name_or_path",
                )
            )
        return found

    def _factory_problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if not ENTRYPOINT.fullmatch(str(self.factory)):
            found.append(
                (
                    "factory",
                    self.factory,
                    "must be your function as `package.module:name`, e.g. my_model:build",
                )
            )
        if self.name_or_path is not None and self.config is not None:
            found.append(
                (
                    "name_or_path",
                    self.name_or_path,
                    "give at most one of name_or_path or config with a factory",
                )
            )
        if self.name_or_path is None and self.tokenizer is None:
            found.append(
                (
                    "tokenizer",
                    None,
                    "is required with a factory (the data's tokens); or give name_or_path",
                )
            )
        if self.peft is not None and self.peft.method != "none":
            found.append(
                (
                    "peft",
                    self.peft.method,
                    "not with a factory: your function builds "
                    "the whole model (wrap it in an adapter there)",
                )
            )
        return found


# GPUs one trial may span: a host's worth (NVLink domains top out at 8; 72 in a rack).
MAX_GPUS_PER_TRIAL = 72
MAX_NODES_PER_TRIAL = 1024
DistributedStrategy = Literal["ddp", "fsdp"]


@dataclass
class DistributedSettings:
    """One trial across several GPUs, of its host or of several (torch.distributed, started by
    torch's elastic launcher). `training.distributed` absent: every trial trains in one process."""

    gpus_per_trial: int = _doc(
        "Ranks (GPUs) each trial trains on; each worker of `hpo run --gpus` owns this many. "
        "On the CPU (tests, the bench) as many CPU ranks, over gloo.",
        2,
    )
    strategy: DistributedStrategy = _doc(
        "ddp: every rank holds the whole model and the gradients are summed (data-parallel); "
        "fsdp: every rank holds 1/N of the weights, gradients and optimizer state (FSDP2), "
        "for a model whose training does not fit one GPU.",
        "ddp",
    )
    nodes: int = _doc(
        "Hosts each trial spans, gpus_per_trial ranks on each (world size: nodes x "
        "gpus_per_trial). Above 1, every host runs `hpo run` with the same study and config "
        "(the Slurm recipe does): the first trains and reports, the others follow "
        "(docs/guides/distributed.md, Several hosts).",
        1,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if not 1 <= self.gpus_per_trial <= MAX_GPUS_PER_TRIAL:
            rule = f"must be an integer in [1, {MAX_GPUS_PER_TRIAL}]"
            found.append(("gpus_per_trial", self.gpus_per_trial, rule))
        if not 1 <= self.nodes <= MAX_NODES_PER_TRIAL:
            found.append(("nodes", self.nodes, f"must be an integer in [1, {MAX_NODES_PER_TRIAL}]"))
        if self.strategy not in ("ddp", "fsdp"):
            found.append(("strategy", self.strategy, "must be ddp or fsdp"))
        return found


@dataclass
class TrainingConfig:
    """Fixed settings of the training loop and defaults for every tunable hyperparameter."""

    physical_batch_size: int | Literal["auto"] = _doc(
        "Examples per forward/backward pass; auto: the largest that fits, found by a search.",
        "auto",
    )
    batch_search_start: int = _doc("auto: first physical batch the search probes.", 8)
    batch_search_max: int = _doc("auto: largest physical batch the search considers.", 256)
    batch_safety_margin: float = _doc(
        "auto: use this fraction of the largest batch that fits.", 0.9
    )
    eval_batch_size: int | None = _doc("Examples per evaluation batch; default 2x physical.")
    effective_batch_size: int = _doc("Examples per optimizer step (tunable).", 32)
    learning_rate: float = _doc("Peak AdamW learning rate (tunable).", 5e-5)
    weight_decay: float = _doc("AdamW decoupled weight decay, not applied to biases/norms.", 0.01)
    warmup_ratio: float = _doc("Fraction of optimizer steps spent warming up linearly.", 0.06)
    lr_schedule: LRSchedule = _doc(
        "The learning rate after warmup: linear (decays to zero at the last step), cosine "
        "(half a cosine down to zero), constant_with_warmup, or inverse_sqrt (the rate times "
        "sqrt(warmup steps / step)).",
        "linear",
    )
    epochs: int = _doc("Passes over the training data.", 1)
    max_steps: int | None = _doc("Stop after this many optimizer steps (caps epochs).")
    max_grad_norm: float | None = _doc("Clip the gradient norm to this; null disables.", 1.0)
    adam_beta1: float = _doc("AdamW beta1.", 0.9)
    adam_beta2: float = _doc("AdamW beta2.", 0.999)
    adam_epsilon: float = _doc("AdamW epsilon.", 1e-8)
    label_smoothing: float = _doc("Cross-entropy label smoothing in [0, 1).", 0.0)
    gradient_checkpointing: bool = _doc(
        "Recompute activations in the backward pass: 20-30% slower, far less activation "
        "memory (a larger physical batch fits); the same gradients.",
        False,
    )
    threshold: float = _doc(
        "multi_label_classification: a label is predicted when its probability is at least this.",
        0.5,
    )
    class_weights: list[float] | Literal["balanced"] | None = _doc(
        "Per-class loss weights in label order, or `balanced` (inverse class frequency)."
    )
    evals_per_epoch: int = _doc(
        "Evaluations per epoch, evenly spaced: each after the optimizer step nearest its "
        "fraction of the epoch, the last at its end; an epoch with fewer steps evaluates after "
        "every step.",
        1,
    )
    early_stopping_patience: int | None = _doc(
        "Stop after this many evaluations without improvement; null disables."
    )
    log_every_steps: int = _doc("Read the loss (a host sync) every this many optimizer steps.", 10)
    precision: Precision = _doc(
        "auto: bf16 on capable CUDA, fp16 on older CUDA, fp32 on CPU.", "auto"
    )
    tf32: bool = _doc("Allow TF32 matmuls and convolutions on CUDA.", True)
    device: str = _doc("auto, cpu, cuda or cuda:N.", "auto")
    num_workers: int | None = _doc(
        "DataLoader worker processes; null: none (the trainer pads its own batches)."
    )
    seed: int = _doc("Seed for weights init, shuffling and dropout (the same for every trial).", 42)
    distributed: DistributedSettings | None = _doc(
        "Train each trial on several GPUs of its host (data-parallel); null or absent: one "
        "process per trial. The effective batch is split evenly across the ranks: it must be a "
        "multiple of distributed.gpus_per_trial."
    )
    entrypoint: str | None = _doc(
        "Your own training function, `package.module:name`, called in each trial with a "
        "context (hpo.TrainingContext) instead of hpo's trainer; the module is "
        "imported with the config file's folder first on the path. The config then needs no "
        "model:, data: or task:, study.metric names a metric your function reports, and "
        "study.direction is required. null: hpo's own trainer."
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if self.entrypoint is not None and not ENTRYPOINT.fullmatch(self.entrypoint):
            rule = "must be `package.module:function`, e.g. train_mlp:train"
            found.append(("entrypoint", self.entrypoint, rule))
        positive = ("effective_batch_size", "epochs", "evals_per_epoch", "log_every_steps")
        for key in (*positive, "batch_search_start", "batch_search_max"):
            if getattr(self, key) < 1:
                found.append((key, getattr(self, key), "must be a positive integer"))
        if self.physical_batch_size != "auto" and self.physical_batch_size < 1:
            found.append(
                (
                    "physical_batch_size",
                    self.physical_batch_size,
                    "must be a positive integer or auto",
                )
            )
        if not 0 < self.threshold < 1:
            found.append(("threshold", self.threshold, "must be in (0, 1)"))
        if not 0 < self.batch_safety_margin <= 1:
            found.append(("batch_safety_margin", self.batch_safety_margin, "must be in (0, 1]"))
        for key in ("eval_batch_size", "max_steps", "early_stopping_patience"):
            value = getattr(self, key)
            if value is not None and value < 1:
                found.append((key, value, "must be a positive integer or null"))
        if self.learning_rate <= 0:
            found.append(("learning_rate", self.learning_rate, "must be > 0"))
        for key in ("weight_decay", "adam_epsilon"):
            if getattr(self, key) < 0:
                found.append((key, getattr(self, key), "must be >= 0"))
        for key in ("warmup_ratio", "label_smoothing", "adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                found.append((key, getattr(self, key), "must be in [0, 1)"))
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            found.append(("max_grad_norm", self.max_grad_norm, "must be > 0 or null"))
        if isinstance(self.class_weights, list) and any(w <= 0 for w in self.class_weights):
            found.append(("class_weights", self.class_weights, "every weight must be > 0"))
        if self.device != "auto" and not _is_device_name(self.device):
            found.append(("device", self.device, "must be auto, cpu, cuda or cuda:N"))
        if self.num_workers is not None and self.num_workers < 0:
            found.append(("num_workers", self.num_workers, "must be >= 0 or null"))
        found.extend(_above_bounds(self, _TRAINING_BOUNDS))
        found.extend(self._distributed_problems())
        return found

    @property
    def world_size(self) -> int:
        """Ranks per trial: distributed.nodes x distributed.gpus_per_trial, or 1."""
        settings = self.distributed
        return settings.nodes * settings.gpus_per_trial if settings is not None else 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks (GPUs) of a trial on each of its hosts: distributed.gpus_per_trial, or 1."""
        return self.distributed.gpus_per_trial if self.distributed is not None else 1

    def _distributed_problems(self) -> list[tuple[str, Any, str]]:
        """Every rank takes an equal share of each optimizer step, so the effective batch
        stays exact: physical x accumulation x world size."""
        ranks = self.world_size
        if ranks > 1 and self.effective_batch_size % ranks:
            nearest = ranks * max(1, self.effective_batch_size // ranks)
            what = "gpus_per_trial" if ranks == self.ranks_per_node else "nodes x gpus_per_trial"
            rule = (
                f"must be a multiple of distributed.{what} ({ranks}): each rank "
                f"trains an equal share of the step, e.g. {nearest}"
            )
            return [("effective_batch_size", self.effective_batch_size, rule)]
        if ranks > 1 and self.entrypoint is not None:
            rule = "hpo's trainer only: your own function starts its own ranks"
            return [("distributed", "set", rule)]
        return []

    def data_problems(self, label_names: list[str]) -> list[tuple[str, Any, str]]:
        """What only the data can decide: checked once its labels are known, before any trial."""
        weights = self.class_weights
        if isinstance(weights, list) and len(weights) != len(label_names):
            rule = (
                f"has {len(weights)} weights for {len(label_names)} labels {label_names}; "
                "give one weight per label, in this order, or `balanced`"
            )
            return [("class_weights", weights, rule)]
        return []


def _above_bounds(config: Any, bounds: dict[str, int]) -> list[tuple[str, Any, str]]:
    """A problem for each numeric setting of `config` past its bound in `bounds`."""
    found = []
    for key, most in bounds.items():
        value = getattr(config, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            found.append((key, value, f"must be at most {most}"))
    return found


def _is_device_name(name: str) -> bool:
    if name in ("cpu", "cuda"):
        return True
    prefix, _, index = name.partition(":")
    return prefix == "cuda" and index.isdigit()


@dataclass
class TrainJob:
    """Everything one training run needs: the trainer's whole input."""

    data: DataConfig
    model: ModelConfig
    training: TrainingConfig
    task: str = "sequence_classification"  # a name in trainer.tasks.TASKS

    @property
    def gradient_checkpointing(self) -> bool:
        """training.gradient_checkpointing, or model.gradient_checkpointing (its older name)."""
        return self.training.gradient_checkpointing or self.model.gradient_checkpointing
