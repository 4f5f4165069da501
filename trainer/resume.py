"""What a checkpoint of a training run holds, and how a run is put back from one: weights (a
LoRA run's adapter and head only), optimizer, scheduler, batch sizes, progress and RNG states, as
tensors and plain values only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hpo.trainer.checkpoint import job_fingerprint, rng_state, set_rng_state
from hpo.trainer.config import TrainJob
from hpo.trainer.evaluation import Evaluation
from hpo.trainer.peft_adapters import load_trained_state, trained_state
from hpo.trainer.progress import Progress

# Settings that change how a run is computed, not what it computes: a checkpoint stays valid.
RESUMABLE_ACROSS = frozenset(
    {
        "physical_batch_size",
        "eval_batch_size",
        "device",
        "num_workers",
        "log_every_steps",
        "batch_search_start",
        "batch_search_max",
        "batch_safety_margin",
        "gradient_checkpointing",  # recomputes the same activations: the same gradients
    }
)
# Settings added after checkpoints existed, with the value every earlier run had: left out of
# the fingerprint at that value, so a retry after an upgrade still resumes its checkpoint.
_ADDED_LATER: dict[str, dict[str, Any]] = {
    "training": {"lr_schedule": "linear", "distributed": None},
    "model": {"dropout": None, "factory": None},
}


def run_fingerprint(job: TrainJob, label_names: list[str], examples: int) -> str:
    """Identifies the job a checkpoint belongs to: a run resumes only a state of the same job."""
    training = _fingerprinted(dataclasses.asdict(job.training), "training")
    return job_fingerprint(
        {
            "training": {k: v for k, v in training.items() if k not in RESUMABLE_ACROSS},
            "model": _fingerprinted(dataclasses.asdict(job.model), "model"),
            "data": dataclasses.asdict(job.data),
            "task": job.task,
            "labels": label_names,
            "examples": examples,
        }
    )


def _fingerprinted(settings: dict[str, Any], section: str) -> dict[str, Any]:
    earlier = _ADDED_LATER[section]
    return {k: v for k, v in settings.items() if not (k in earlier and v == earlier[k])}


@dataclass
class TrainingParts:
    """The objects of a run whose state a checkpoint holds, besides its progress."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None


@dataclass
class BatchSizes:
    """Sizes that out-of-memory recoveries may have lowered: a resumed run keeps them."""

    physical_batch_size: int
    eval_batch_size: int
    oom_recoveries: int


def training_state(
    fingerprint: str, parts: TrainingParts, sizes: BatchSizes, progress: Progress, train_s: float
) -> dict[str, Any]:
    """The whole state of a run, `train_s` seconds of training in."""
    return {
        "fingerprint": fingerprint,
        "model": trained_state(parts.model),  # the frozen base is rebuilt, never saved
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        **dataclasses.asdict(sizes),
        "run": progress_state(progress, train_s),
        "rng": rng_state(),
    }


def restore_training(state: dict[str, Any], parts: TrainingParts, progress: Progress) -> BatchSizes:
    """Load a saved state into the run's objects and progress; the RNGs last, so that nothing
    here draws from them after they are set."""
    load_trained_state(parts.model, state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.scaler is not None and state["scaler"] is not None:
        parts.scaler.load_state_dict(state["scaler"])
    restore_progress(progress, state["run"])
    set_rng_state(state["rng"])
    return BatchSizes(
        state["physical_batch_size"], state["eval_batch_size"], state["oom_recoveries"]
    )


def progress_state(progress: Progress, train_s: float) -> dict[str, Any]:
    """Counters, evaluations and the loss history; the best evaluation by its index."""
    return {
        "step": progress.step,
        "samples": progress.samples,
        "tokens": progress.tokens,
        "train_s": train_s,
        "evaluations": [dataclasses.asdict(e) for e in progress.evaluations],
        "best_index": progress.best.index if progress.best else None,
        "since_best": progress.since_best,
        "loss_history": list(progress.meter.history),
    }


def restore_progress(progress: Progress, saved: dict[str, Any]) -> None:
    progress.step, progress.samples, progress.tokens = (
        saved["step"],
        saved["samples"],
        saved["tokens"],
    )
    progress.train_s, progress.since_best = saved["train_s"], saved["since_best"]
    progress.meter.history = list(saved["loss_history"])
    progress.evaluations = [Evaluation(**e) for e in saved["evaluations"]]
    best_index = saved["best_index"]
    progress.best = next((e for e in progress.evaluations if e.index == best_index), None)
