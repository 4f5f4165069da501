"""The sha256 of data and model files, each file hashed once per version of it: a cache keyed by
the file's path, size, times and inode, so a worker's startup does not read a large file again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# A file this large is said in the log when it is hashed: a first start may wait on it.
SAID_BYTES = 1 << 30


def hpo_cache_root() -> Path:
    """$HPO_CACHE_DIR, or ~/.cache/hpo: hpo's caches on this host (tokens, compiled kernels)."""
    env = os.environ.get("HPO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hpo"


def content_sha256(path: Path, recursive: bool = True) -> str:
    """A file's sha256 (what `sha256sum` prints); for a folder, the sha256 of its files' relative
    names and sha256s, in name order (`recursive=False`: its top-level files only)."""
    if not path.is_dir():
        return file_sha256(path)
    pattern = "**/*" if recursive else "*"
    files = sorted(p for p in path.glob(pattern) if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path).as_posix()}\0{file_sha256(file)}\n".encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of one file's bytes, read once per version of the file on this host."""
    stat = path.stat()
    # ctime and the inode change with any write or replacement, even one that restores mtime.
    times = f"{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0{stat.st_ino}"
    version = f"{path.resolve()}\0{stat.st_size}\0{times}"
    entry = _cache_folder() / hashlib.sha256(version.encode()).hexdigest()[:32]
    cached = _read_entry(entry)
    if cached is not None:
        return cached
    if stat.st_size >= SAID_BYTES:
        log.info("hashing %s (%.1f GB) once for this host's cache", path, stat.st_size / 1e9)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    _write_entry(entry, digest.hexdigest())
    return digest.hexdigest()


def _cache_folder() -> Path:
    return hpo_cache_root() / "sha256"


def _read_entry(entry: Path) -> str | None:
    try:
        text = entry.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    # A damaged entry is hashed again and overwritten.
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def _write_entry(entry: Path, digest: str) -> None:
    """Written aside and renamed, so a concurrent reader never sees half an entry. A cache that
    cannot be written (a read-only home) costs the next start one more read, nothing else."""
    aside = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, aside = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.name}.")
        with os.fdopen(handle, "w", encoding="ascii") as out:
            out.write(digest)
        os.replace(aside, entry)
    except OSError as e:
        log.debug("sha256 cache %s not written: %s", entry, e)
        if aside is not None:
            with contextlib.suppress(OSError):
                Path(aside).unlink()
