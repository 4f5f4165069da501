"""One rank of a data-parallel run (`strategy: ddp`): each optimizer step split evenly across the
ranks, exact accumulation, OOMs agreed so every rank steps down together and redoes the step, and
the decisions (pruning, stopping, checkpoints) taken on rank 0 and followed by all.
trainer.launch starts the ranks.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpo.trainer.batching import collate, plan_epoch
from hpo.trainer.checkpoint import CheckpointStore, rng_state, set_rng_state
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.evaluation import metrics_of
from hpo.trainer.loop import OnEvaluation, ShouldStop, Trainer
from hpo.trainer.memory import none_on_oom, optimizer_oom_due
from hpo.trainer.progress import Progress
from hpo.trainer.rank_state import agreed_state
from hpo.trainer.result import TrainResult
from hpo.trainer.step import (
    grad_accum_steps_for,
    optimizer_step,
    optimizer_step_bytes,
    optimizer_temporary_bytes,
)
from hpo.trainer.user_metrics import UserMetrics

log = logging.getLogger(__name__)

# Gradients are summed in buckets of this many MB, one all-reduce each (0: one per parameter):
# torch DDP's default size is 25; the variable is a knob for a bench or a slow interconnect.
BUCKET_MB_ENV = "HPO_GRAD_BUCKET_MB"


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the trial's process group, and the few collectives the trainer
    needs. Tensors travel on `device` (NCCL wants CUDA tensors; gloo takes the CPU's). The
    main rank reports and decides: rank 0, or across hosts the first rank of the host that runs
    the trial (the rendezvous numbers the hosts in no set order)."""

    rank: int
    world_size: int
    device: torch.device
    main: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == self.main

    @staticmethod
    def leading_rank(leads: bool) -> int:
        """The rank of the one process of the group that says it `leads` (told to all)."""
        said: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(said, leads)
        return said.index(True)

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a host sync: every rank waits for the slowest)."""
        value = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def min(self, value: int) -> int:
        tensor = torch.tensor([value], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks (a new tensor; `tensor` is left as it was)."""
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def broadcast_weights(self, model: torch.nn.Module) -> None:
        """The main rank's parameters and buffers on every rank."""
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                dist.broadcast(tensor, src=self.main)

    def from_main(self, value: Any) -> Any:
        """The main rank's `value`, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=self.main)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


class GradientBuckets:
    """The gradients summed over the ranks in buckets of about `bucket_bytes`: one all-reduce
    per bucket rather than per parameter (a BERT-base has ~200 parameters, a few buckets), as
    torch's DDP module does. Each bucket is copied into a flat buffer, allocated by `allocate`
    before the sum (where the ranks agree that it fit: see _reserve_step_memory) and freed
    after it. 0: one all-reduce per parameter, in place. The sums are the same, element by
    element."""

    def __init__(self, model: torch.nn.Module, device: torch.device, bucket_bytes: int) -> None:
        self.device = device
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0  # bytes in the last bucket
        for param in (p for p in model.parameters() if p.requires_grad):
            nbytes = param.numel() * param.element_size()
            last = self.buckets[-1] if self.buckets else None
            if last and last[0].dtype == param.dtype and size + nbytes <= bucket_bytes:
                last.append(param)
                size += nbytes
            else:
                self.buckets.append([param])
                size = nbytes
        self.flat_numel: dict[torch.dtype, int] = {}  # per dtype: its largest shared bucket
        for bucket in (b for b in self.buckets if len(b) > 1):
            numel, dtype = sum(p.numel() for p in bucket), bucket[0].dtype
            self.flat_numel[dtype] = max(numel, self.flat_numel.get(dtype, 0))
        self.flat: dict[torch.dtype, torch.Tensor] = {}

    def flat_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self.flat.values())

    def allocate(self) -> None:
        """The flat buffers of the next sum (an OOM here changes nothing)."""
        for dtype, numel in self.flat_numel.items():
            if dtype not in self.flat:
                self.flat[dtype] = torch.empty(numel, dtype=dtype, device=self.device)

    def sum(self) -> None:
        """Every gradient summed over the ranks, in place. A parameter without a gradient is
        left out, as the optimizer leaves it; it has none on any rank (the same model and
        code on each), so every rank makes the same all-reduces."""
        for bucket in self.buckets:
            grads = [p.grad for p in bucket if p.grad is not None]
            if len(grads) == 1:
                dist.all_reduce(grads[0], op=dist.ReduceOp.SUM)
            if len(grads) <= 1:
                continue
            flat = self.flat[grads[0].dtype]
            offsets = [0]
            for grad in grads:
                offsets.append(offsets[-1] + grad.numel())
                flat[offsets[-2] : offsets[-1]].copy_(grad.reshape(-1))
            dist.all_reduce(flat[: offsets[-1]], op=dist.ReduceOp.SUM)
            for grad, start, end in zip(grads, offsets, offsets[1:], strict=False):
                grad.copy_(flat[start:end].view_as(grad))
        self.flat = {}  # the optimizer step may use the memory


class OptimizerStepOutOfMemory(Exception):
    """A rank ran out of memory midway through an optimizer step: the ranks' weights may
    differ, so the run cannot go on (every rank raises it; the retry resumes)."""


class DistributedTrainer(Trainer):
    """The one-process Trainer, data-parallel. Every rank plans the same epoch (same seed) and
    takes its share of each step, so the effective batch is exact: physical x accumulation x
    world size. A micro-batch's loss is divided by the counted units (examples or tokens) of the
    whole step over every rank, and the ranks' gradients are summed: the gradient is the
    one-process gradient of the step.

    Why not torch's DistributedDataParallel module: it all-reduces inside the last backward, and
    a rank that runs out of memory there leaves the others waiting in an all-reduce it never
    joins; nor can the step be redone (some buckets were reduced, some not). Here every forward
    and backward is local and followed by an agreement whether any rank failed; only then are
    the gradients summed, in place (an all-reduce that allocates nothing). The price is the
    overlap of that all-reduce with the backward (bench/distributed_scaling.py measures it).

    Evaluation is shared: rank r evaluates batches r, r + world size, ... of the one-process
    evaluation batches, and the main rank adds their outputs up in the one-process order, so
    its metrics are exactly the one-process metrics (no padded or repeated example, the same
    float sums); the pruner, the trackers and the checkpoint live there."""

    def __init__(
        self,
        job: TrainJob,
        data: PreparedData,
        group: RankGroup,
        metric: str | None = None,
        user_metrics: UserMetrics | None = None,
    ) -> None:
        self.group = group  # first: the base class sets the physical batch, which reads it
        self._step_indices = np.zeros(0, dtype=np.int64)
        self._rank_rngs: list[Any] = []
        self.optimizer_steps_taken = 0  # in this process (a test hook counts them)
        self._faults_raised: set[int] = set()
        super().__init__(job, data, metric, user_metrics)
        self._broadcast_weights()
        # Never larger than the optimizer's temporaries (the buffer is free before the step):
        # bucketing then costs no memory at the step's peak, unless the optimizer is fused.
        bucket_bytes = int(float(os.environ.get(BUCKET_MB_ENV) or 25) * 2**20)
        temporaries = optimizer_temporary_bytes(self.optimizer)
        bucket_bytes = min(bucket_bytes, temporaries) if temporaries else bucket_bytes
        self.gradients = GradientBuckets(self.model, self.device, bucket_bytes)
        if not group.is_main:  # dropout masks of their own; the main draws as one process would
            torch.manual_seed(self.cfg.seed + 1 + group.rank)

    def _broadcast_weights(self) -> None:
        """The main rank's weights on every rank: a model factory may not seed its init."""
        self.group.broadcast_weights(self.model)

    # -- the share of each step ----------------------------------------------------------------

    def _use_physical_batch(self, physical_batch_size: int) -> None:
        self.physical_batch_size = physical_batch_size
        share = self.cfg.effective_batch_size // self.group.world_size
        self.grad_accum_steps = grad_accum_steps_for(share, physical_batch_size)

    def _rank_parts(self, indices: np.ndarray) -> list[np.ndarray]:
        """This rank's micro-batches of a step: the same count on every rank (an empty one, in
        the short last step of an epoch, runs a stand-in example at weight 0, so every rank
        takes part in every collective)."""
        shard = np.array_split(indices, self.group.world_size)[self.group.rank]
        largest_shard = -(-len(indices) // self.group.world_size)
        parts = grad_accum_steps_for(largest_shard, self.physical_batch_size)
        return list(np.array_split(shard, parts))

    def _loaded(self, part: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return part if len(part) else indices[:1]

    def _steps(
        self, epoch: int, skip: int = 0
    ) -> Iterator[tuple[np.ndarray, list[dict[str, torch.Tensor]]]]:
        plan = plan_epoch(
            self.data.train.lengths, self.cfg.effective_batch_size, 1, self.cfg.seed, epoch
        )[skip:]
        steps = [np.concatenate(step) for step in plan]
        parts = [self._rank_parts(indices) for indices in steps]
        self.train_sampler.micro_batches = [
            self._loaded(part, indices)
            for indices, step_parts in zip(steps, parts, strict=True)
            for part in step_parts
        ]
        micro_batches = iter(self.train_loader)
        for indices, step_parts in zip(steps, parts, strict=True):
            yield indices, [self._to_device(next(micro_batches)) for _ in step_parts]

    def _split_step(self, indices: np.ndarray) -> list[dict[str, torch.Tensor]]:
        data = self.data
        return [
            self._to_device(
                collate(data.train, self._loaded(part, indices), data.pad_token_id, self.padding)
            )
            for part in self._rank_parts(indices)
        ]

    def _train_step(
        self, run: Progress, indices: np.ndarray, micro_batches: list[dict[str, torch.Tensor]]
    ) -> None:
        self._step_indices = indices  # _try_step weighs its micro-batches by it
        super()._train_step(run, indices, micro_batches)

    # -- one step, with out-of-memory errors agreed across the ranks ---------------------------

    def _try_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """The whole step's loss (summed over the ranks), or None when any rank ran out of
        memory. After each forward and each backward, and before the optimizer step, the ranks
        agree whether one failed, so all of them drop the step together and redo it at half
        the micro-batch."""
        weights = [1.0 if len(part) else 0.0 for part in self._rank_parts(self._step_indices)]
        units = self._step_units(micro_batches, weights)
        total = torch.zeros((), device=self.device)
        for batch, weight in zip(micro_batches, weights, strict=True):
            loss = none_on_oom(functools.partial(self._micro_loss, batch, units, weight))
            if self.group.any(loss is None):
                return None
            assert loss is not None  # noqa: S101 (for mypy: every rank has a loss now)
            done = none_on_oom(functools.partial(self._backward, loss))
            if self.group.any(done is None):
                return None
            total += loss.detach()
        if self.group.any(none_on_oom(self._reserve_step_memory) is None):
            return None
        # Summed in place before the step, so every rank unscales the same gradients: an fp16
        # loss scaler finds an inf on all ranks or on none, and they skip or step together.
        self.gradients.sum()
        self._optimizer_step()
        return self.group.sum(total)

    def _reserve_step_memory(self) -> bool:
        """Allocate the gradient buckets, and (then free) what the optimizer step will, so
        that a rank short of memory fails here, before any weight changed, rather than midway
        through the update (its weights and AdamW state then half updated, unlike the other
        ranks') or in an all-reduce the others have joined."""
        self.gradients.flat = {}  # a failed attempt's, if any
        self.gradients.allocate()
        step = self.optimizer_steps_taken + 1
        if step not in self._faults_raised and optimizer_oom_due(step):
            self._faults_raised.add(step)
            raise torch.OutOfMemoryError(f"CUDA out of memory (test hook: optimizer step {step})")
        # The buckets are freed before the step: it may reuse their memory.
        size = optimizer_step_bytes(self.optimizer) - self.gradients.flat_bytes()
        if size > 0:  # freed at once; CUDA's caching allocator keeps the block for the step
            torch.empty(size, dtype=torch.uint8, device=self.device)
        return True

    def _update(self) -> bool:
        optimizer_step(self.model, self.optimizer, self.cfg, self.scaler)
        return True

    def _optimizer_step(self) -> None:
        """The update; an OOM in it still (the reservation fell short) fails every rank
        together with the reason: the ranks' weights may differ from here on, so the retry
        resumes from the last checkpoint."""
        done = none_on_oom(self._update)
        if self.group.any(done is None):
            failed_ranks = self.group.gather(done is None)  # every rank asks: they all failed
            raise OptimizerStepOutOfMemory(
                f"out of memory inside the optimizer step on rank {failed_ranks.index(True)}, "
                "after the memory for it was reserved: the ranks' weights may differ"
            )
        self.optimizer_steps_taken += 1

    def _step_units(
        self, micro_batches: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> torch.Tensor:
        """The counted units (examples or tokens) of the whole step, over every rank."""
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for batch, weight in zip(micro_batches, weights, strict=True):
            if weight:
                local += self.task.units(batch["labels"])
        return self.group.sum(local).clamp(min=1)  # no counted token: zero loss, not NaN

    def _micro_loss(
        self, batch: dict[str, torch.Tensor], units: torch.Tensor, weight: float
    ) -> torch.Tensor:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with self._autocast():
            logits, labels = self.task.logits(self.forward_model, inputs, labels)
        loss = self.task.loss_sum(logits, labels, self.class_weights, self.cfg.label_smoothing)
        return loss * weight / units

    def _backward(self, loss: torch.Tensor) -> bool:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return True

    # -- evaluation, shared ----------------------------------------------------------------------

    def _evaluation_share(self) -> tuple[int, int]:
        return self.group.rank, self.group.world_size

    def evaluate(self) -> dict[str, float]:
        """Every rank evaluates its share (an OOM on any rank halves the batch on all, and the
        pass starts over); the metrics, on the main rank ({} on the others)."""
        evaluator, model = self.evaluator, self._evaluation_model()
        while True:
            found = none_on_oom(functools.partial(evaluator.share_outputs, model))
            if not self.group.any(found is None):
                break
            evaluator.halve_after_oom()
        shares = self.group.gather(found)
        if not self.group.is_main:
            return {}
        ranks = self.group.world_size
        ordered = [shares[i % ranks][i // ranks] for i in range(evaluator.batch_count)]
        return metrics_of(ordered, self.device, self.task, self.data.label_names, self.user_metrics)

    # -- decisions on rank 0, followed by every rank -------------------------------------------

    def fit(
        self,
        on_evaluation: OnEvaluation | None = None,
        checkpoints: CheckpointStore | None = None,
        should_stop: ShouldStop | None = None,
    ) -> TrainResult:
        """As Trainer.fit; `on_evaluation` and `should_stop` are asked on rank 0 only."""
        main = self.group.is_main
        asked = should_stop if main else None

        def agreed_stop() -> bool:
            stop = self.group.any(bool(asked is not None and asked()))
            if stop:  # every rank checkpoints now: rank 0 writes their RNG states too
                self._rank_rngs = self.group.gather(rng_state())
            return stop

        return super().fit(on_evaluation if main else None, checkpoints, agreed_stop)

    def _evaluate(
        self,
        run: Progress,
        on_evaluation: OnEvaluation | None,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        self._rank_rngs = self.group.gather(rng_state())  # for a checkpoint written now
        if self.group.is_main:  # it evaluates (with the others) and decides
            super()._evaluate(run, on_evaluation, checkpoints)
        else:
            self.evaluate()
        self._follow_main(run)

    def _resume(
        self,
        run: Progress,
        checkpoints: CheckpointStore | None,
        on_evaluation: OnEvaluation | None,
    ) -> int | None:
        """Every rank loads the same state, the main rank's (the weights, optimizer and progress
        are the same on all), then its own RNG; a pruning decision on the restored evaluations
        is rank 0's."""
        resumed_at = super()._resume(run, checkpoints, on_evaluation)
        self._follow_main(run)
        return resumed_at

    def _load_state(self, checkpoints: CheckpointStore | None) -> dict[str, Any] | None:
        """The main rank's checkpoint, on every rank: a rank on a host without the trial's
        shared folder (none there, or an older one) receives it from the main rank."""
        return agreed_state(self.group, super()._load_state(checkpoints))

    def _follow_main(self, run: Progress) -> None:
        """Rank 0's verdict on the run (go on, pruned, early-stopped, diverged) on every rank."""
        status, reason = self.group.from_main((run.status, run.reason))
        if status != run.status:
            run.stop(status, reason)

    def _checkpoint(self, run: Progress, checkpoints: CheckpointStore | None) -> None:
        if self.group.is_main:  # the weights and optimizer state are the same everywhere
            super()._checkpoint(run, checkpoints)

    def _save_best_model(self, checkpoints: CheckpointStore | None) -> None:
        if self.group.is_main:
            super()._save_best_model(checkpoints)

    def _extra_state(self) -> dict[str, Any]:
        return {"rank_rng": self._rank_rngs}

    def _restored(self, state: dict[str, Any]) -> None:
        rngs = state.get("rank_rng") or []
        if len(rngs) == self.group.world_size:
            set_rng_state(rngs[self.group.rank])
