"""Out-of-memory handling: one predicate for "is this an OOM", freeing memory before a retry,
and a simulated memory budget so the CPU can raise the same OOM a GPU would (a test hook).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from hpo.trainer.memory_share import memory_share

# Set by tests, never by users: a CPU run then raises torch.OutOfMemoryError past this many bytes.
BUDGET_ENV = "HPO_TEST_MEMORY_BUDGET_BYTES"
# Tests only, with BUDGET_ENV: the budget holds on this rank of a distributed run alone (the
# launcher sets RANK), so one rank runs out of memory while the others would not.
BUDGET_RANK_ENV = "HPO_TEST_MEMORY_BUDGET_RANK"
# Tests only: optimizer step N (1-based, counted in this process) of a distributed run runs out
# of memory once, before it changes anything, on the rank BUDGET_RANK_ENV names (every rank
# without it).
OPTIMIZER_OOM_ENV = "HPO_TEST_OPTIMIZER_OOM_AT_STEP"
# Tests only: the run's step N (1-based) of a sharded run runs out of memory after its first
# micro-batch's backward, on the rank BUDGET_RANK_ENV names (every rank without it), until an OOM
# recovery halved the run's physical batch.
SHARDED_OOM_ENV = "HPO_TEST_SHARDED_OOM_AT_STEP"
# Tests only: evaluation N (1-based) of a sharded run runs out of memory as it starts, on the rank
# BUDGET_RANK_ENV names (every rank without it), until the ranks were started again after an OOM.
SHARDED_EVAL_OOM_ENV = "HPO_TEST_SHARDED_OOM_AT_EVALUATION"
# The part of its GPU's memory this worker may use, when several workers share one GPU
# (`hpo run --workers-per-gpu N` sets 1/N for each): a number in (0, 1].

# Allocation failures that cuDNN, cuBLAS and the CPU allocator report as plain RuntimeErrors.
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    # cuDNN's way of saying it could not get workspace memory:
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contig",
    "DefaultCPUAllocator: can't allocate memory",
)


T = TypeVar("T")


class OutOfMemoryAtBatchOne(Exception):
    """Even one example per micro-batch does not fit: the run cannot go on on this device."""


def is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


def none_on_oom(attempt: Callable[[], T]) -> T | None:
    """`attempt()`, or None when it ran out of memory; any other error propagates. Call
    release_memory after a None: by then the error's traceback no longer holds its tensors."""
    try:
        return attempt()
    except Exception as error:
        if not is_oom(error):
            raise
        return None


def release_memory(device: torch.device) -> None:
    """Give memory held for a failed step back, so the next attempt does not fail spuriously.
    Call it outside the `except` block: the exception keeps the failed step's tensors alive."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class MemoryBudget(TorchDispatchMode):
    """Counts the bytes of every tensor storage allocated while active and raises
    torch.OutOfMemoryError when live storage would pass `limit_bytes`, as CUDA would.

    A storage is live while anything but this tracker holds it: autograd's saved tensors and
    gradients count, though no Python object refers to them."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[torch.UntypedStorage, int]] = {}

    def collect(self) -> None:
        """Forget storages that only this tracker still holds."""
        for pointer, (storage, size) in list(self._live.items()):
            if torch._C._storage_Use_Count(storage._cdata) <= 1:
                del self._live[pointer]
                self.current_bytes -= size

    def _new_storages(self, out: Any) -> list[torch.UntypedStorage]:
        found: dict[int, torch.UntypedStorage] = {}
        for value in tree_flatten(out)[0]:
            # A sharded weight (DTensor) has no storage of its own: its local shard has one.
            if isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value):
                storage = value.untyped_storage()
                pointer = storage.data_ptr()
                if pointer and pointer not in self._live:
                    found[pointer] = storage
        return list(found.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        new = self._new_storages(out)
        if not new:
            return out
        self.collect()
        size = sum(storage.nbytes() for storage in new)
        if self.current_bytes + size > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated budget of {self.limit_bytes} bytes): tried to "
                f"allocate {size} bytes with {self.current_bytes} in use"
            )
        for storage in new:
            self._live[storage.data_ptr()] = (storage, storage.nbytes())
        self.current_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


def claim_memory_share(device: torch.device) -> None:
    """Cap this process's CUDA allocations at its share of the GPU; an allocation past it raises
    the same OOM as a full GPU, so the batch finder and the OOM recovery work within the share.
    Call it in the process that trains, before it allocates: it initialises CUDA."""
    share = memory_share()
    if device.type == "cuda" and share < 1:
        # torch wants an index: "cuda" alone (the current device) is refused with a ValueError.
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(share, index)


def budget_from_env() -> int | None:
    """The simulated memory budget of a CPU test run, scaled by the worker's share."""
    value = os.environ.get(BUDGET_ENV)
    only_rank = os.environ.get(BUDGET_RANK_ENV)
    if only_rank is not None and only_rank != os.environ.get("RANK"):
        return None
    return int(int(value) * memory_share()) if value else None


def optimizer_oom_due(step: int) -> bool:
    """Whether the test hook OPTIMIZER_OOM_ENV fails optimizer step `step` on this rank."""
    return _due_here(OPTIMIZER_OOM_ENV, step)


def sharded_oom_due(step: int, oom_recoveries: int) -> bool:
    """Whether the test hook SHARDED_OOM_ENV fails the sharded run's step `step` on this rank."""
    return not oom_recoveries and _due_here(SHARDED_OOM_ENV, step)


def sharded_evaluation_oom_due(evaluation: int, oom_restarts: int) -> bool:
    """Whether the test hook SHARDED_EVAL_OOM_ENV fails the sharded run's evaluation
    `evaluation` on this rank."""
    return not oom_restarts and _due_here(SHARDED_EVAL_OOM_ENV, evaluation)


def _due_here(name: str, step: int) -> bool:
    only_rank = os.environ.get(BUDGET_RANK_ENV)
    return os.environ.get(name) == str(step) and only_rank in (None, os.environ.get("RANK"))


@contextlib.contextmanager
def simulated_budget(device: torch.device) -> Iterator[MemoryBudget | None]:
    """A MemoryBudget on the CPU when the test hook is set; otherwise nothing."""
    limit = budget_from_env()
    if limit is None or device.type != "cpu":
        yield None
        return
    with MemoryBudget(limit) as budget:
        yield budget
