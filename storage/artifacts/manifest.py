"""What a reader of the artifact store may trust: the manifest (what, where, size, when, sha256)
and the keys hpo makes. A key, a manifest or a name in it that is not one hpo writes is refused
(UntrustedArtifact), so nothing read from the store leads a read or a delete out of it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import asdict, dataclass, field

from hpo.storage.artifacts.errors import ArtifactStoreError, UntrustedArtifact

KINDS = ("state", "best-model")
MANIFEST_SUFFIX = ".manifest.json"
FORMAT = 1
# One path segment of a name hpo makes: a folder, a version, a file's name, a prefix's part.
SAFE_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# One segment of a key hpo makes: a slug, trial-N, a kind, a version, a file's name, a probe.
_KEY_PART = re.compile(r"\.?[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class FileEntry:
    path: str  # inside the artifact, e.g. model.safetensors
    key: str
    size: int
    sha256: str


@dataclass
class Manifest:
    """What one artifact (a trial's resume state or best model) holds, written last."""

    study: str  # the study's folder name (a slug and a hash, hpo.trial.folders)
    folder: str  # trial-N
    kind: str
    version: str
    written_at: str
    files: list[FileEntry] = field(default_factory=list)
    format: int = FORMAT

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def published_at(self) -> float:
        """`written_at` as a POSIX timestamp; ValueError if it does not parse."""
        return dt.datetime.fromisoformat(self.written_at).timestamp()

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "size": self.size}, indent=1).encode()


def trial_prefix(study: str, folder: str) -> str:
    return f"{folder_name(study)}/{folder_name(folder)}"


def folder_name(name: str) -> str:
    """`name` (a study's or trial's folder) if it is one path segment hpo makes."""
    if not SAFE_PART.fullmatch(name):
        raise ArtifactStoreError(f"{name[:80]!r} is not a folder name hpo makes")
    return name


def manifest_key(study: str, folder: str, kind: str) -> str:
    if kind not in KINDS:
        raise ArtifactStoreError(f"unknown artifact kind {kind!r}")
    return f"{trial_prefix(study, folder)}/{kind}{MANIFEST_SUFFIX}"


def checked_key(key: str) -> str:
    """`key`, if it is one hpo makes; UntrustedArtifact otherwise. Every backend call takes its
    key through here, so no name read from the store (a manifest, a listing) reaches past it."""
    problem = _key_problem(key)
    if problem is not None:
        raise UntrustedArtifact(f"key {_quoted(key)} {problem}: refused")
    return key


def _key_problem(key: str) -> str | None:
    """What could make `key` name something outside the store once a file system or an
    S3-compatible server normalises it; None for a key of plain segments."""
    if not isinstance(key, str) or not key:
        return "is empty or not text"
    if key.startswith("/"):
        return "is an absolute path"
    if "\\" in key:
        return "holds a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return "holds NUL or another control character"
    segments = key.split("/")
    if "" in segments:
        return "has an empty segment ('//', or a '/' at its end)"
    if "." in segments or ".." in segments:
        return "has a '.' or '..' segment"
    if not all(_KEY_PART.fullmatch(segment) for segment in segments):
        return "has a segment hpo never makes (only letters, digits, '.', '_' and '-')"
    return None


def parsed_manifest(raw: bytes, where: str, study: str, folder: str, kind: str) -> Manifest:
    """The manifest at `where` (named in messages), or UntrustedArtifact saying what is wrong
    with it: nothing it names is then read or deleted."""
    try:
        data = json.loads(raw)
        data.pop("size", None)
        files = [FileEntry(**f) for f in data.pop("files")]
        manifest = Manifest(**data, files=files)
        manifest.published_at()  # a time that does not parse is not hpo's
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UntrustedArtifact(f"{where} is not a manifest hpo wrote: refused") from e
    problem = _manifest_problem(manifest, study, folder, kind)
    if problem is not None:
        raise UntrustedArtifact(f"{where} {problem}: refused, nothing read or removed")
    return manifest


def _manifest_problem(manifest: Manifest, study: str, folder: str, kind: str) -> str | None:
    """Why hpo will not act on the manifest: a name in it (its trial, its version, a file's
    key or path) that is not one hpo writes, or a file without a size and hash; None if none."""
    if (manifest.study, manifest.folder, manifest.kind) != (study, folder, kind):
        return "belongs to another trial"
    if not isinstance(manifest.version, str) or not SAFE_PART.fullmatch(manifest.version):
        return f"names the version {_quoted(manifest.version)}, not a folder name hpo makes"
    expected = f"{trial_prefix(study, folder)}/{kind}/{manifest.version}/"
    paths: set[str] = set()
    for entry in manifest.files:
        problem = _entry_problem(entry, expected)
        if problem is not None:
            return problem
        paths.add(entry.path)
    folders: set[str] = set()
    for parts in (path.split("/") for path in paths):
        folders.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
    if len(paths) < len(manifest.files) or paths & folders:
        return "names one file twice, or a file as a folder of another"
    return None


def _entry_problem(entry: FileEntry, expected_prefix: str) -> str | None:
    if not all(isinstance(text, str) for text in (entry.path, entry.key, entry.sha256)):
        return "has a file whose path, key or sha256 is not text"
    if entry.key != expected_prefix + entry.path or _key_problem(entry.key) is not None:
        return f"names {_quoted(entry.key)}, outside its version"
    if not all(SAFE_PART.fullmatch(part) for part in entry.path.split("/")):
        return f"names the file {_quoted(entry.path)}, not a path hpo uploads"
    if type(entry.size) is not int or entry.size < 0 or not _SHA256.fullmatch(entry.sha256):
        return f"gives {_quoted(entry.path)} no size in bytes or no sha256"
    return None


def _quoted(value: object) -> str:
    """A value read from the store, for a one-line message: quoted and cut short."""
    shown = repr(value)
    return shown if len(shown) <= 120 else shown[:117] + "..."
