"""The artifact store: checkpoints and best models where every host can reach them, on a shared
mount (`file:///path`) or in S3 and S3-compatible stores (`s3://bucket/prefix`, via boto3).

What a reader may trust is what a manifest names: a publish uploads its files under a new
version first and writes the manifest (what, where, size, when, sha256) last, so an upload cut
midway leaves nothing a reader would use; a fetch checks every file's size and hash. Keys are
made by hpo from slugs (never a user's string), and removal deletes only the keys that hpo's
own manifests list.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import unquote, urlsplit

from storage.errors import StorageError
from storage.url import mask_text

ENV_VAR = "HPO_ARTIFACT_STORE"
EXAMPLE_URLS = "file:///mnt/shared/hpo or s3://bucket/prefix"
KINDS = ("state", "best-model")
MANIFEST_SUFFIX = ".manifest.json"
FORMAT = 1
_SAFE_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# One segment of a key hpo makes: a slug, trial-N, a kind, a version, a file's name, a probe.
_KEY_PART = re.compile(r"\.?[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# S3's bucket rules (lowercase, digits, dots and hyphens, 3 to 63 characters).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CHUNK = 1 << 20
# Seconds an S3 call waits to connect, or for the next bytes of an answer, before a retry.
S3_TIMEOUT_S = 10

log = logging.getLogger(__name__)


class ArtifactStoreError(StorageError):
    """The artifact store cannot be reached or used, or holds something hpo will not trust.
    Messages never contain a credential."""


class UntrustedArtifact(ArtifactStoreError):
    """A manifest hpo did not write, or a file that does not match its manifest."""


class StoreRefused(ArtifactStoreError):
    """The store said no in a way no wait will change: no credentials, access denied, no such
    bucket, a folder that cannot be written. Not retried; at start, `hpo run` stops on it."""


# S3's answers that a retry gets again: the credentials, the bucket or the rights are wrong.
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AuthorizationHeaderMalformed",
        "NoSuchBucket",
        "InvalidBucketName",
        "PermanentRedirect",
        "InvalidObjectState",
    }
)
# The OS's: no right to write, a read-only mount, a file where a folder should be.
_REFUSED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})
PROBE_PREFIX = ".hpo-probe-"


def is_refusal(error: BaseException) -> bool:
    """Whether the store's error is permanent (see StoreRefused), not a dropped connection,
    a timeout, a busy server or a full disk, which may pass."""
    if isinstance(error, StoreRefused):
        return True
    if isinstance(error, OSError):
        return error.errno in _REFUSED_ERRNOS
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return True
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _REFUSED_CODES or status in (401, 403)
    return False


def store_error(message: str, error: BaseException) -> ArtifactStoreError:
    """`message` as the error it is: StoreRefused when `error` is permanent."""
    return (StoreRefused if is_refusal(error) else ArtifactStoreError)(message)


@dataclass(frozen=True)
class ArtifactURL:
    """A validated artifact store URL and where it came from."""

    url: str
    origin: str  # "--artifact-store", "$HPO_ARTIFACT_STORE", "config", "study"

    @property
    def scheme(self) -> str:
        return self.url.partition("://")[0]

    def describe(self) -> str:
        return f"{self.url} (from {self.origin})"


def resolve_artifact_url(
    cli_value: str | None, config_value: str | None, study_value: str | None = None
) -> ArtifactURL | None:
    """The store by precedence (--artifact-store, $HPO_ARTIFACT_STORE, the config, the study's
    record), validated; None without one. Raises ArtifactStoreError naming what is wrong."""
    if cli_value is not None and not cli_value.strip():
        raise ArtifactStoreError(
            f"--artifact-store is empty; give e.g. {EXAMPLE_URLS}, or leave it out"
        )
    candidates = (
        (cli_value, "--artifact-store"),
        (os.environ.get(ENV_VAR) or None, f"${ENV_VAR}"),
        (config_value, "config"),
        (study_value, "the study's record"),
    )
    for value, origin in candidates:
        if value:
            return ArtifactURL(validated_artifact_url(value, origin), origin)
    return None


def validated_artifact_url(url: str, origin: str = "config") -> str:
    """The URL, normalised (no trailing slash); raises ArtifactStoreError with one line."""
    where = f"artifact store URL from {origin}"
    shown = repr(masked_artifact_url(url)[:200])
    if url != url.strip() or any(ord(c) < 32 for c in url):
        raise ArtifactStoreError(f"{where} has spaces or control characters in it ({shown})")
    parts = urlsplit(url)
    if parts.scheme not in ("file", "s3"):
        scheme = repr(parts.scheme[:20]) if parts.scheme else "no scheme"
        raise ArtifactStoreError(
            f"{where} has {scheme} ({shown}); use {EXAMPLE_URLS}"
            + (
                " (gs:// is not supported yet: mount the bucket and use file://)"
                if parts.scheme == "gs"
                else ""
            )
        )
    if parts.query or parts.fragment:
        raise ArtifactStoreError(
            f"{where} has a query or fragment ({shown}); set the endpoint with "
            "$AWS_ENDPOINT_URL and credentials with the usual AWS variables or profiles"
        )
    if "@" in parts.netloc or parts.password is not None:
        raise ArtifactStoreError(
            f"{where} holds credentials ({shown}); never put keys in the URL: use "
            "$AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY, $AWS_PROFILE or an instance role"
        )
    if parts.scheme == "file":
        return _validated_file_url(parts.netloc, parts.path, where, shown)
    return _validated_s3_url(parts.netloc, parts.path, where, shown)


def masked_artifact_url(url: str) -> str:
    """The URL as hpo shows it: credentials masked, and a query or fragment (where a presigned
    URL keeps its signature) replaced by `***`."""
    masked = mask_text(url)
    for mark in ("?", "#"):
        if mark in masked:
            masked = masked.split(mark, 1)[0] + mark + "***"
    return masked


def _validated_file_url(host: str, path: str, where: str, shown: str) -> str:
    if host not in ("", "localhost") or not path.startswith("/"):
        raise ArtifactStoreError(
            f"{where} needs an absolute path, file:///path (three slashes), got {shown}"
        )
    folder = Path(unquote(path))
    # A missing folder in a folder that exists is made by `hpo run` (as checkpoint_dir is);
    # a missing parent is more likely a shared mount not mounted on this host.
    if folder.exists() and not folder.is_dir():
        raise ArtifactStoreError(
            f"{where}: {str(folder)[:200]!r} is not a folder; name a folder on the shared "
            "mount (every host must see the same folder there)"
        )
    if not folder.is_dir() and not folder.parent.is_dir():
        raise ArtifactStoreError(
            f"{where}: {str(folder)[:200]!r} is not a folder, nor is {str(folder.parent)[:200]!r};"
            " create it on the shared mount (every host must see the same folder there)"
        )
    return "file://" + str(folder.resolve())


def _validated_s3_url(bucket: str, path: str, where: str, shown: str) -> str:
    if not _BUCKET.fullmatch(bucket):
        raise ArtifactStoreError(
            f"{where} names no valid bucket ({shown}); a bucket name has 3 to 63 lowercase "
            "letters, digits, dots or hyphens: s3://bucket/prefix"
        )
    prefix = path.strip("/")
    if prefix and not all(_SAFE_PART.fullmatch(p) for p in prefix.split("/")):
        raise ArtifactStoreError(
            f"{where} has a prefix hpo will not use ({shown}); use letters, digits, '.', '_' "
            "and '-' between slashes"
        )
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


@dataclass(frozen=True)
class ArtifactTarget:
    """Where one trial's artifacts go: the store's URL, the study's folder name (a slug and a
    hash of the study name) and the trial's folder name; pickled into the trial process."""

    url: str
    study: str
    folder: str


