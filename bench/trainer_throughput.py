"""Training samples/s of our loop (trainer.loop) against a transformers Trainer tuned for speed,
for any task: the same model, data, batch and precision in one run.
Run: .venv/bin/python bench/trainer_throughput.py [--task regression | --config FILE] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from torch.utils.hooks import RemovableHandle
from transformers import (
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

from hpo.config.loader import load_config
from hpo.config.schema import Config
from hpo.config.search_paths import with_params
from hpo.errors import USER_ERRORS
from hpo.trainer import device as dev
from hpo.trainer.batching import collate
from hpo.trainer.config import TrainingConfig
from hpo.trainer.data import PreparedData, TokenizedSplit
from hpo.trainer.loaders import num_workers_for, padding_for
from hpo.trainer.loop import Trainer
from hpo.trainer.model import build_model, load_tokenizer
from hpo.trainer.step import grad_accum_steps_for, make_optimizer
from hpo.trainer.tasks import TASKS, make_task, prepare_data
from hpo.trainer.tasks.causal_lm import body_and_head

REPO = Path(__file__).resolve().parents[1]
# The shipped config of each task, what --task measures.
TASK_CONFIGS = {
    "sequence_classification": "configs/demo.yaml",
    "multi_label_classification": "configs/multilabel.yaml",
    "regression": "configs/regression.yaml",
    "token_classification": "configs/ner.yaml",
    "causal_lm": "configs/causal-lm.yaml",
}
LEARNING_RATE = 1e-4
# Ratios within this band of 1.0 are noise on a shared machine, not a difference.
PARITY_BAND = 0.05
LEGEND = (
    "clock: from the start of training (first step included) to the end of the last optimizer "
    "step; model build, tokenization and evaluation excluded\n"
    "tokens/s: real (non-padding) tokens; padding %: share of computed positions that are padding"
)


@dataclass
class Run:
    """One timed training run of one engine."""

    engine: str
    optimizer_steps: int
    samples: int
    real_tokens: int
    padded_tokens: int
    train_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_s

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.train_s

    @property
    def padding_pct(self) -> float:
        return 100.0 * (1.0 - self.real_tokens / max(1, self.padded_tokens))


@dataclass
class Setup:
    """Everything both engines share: data, settings and the resolved device."""

    config: Config
    data: PreparedData
    tokenizer: Any
    training: TrainingConfig
    steps: int
    device: torch.device
    precision: str
    fused_adamw: bool
    pad_multiple: int
    theirs_compiled: bool


class BatchCounter:
    """Counts what the model trains on, from a forward pre-hook, the same way for both engines."""

    def __init__(self) -> None:
        self.samples = 0
        self.padded_tokens = 0
        self._real_tokens: torch.Tensor | None = None

    def attach(self, model: torch.nn.Module) -> RemovableHandle:
        return model.register_forward_pre_hook(self._count, with_kwargs=True)

    # Never traced: inside a compiled model (compiled whole, the hook is part of its forward)
    # the running sum became a graph output, which a CUDA graph's next replay overwrote.
    @torch.compiler.disable
    def _count(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not module.training:
            return  # our loop's evaluations run in eval mode
        input_ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        self.samples += int(input_ids.shape[0])
        self.padded_tokens += int(input_ids.numel())
        # Summed on the device: reading it here would be a host sync on every micro-batch.
        real = mask.sum()
        self._real_tokens = real if self._real_tokens is None else self._real_tokens + real

    @property
    def real_tokens(self) -> int:
        return 0 if self._real_tokens is None else int(self._real_tokens.item())


class StepClock(TrainerCallback):
    """Times a transformers run from on_train_begin to the end of its last optimizer step."""

    def __init__(self, device: torch.device, last_step: int) -> None:
        self.device, self.last_step = device, last_step
        self.started = self.finished = math.nan

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # queued kernels belong to the timed steps
        return time.perf_counter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = self._now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.last_step:
            self.finished = self._now()


class TokenizedExamples(torch.utils.data.Dataset):
    """Our tokenized split as the dicts a transformers Trainer expects; built once, untimed."""

    def __init__(self, split: TokenizedSplit, task: str) -> None:
        self.examples = [_example(split, i, task) for i in range(len(split))]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]


def _example(split: TokenizedSplit, index: int, task: str) -> dict[str, Any]:
    """One example with its targets in transformers' form: a class id, a number, a multi-hot
    row, a tag id per token, or (causal LM) the input ids themselves, which the model shifts;
    ours are stored shifted already, next token at each position."""
    start, end = int(split.offsets[index]), int(split.offsets[index + 1])
    example: dict[str, Any] = {"input_ids": split.ids[start:end].tolist()}
    if split.token_labels is not None:
        targets = split.token_labels[start:end].tolist()
        example["labels"] = [-100, *targets[:-1]] if task == "causal_lm" else targets
    else:
        assert split.labels is not None
        example["labels"] = split.labels[index].tolist()
    if split.type_ids is not None:
        example["token_type_ids"] = split.type_ids[start:end].tolist()
    return example


# -- shared settings -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--task",
        choices=list(TASKS),
        help="measure the task's shipped config (configs/...); default: sequence_classification",
    )
    parser.add_argument("--config", help="a config of your own (its task: is measured)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps measured")
    parser.add_argument("--effective-batch-size", type=int, default=64)
    parser.add_argument("--physical-batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs; medians shown")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's own)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="both engines compiled: our model.compile, transformers' torch_compile=True",
    )
    parser.add_argument(
        "--trainer-eager",
        action="store_true",
        help="with --compile: transformers' Trainer stays eager, its best with dynamic padding "
        "(its torch_compile=True recompiles for new lengths: 2026-11-26, an H100, 6-7x slower)",
    )
    parser.add_argument(
        "--cudnn-benchmark",
        choices=["on", "off"],
        default="on",
        help="torch.backends.cudnn.benchmark for both engines (hpo's loop sets it on)",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=None,
        help="untimed runs of both engines first (default: 1 with --compile, which compiles "
        "every shape once and shares it between the engines, else 0)",
    )
    parser.add_argument(
        "--compile-scope",
        choices=["auto", "blocks", "model"],
        default=None,
        help="with --compile: our model.compile_scope (default: the config's, else auto)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --compile: our model.cuda_graphs (the compiled step replayed as CUDA graphs)",
    )
    parser.add_argument(
        "--static-batch",
        action="store_true",
        help="with --compile: leave our batch dimension static (hpo.trainer.compiled marks it "
        "dynamic), to measure what dynamic shapes cost",
    )
    parser.add_argument(
        "--engines",
        choices=["both", "ours", "theirs"],
        default="both",
        help="run one engine alone (a profile of ours, say); the ratio needs both",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed runs, one more of ours under torch.profiler: the busiest kernels "
        "and how much of the clock the device computed (where low MFU goes)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak for model FLOPs utilisation (default: known GPUs, bf16)",
    )
    args = parser.parse_args(argv)
    counts = (args.steps, args.effective_batch_size, args.physical_batch_size, args.repeats)
    if min(counts) < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--steps, --repeats, --threads and both batch sizes must be positive")
    if args.warmup_rounds is None:
        args.warmup_rounds = 1 if args.compile else 0
    if args.warmup_rounds < 0:
        parser.error("--warmup-rounds must be 0 or more")
    if args.effective_batch_size % args.physical_batch_size:
        # transformers accumulates whole physical batches; ours would balance uneven ones.
        parser.error("--effective-batch-size must be a multiple of --physical-batch-size")
    if args.task is not None and args.config is not None:
        parser.error("give --task (its shipped config) or --config, not both")
    if args.config is None:
        args.config = str(REPO / TASK_CONFIGS[args.task or "sequence_classification"])
    return args


def bench_training(config: Config, data: PreparedData, args: argparse.Namespace) -> TrainingConfig:
    """The config's training settings with the benchmark's batch, steps and learning rate."""
    steps_per_epoch = math.ceil(len(data.train) / args.effective_batch_size)
    return dataclasses.replace(
        config.training,
        effective_batch_size=args.effective_batch_size,
        physical_batch_size=args.physical_batch_size,
        learning_rate=LEARNING_RATE,
        max_steps=args.steps,
        # Enough epochs that max_steps, not the config's epochs, ends the run.
        epochs=max(1, math.ceil(args.steps / steps_per_epoch)),
        # Fewest evaluations our loop does: each epoch's end and the last step (both untimed).
        evals_per_epoch=1,
        early_stopping_patience=None,
        device=args.device,
        # The same DataLoader workers for both: the config's, else trainer.loaders' own rule.
        num_workers=num_workers_for(config.training.num_workers),
    )


def make_setup(args: argparse.Namespace) -> Setup:
    config = load_config(args.config)
    config.model.compile = config.model.compile or args.compile
    if args.compile_scope is not None:
        config.model.compile_scope = args.compile_scope
    config.model.cuda_graphs = config.model.cuda_graphs or args.cuda_graphs
    if args.static_batch:
        import hpo.trainer.compiled

        hpo.trainer.compiled._batch_dimension_dynamic = lambda *_: None
    device = dev.resolve_device(args.device)
    tokenizer = load_tokenizer(config.model, config.task)
    data = prepare_data(config.data, tokenizer, config.task, config.training)
    training = bench_training(config, data, args)
    precision = dev.resolve_precision(training.precision, device)
    # Set once for the process, so both engines run with the same TF32 and cuDNN settings.
    dev.configure_backends(device, training.tf32)
    if args.cudnn_benchmark == "off":
        keep_cudnn_benchmark_off()
    _, optimizer_name = make_optimizer(torch.nn.Linear(1, 1).to(device), training)
    return Setup(
        config=config,
        data=data,
        tokenizer=tokenizer,
        training=training,
        steps=args.steps,
        device=device,
        precision=precision,
        fused_adamw=optimizer_name == "adamw_fused",
        pad_multiple=padding_for(device, config.model.compile, config.data.max_length).multiple,
        theirs_compiled=config.model.compile and not args.trainer_eager,
    )


def keep_cudnn_benchmark_off() -> None:
    """Our loop sets cudnn.benchmark on as it starts; this keeps it off for the comparison."""
    configure = dev.configure_backends

    def without_benchmark(device: torch.device, tf32: bool) -> None:
        configure(device, tf32)
        torch.backends.cudnn.benchmark = False

    dev.configure_backends = without_benchmark
    torch.backends.cudnn.benchmark = False


# Dense bf16 peaks (TFLOPS, no sparsity) by a word of the device name, for MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def flops_per_token(model: torch.nn.Module, mean_length: float) -> float:
    """Training FLOPs per real token: 6 per trained non-embedding parameter (forward, and backward
    for the inputs and the weight), 4 per frozen one (an adapter's base: no weight gradient), plus
    attention's scores and weighted sum, 12 x layers x hidden x sequence length. An output layer
    tied to the input embedding (a causal LM's) is a matrix product per token: it counts."""
    embedding: Any = getattr(model, "get_input_embeddings", lambda: None)()
    output: Any = getattr(model, "get_output_embeddings", lambda: None)()
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    total = 0.0
    for name, p in model.named_parameters():
        if "embed" in name and not (tied and p is embedding.weight):
            continue
        total += (6.0 if p.requires_grad else 4.0) * p.numel()
    cfg = getattr(model, "config")  # noqa: B009
    return total + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * mean_length


def mfu_line(setup: Setup, args: argparse.Namespace, runs: dict[str, list[Run]]) -> str:
    """Model FLOPs utilisation of each engine, counting real tokens only (padding is waste)."""
    name = dev.device_name(setup.device)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        return f"MFU: no known peak for {name}; pass --peak-tflops"
    # Only its shape counts: built on the meta device where it is built from a config
    # (from_pretrained refuses the meta device).
    model = _build(setup, torch.device("meta") if setup.config.model.config else None)
    lengths = setup.data.train.lengths
    per_token = flops_per_token(model, float(lengths.mean()))
    shares = []
    for engine, engine_runs in runs.items():
        if not engine_runs:
            continue
        rate = median_run(engine_runs).tokens_per_s
        shares.append(f"{engine} {100 * rate * per_token / (peak * 1e12):.1f}%")
    return f"MFU (real tokens, peak {peak:g} TFLOPS): " + ", ".join(shares)


def warm_up(setup: Setup) -> int:
    """One untimed forward/backward, so neither engine pays the process's one-time start-up;
    returns the model's parameter count."""
    model = _build(setup)
    model.to(setup.device).train()
    rows = np.arange(min(fixed_physical(setup.training), len(setup.data.train)))
    batch = collate(setup.data.train, rows, setup.data.pad_token_id)
    batch = {k: v.to(setup.device) for k, v in batch.items()}
    labels = batch.pop("labels")
    with dev.autocast(setup.device, setup.precision):
        logits = model(**batch).logits
    task = make_task(setup.config.task, setup.config.data, setup.training)
    (task.loss_sum(logits, labels) / task.units(labels)).backward()
    return sum(p.numel() for p in model.parameters())


def _build(setup: Setup, device: torch.device | None = None) -> torch.nn.Module:
    """The task's model, as both engines train it; one built from a config is initialised on
    `device` (default the benchmark's: a 1B model's random init on the CPU takes a while)."""
    config = setup.config
    return build_model(
        config.model,
        setup.data.label_names,
        setup.training.seed,
        device or setup.device,
        task=config.task,
    )


# -- the two engines -----------------------------------------------------------------------------


def run_ours(setup: Setup) -> Run:
    trainer = Trainer(
        dataclasses.replace(with_params(setup.config, {}), training=setup.training),
        setup.data,
        setup.config.study.primary_metric,
    )
    if trainer.padding.multiple != setup.pad_multiple:
        raise RuntimeError(
            f"hpo.trainer.loop pads to multiples of {trainer.padding.multiple}, the benchmark's HF "
            f"collator to {setup.pad_multiple}; both should use trainer.loaders.padding_for"
        )
    counter = BatchCounter()
    # A causal LM's loss may run its body alone (the output layer on counted positions only):
    # count what the body is given then.
    parts = body_and_head(trainer.model) if setup.config.task == "causal_lm" else None
    handle = counter.attach(parts[0] if parts is not None else trainer.model)
    result = trainer.fit()  # train_s stops before each evaluation and restarts after it
    handle.remove()
    if result.status != "completed" or result.optimizer_steps != setup.steps:
        raise RuntimeError(
            f"our loop ended {result.status} after {result.optimizer_steps} steps: "
            f"{result.stop_reason}"
        )
    _check_own_count(result.samples_per_s * result.train_s, counter.samples, "samples")
    _check_own_count(result.tokens_per_s * result.train_s, counter.real_tokens, "tokens")
    return Run(
        "ours",
        result.optimizer_steps,
        counter.samples,
        counter.real_tokens,
        counter.padded_tokens,
        result.train_s,
    )


def _check_own_count(reported: float, counted: int, what: str) -> None:
    """Our TrainResult derives its rates from its own counts; they must match what ran."""
    if round(reported) != counted:
        print(
            f"warning: our TrainResult implies {round(reported)} {what}, the model saw {counted}",
            file=sys.stderr,
        )


def fixed_physical(cfg: TrainingConfig) -> int:
    """The benchmark always sets the physical batch from --physical-batch-size."""
    if cfg.physical_batch_size == "auto":
        raise ValueError("the benchmark needs a numeric physical batch size")
    return cfg.physical_batch_size


def hf_arguments(setup: Setup, output_dir: str) -> TrainingArguments:
    """transformers' fastest settings for the same batch, schedule, precision and data loading."""
    cfg, on_cuda = setup.training, setup.device.type == "cuda"
    workers = cfg.num_workers or 0
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=fixed_physical(cfg),
        gradient_accumulation_steps=grad_accum_steps_for(
            cfg.effective_batch_size, fixed_physical(cfg)
        ),
        max_steps=setup.steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon,
        lr_scheduler_type="linear",
        warmup_steps=cfg.warmup_ratio,  # a float below 1 is a ratio of the steps
        max_grad_norm=cfg.max_grad_norm or 0.0,
        label_smoothing_factor=cfg.label_smoothing,
        optim="adamw_torch_fused" if setup.fused_adamw else "adamw_torch",
        train_sampling_strategy="group_by_length",
        bf16=setup.precision == "bf16",
        fp16=setup.precision == "fp16",
        tf32=cfg.tf32 if _has_tf32(setup.device) else None,  # it refuses True without Ampere
        use_cpu=not on_cuda,
        torch_compile=setup.theirs_compiled,
        dataloader_pin_memory=on_cuda,
        dataloader_num_workers=workers,
        dataloader_prefetch_factor=4 if workers else None,
        dataloader_persistent_workers=workers > 0,
        remove_unused_columns=False,  # our examples hold only model inputs
        logging_nan_inf_filter=False,  # its isnan check is a host sync on every micro-batch
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=cfg.seed,
    )


def _has_tf32(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def run_theirs(setup: Setup, examples: TokenizedExamples) -> Run:
    steps = setup.steps
    model = _build(setup)
    counter, clock = BatchCounter(), StepClock(setup.device, steps)
    handle = counter.attach(model)
    multiple = setup.pad_multiple if setup.pad_multiple > 1 else None
    collator: Any = (
        DataCollatorForTokenClassification(setup.tokenizer, pad_to_multiple_of=multiple)
        if setup.data.train.token_labels is not None  # pads the labels too, with -100
        else DataCollatorWithPadding(setup.tokenizer, pad_to_multiple_of=multiple)
    )
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as output_dir:
        hf = transformers.Trainer(
            model=model,
            args=hf_arguments(setup, output_dir),
            train_dataset=examples,
            data_collator=collator,
            processing_class=setup.tokenizer,
            callbacks=[clock],
        )
        hf.remove_callback(PrinterCallback)  # it prints the final metrics dict to stdout
        output = hf.train()
    handle.remove()
    if output.global_step != steps or math.isnan(clock.finished):
        raise RuntimeError(f"transformers stopped after {output.global_step} of {steps} steps")
    train_s = clock.finished - clock.started
    return Run(
        "transformers", steps, counter.samples, counter.real_tokens, counter.padded_tokens, train_s
    )


# -- report --------------------------------------------------------------------------------------


def median_run(runs: list[Run]) -> Run:
    """Per-column medians over repeats (each column on its own)."""
    return Run(
        runs[0].engine,
        runs[0].optimizer_steps,
        round(statistics.median(r.samples for r in runs)),
        round(statistics.median(r.real_tokens for r in runs)),
        round(statistics.median(r.padded_tokens for r in runs)),
        statistics.median(r.train_s for r in runs),
    )


def verdict(ratio: float) -> str:
    if abs(ratio - 1.0) <= PARITY_BAND:
        return f"on par: within {PARITY_BAND:.0%} of transformers' Trainer"
    if ratio > 1.0:
        return f"ours is {ratio - 1.0:.0%} faster than transformers' Trainer"
    return f"ours is {1.0 - ratio:.0%} slower than transformers' Trainer; worth investigating"


def busy_cpus() -> float:
    """The 1-minute load average: above the core count, other processes share our cores."""
    return os.getloadavg()[0]


def describe_model(setup: Setup, parameters: int) -> str:
    model = setup.config.model
    origin = model.name_or_path or f"inline {(model.config or {}).get('model_type')} config"
    weights = "pretrained" if model.name_or_path else "random init"
    adapter = model.adapter
    trained = (
        f", LoRA r={adapter.r} alpha={adapter.alpha:g} on {adapter.target_modules}: the base frozen"
        if adapter is not None
        else ""
    )
    return f"{origin} ({weights}, {parameters / 1e6:.1f}M parameters{trained})"


def report(
    setup: Setup, args: argparse.Namespace, runs: dict[str, list[Run]], parameters: int, load: float
) -> None:
    cfg = setup.training
    ran = [engine_runs for engine_runs in runs.values() if engine_runs]
    accum = grad_accum_steps_for(cfg.effective_batch_size, fixed_physical(cfg))
    print(f"config: {args.config}")
    print(f"model: {describe_model(setup, parameters)}")
    print(
        f"device: {dev.device_name(setup.device)}, precision {setup.precision}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(
        f"batch: effective {cfg.effective_batch_size} = {cfg.physical_batch_size} x {accum} "
        f"micro-batches, dynamic padding, lr {cfg.learning_rate:g}, "
        f"{'fused' if setup.fused_adamw else 'foreach'} AdamW, "
        f"{cfg.num_workers} loader workers, cudnn.benchmark {args.cudnn_benchmark}, "
        f"{len(ran[0])} repeat(s) after {args.warmup_rounds} untimed round(s), medians"
    )
    compiled = {True: "compiled", False: "eager"}
    graphs = ", CUDA graphs" if setup.config.model.cuda_graphs else ""
    scope = f" ({setup.config.model.compile_scope}{graphs})" if setup.config.model.compile else ""
    print(
        f"engines: ours {compiled[setup.config.model.compile]}{scope}, "
        f"transformers {compiled[setup.theirs_compiled]}"
    )
    print(LEGEND)
    print()
    header = f"{'engine':<13}{'steps':>6}{'samples':>9}{'samples/s':>11}{'tokens/s':>11}"
    print(header + f"{'padding %':>11}{'wall s':>9}")
    for engine_runs in ran:
        run = median_run(engine_runs)
        print(
            f"{run.engine:<13}{run.optimizer_steps:>6}{run.samples:>9}{run.samples_per_s:>11.1f}"
            f"{run.tokens_per_s:>11.0f}{run.padding_pct:>11.1f}{run.train_s:>9.2f}"
        )
    if len(ran[0]) > 1:
        for engine_runs in ran:
            rates = ", ".join(f"{r.samples_per_s:.1f}" for r in engine_runs)
            print(f"  {engine_runs[0].engine} samples/s per repeat: {rates}")
    print()
    if setup.device.type == "cuda":
        print(mfu_line(setup, args, runs))
    if len(ran) < 2:
        return
    ours_rate = statistics.median(r.samples_per_s for r in runs["ours"])
    ratio = ours_rate / statistics.median(r.samples_per_s for r in runs["theirs"])
    print(f"ratio ours/theirs (samples/s): {ratio:.2f}")
    print(f"verdict: {verdict(ratio)}")
    cores = os.cpu_count() or 1
    if setup.device.type == "cpu" and load > cores:
        # Spinning OpenMP threads that lose their core stall every op; one thread does not spin.
        hint = "--repeats 5" if args.threads == 1 else "--threads 1 --repeats 5"
        print(
            f"note: load average {load:.1f} on {cores} cores: other processes share the CPU, so "
            f"these numbers are noisy; try {hint}"
        )


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_ours(setup: Setup, rows: int = 20) -> None:
    """One more run of our loop under torch.profiler: the operators that took the most device
    (or CPU) time, and the device's busy share of the run's clock. A low share means the loop
    waits on the host (launches, data, syncs); a high one with low MFU, on slow kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = setup.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    free_memory(setup.device)
    with profile(activities=activities) as prof:
        run = run_ours(setup)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\nprofile: one more run of ours, {run.samples_per_s:.1f} samples/s under the profiler")
    print(events.table(sort_by=key, row_limit=rows))
    if cuda:
        busy_us = sum(getattr(e, key) for e in events)  # self times of all device work
        print(
            f"device busy {busy_us / 1e6:.2f} s of the clock's {run.train_s:.2f} s "
            f"({100 * busy_us / 1e6 / run.train_s:.0f}%; evaluations included in busy)"
        )


def run_engine(setup: Setup, examples: TokenizedExamples, engine: str, label: str) -> Run:
    """One run, its figures printed at once: a run cut short by a time limit still says what
    the finished ones measured (wall s of an untimed round shows what compiling cost)."""
    free_memory(setup.device)
    started = time.perf_counter()
    run = run_ours(setup) if engine == "ours" else run_theirs(setup, examples)
    print(
        f"# {engine} {label}: {run.samples_per_s:.1f} samples/s, clock {run.train_s:.2f} s, "
        f"wall {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return run


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # "Loading weights" bars, once per model build
    try:
        setup = make_setup(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    examples = TokenizedExamples(setup.data.train, setup.config.task)
    parameters = warm_up(setup)
    engines = ("ours", "theirs") if args.engines == "both" else (args.engines,)
    load = busy_cpus()
    for _ in range(args.warmup_rounds):
        # Compiled code is cached per process and shared by both engines (same model class,
        # same padded shapes): whoever ran first would pay every compilation in its clock.
        for engine in engines:
            run_engine(setup, examples, engine, "untimed")
    runs: dict[str, list[Run]] = {"ours": [], "theirs": []}
    for repeat in range(args.repeats):
        # Alternate who goes first, so drift in machine speed hits both engines alike.
        order = engines if repeat % 2 == 0 else engines[::-1]
        for engine in order:
            runs[engine].append(run_engine(setup, examples, engine, f"repeat {repeat + 1}"))
    report(setup, args, runs, parameters, max(load, busy_cpus()))
    if args.profile:
        profile_ours(setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
