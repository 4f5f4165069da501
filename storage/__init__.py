"""storage: where a study lives. URL resolution, engine options and password masking; the
artifact store (checkpoints and best models every host can reach) is `hpo.storage.artifacts`.

`open_storage(url)` is the one way hpo opens an Optuna RDB storage. The package imports
lazily: `hpo.storage.errors` and `hpo.storage.url` load without SQLAlchemy's engine or Optuna,
so the CLI answers a bad config or URL, or a Ctrl-C, in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpo.storage.engine import open_storage
    from hpo.storage.url import StorageURL, mask_url, resolve_storage_url

_WHERE = {
    "open_storage": "hpo.storage.engine",
    "StorageURL": "hpo.storage.url",
    "mask_url": "hpo.storage.url",
    "resolve_storage_url": "hpo.storage.url",
}

__all__ = ["StorageURL", "mask_url", "open_storage", "resolve_storage_url"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