# -- the two backends ---------------------------------------------------------------------------


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


class FileBackend:
    """A folder on a mount every host shares; each write goes aside, then is renamed.

    Below the root, every folder is opened one step at a time without following a symbolic
    link (hpo makes none there): a link placed in the store, or swapped in meanwhile, never
    leads a read, a write or a delete out of it; it is refused (UntrustedArtifact)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def check(self) -> None:
        """A probe file written, read and deleted. A missing folder is made for the probe and
        removed after it: a check leaves nothing behind (`create` makes it for good)."""
        made = not self.root.is_dir()
        if made:
            self.create()
        try:
            _probe(self, listed=False)  # a file store lists by folder, never a dot file
        finally:
            if made:
                _remove_empty(self.root)

    def create(self) -> None:
        """The folder, if missing (its parent exists: see validated_artifact_url)."""
        try:
            self.root.mkdir(exist_ok=True)
        except OSError as e:
            raise store_error(f"cannot create {self.root}: {e.strerror or e}", e) from e

    def put(self, key: str, source: BinaryIO) -> None:
        with self._writing(key) as target:
            shutil.copyfileobj(source, target, _CHUNK)

    def write(self, key: str, data: bytes) -> None:
        with self._writing(key) as target:
            target.write(data)

    def get(self, key: str, target: BinaryIO) -> None:
        try:
            with self._reading(key) as source:
                shutil.copyfileobj(source, target, _CHUNK)
        except OSError as e:
            raise self._error(f"cannot read {key}", e) from e

    def read(self, key: str) -> bytes | None:
        try:
            with self._reading(key) as source:
                return source.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(f"cannot read {key}", e) from e

    def delete(self, keys: list[str]) -> None:
        for key in keys:  # every key checked before any is deleted
            _checked_key(key)
        for key in keys:
            try:
                self._unlink(key)
            except OSError as e:
                raise self._error(f"cannot remove {key} from {self.root}", e) from e
        try:
            for key in keys:  # the version folders hpo made, once empty
                self._remove_empty_folders(key.split("/")[:-1])
        except OSError as e:
            raise self._error(f"cannot remove from {self.root}", e) from e

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """The regular files in the folder `prefix` and below; links and dot files skipped."""
        if not self.root.is_dir():  # e.g. the shared mount is not mounted on this host
            raise ArtifactStoreError(f"{self.root} is not a folder")
        base = prefix.strip("/")
        try:
            top = self._folder(_checked_key(base).split("/") if base else [])
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._error(f"cannot list {prefix}", e) from e
        try:
            for folder, _, names, folder_fd in os.fwalk(dir_fd=top):  # never follows a link
                for name in names:
                    info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode) and not name.startswith("."):
                        yield posixpath.normpath(posixpath.join(base, folder, name)), info.st_size
        except OSError as e:
            raise self._error(f"cannot list {prefix}", e) from e
        finally:
            os.close(top)

    def _folder(self, parts: Sequence[str], create: bool = False) -> int:
        """An open descriptor of the folder root/parts (made, with `create`), each step opened
        without following a link; the caller closes it. A link is OSError ELOOP."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                inner = _open_folder(part, fd)
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _parent(self, key: str, create: bool = False) -> tuple[int, str]:
        """The key's folder, open (see _folder), and the file's name in it."""
        *folders, name = _checked_key(key).split("/")
        return self._folder(folders, create), name

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[BinaryIO]:
        folder, name = self._parent(key)
        try:
            # O_NONBLOCK: a pipe put in the store fails the check below instead of blocking.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        finally:
            os.close(folder)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UntrustedArtifact(f"{key} in {self.root} is not a regular file: refused")
            yield handle

    @contextlib.contextmanager
    def _writing(self, key: str) -> Iterator[BinaryIO]:
        try:
            folder, name = self._parent(key, create=True)
        except OSError as e:
            raise self._error(f"cannot write {self.root / key}", e) from e
        try:
            with _AtomicFile(folder, name, self.root / key) as target:
                yield target
        finally:
            os.close(folder)

    def _unlink(self, key: str) -> None:
        try:
            folder, name = self._parent(key)
        except FileNotFoundError:
            return  # its folder is gone: so is the file
        try:
            info = os.stat(name, dir_fd=folder, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):  # not hpo's: left where it is
                raise OSError(errno.ELOOP, "a symbolic link", key)
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            return
        finally:
            os.close(folder)

    def _remove_empty_folders(self, folders: Sequence[str]) -> None:
        """The key's folders, innermost first, each while it is empty; never the root."""
        for depth in range(len(folders), 0, -1):
            try:
                parent = self._folder(folders[: depth - 1])
            except FileNotFoundError:
                return
            try:
                os.rmdir(folders[depth - 1], dir_fd=parent)
            except OSError:  # not empty (another version, a manifest), gone, or a link: stays
                return
            finally:
                os.close(parent)

    def _error(self, doing: str, error: OSError) -> ArtifactStoreError:
        if error.errno == errno.ELOOP:
            return UntrustedArtifact(
                f"{doing}: it leads through a symbolic link in {self.root}, which hpo never "
                "makes nor follows (a link could lead out of the store): refused"
            )
        return store_error(f"{doing}: {error.strerror or error}", error)


