"""`hpo run --gpus`: one worker process per GPU of this host, each seeing only its own GPU, all
stopped together by one Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

from hpo.errors import ConfigError
from hpo.logs import WORKER_LABEL_ENV
from hpo.stopping import EXIT_INTERRUPTED

log = logging.getLogger(__name__)

# Tests only: pretend this host has N GPUs; the workers then train on the CPU.
FAKE_GPUS_ENV = "HPO_TEST_FAKE_GPUS"


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


def select_gpus(spec: str, visible: Sequence[str]) -> list[str]:
    """The GPUs named by --gpus: `auto` (every visible one), `none`, or a list like `0,1,3`.
    An empty list means one CPU worker."""
    spec = spec.strip().lower()
    if spec == "none":
        return []
    if spec == "auto":
        return list(visible)
    wanted = [gpu.strip() for gpu in spec.split(",") if gpu.strip()]
    problems = []
    if not wanted:
        problems.append(f"--gpus: got {spec!r}; use auto, none or a list of GPU ids like 0,1,3")
    if len(set(wanted)) != len(wanted):
        problems.append(f"--gpus: got {spec!r}; a GPU is listed twice")
    missing = [gpu for gpu in wanted if gpu not in visible]
    if missing:
        seen = ", ".join(visible) if visible else "none"
        problems.append(
            f"--gpus: GPU {', '.join(missing)} is not visible on this host (visible: {seen}); "
            "use --gpus auto, or --gpus none to run on the CPU"
        )
    if problems:
        raise ConfigError(problems, "command line")
    return wanted


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The `hpo run` arguments for one worker: the user's, without --gpus."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif not arg.startswith("--gpus="):
            out.append(arg)
    return out


def run_workers(gpus: Sequence[str], argv: Sequence[str]) -> int:
    """Start one `hpo run` per GPU and wait for all of them. Ctrl-C or SIGTERM is passed to every
    worker once; each hands its running trial back and exits."""
    device = "cpu" if os.environ.get(FAKE_GPUS_ENV) else "cuda"
    threads = max(1, (os.cpu_count() or 1) // len(gpus))
    workers = []
    for gpu in gpus:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, WORKER_LABEL_ENV: f"gpu{gpu}"}
        env.setdefault("OMP_NUM_THREADS", str(threads))  # the host's cores, shared
        command = [sys.executable, "-m", "hpo", *worker_argv(argv), "--device", device]
        # Their own process group: a terminal's Ctrl-C reaches them once, from here.
        workers.append(subprocess.Popen(command, env=env, start_new_session=True))
    log.info("started %d workers: GPUs %s", len(workers), ", ".join(gpus))
    received: list[str] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    codes = [worker.wait() for worker in workers]
    for gpu, code in zip(gpus, codes, strict=True):
        if code not in (0, EXIT_INTERRUPTED):
            log.warning("the worker on GPU %s exited with code %d", gpu, code)
    if received:
        return EXIT_INTERRUPTED if received[0] == "SIGINT" else 0
    return next((code for code in codes if code != 0), 0)
