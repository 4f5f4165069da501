"""A cache of members' features (predictions, embeddings) on disk: an array per (member weights'
sha256, data file's sha256, feature kind), so a second ensemble over the same members reads
them instead of running the models again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hpo.ensemble.errors import EnsembleError
from hpo.trainer.digests import hpo_cache_root

log = logging.getLogger("hpo")

_SHA256 = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def default_cache_folder() -> Path:
    """$HPO_CACHE_DIR/features, or ~/.cache/hpo/features."""
    return hpo_cache_root() / "features"


def ordered_kind(kind: str, order: Sequence[str]) -> str:
    """The cache kind of features whose columns follow `order` (the first member's label
    names): under another first member with the same labels in another order, another entry,
    never columns read back under the wrong labels."""
    if not order:
        return kind
    return f"{kind}.{hashlib.sha256(json.dumps(list(order)).encode()).hexdigest()[:16]}"


class FeatureCache:
    """Arrays stored as .npy under `folder`, each written aside and renamed in (a reader never
    sees half a file; two writers of one key write the same array)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_cache_folder()

    def path(self, weights_sha256: str, data_sha256: str, kind: str) -> Path:
        for name, digest in (("weights", weights_sha256), ("data", data_sha256)):
            if not _SHA256.fullmatch(digest):
                raise EnsembleError(f"feature cache: {name} sha256 {digest!r} is not a sha256")
        if not _KIND.fullmatch(kind):
            raise EnsembleError(f"feature cache: kind {kind!r} must be letters, digits, _ . -")
        return self.folder / weights_sha256[:2] / f"{weights_sha256}-{data_sha256}-{kind}.npy"

    def get(self, weights_sha256: str, data_sha256: str, kind: str) -> np.ndarray | None:
        path = self.path(weights_sha256, data_sha256, kind)
        if not path.is_file():
            return None
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError):  # EOFError: an empty file
            path.unlink(missing_ok=True)  # damaged (a full disk, say): computed again
            return None

    def put(
        self, weights_sha256: str, data_sha256: str, kind: str, array: np.ndarray
    ) -> Path | None:
        """Store `array`; None when the folder cannot be written (the next run computes it
        again, as the ensemble cache beside)."""
        path = self.path(weights_sha256, data_sha256, kind)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, aside = tempfile.mkstemp(
                prefix=f".{path.stem}.", suffix=".npy", dir=path.parent
            )
        except OSError as e:
            log.info("feature cache: not stored in %s (%s)", self.folder, e)
            return None
        try:
            with os.fdopen(handle, "wb") as out:
                np.save(out, np.asarray(array), allow_pickle=False)
            os.replace(aside, path)
        except OSError as e:  # a full disk, say
            Path(aside).unlink(missing_ok=True)
            log.info("feature cache: not stored in %s (%s)", self.folder, e)
            return None
        except BaseException:
            Path(aside).unlink(missing_ok=True)
            raise
        return path

    def get_or_compute(
        self,
        weights_sha256: str,
        data_sha256: str,
        kind: str,
        compute: Callable[[], np.ndarray],
    ) -> np.ndarray:
        """The cached array, or `compute()`'s, stored for the next call."""
        cached = self.get(weights_sha256, data_sha256, kind)
        if cached is not None:
            return cached
        array = np.asarray(compute())
        self.put(weights_sha256, data_sha256, kind, array)
        return array
