"""`hpo run --gpus` and `--workers-per-gpu`: worker processes for the GPUs of this host (one per
GPU, or N sharing each, every one capped at its share of the GPU's memory), each seeing only its
own GPU, all stopped together by one Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import IO, TextIO

from hpo import live
from hpo.errors import ConfigError, HPOError
from hpo.logs import WORKER_LABEL_ENV
from hpo.stopping import EXIT_INTERRUPTED, StopRequest
from hpo.trainer.memory_share import SHARE_ENV

log = logging.getLogger(__name__)

# Tests only: pretend this host has N GPUs; the workers then train on the CPU.
FAKE_GPUS_ENV = "HPO_TEST_FAKE_GPUS"
# Workers per GPU that `--workers-per-gpu` accepts, and those `auto` tries, most first.
MAX_WORKERS_PER_GPU = 16
AUTO_WORKERS_PER_GPU = (4, 2)
GPUS_RULE = "use auto, none or a list of GPU ids like 0,1,3"


def visible_gpus() -> list[str]:
    """Ids of the GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        return [str(i) for i in range(int(fake))]
    import torch

    count = torch.cuda.device_count()  # NVML-based: does not initialise CUDA here
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()][:count]
    return [str(i) for i in range(count)]


def select_gpus(spec: str, visible: Sequence[str], flag: str = "--gpus") -> list[str]:
    """The GPUs named by --gpus: `auto` (every visible one), `none`, or a list like `0,1,3`.
    An empty list means one CPU worker. `flag`: how messages name the option."""
    spec = spec.strip()
    if spec.lower() == "none":
        return []
    if spec.lower() == "auto":
        return list(visible)
    wanted = [gpu.strip() for gpu in spec.split(",") if gpu.strip()]
    problems = [] if wanted else [f"{flag}: got {spec!r}; {GPUS_RULE}"]
    if len(set(wanted)) != len(wanted):
        problems.append(f"{flag}: got {spec!r}; a GPU is listed twice")
    words = [gpu for gpu in wanted if gpu.lower() in ("auto", "none")]
    if words:
        problems.append(
            f"{flag}: got {spec!r}; {words[0].lower()} stands alone and cannot be combined with "
            f"GPU ids: give {flag} {words[0].lower()} or a list of ids like 0,1,3"
        )
    ids = [gpu for gpu in wanted if gpu not in words]
    not_ids = [gpu for gpu in ids if gpu not in visible and not _looks_like_gpu_id(gpu)]
    if not_ids:
        problems.append(
            f"{flag}: got {spec!r}; {', '.join(map(repr, not_ids))} is not a GPU id: GPU ids "
            f"are the whole numbers nvidia-smi lists (0, 1, ...), e.g. {flag} 0,1,3"
        )
    missing = list(dict.fromkeys(gpu for gpu in ids if gpu not in visible and gpu not in not_ids))
    if missing:
        seen = ", ".join(visible) if visible else "none"
        problems.append(
            f"{flag}: GPU {', '.join(missing)} is not visible on this host (visible: {seen}); "
            f"use {flag} auto, or {flag} none to run on the CPU"
        )
    if problems:
        raise ConfigError(problems, "command line" if flag.startswith("--") else "hpo.run")
    return wanted


def gpu_groups(gpus: Sequence[str], per_trial: int, flag: str = "--gpus") -> list[str]:
    """The GPUs of each worker when a trial spans `per_trial` of them
    (training.distributed.gpus_per_trial): consecutive ids, as CUDA_VISIBLE_DEVICES lists
    them ("0,1"). GPUs left over (5 GPUs, 2 per trial) stay idle, and the log says so."""
    if per_trial == 1 or not gpus:
        return list(gpus)
    if len(gpus) < per_trial:
        raise ConfigError(
            [
                f"{flag}: {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({', '.join(gpus)}) for "
                f"trials of {per_trial} (training.distributed.gpus_per_trial): give at least "
                f"{per_trial} GPUs, or lower gpus_per_trial"
            ],
            "command line" if flag.startswith("--") else "hpo.run",
        )
    workers = len(gpus) // per_trial
    groups = [",".join(gpus[i * per_trial : (i + 1) * per_trial]) for i in range(workers)]
    idle = gpus[workers * per_trial :]
    if idle:
        log.warning(
            "GPU %s left idle: %d GPUs make %d trials of %d",
            ", ".join(idle),
            len(gpus),
            workers,
            per_trial,
        )
    return groups


def _looks_like_gpu_id(name: str) -> bool:
    """A GPU id as CUDA_VISIBLE_DEVICES may name one: an index, or a GPU or MIG UUID."""
    return (name.isascii() and name.isdigit()) or name.startswith(("GPU-", "MIG-"))


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The `hpo run` arguments for one worker: the user's, without --gpus and --workers-per-gpu."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--gpus", "--workers-per-gpu"):
            skip = True
        elif not arg.startswith(("--gpus=", "--workers-per-gpu=")):
            out.append(arg)
    return out