def _open_folder(name: str, parent: int) -> int:
    """The folder `name` in `parent`, opened without following a link (OSError ELOOP)."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except NotADirectoryError:  # what Linux says of a link with O_DIRECTORY and O_NOFOLLOW
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, "a symbolic link", name) from None
        raise


class _AtomicFile:
    """A file written aside (`.NAME.UUID.part`) in the open folder `folder` and renamed into
    place on success only; `path` names it in messages."""

    def __init__(self, folder: int, name: str, path: Path) -> None:
        self.folder, self.name, self.path = folder, name, path
        self.aside = f".{name}.{uuid.uuid4().hex}.part"

    def __enter__(self) -> BinaryIO:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            self.handle = os.fdopen(os.open(self.aside, flags, 0o666, dir_fd=self.folder), "wb")
        except OSError as e:
            raise store_error(f"cannot write {self.path}: {e.strerror or e}", e) from e
        return self.handle

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        try:
            if error is None:  # on the disk before the name says it is there
                self.handle.flush()
                os.fsync(self.handle.fileno())
            self.handle.close()
            if error is None:  # a link at `name` is replaced, never followed
                os.replace(self.aside, self.name, src_dir_fd=self.folder, dst_dir_fd=self.folder)
        except OSError as e:
            raise store_error(f"cannot write {self.path}: {e.strerror or e}", e) from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.aside, dir_fd=self.folder)
        if isinstance(error, OSError):  # e.g. the disk full mid-copy
            raise store_error(
                f"cannot write {self.path}: {error.strerror or error}", error
            ) from error


def _remove_empty(folder: Path) -> bool:
    try:
        folder.rmdir()
        return True
    except OSError:  # not empty (another version, a manifest): it stays
        return False


class S3Backend:
    """A bucket and prefix, through boto3: credentials, profiles, regions and the endpoint
    (`$AWS_ENDPOINT_URL`, for MinIO, Ceph or R2) come from the usual AWS settings."""

    def __init__(self, bucket: str, prefix: str) -> None:
        import boto3
        from botocore.config import Config as BotoConfig
        from botocore.exceptions import BotoCoreError

        self.bucket, self.prefix = bucket, prefix
        # Few quick retries and short timeouts: hpo's uploader retries with its own backoff, and
        # a store that accepts connections but never answers (a dead proxy, a firewall's drop)
        # held `hpo status` and every trial's end for 3 minutes at botocore's 60 s x 3.
        settings = BotoConfig(
            connect_timeout=S3_TIMEOUT_S,
            read_timeout=S3_TIMEOUT_S,
            retries={"max_attempts": 2, "mode": "standard"},
        )
        try:
            self.client = boto3.session.Session().client("s3", config=settings)
        except (BotoCoreError, ValueError) as e:  # a missing profile; an endpoint or region
            raise ArtifactStoreError(f"cannot set up S3: {_reason(e)}") from e  # that is no URL

    def check(self) -> None:
        """A probe object written, read, listed and deleted under the prefix."""
        _probe(self, listed=True)

    def create(self) -> None:
        """Nothing to make: a prefix exists once an object is under it."""

    def put(self, key: str, source: BinaryIO) -> None:
        with self._errors(f"cannot upload {key}"):
            self.client.upload_fileobj(source, self.bucket, self._key(key))

    def write(self, key: str, data: bytes) -> None:
        with self._errors(f"cannot write {key}"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get(self, key: str, target: BinaryIO) -> None:
        with self._errors(f"cannot download {key}"):
            self.client.download_fileobj(self.bucket, self._key(key), target)

    def read(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        with self._errors(f"cannot read {key}"):
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            return bytes(answer["Body"].read())

    def delete(self, keys: list[str]) -> None:
        with self._errors("cannot remove objects"):
            for start in range(0, len(keys), 1000):  # S3's most per request
                batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
                answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})
                # Refusals come per key in the answer, not as an error of the call.
                for refused in answer.get("Errors", [])[:1]:
                    raise _refused_deletion(refused, len(answer["Errors"]), self.bucket)

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        if prefix.rstrip("/"):
            _checked_key(prefix.rstrip("/"))
        strip = len(self._under_prefix(""))
        with self._errors(f"cannot list {prefix}"):
            pages = self.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=self._under_prefix(prefix)):
                for item in page.get("Contents", []):
                    yield item["Key"][strip:], int(item["Size"])

    def _key(self, key: str) -> str:
        """The object's key in the bucket: `key`, checked, under the store's prefix."""
        return self._under_prefix(_checked_key(key))

    def _under_prefix(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _errors(self, doing: str) -> Any:
        return _Wrapped(f"{doing} (s3://{self.bucket})")


class _Wrapped:
    """Turns botocore's and the OS's errors into ArtifactStoreError, credentials masked."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: object
    ) -> None:
        if error is None or isinstance(error, ArtifactStoreError):
            return
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(error, BotoCoreError | ClientError | OSError):
            raise store_error(f"{self.doing}: {_reason(error)}", error) from error


