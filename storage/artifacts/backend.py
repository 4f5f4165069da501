"""What the file and S3 stores have in common: objects by key (`Backend`), and the probe a
store's check runs before the first trial.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import BinaryIO, Protocol

from hpo.storage.artifacts.errors import ArtifactStoreError

# Bytes copied or hashed at a time (a file store's copies, a publish's and a fetch's hashes).
CHUNK = 1 << 20
PROBE_PREFIX = ".hpo-probe-"


class Backend(Protocol):
    """Objects by key: what the file and S3 stores have in common."""

    def check(self) -> None: ...
    def create(self) -> None: ...
    def put(self, key: str, source: BinaryIO) -> None: ...
    def get(self, key: str, target: BinaryIO) -> None: ...
    def read(self, key: str) -> bytes | None: ...
    def write(self, key: str, data: bytes) -> None: ...
    def delete(self, keys: list[str]) -> None: ...
    def list(self, prefix: str) -> Iterator[tuple[str, int]]: ...


def probe(backend: Backend, listed: bool) -> None:
    """Write, read back, (list) and delete a small object: what every trial's uploads and the
    workers' cleanup of the store do."""
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    data = b"hpo checks that it may write here; this file is removed at once\n"
    backend.write(key, data)
    try:
        if backend.read(key) != data:
            raise ArtifactStoreError(f"cannot read back {key}: it came back changed")
        if listed and not any(name == key for name, _ in backend.list(PROBE_PREFIX)):
            raise ArtifactStoreError(f"cannot list {key}: the store does not list it")
    finally:
        backend.delete([key])
