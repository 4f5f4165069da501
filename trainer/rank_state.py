"""One checkpoint for every rank of a resumed run: the main rank's. A host without the trial's
shared folder has no checkpoint, or an older one; its ranks receive the main rank's over the
process group, so that every rank resumes at the same step with the same state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RankGroup(Protocol):
    """What this module asks of trainer.distributed's RankGroup."""

    @property
    def rank(self) -> int: ...

    @property
    def main(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def is_main(self) -> bool: ...

    def any(self, flag: bool) -> bool: ...

    def from_main(self, value: Any) -> Any: ...


def checkpoint_identity(state: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What tells two checkpoints of one job apart: the step, and the seconds trained at it
    (a float from the clock: two writes at the same step differ in it)."""
    if state is None:
        return None
    run = state.get("run") or {}
    return (run.get("step"), run.get("train_s"))


def agreed_state(group: RankGroup, local: dict[str, Any] | None) -> dict[str, Any] | None:
    """The main rank's checkpoint on every rank (None on all: the main rank has none, and every
    rank starts over). A rank keeps its `local` state when it is that very checkpoint; the
    others receive it from the main rank."""
    main_identity = group.from_main(checkpoint_identity(local))
    if main_identity is None:
        return None
    lacking = checkpoint_identity(local) != main_identity
    if not group.any(lacking):
        return local
    received = broadcast_state(group, local if group.is_main else None)
    if not lacking:
        return local
    had = "none" if local is None else f"the one of step {local['run']['step']}"
    log.info(
        "rank %d: this host's folder lacks the checkpoint of step %s (it has %s): resuming "
        "from the main rank's, received from it",
        group.rank,
        main_identity[0],
        had,
    )
    return received


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor was in a state sent without its tensors: its place among those sent
    after it."""

    index: int


def broadcast_state(group: RankGroup, state: Any) -> Any:
    """The main rank's `state` (dicts, lists and tuples of tensors and plain values) on every
    rank, its tensors on the CPU: the structure goes as one object, then each tensor on its own
    as bytes (through group.device: NCCL sends CUDA tensors only), so no rank ever holds the
    whole state pickled."""
    tensors: list[torch.Tensor] = []
    sent = None
    if group.is_main:
        hollow = _hollowed(state, tensors)
        sent = (hollow, [(tuple(t.shape), t.dtype) for t in tensors])
    hollow, specs = group.from_main(sent)
    received: list[torch.Tensor] = []
    for index, (shape, dtype) in enumerate(specs):
        if group.is_main:
            data = tensors[index].detach().contiguous().reshape(-1).view(torch.uint8)
            data = data.to(group.device)
        else:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            data = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        if data.numel():
            dist.broadcast(data, src=group.main)
        if not group.is_main:
            received.append(data.cpu().view(dtype).reshape(shape))
    return state if group.is_main else _filled(hollow, received)


def _hollowed(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by its slot; the tensors appended to `tensors`."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1)
    if isinstance(value, dict):
        return {k: _hollowed(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_hollowed(v, tensors) for v in value)
    return value


def _filled(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A hollowed state with its tensors put back."""
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _filled(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_filled(v, tensors) for v in value)
    return value
