"""One optimizer step, the primitives both the training loop and the batch finder use: AdamW,
the learning-rate schedules and exact gradient accumulation over micro-batches (the loss
itself is the task's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hpo.trainer.config import LRSchedule, TrainingConfig

if TYPE_CHECKING:
    from hpo.trainer.tasks.base import Task


def grad_accum_steps_for(effective_batch_size: int, physical_batch_size: int) -> int:
    """Micro-batches per optimizer step; an effective batch below the physical one is one step."""
    return max(1, math.ceil(effective_batch_size / physical_batch_size))


def make_optimizer(
    model: torch.nn.Module, cfg: TrainingConfig
) -> tuple[torch.optim.Optimizer, str]:
    """AdamW without decay on biases and norms; fused where this torch and device support it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    options: dict[str, Any] = {
        "lr": cfg.learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_epsilon,
    }
    try:
        return torch.optim.AdamW(groups, fused=True, **options), "adamw_fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **options), "adamw_foreach"


# inverse_sqrt without warmup: the rate decays as if warmup had been this many steps
# (transformers' choice), so that it does not halve within the first four steps.
INVERSE_SQRT_TIMESCALE = 10_000


def lr_factor(schedule: LRSchedule, step: int, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (from 0) as a fraction of the peak."""
    # 1) linear warmup, the same for every schedule
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    # 2) after it, the schedule's own curve
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "constant_with_warmup":
        return 1.0
    if schedule == "inverse_sqrt":
        timescale = warmup_steps or INVERSE_SQRT_TIMESCALE
        return 1.0 / math.sqrt((step + timescale - warmup_steps) / timescale)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")  # the config refuses it


def lr_schedule(
    optimizer: torch.optim.Optimizer,
    schedule: LRSchedule,
    warmup_steps: int,
    total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_steps`, then `schedule` (training.lr_schedule) up to
    `total_steps`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(schedule, step, warmup_steps, total_steps)
    )


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    cfg: TrainingConfig,
    autocast: Callable[[], Any],
    task: Task,
    class_weights: torch.Tensor | None = None,
    scaler: torch.amp.GradScaler | None = None,
    cuda_graphs: bool = False,
) -> torch.Tensor:
    """Forward and backward every micro-batch of one optimizer step; returns the step's loss.

    With `cuda_graphs` (a model compiled with model.cuda_graphs) each micro-batch begins a new
    graph step: the previous micro-batch's backward is done, so its graph outputs may be reused
    (without this, accumulation read outputs that the next replay had overwritten).

    Each micro-batch's loss is its summed loss divided by the units (examples, or counted
    tokens) of the whole step, so the accumulated gradient is exactly that of the step's mean
    loss, however the units fall into micro-batches. Token counts stay on the device: no sync."""
    units = sum((task.units(mb["labels"]) for mb in micro_batches), start=0)
    if isinstance(units, torch.Tensor):
        units = units.clamp(min=1)  # a step of no counted token: zero loss, not NaN
    total = torch.zeros((), device=micro_batches[0]["labels"].device)
    for batch in micro_batches:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            logits, labels = task.logits(model, inputs, labels)
        loss = task.loss_sum(logits, labels, class_weights, cfg.label_smoothing) / units
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    return total


def loss_scaler(device_type: str) -> torch.amp.GradScaler:
    """fp16's loss scaler, for one process and for the ranks of a run alike. Under FSDP2 each
    rank holds only its shard of a gradient, an inf perhaps in one rank's shard alone; the
    gradients are DTensors, and torch's DTensor all-reduces (MAX) what unscale_ found over the
    ranks, so all skip the step or none (tests/test_fsdp.py checks it). Not the FSDP1
    ShardedGradScaler: its found_inf has shape [1], and fused AdamW's step fails on it
    (torch 2.13: "output with shape [] doesn't match the broadcast shape [1]")."""
    return torch.amp.GradScaler(device_type)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainingConfig,
    scaler: torch.amp.GradScaler | None = None,
    keep_grads: bool = False,
) -> None:
    """Unscale (fp16), clip, step and clear the gradients of one accumulated step; zeroed in
    place with `keep_grads` (see `allocate_grads`), else freed."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if cfg.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=not keep_grads)


def optimizer_step_bytes(optimizer: torch.optim.Optimizer) -> int:
    """About the memory the next AdamW step allocates: two state tensors for each parameter
    that has none yet (its first step), and its temporaries (optimizer_temporary_bytes)."""
    state = sum(
        2 * _nbytes(param)
        for group in optimizer.param_groups
        for param in group["params"]
        if param.requires_grad and not optimizer.state.get(param)
    )
    return state + optimizer_temporary_bytes(optimizer)


def optimizer_temporary_bytes(optimizer: torch.optim.Optimizer) -> int:
    """What an AdamW step allocates for the time of the step: none when fused; with foreach,
    temporaries as large as the parameters of one group (its square roots and quotients),
    the largest group's."""
    if any(group.get("fused") for group in optimizer.param_groups):
        return 0
    sizes = [sum(_nbytes(p) for p in group["params"]) for group in optimizer.param_groups]
    return max(sizes, default=0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def allocate_grads(model: torch.nn.Module) -> None:
    """Give every trainable parameter a zero gradient of its own, kept from step to step.

    For a model replayed as CUDA graphs: a backward's gradient is a graph output, and a
    parameter without a gradient would take that buffer as its own, which the next micro-batch's
    replay overwrites before the accumulation reads it. With a gradient of its own, autograd
    adds into it in place."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
