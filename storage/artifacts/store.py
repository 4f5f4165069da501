"""A study's artifacts in the store: per trial folder, a resume state and a best model, each
published whole (its files under a new version first, the manifest last) and fetched verified.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hpo.storage.artifacts.backend import CHUNK, Backend
from hpo.storage.artifacts.errors import (
    ArtifactStoreError,
    StoreRefused,
    UntrustedArtifact,
)
from hpo.storage.artifacts.local import FileBackend
from hpo.storage.artifacts.manifest import (
    KINDS,
    MANIFEST_SUFFIX,
    SAFE_PART,
    FileEntry,
    Manifest,
    folder_name,
    manifest_key,
    parsed_manifest,
    trial_prefix,
)
from hpo.storage.artifacts.s3 import S3Backend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArtifactTarget:
    """Where one trial's artifacts go: the store's URL, the study's folder name (a slug and a
    hash of the study name) and the trial's folder name; pickled into the trial process."""

    url: str
    study: str
    folder: str


class ArtifactStore:
    """A study's artifacts: per trial folder, a resume state and a best model, each published
    whole (objects first, the manifest last) and fetched verified."""

    def __init__(self, url: str, backend: Backend | None = None) -> None:
        self.url = url
        self.backend = backend or _backend_for(url)

    def check(self) -> None:
        """Once, before the first trial: a small object written, read and deleted under the
        URL. No credentials, access denied, no such bucket or a folder that cannot be written
        raise StoreRefused; a store that does not answer, ArtifactStoreError; each one line
        that says what to do, where otherwise every trial's uploads would wait out
        study.artifact_patience in vain."""
        try:
            self.backend.check()
        except ArtifactStoreError as e:
            refused = isinstance(e, StoreRefused)
            raise (StoreRefused if refused else ArtifactStoreError)(
                f"artifact store {self.url}: {e}; {self._fix(refused)}"
            ) from e

    def create(self) -> None:
        """Make what the store needs before the first upload (a file store's folder)."""
        self.backend.create()

    def _fix(self, refused: bool) -> str:
        if self.url.startswith("s3://") and refused:
            return (
                "check the bucket's name and the AWS credentials ($AWS_ACCESS_KEY_ID and "
                "$AWS_SECRET_ACCESS_KEY, $AWS_PROFILE or an instance role): hpo writes, "
                "reads, lists and deletes under the prefix"
            )
        if self.url.startswith("s3://"):
            return "check $AWS_ENDPOINT_URL and the network, then start again"
        if refused:
            return "let this user write to the folder (on every host), or name another"
        return "check the shared mount, then start again"

    def uri(self, study: str, folder: str, kind: str) -> str:
        return f"{self.url}/{trial_prefix(study, folder)}/{kind}"

    def publish(self, study: str, folder: str, kind: str, source: Path) -> Manifest:
        """Upload `source` (a file, or a folder's files) as the trial's `kind`, replacing the
        one there; the old version's objects go once the new manifest is written."""
        try:
            previous = self.manifest(study, folder, kind)
        except ArtifactStoreError as e:
            if not isinstance(e, UntrustedArtifact):
                raise  # the store itself failed
            previous = None  # a manifest hpo will not trust is replaced, its objects left
        manifest = Manifest(study, folder, kind, _new_version(), _now())
        prefix = f"{trial_prefix(study, folder)}/{kind}/{manifest.version}"
        try:
            for name, path in _files_of(source):
                manifest.files.append(self._put(f"{prefix}/{name}", name, path))
            self.backend.write(manifest_key(study, folder, kind), manifest.to_json())
        except ArtifactStoreError:
            self._forget([f.key for f in manifest.files])
            raise
        if previous is not None and previous.version != manifest.version:
            self._forget([f.key for f in previous.files])
        return manifest

    def manifest(self, study: str, folder: str, kind: str) -> Manifest | None:
        """The trial's manifest of `kind`, or None. One that does not parse, or names keys
        outside its own version, is refused (ArtifactStoreError)."""
        key = manifest_key(study, folder, kind)
        raw = self.backend.read(key)
        if raw is None:
            return None
        return parsed_manifest(raw, f"{self.url}/{key}", study, folder, kind)

    def intact(self, study: str, folder: str, kind: str) -> bool:
        """Whether the trial's `kind` is in the store whole, without downloading it: a manifest
        hpo trusts, naming at least one file, and every object it names listed at its size.
        What hpo will not trust (a forged manifest, a link in a file store) is not whole. Raises
        ArtifactStoreError when the store fails (not knowing is not "absent")."""
        try:
            manifest = self.manifest(study, folder, kind)
            if manifest is None or not manifest.files:
                return False
            version = f"{trial_prefix(study, folder)}/{kind}/{manifest.version}/"
            listed = dict(self.backend.list(version))
        except UntrustedArtifact:
            return False
        return all(listed.get(entry.key) == entry.size for entry in manifest.files)

    def fetch(self, study: str, folder: str, kind: str, into: Path) -> Manifest | None:
        """Download the artifact into the new folder `into`, every file checked against the
        manifest's size and sha256; None (and no folder) when there is none."""
        manifest = self.manifest(study, folder, kind)
        if manifest is None:
            return None
        into.mkdir(parents=True)
        try:
            for entry in manifest.files:
                self._get(entry, into / entry.path)
        except BaseException:
            shutil.rmtree(into, ignore_errors=True)
            raise
        return manifest

    def remove(self, study: str, folder: str, kinds: tuple[str, ...] = KINDS) -> None:
        """Remove the trial's artifacts of `kinds`: the manifest first (readers stop trusting
        the objects), then the objects it lists, nothing else."""
        for kind in kinds:
            manifest = self.manifest(study, folder, kind)
            if manifest is not None:
                self.backend.delete([manifest_key(study, folder, kind)])
                self.backend.delete([f.key for f in manifest.files])

    def folders(self, study: str) -> dict[str, list[str]]:
        """The trial folders of `study` with artifacts: folder -> kinds. A name hpo does not
        make (listed from a store anyone may write to) is left out."""
        found: dict[str, list[str]] = {}
        for key, _ in self.backend.list(f"{folder_name(study)}/"):
            parts = key.split("/")
            if (
                len(parts) == 3
                and parts[0] == study
                and SAFE_PART.fullmatch(parts[1])
                and parts[2].endswith(MANIFEST_SUFFIX)
            ):
                kind = parts[2][: -len(MANIFEST_SUFFIX)]
                if kind in KINDS:
                    found.setdefault(parts[1], []).append(kind)
        return {folder: sorted(kinds, key=KINDS.index) for folder, kinds in found.items()}

    def size(self, study: str) -> int:
        """Bytes the study's artifacts take in the store (every object under its folder)."""
        return sum(size for _, size in self.backend.list(f"{folder_name(study)}/"))

    def _put(self, key: str, name: str, path: Path) -> FileEntry:
        """Hash and upload one open file: a checkpoint replaced meanwhile (by a rename) is
        still read whole from the file that was opened."""
        try:
            with path.open("rb") as handle:
                digest, size = _sha256(handle)
                handle.seek(0)
                self.backend.put(key, handle)
        except OSError as e:
            raise ArtifactStoreError(f"cannot read {path}: {e.strerror or e}") from e
        return FileEntry(name, key, size, digest)

    def _get(self, entry: FileEntry, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with target.open("w+b") as handle:
                self.backend.get(entry.key, handle)
                handle.seek(0)
                digest, size = _sha256(handle)
        except OSError as e:
            raise ArtifactStoreError(f"cannot write {target}: {e.strerror or e}") from e
        if (digest, size) != (entry.sha256, entry.size):
            raise UntrustedArtifact(
                f"{entry.key} does not match its manifest (sha256 {digest[:12]}..., {size} "
                f"bytes; expected {entry.sha256[:12]}..., {entry.size} bytes): refused"
            )

    def _forget(self, keys: list[str]) -> None:
        """Remove objects that no manifest names (a cut upload's, a replaced version's). A
        store that refuses now keeps them: no reader uses them; the loss is logged."""
        if not keys:
            return
        try:
            self.backend.delete(keys)
        except ArtifactStoreError as e:
            log.warning("%d objects no manifest names stay in the store: %s", len(keys), e)


def _backend_for(url: str) -> Backend:
    scheme, _, rest = url.partition("://")
    if scheme == "file":
        return FileBackend(Path(rest))
    bucket, _, prefix = rest.partition("/")
    return S3Backend(bucket, prefix)


def _files_of(source: Path) -> list[tuple[str, Path]]:
    """(name in the artifact, local path): the file itself, or a folder's files (a symlinked
    folder, such as best-model, is read where it points, at this moment)."""
    try:
        if source.is_file():
            return [(source.name, source)]
        folder = source.resolve(strict=True)
        files = sorted(
            (p.relative_to(folder).as_posix(), p)
            for p in folder.rglob("*")
            if p.is_file() and not p.is_symlink()
        )
    except OSError as e:
        raise ArtifactStoreError(f"cannot read {source}: {e.strerror or e}") from e
    for name, _ in files:
        if not all(SAFE_PART.fullmatch(part) for part in name.split("/")):
            raise ArtifactStoreError(f"{source} holds {name[:80]!r}, a name hpo does not upload")
    return files


def _sha256(handle: BinaryIO) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _new_version() -> str:
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
