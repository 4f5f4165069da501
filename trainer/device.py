"""Where and in what precision training runs: device choice, precision `auto`, TF32, peak memory."""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Any

import torch

from hpo.trainer.errors import DeviceError


def resolve_device(name: str, source: str = "training.device") -> torch.device:
    """The torch device `name` means here; `source` is where the user wrote it, for the error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:  # torch's message lists twenty device types, most not for hpo
        raise DeviceError(
            f"{source} is {name!r}, not a device; use auto, cpu, cuda or cuda:N"
        ) from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{source} is {name!r} but CUDA is not available; use auto or cpu")
    return device


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto: bf16 where CUDA supports it, fp16 on older CUDA, fp32 on the CPU (bf16 is slow)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def configure_backends(device: torch.device, tf32: bool) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True


# The share of the host's cores this process last took (threads, of host threads, why), for
# device_name: torch's thread count is the process's, and so is this note.
_cpu_share: list[tuple[int, int, str]] = []


def use_cpu_share(threads: int, host_threads: int, why: str) -> None:
    """Train on `threads` of the host's `host_threads` (`why`: who uses the rest)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _cpu_share[:] = [(threads, host_threads, why)]


def cpu_threads() -> int:
    """The threads torch's CPU operations use in this process."""
    return torch.get_num_threads()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    if _cpu_share and _cpu_share[0][0] == threads:
        _, host_threads, why = _cpu_share[0]
        return f"cpu ({threads} of {host_threads} threads: {why})"
    return f"cpu ({threads} threads)"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated since the last reset; on the CPU, the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
