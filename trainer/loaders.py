"""DataLoaders of a training run: worker processes that pad batches, kept alive across epochs and
evaluations, started by fork and deaf to the stop signals the training process handles.
"""

from __future__ import annotations

import multiprocessing.context
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_sharer
from types import TracebackType
from typing import Any

import numpy as np
import torch

from hpo.trainer.batching import BatchCollator, Padding
from hpo.trainer.data import TokenizedSplit

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class PlanSampler:
    """The current epoch's micro-batches, read afresh at every pass over the loader, so one
    loader (and its persistent workers) serves every epoch."""

    def __init__(self) -> None:
        self.micro_batches: list[np.ndarray] = []

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


class _ForkedDeaf(multiprocessing.context.ForkProcess):
    """A loader worker forked with the stop signals blocked: until leave_stop_signals_to_the_
    trainer ignores them, a Ctrl-C or SIGTERM to the whole group would run the training
    process's own handler in the worker (hpo's trial process: exit at once), and the worker's
    death would raise torch's "DataLoader worker exited unexpectedly" from a SIGCHLD handler
    wherever the training process was (most likely what a CI run printed: a thread's KeyError
    in Thread.start, the SIGCHLD handler's exception having landed there)."""

    def start(self) -> None:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _DeafForkContext(multiprocessing.context.ForkContext):
    Process = _ForkedDeaf


# Forked from this process, whatever start method the caller's multiprocessing uses: nothing to
# pickle, and no dependence on a fork server that a signal to the whole group may have stopped.
LOADER_CONTEXT = _DeafForkContext() if sys.platform == "linux" else None


def leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers ignore a Ctrl-C or SIGTERM sent to the whole process group (a
    terminal, Slurm, systemd): the training process checkpoints first and then ends them.
    Forked with both blocked (_ForkedDeaf), they take them again once ignored. Nor do they print
    a traceback when the training process has ended while they were handing it a batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    sys.excepthook = _quiet_when_the_trainer_left(sys.excepthook)


def _quiet_when_the_trainer_left(previous: ExceptHook) -> ExceptHook:
    """A worker hands each batch's tensors over as file descriptors, from a thread of
    multiprocessing's resource_sharer that the training process connects to; the thread
    reports what goes wrong through sys.excepthook and serves on. A training process that
    stops (a stop signal, a trial handed back) may leave mid-handshake: the ConnectionError or
    EOFError is then no error of anyone's (a CI run printed it as a traceback). Everything
    else goes to `previous`."""

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> Any:
        left = isinstance(error, (ConnectionError, EOFError))
        if left and any(
            frame.f_code.co_filename == resource_sharer.__file__
            for frame, _ in traceback.walk_tb(tb)
        ):
            return None
        return previous(kind, error, tb)

    return hook


def num_workers_for(configured: int | None) -> int:
    """The configured worker count, or none: the training process pads its own batches."""
    if configured is not None:
        return configured
    # Padding pre-tokenized ids is a gather and a copy (well under a millisecond a batch). On the
    # CPU extra processes only steal compute; on a GPU they slow an eager step's kernel launches
    # (H200, BERT-base at 512 tokens: 401 samples/s with 4 workers, 494 with none at batch 16,
    # 850 and 865 at batch 64; bench/README.md "Where the H200's time goes").
    return 0


def padding_for(device: torch.device, compiled: bool, max_length: int) -> Padding:
    """Tensor-core friendly widths on CUDA; few shapes (bucketed widths, few recompiles) when
    the model is compiled."""
    return Padding(8 if device.type == "cuda" else 1, buckets=compiled, cap=max_length)


@dataclass(frozen=True)
class LoaderSettings:
    """How every loader of one run is built."""

    pad_token_id: int
    padding: Padding
    num_workers: int
    pin_memory: bool
    seed: int

    def build(
        self, split: TokenizedSplit, batches: Iterable[np.ndarray]
    ) -> torch.utils.data.DataLoader:
        """A loader of `batches` (each a list of example indices of `split`), padded."""
        workers = self.num_workers
        return torch.utils.data.DataLoader(
            BatchCollator(split, self.pad_token_id, self.padding),
            sampler=batches,
            batch_size=None,
            num_workers=workers,
            pin_memory=self.pin_memory,
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers else None,
            multiprocessing_context=LOADER_CONTEXT if workers else None,
            worker_init_fn=leave_stop_signals_to_the_trainer if workers else None,
            # Its own generator: starting an epoch must not draw from the global RNG that
            # dropout uses, or a resumed run would see other dropout masks than the original.
            generator=torch.Generator().manual_seed(self.seed),
        )


def to_device(
    batch: dict[str, torch.Tensor], device: torch.device, non_blocking: bool
) -> dict[str, torch.Tensor]:
    """Every tensor of a batch on `device`; non-blocking from pinned memory."""
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