def _refused_deletion(refused: dict[str, Any], count: int, bucket: str) -> ArtifactStoreError:
    from botocore.exceptions import ClientError

    code, text = str(refused.get("Code", "")), str(refused.get("Message", ""))
    answer: Any = {"Error": {"Code": code, "Message": text}}
    return store_error(
        f"cannot remove {count} objects (s3://{bucket}): {code}: {mask_text(text)[:200]}",
        ClientError(answer, "DeleteObjects"),
    )


def _probe(backend: Backend, listed: bool) -> None:
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


def _reason(error: BaseException) -> str:
    """The error in a line, with anything that looks like a URL's password masked."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return mask_text(text)[:300]


# -- the store ----------------------------------------------------------------------------------


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
        return f"{self.url}/{_prefix(study, folder)}/{kind}"

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
        prefix = f"{_prefix(study, folder)}/{kind}/{manifest.version}"
        try:
            for name, path in _files_of(source):
                manifest.files.append(self._put(f"{prefix}/{name}", name, path))
            self.backend.write(_manifest_key(study, folder, kind), manifest.to_json())
        except ArtifactStoreError:
            self._forget([f.key for f in manifest.files])
            raise
        if previous is not None and previous.version != manifest.version:
            self._forget([f.key for f in previous.files])
        return manifest

    def manifest(self, study: str, folder: str, kind: str) -> Manifest | None:
        """The trial's manifest of `kind`, or None. One that does not parse, or names keys
        outside its own version, is refused (ArtifactStoreError)."""
        key = _manifest_key(study, folder, kind)
        raw = self.backend.read(key)
        if raw is None:
            return None
        return _parsed_manifest(raw, f"{self.url}/{key}", study, folder, kind)

    def intact(self, study: str, folder: str, kind: str) -> bool:
        """Whether the trial's `kind` is in the store whole, without downloading it: a manifest
        hpo trusts, naming at least one file, and every object it names listed at its size.
        What hpo will not trust (a forged manifest, a link in a file store) is not whole. Raises
        ArtifactStoreError when the store fails (not knowing is not "absent")."""
        try:
            manifest = self.manifest(study, folder, kind)
            if manifest is None or not manifest.files:
                return False
            version = f"{_prefix(study, folder)}/{kind}/{manifest.version}/"
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
                self.backend.delete([_manifest_key(study, folder, kind)])
                self.backend.delete([f.key for f in manifest.files])

    def folders(self, study: str) -> dict[str, list[str]]:
        """The trial folders of `study` with artifacts: folder -> kinds. A name hpo does not
        make (listed from a store anyone may write to) is left out."""
        found: dict[str, list[str]] = {}
        for key, _ in self.backend.list(f"{_folder_name(study)}/"):
            parts = key.split("/")
            if (
                len(parts) == 3
                and parts[0] == study
                and _SAFE_PART.fullmatch(parts[1])
                and parts[2].endswith(MANIFEST_SUFFIX)
            ):
                kind = parts[2][: -len(MANIFEST_SUFFIX)]
                if kind in KINDS:
                    found.setdefault(parts[1], []).append(kind)
        return {folder: sorted(kinds, key=KINDS.index) for folder, kinds in found.items()}

    def size(self, study: str) -> int:
        """Bytes the study's artifacts take in the store (every object under its folder)."""
        return sum(size for _, size in self.backend.list(f"{_folder_name(study)}/"))

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


