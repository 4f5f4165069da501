"""The artifact store: checkpoints and best models where every host can reach them, on a shared
mount (`file:///path`) or in S3 and S3-compatible stores (`s3://bucket/prefix`, via boto3).

What a reader may trust is what a manifest names: a publish uploads its files under a new
version first and writes the manifest (what, where, size, when, sha256) last, so an upload cut
midway leaves nothing a reader would use; a fetch checks every file's size and hash. Keys are
made by hpo from slugs (never a user's string), and removal deletes only the keys that hpo's
own manifests list.

Import from `hpo.storage.artifacts`: the names below are the store's surface. Its modules are its
rooms, one job each: `url` (which store), `store` (publish, fetch, remove), `manifest` (what a
reader may trust), `backend` (what a backend does), `local` and `s3` (the two backends),
`errors`.
"""

from __future__ import annotations

from hpo.storage.artifacts.errors import (
    ArtifactStoreError,
    StoreRefused,
    UntrustedArtifact,
    is_refusal,
)
from hpo.storage.artifacts.local import FileBackend
from hpo.storage.artifacts.manifest import KINDS, FileEntry, Manifest
from hpo.storage.artifacts.s3 import S3Backend
from hpo.storage.artifacts.store import ArtifactStore, ArtifactTarget
from hpo.storage.artifacts.url import (
    ENV_VAR,
    ArtifactURL,
    masked_artifact_url,
    resolve_artifact_url,
    validated_artifact_url,
)

__all__ = [
    "ENV_VAR",
    "KINDS",
    "ArtifactStore",
    "ArtifactStoreError",
    "ArtifactTarget",
    "ArtifactURL",
    "FileBackend",
    "FileEntry",
    "Manifest",
    "S3Backend",
    "StoreRefused",
    "UntrustedArtifact",
    "is_refusal",
    "masked_artifact_url",
    "resolve_artifact_url",
    "validated_artifact_url",
]
