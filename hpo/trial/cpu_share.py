"""The cores of one host, shared by the hpo workers that train on its CPU, however they were
started: each live worker holds a lock on a file of its own in a folder of this host, and each
trial takes its share of the cores (torch's intra-op threads) when it starts.

A worker's file is locked (flock) for as long as the worker lives: the kernel drops the lock
when the process ends, by kill -9 too, so an unlocked file is a dead worker's and is removed by
whoever finds it. A worker whose thread count is set by the user (OMP_NUM_THREADS, or the share
`hpo run --gpus` gives the workers it starts) keeps it, and the others share what it leaves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)

# The thread settings a user makes: any of them set means this worker's count is theirs.
THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_SUFFIX = ".worker"
# A worker's entry is made under a temporary name and locked a moment later, so an unlocked
# temporary entry is taken for a dead worker's only once it is this old.
STALE_TEMPORARY_S = 60.0
_AUTO = "auto"


@dataclass(frozen=True)
class CpuShare:
    """One trial's part of the host: `threads` of the host's `host_threads`, with `workers`
    hpo workers (this one included) training on its CPU."""

    threads: int
    host_threads: int
    workers: int

    def why(self) -> str:
        return f"{self.workers} hpo worker{'s' if self.workers > 1 else ''} on this host"


def workers_dir() -> Path:
    """The registry: under hpo's caches of this host ($HPO_CACHE_DIR or ~/.cache/hpo, where the
    compiled kernels the host's workers share live too), one folder per host name, in case
    that folder is a home folder on a network disk that several hosts share."""
    from hpo.trainer.digests import hpo_cache_root

    return hpo_cache_root() / "cpu-workers" / _safe_name(socket.gethostname())


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip(".") or "host"


def host_threads() -> int:
    """The cores this process may run on (its CPU affinity: a cpuset or taskset counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def user_threads() -> int | None:
    """The thread count the user (or `hpo run --gpus`) set for this process, if any."""
    for name in THREAD_ENVS:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


@contextlib.contextmanager
def registered(folder: Path | None = None, threads: int | None = None) -> Iterator[Path | None]:
    """This process, counted as a CPU worker of the host while the block runs; `threads`: a
    fixed count of its own (by default the user's setting, if any), else it shares. Yields its
    file, or None when the folder cannot be used (the worker then runs unshared, said once)."""
    folder = workers_dir() if folder is None else folder
    fixed = user_threads() if threads is None else threads
    try:
        entry, handle = _register(folder, fixed)
    except OSError as e:
        log.warning(
            "cannot register this worker in %s (%s): its trials will not share the "
            "host's cores with other workers",
            folder,
            e.strerror or e,
        )
        yield None
        return
    try:
        yield entry
    finally:
        entry.unlink(missing_ok=True)
        handle.close()


def _register(folder: Path, fixed: int | None) -> tuple[Path, TextIO]:
    """Write the entry under a temporary name, locked before it is written, and rename it into
    place: a reader never sees an entry that is not yet locked."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if folder.stat().st_uid != os.getuid():  # another user's (made first in a shared /tmp)
        raise PermissionError(errno.EACCES, "the folder belongs to another user")
    name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    temporary = folder / f".{name}.tmp"
    handle = open(temporary, "w", encoding="utf-8")  # held open: it holds the lock
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.write(_AUTO if fixed is None else str(fixed))
        handle.flush()
        entry = folder / f"{name}{_SUFFIX}"
        temporary.rename(entry)
    except OSError:
        handle.close()
        temporary.unlink(missing_ok=True)
        raise
    return entry, handle


def live_workers(folder: Path) -> list[tuple[str, int | None]]:
    """The live CPU workers, by entry name in a fixed order, with their thread count (None: it
    shares); the files of dead workers are removed on the way."""
    try:
        paths = sorted(folder.iterdir())
    except OSError:
        return []
    found: list[tuple[str, int | None]] = []
    for path in paths:
        if path.name.endswith(_SUFFIX):
            held = _held(path)
            if held is not None:
                found.append((path.name, None if held == _AUTO else int(held)))
        elif path.name.endswith(".tmp") and _older_than(path, STALE_TEMPORARY_S):
            _held(path)  # a worker killed while it registered: removed unless still locked
    return found


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


def _held(path: Path) -> str | None:
    """The entry's text while its worker lives (holds the lock); None, after removing it, when
    its worker is gone (or it vanished meanwhile)."""
    try:
        with open(path, encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = handle.read().strip()
                return text if text.isdigit() else _AUTO
            path.unlink(missing_ok=True)  # a lock we could take: its worker is dead
            return None
    except OSError:
        return None


def share_for(own: int, workers: list[int | None], cores: int) -> CpuShare:
    """The threads of the `own`-th live worker (a sharing one: its count is None): the cores
    that workers with a count of their own leave, split evenly among the sharing ones (the
    first in the registry's order take the remainder), at least one each."""
    fixed = sum(count for count in workers if count is not None)
    sharing = [i for i, count in enumerate(workers) if count is None]
    base, extra = divmod(max(0, cores - fixed), len(sharing))
    threads = base + (1 if sharing.index(own) < extra else 0)
    return CpuShare(max(1, threads), cores, len(workers))


def trial_share(entry: Path) -> CpuShare | None:
    """The share, for the trial starting now, of the worker registered as `entry`; None when
    its count is fixed (the user's), or the entry is gone (the folder was wiped)."""
    workers = live_workers(entry.parent)
    names = [name for name, _ in workers]
    if entry.name not in names or workers[names.index(entry.name)][1] is not None:
        return None
    return share_for(names.index(entry.name), [count for _, count in workers], host_threads())
