"""The artifact store on a folder every host mounts (`file:///path`): writes go aside and are
renamed, and no symbolic link is followed below the root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from hpo.storage.artifacts.backend import CHUNK, probe
from hpo.storage.artifacts.errors import ArtifactStoreError, UntrustedArtifact, store_error
from hpo.storage.artifacts.manifest import checked_key


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
            probe(self, listed=False)  # a file store lists by folder, never a dot file
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
            shutil.copyfileobj(source, target, CHUNK)

    def write(self, key: str, data: bytes) -> None:
        with self._writing(key) as target:
            target.write(data)

    def get(self, key: str, target: BinaryIO) -> None:
        try:
            with self._reading(key) as source:
                shutil.copyfileobj(source, target, CHUNK)
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
            checked_key(key)
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
            top = self._folder(checked_key(base).split("/") if base else [])
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
        *folders, name = checked_key(key).split("/")
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