def _prefix(study: str, folder: str) -> str:
    return f"{_folder_name(study)}/{_folder_name(folder)}"


def _folder_name(name: str) -> str:
    """`name` (a study's or trial's folder) if it is one path segment hpo makes."""
    if not _SAFE_PART.fullmatch(name):
        raise ArtifactStoreError(f"{name[:80]!r} is not a folder name hpo makes")
    return name


def _manifest_key(study: str, folder: str, kind: str) -> str:
    if kind not in KINDS:
        raise ArtifactStoreError(f"unknown artifact kind {kind!r}")
    return f"{_prefix(study, folder)}/{kind}{MANIFEST_SUFFIX}"


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
        if not all(_SAFE_PART.fullmatch(part) for part in name.split("/")):
            raise ArtifactStoreError(f"{source} holds {name[:80]!r}, a name hpo does not upload")
    return files


def _checked_key(key: str) -> str:
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


def _parsed_manifest(raw: bytes, where: str, study: str, folder: str, kind: str) -> Manifest:
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
    if not isinstance(manifest.version, str) or not _SAFE_PART.fullmatch(manifest.version):
        return f"names the version {_quoted(manifest.version)}, not a folder name hpo makes"
    expected = f"{_prefix(study, folder)}/{kind}/{manifest.version}/"
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
    if not all(_SAFE_PART.fullmatch(part) for part in entry.path.split("/")):
        return f"names the file {_quoted(entry.path)}, not a path hpo uploads"
    if type(entry.size) is not int or entry.size < 0 or not _SHA256.fullmatch(entry.sha256):
        return f"gives {_quoted(entry.path)} no size in bytes or no sha256"
    return None


def _quoted(value: object) -> str:
    """A value read from the store, for a one-line message: quoted and cut short."""
    shown = repr(value)
    return shown if len(shown) <= 120 else shown[:117] + "..."


def _sha256(handle: BinaryIO) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _new_version() -> str:
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
