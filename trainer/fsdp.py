"""One rank of a sharded run (`strategy: fsdp`, torch's FSDP2 `fully_shard`): each rank holds
1/N of the weights, gradients and optimizer state, and checkpoints its share with
torch.distributed.checkpoint. The rest is trainer.distributed's data-parallel rank.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hpo.trainer.checkpoint import CheckpointStore, rng_state, set_rng_state
from hpo.trainer.distributed import DistributedTrainer
from hpo.trainer.errors import ModelError
from hpo.trainer.files import SHARDED_NAME, SHARDED_STATE_DIR, drop_sharded_states
from hpo.trainer.loop import OnEvaluation, Trainer
from hpo.trainer.memory import (
    OutOfMemoryAtBatchOne,
    is_oom,
    sharded_evaluation_oom_due,
    sharded_oom_due,
)
from hpo.trainer.peft_adapters import is_adapted, parameter_counts
from hpo.trainer.progress import Progress
from hpo.trainer.result import TrainResult
from hpo.trainer.resume import BatchSizes, progress_state, restore_progress
from hpo.trainer.step import optimizer_step

log = logging.getLogger(__name__)


class ShardedStepOutOfMemory(OutOfMemoryAtBatchOne):
    """A rank of a sharded run ran out of memory in a training step at `physical_batch_size`.
    Unlike a data-parallel step it cannot be redone in place: the forward and backward gather
    and scatter weights with every rank, so the others are already waiting in a collective
    the failed one never joins. The rank ends; trainer.launch then starts every rank again
    from the last checkpoint at half the batch (at batch 1, the run ends)."""

    def __init__(self, message: str, physical_batch_size: int = 1) -> None:
        super().__init__(message)
        self.physical_batch_size = physical_batch_size

    def __reduce__(self) -> tuple[Any, ...]:  # it crosses the rank's pipe whole
        return type(self), (str(self), self.physical_batch_size)


class ShardedEvaluationOutOfMemory(OutOfMemoryAtBatchOne):
    """A rank of a sharded run ran out of memory evaluating at `eval_batch_size`. As in a step
    (ShardedStepOutOfMemory), the pass cannot be halved and redone in place: every forward
    gathers the weights from all ranks, and the others already wait in a gather this rank never
    joins. The rank ends; trainer.launch starts every rank again from the last checkpoint at
    the same physical batch and half the evaluation batch (a resumed run trains the same
    steps to the same weights, so the evaluation redone is the one that failed)."""

    def __init__(self, message: str, eval_batch_size: int = 1) -> None:
        super().__init__(message)
        self.eval_batch_size = eval_batch_size

    def __reduce__(self) -> tuple[Any, ...]:  # it crosses the rank's pipe whole
        return type(self), (str(self), self.eval_batch_size)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded each on its own, innermost first: a transformers model's repeated
    blocks (the classes its `_no_split_modules` names, e.g. BertLayer), else the children of
    its longest ModuleList (a model of the user's factory); none for a model without either."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        lists = [list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        blocks = max(lists, key=len) if lists else []
    # fully_shard wants a block's inner blocks sharded before it: modules() lists parents first.
    return blocks[::-1]


def untied_input_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """A transformers model's input embeddings, sharded as a unit of their own when no other
    module shares their weight (a causal LM's tied head does: those stay with the root). Left
    in the root, a large vocabulary would be gathered whole for the whole step."""
    try:
        embeddings = model.get_input_embeddings()  # type: ignore[operator]
        head = model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if not isinstance(embeddings, torch.nn.Module):
        return None
    if head is not None and getattr(head, "weight", None) is getattr(embeddings, "weight", 0):
        return None
    return embeddings


def precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16: each block's weights gathered and computed in bf16, gradients reduced in fp32 (the
    sharded weights and AdamW's state stay fp32, as under autocast); otherwise as they are
    (fp16 keeps fp32 weights under autocast with the loss scaler, as a one-GPU run does; the
    ranks agree on a skipped step: see step.loss_scaler)."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: torch.nn.Module, world_size: int, device: torch.device, precision: str
) -> None:
    """Shard each transformer block, the input embeddings (when untied), then the root (the
    head and what is left), over all ranks, as torch's FSDP2 guide recommends: a unit's weights
    are gathered just before its forward and backward and freed after. Gradients are summed
    over the ranks, not averaged: each rank's loss is already divided by the counted units of
    the whole step (as in DDP)."""
    mesh = init_device_mesh(device.type, (world_size,))
    policy = precision_policy(precision)
    units = transformer_blocks(model)
    embeddings = untied_input_embeddings(model)
    inside_a_block = any(embeddings is m for unit in units for m in unit.modules())
    if embeddings is not None and not inside_a_block:  # BERT's are: BertEmbeddings is a block
        units.append(embeddings)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no other)


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name: shape and dtype


def _said(entry: tuple[tuple[int, ...], torch.dtype] | None) -> str:
    return "none" if entry is None else f"{list(entry[0])} {entry[1]}"


def _layout(model: torch.nn.Module) -> Layout:
    """Each parameter's and buffer's shape and dtype, by name."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors}


def match_rank0_layout(model: torch.nn.Module, whole: torch.nn.Module | None) -> None:
    """`model` (on the meta device) checked against rank 0's `whole` one (None on the other
    ranks), tensor by tensor: a loaded checkpoint may keep some weights in another dtype than
    its config says (those are cast: on the meta device that costs nothing); other shapes or
    names are a ModelError on every rank at once."""
    sent: list[Any] = [_layout(whole) if whole is not None else None]
    dist.broadcast_object_list(sent, src=0)
    reference: Layout = sent[0]
    own = _layout(model)
    names = own.keys() | reference.keys()
    differ = sorted(name for name in names if own.get(name) != reference.get(name))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shape, dtype = reference.get(name, (tuple(tensor.shape), tensor.dtype))
        if shape == tuple(tensor.shape) and dtype != tensor.dtype:
            tensor.data = tensor.data.to(dtype)
            differ.remove(name)
    if differ:
        name = differ[0]
        raise ModelError(
            f"strategy fsdp: the model built without its weights differs from the one rank 0 "
            f"built at {name} ({_said(own.get(name))} here, {_said(reference.get(name))} on "
            "rank 0), so rank 0's weights cannot be shared out; strategy ddp builds the model "
            "on every rank"
        )


def non_persistent_buffers(model: torch.nn.Module) -> list[str]:
    """The buffers a state dict leaves out (BERT's position_ids, a rotary embedding's
    inv_freq): computed when the model is built, so the meta device left them empty."""
    saved = set(model.state_dict())
    return [name for name, _ in model.named_buffers() if name not in saved]


def load_from_rank0(
    model: torch.nn.Module,
    whole: torch.nn.Module | None,
    unsaved_buffers: list[str],
    device: torch.device,
) -> None:
    """The sharded `model` (on the meta device) given memory on `device` and rank 0's weights
    and buffers (`whole`: rank 0's model, None on the others): each rank keeps its share of
    each weight as it arrives, one tensor at a time. Tied weights stay one parameter."""
    model.to_empty(device=device)
    full = whole.state_dict() if whole is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    sources = dict(whole.named_buffers()) if whole is not None else {}
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name in unsaved_buffers:
            if name in sources:
                buffers[name].copy_(sources[name])
            dist.broadcast(buffers[name], src=0)


def held_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of weights and optimizer state this rank holds (a sharded tensor: its own shard)."""
    tensors: list[torch.Tensor] = [*model.parameters()]
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


class ShardedTrainer(DistributedTrainer):
    """The data-parallel rank with the model sharded (FSDP2). What differs:

    - every rank evaluates the whole evaluation split in step with the others (each forward
      gathers the weights from every rank), so the metrics are the one-process metrics on
      every rank; rank 0's verdict is followed, as in DDP;
    - a checkpoint is written by every rank together: its share of the weights and optimizer
      state with torch.distributed.checkpoint into a folder of its own, then rank 0's state file
      (schedule, progress, RNGs) naming that folder. A retry with the same N resumes it;
    - the best model is gathered whole onto rank 0's host memory and saved as a plain model
      (hpo predict loads it as any other);
    - an out-of-memory error in a step or an evaluation ends the ranks (see
      ShardedStepOutOfMemory, ShardedEvaluationOutOfMemory); the ones started again say so
      with restarted_after_oom."""

    oom_restarts = 0  # times every rank was started again after an OOM in a step or evaluation
    _step_number = 0  # the run's step being trained (1-based)
    _evaluation_number = 0  # the run's evaluation being made (1-based)

    def restarted_after_oom(self, restarts: int) -> None:
        """The ranks were started again `restarts` times after an OOM, each at half the
        physical or evaluation batch (already this trainer's): a checkpoint resumes at no
        larger a batch."""
        self.oom_restarts = self.step_oom_recoveries = restarts

    def _build_model_and_optimizer(self) -> None:
        """Every rank builds the model on the meta device (shapes, no memory) and shards it;
        rank 0 alone also builds it whole, as a one-process run does (loaded, or initialised
        from the trial's seed), and sends each rank its share. A host of N ranks then holds
        the whole model once, not N times (a 7B model: 28 GB, not N x 28 GB)."""
        meta = torch.device("meta")
        self.model = self._fresh_model(meta).to(meta)  # a factory's: built, then let go
        # Built second, so rank 0's random state after it is a one-process run's. A loaded
        # model stays on the CPU: rank 0's GPU then holds one whole weight at a time.
        whole = self._fresh_model(self.device) if self.group.rank == 0 else None
        match_rank0_layout(self.model, whole)
        self.trainable_params, self.total_params = parameter_counts(self.model)
        if self.job.model.compile:
            log.warning("model.compile is not applied with strategy fsdp (not built yet)")
        self.forward_model, self.graphed = self.model, False
        unsaved = non_persistent_buffers(self.model)
        shard_model(self.model, self.group.world_size, self.device, self.precision)
        load_from_rank0(self.model, whole, unsaved, self.device)
        del whole  # rank 0's whole copy: each rank now holds its share
        self._make_optimizer()

    def _broadcast_weights(self) -> None:
        """Done before sharding (see _build_model_and_optimizer)."""

    # -- one step ------------------------------------------------------------------------------

    def _try_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """The whole step's loss, summed over the ranks. Each backward reduce-scatters its
        gradient into the rank's shard, where the micro-batches accumulate: no whole gradient
        is held between micro-batches. An OOM ends this rank (ShardedStepOutOfMemory)."""
        weights = [1.0 if len(part) else 0.0 for part in self._rank_parts(self._step_indices)]
        units = self._step_units(micro_batches, weights)
        total = torch.zeros((), device=self.device)
        try:
            for batch, weight in zip(micro_batches, weights, strict=True):
                loss = self._micro_loss(batch, units, weight)
                self._backward(loss)
                total += loss.detach()
                if sharded_oom_due(self._step_number, self.oom_recoveries):  # a test hook
                    raise torch.OutOfMemoryError("CUDA out of memory (test hook: sharded step)")
            optimizer_step(self.model, self.optimizer, self.cfg, self.scaler)
        except Exception as e:
            if not is_oom(e):
                raise
            size = self.physical_batch_size
            then = (
                "one example per micro-batch does not fit"
                if size == 1
                else "every rank starts again at half the batch"
            )
            raise ShardedStepOutOfMemory(
                f"out of memory on rank {self.group.rank} in a sharded step at physical batch "
                f"{size}: {then}",
                size,
            ) from e
        return self.group.sum(total)

    def _train_step(
        self, run: Progress, indices: np.ndarray, micro_batches: list[dict[str, torch.Tensor]]
    ) -> None:
        self._step_number = run.step + 1  # for the test hook in _try_step
        super()._train_step(run, indices, micro_batches)

    def _result(self, run: Progress, started: float) -> TrainResult:
        result = super()._result(run, started)
        result.rank_state_bytes = held_state_bytes(self.model, self.optimizer)
        return result

    # -- evaluations, with every rank -----------------------------------------------------------

    def _evaluation_share(self) -> tuple[int, int]:
        return 0, 1  # every batch on every rank: each forward gathers the weights from all

    def evaluate(self) -> dict[str, float]:
        """The whole split on every rank, in one pass (not DDP's split evaluation: see
        _evaluation_share). An OOM ends this rank (ShardedEvaluationOutOfMemory)."""
        size = self.evaluator.batch_size
        try:
            if sharded_evaluation_oom_due(self._evaluation_number, self.oom_restarts):
                # A test hook: the other ranks go on into the first batch's gather.
                raise torch.OutOfMemoryError("CUDA out of memory (test hook: sharded evaluation)")
            return self.evaluator.once(self._evaluation_model())
        except Exception as e:
            if not is_oom(e):
                raise
            then = (
                "one example does not fit"
                if size == 1
                else "every rank starts again at half the evaluation batch"
            )
            raise ShardedEvaluationOutOfMemory(
                f"out of memory on rank {self.group.rank} in a sharded evaluation at "
                f"evaluation batch {size}: {then}",
                size,
            ) from e

    def _evaluate(
        self,
        run: Progress,
        on_evaluation: OnEvaluation | None,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        self._rank_rngs = self.group.gather(rng_state())  # for a checkpoint written now
        self._evaluation_number = len(run.evaluations) + 1  # for the test hook in evaluate
        Trainer._evaluate(self, run, on_evaluation, None)  # every rank: the forward needs all
        self._follow_main(run)
        if checkpoints is None:
            return
        if self.group.from_main(run.best is run.evaluations[-1]):
            self.unsaved_best = self._whole_weights()
        going_on = run.status == "completed" and run.step < self.total_steps
        if going_on and self.group.from_main(checkpoints.state_due()):
            self._checkpoint(run, checkpoints)
        run.segment_start = time.perf_counter()

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        """The best model's weights, gathered whole into rank 0's host memory (every rank takes
        part; the others get nothing): a LoRA run's trained ones only, as best_weights."""
        adapted = is_adapted(self.model)  # the frozen base is not gathered at all
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapted
        )
        state: dict[str, torch.Tensor] = get_model_state_dict(self.model, options=options)  # type: ignore[assignment]
        if adapted:
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trainable}
        return state

    # -- checkpoints, with every rank -----------------------------------------------------------

    def _sharded_state(self) -> dict[str, Any]:
        """The model and optimizer state as DCP saves and loads them; a LoRA run's frozen base
        is left out (it is rebuilt from the base model)."""
        options = StateDictOptions(ignore_frozen_params=is_adapted(self.model))
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model, "optimizer": optimizer}

    def _checkpoint(self, run: Progress, checkpoints: CheckpointStore | None) -> None:
        """Each rank writes its share into `sharded-state.<step>`; once all have, rank 0 writes
        the state file naming it and removes older shares. A crash in between leaves the last
        complete checkpoint as it was."""
        if checkpoints is None:
            return
        self._save_best_model(checkpoints)  # first: the state names this best evaluation
        run.meter.read()  # the partial loss goes to the history, which is saved
        name = f"{SHARDED_STATE_DIR}.{run.step}"
        failed = [r for r in self.group.gather(self._save_shares(checkpoints, name)) if r]
        if failed or not self.group.is_main:
            if failed and self.group.is_main:  # the run's result names what went wrong
                checkpoints.errors.append(failed[0])
            return
        sizes = BatchSizes(self.physical_batch_size, self.eval_batch_size, self.oom_recoveries)
        train_s = run.train_s + self._elapsed_since(run.segment_start)
        state = {
            "fingerprint": self.fingerprint(),
            "sharded": name,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            **dataclasses.asdict(sizes),
            "run": progress_state(run, train_s),
            "rng": rng_state(),
            **self._extra_state(),
        }
        if checkpoints.save_state(state):
            drop_sharded_states(checkpoints.directory, keep=name)

    def _save_shares(self, checkpoints: CheckpointStore, name: str) -> str | None:
        """This rank's share written into the folder `name`; None, or why it was not."""
        started = time.perf_counter()
        folder = checkpoints.directory / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            dcp.save(self._sharded_state(), checkpoint_id=folder)
            return None
        except (OSError, dcp.api.CheckpointException) as e:
            reason = f"sharded checkpoint not written to {folder}: {e}"
            log.warning("%s; training goes on without it", reason)
            return reason
        finally:
            checkpoints.seconds += time.perf_counter() - started

    def _resume(
        self,
        run: Progress,
        checkpoints: CheckpointStore | None,
        on_evaluation: OnEvaluation | None,
    ) -> int | None:
        """Every rank loads its share of the checkpoint the main rank names; the rest as
        Trainer's, from the main rank's state. Where any rank cannot (a host without the
        trial's shared folder lacks the shares), every rank starts over: never some ranks
        resumed and the others fresh, or ranks at different steps."""
        local = checkpoints.load_state(self.fingerprint()) if checkpoints else None
        state = self.group.from_main(local)  # small: the weights and optimizer are in the shares
        folder = _sharded_folder(state, checkpoints)
        if self.group.any(folder is None):
            if state is not None and (folder is None or self.group.is_main):
                log.warning(
                    "rank %d: %s lacks the sharded checkpoint %s whole (a host without the "
                    "trial's shared folder); every rank starts over",
                    self.group.rank,
                    "this host's trial folder" if folder is None else "another rank's host",
                    state.get("sharded"),
                )
            self._follow_main(run)
            return None
        assert state is not None and folder is not None and checkpoints is not None  # noqa: S101
        adapted = is_adapted(self.model)
        shares = self._sharded_state()
        dcp.load(shares, checkpoint_id=folder)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=shares["model"],
            optim_state_dict=shares["optimizer"],
            options=StateDictOptions(ignore_frozen_params=adapted, strict=not adapted),
        )
        sizes = self._restore_rest(state, run)
        self._resumed(run, sizes, checkpoints, on_evaluation)
        run.segment_start = time.perf_counter()
        return run.step

    def _restore_rest(self, state: dict[str, Any], run: Progress) -> BatchSizes:
        """The schedule, scaler, progress and RNGs (restore_training without the weights);
        the RNGs last, so that nothing draws from them after they are set."""
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        restore_progress(run, state["run"])
        set_rng_state(state["rng"])
        self._restored(state)
        return BatchSizes(
            state["physical_batch_size"], state["eval_batch_size"], state["oom_recoveries"]
        )

    def _resumed(
        self,
        run: Progress,
        sizes: BatchSizes,
        checkpoints: CheckpointStore,
        on_evaluation: OnEvaluation | None,
    ) -> None:
        """Trainer's, then rank 0's verdict on the restored evaluations followed. Started
        again after an OOM: at the halved batches, if the checkpoint's are larger (a restart
        after an evaluation's sets the job's evaluation batch)."""
        if self.oom_restarts:
            eval_batch_size = sizes.eval_batch_size
            if self.cfg.eval_batch_size is not None:
                eval_batch_size = min(eval_batch_size, self.cfg.eval_batch_size)
            sizes = BatchSizes(
                min(sizes.physical_batch_size, self.physical_batch_size),
                eval_batch_size,
                max(sizes.oom_recoveries, self.oom_restarts),
            )
        super()._resumed(run, sizes, checkpoints, on_evaluation)
        self._follow_main(run)


def _sharded_folder(
    state: dict[str, Any] | None, checkpoints: CheckpointStore | None
) -> Path | None:
    """The sharded folder `state` names, when this rank's trial folder holds it whole: DCP's
    metadata and every file it names (any rank may read any share). None otherwise."""
    if state is None or checkpoints is None:
        return None
    name = str(state.get("sharded"))  # one hpo writes: never a path out of the folder
    if not SHARDED_NAME.fullmatch(name):
        log.warning("%s names no sharded state hpo writes", checkpoints.state_path)
        return None
    folder = checkpoints.directory / name
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        log.info("no whole sharded checkpoint in %s: %s", folder, e)
        return None
    names = {info.relative_path for info in metadata.storage_data.values()}
    missing = sorted(n for n in names if not (folder / n).is_file())
    if missing:
        log.info("%s lacks %s of the sharded checkpoint", folder, ", ".join(missing))
        return None
    return folder
