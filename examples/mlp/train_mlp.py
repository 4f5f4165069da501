"""A training function in plain PyTorch, tuned by hpo: a small MLP that classifies points of two
interleaved spirals (synthetic data, CPU, seconds a trial). Run it with

    hpo run --config examples/mlp/config.yaml --study mlp

Everything hpo-specific is the context `ctx`: the sampled parameters, the batch split, report
(pruning), should_stop and save/restore (a stopped trial resumes where it was, on any host).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from hpo import TrainingContext

EPOCHS = 12
TRAIN_POINTS, VAL_POINTS = 2048, 512


def spirals(points: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two spirals wound into each other, with noise: a problem a linear model cannot solve."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (points,), generator=generator)
    radius = torch.rand(points, generator=generator) * 3 * math.pi + 0.5
    angle = radius + labels * math.pi
    xy = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1) / 10
    return xy + 0.02 * torch.randn(points, 2, generator=generator), labels


def mlp(hidden_size: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = [nn.Linear(2, hidden_size), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(hidden_size, hidden_size), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden_size, 2))


def train(ctx: TrainingContext) -> dict[str, float]:
    params = ctx.params
    torch.manual_seed(int(params.get("seed", 0)))
    x_train, y_train = spirals(TRAIN_POINTS, seed=1)
    x_val, y_val = spirals(VAL_POINTS, seed=2)
    model = mlp(int(params["hidden_size"]), int(params.get("layers", 2))).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(params["learning_rate"]))
    if ctx.device.type == "cuda":  # the largest pass that fits; nothing runs out on the CPU
        ctx.find_batch_size(lambda size: probe_step(model, x_train, y_train, size, ctx.device))
    first_epoch = 0
    state = ctx.restore()  # a retry of a stopped trial: go on where it saved
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = int(state["epoch"])
    metrics: dict[str, float] = {}
    for epoch in range(first_epoch, EPOCHS):
        order = torch.randperm(TRAIN_POINTS, generator=torch.Generator().manual_seed(epoch))
        for step in order.split(ctx.effective_batch_size):
            optimizer.zero_grad(set_to_none=True)
            # ctx.grad_accum_steps passes of ctx.physical_batch_size examples make one step;
            # each pass's summed loss over the whole step's size gives the exact mean gradient.
            for micro in step.split(ctx.physical_batch_size):
                logits = model(x_train[micro].to(ctx.device))
                loss = F.cross_entropy(logits, y_train[micro].to(ctx.device), reduction="sum")
                (loss / len(step)).backward()
            optimizer.step()
        metrics = evaluate(model, x_val.to(ctx.device), y_val.to(ctx.device))
        ctx.report(metrics, step=epoch)  # raises optuna.TrialPruned when the pruner says so
        if ctx.should_stop:  # SIGTERM or the trial timeout: save, return; a retry resumes
            ctx.save(
                {
                    "epoch": epoch + 1,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                }
            )
            return metrics
    return metrics


def probe_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, size: int, device: torch.device
) -> None:
    """One full step at `size` examples on a copy (the run's own model and optimizer stay
    untouched): forward, backward and the optimizer's first step, which allocates its state."""
    probe = copy.deepcopy(model)
    index = torch.arange(size) % len(x)
    F.cross_entropy(probe(x[index].to(device)), y[index].to(device)).backward()
    torch.optim.AdamW(probe.parameters()).step()


@torch.inference_mode()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    logits = model(x)
    return {
        "val_loss": F.cross_entropy(logits, y).item(),
        "accuracy": (logits.argmax(dim=1) == y).float().mean().item(),
    }