def choose_workers_per_gpu(
    config: str, gpu: str, largest_batch: int, search_bound: int | None = None
) -> tuple[int, str]:
    """`--workers-per-gpu auto`: the most workers (4, then 2) whose share of the GPU still holds
    the search space's largest effective batch in one micro-batch, so that sharing never makes
    a trial accumulate more steps than it would alone; else 1. Each share is measured by the
    batch finder (`hpo batch-size`) in a process of its own on `gpu`, so this one holds no CUDA
    context, searching no further than `search_bound` (what the decision needs). Returns the
    number and why."""
    for workers in AUTO_WORKERS_PER_GPU:
        chosen = _largest_batch_within(config, gpu, 1 / workers, search_bound)
        if chosen >= largest_batch:
            return workers, (
                f"a 1/{workers} share of GPU {gpu} fits a physical batch of {chosen}, the largest "
                f"effective batch of the search space is {largest_batch}"
            )
    return 1, f"a 1/2 share of GPU {gpu} does not fit the largest effective batch ({largest_batch})"


def _largest_batch_within(config: str, gpu: str, share: float, bound: int | None) -> int:
    device = "cpu" if os.environ.get(FAKE_GPUS_ENV) else "cuda"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, SHARE_ENV: repr(share)}
    command = [
        sys.executable,
        "-m",
        "hpo",
        "batch-size",
        "--config",
        config,
        "--device",
        device,
        "--json",
        "--quiet",
    ]
    if bound is not None:
        command += ["--max", str(bound)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: not even one example fits in the share
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HPOError(
            f"--workers-per-gpu auto: the batch search on GPU {gpu} failed ({last}); "
            "give a number instead, e.g. --workers-per-gpu 2"
        )
    return int(json.loads(done.stdout)["chosen"])


def run_workers(
    gpus: Sequence[str],
    argv: Sequence[str],
    per_gpu: int = 1,
    stop: StopRequest | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> int:
    """Start `per_gpu` workers (`hpo run`) on each GPU, each capped at 1/per_gpu of its memory,
    and wait for all of them. Ctrl-C or SIGTERM is passed to every worker once; each hands its
    running trial back and exits. The caller's `stop` learns of the signal, and its handlers
    are back in place on return (called outside the main thread, where no handler can be
    set, the workers are waited for without). `extra_env`: added to each worker's."""

    device = "cpu" if os.environ.get(FAKE_GPUS_ENV) else "cuda"
    threads = max(1, (os.cpu_count() or 1) // (len(gpus) * per_gpu))
    # On a terminal: a progress line per worker, drawn here below the workers' log lines.
    block = (
        live.LiveBlock(sys.stderr) if live.wanted(sys.stderr) and "--quiet" not in argv else None
    )
    workers = []
    labels = []
    for gpu in gpus:
        for k in range(per_gpu):
            name = gpu.replace(",", "+")  # a worker of a trial across GPUs: gpu0+1
            label = f"gpu{name}" if per_gpu == 1 else f"gpu{name}.{k}"
            env = {
                **os.environ,
                **(extra_env or {}),
                "CUDA_VISIBLE_DEVICES": gpu,
                WORKER_LABEL_ENV: label,
            }
            env[live.RELAY_ENV if block else live.OFF_ENV] = "1"
            if per_gpu > 1:
                env[SHARE_ENV] = repr(1 / per_gpu)
            env.setdefault("OMP_NUM_THREADS", str(threads))  # the host's cores, shared
            command = [sys.executable, "-m", "hpo", *worker_argv(argv), "--device", device]
            # Each worker in a session of its own: a terminal's Ctrl-C reaches the launcher alone,
            # which passes it on once (with the terminal's too, a worker would get it twice, and
            # a second Ctrl-C stops at once).
            workers.append(
                subprocess.Popen(
                    command,
                    env=env,
                    start_new_session=True,
                    text=True,
                    errors="replace",
                    stderr=subprocess.PIPE if block else None,
                    stdout=subprocess.PIPE if block and sys.stdout.isatty() else None,
                )
            )
            labels.append(label)
    shared = f", {per_gpu} per GPU, each with 1/{per_gpu} of its memory" if per_gpu > 1 else ""
    # Logged before the progress block is drawn, so that this line cannot land inside it.
    log.info("started %d workers: GPUs %s%s", len(workers), ", ".join(gpus), shared)
    readers = [
        threading.Thread(target=_relay_lines, args=(pipe, label, block, out), daemon=True)
        for worker, label in zip(workers, labels, strict=True)
        for pipe, out in ((worker.stderr, None), (worker.stdout, sys.stdout))
        if block is not None and pipe is not None
    ]
    for reader in readers:
        reader.start()
    received: list[str] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    handlers = None
    if threading.current_thread() is threading.main_thread():
        handlers = signal.signal(signal.SIGINT, forward), signal.signal(signal.SIGTERM, forward)
    try:
        codes = [worker.wait() for worker in workers]
    finally:
        if handlers is not None:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
    if received and stop is not None:
        stop.note(received[0])
    for reader in readers:
        reader.join(timeout=5)
    if block is not None:
        block.close()
    for label, code in zip(labels, codes, strict=True):
        if code not in (0, EXIT_INTERRUPTED):
            log.warning("the worker %s exited with code %d", label, code)
    if received:
        return EXIT_INTERRUPTED if received[0] == "SIGINT" else 0
    return next((code for code in codes if code != 0), 0)


def _relay_lines(
    pipe: IO[str], label: str, block: live.LiveBlock | None, out: TextIO | None
) -> None:
    """A worker's stderr (or its stdout, printed on `out`), line by line, to the block that
    keeps its progress line below."""
    if block is None:
        return
    for line in pipe:
        block.feed(label, line.rstrip("\n"), out)
