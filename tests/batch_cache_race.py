"""What each process of tests/test_batch_cache.py's race runs: a module of its own that imports
SQLAlchemy and the cache only, so a spawned process starts in a fraction of a second instead of
importing the test module's torch and Optuna (seconds of CPU for each of its 18 processes)."""

from __future__ import annotations

import time

import sqlalchemy as sa

from hpo.storage.batch_cache import BatchSizeCache

KEY = {"model": "abc", "max_length": 128, "device": "NVIDIA H100 80GB HBM3"}


def open_cache(url: str, start: float, size: int) -> int:
    """Open the cache at `start` (every process creates the table at once), record `size`
    and return what the cache then holds."""
    time.sleep(max(0.0, start - time.time()))
    engine = sa.create_engine(url)
    try:
        return BatchSizeCache(engine).record(KEY, size, {"by": size})
    finally:
        engine.dispose()
