"""storage: where a study lives. URL resolution, engine options and password masking.

`open_storage(url)` is the one way hpo opens an Optuna RDB storage.
"""

from storage.engine import open_storage
from storage.url import StorageURL, mask_url, resolve_storage_url

__all__ = ["StorageURL", "mask_url", "open_storage", "resolve_storage_url"]
