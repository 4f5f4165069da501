"""This worker's share of its GPU's memory, as its launcher set it (hpo run --workers-per-gpu);
without torch, so that a worker reads it without importing torch."""

from __future__ import annotations

import math
import os

SHARE_ENV = "HPO_GPU_MEMORY_SHARE"


def memory_share() -> float:
    """This worker's share of its device's memory (SHARE_ENV), 1.0 when it has the device alone."""
    value = os.environ.get(SHARE_ENV, "").strip()
    if not value:
        return 1.0
    try:
        share = float(value)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise ValueError(f"${SHARE_ENV} is {value!r}; it must be a number in (0, 1], e.g. 0.5")
    return share
