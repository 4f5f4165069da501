"""Which artifact store a run uses: the URL by precedence (--artifact-store,
$HPO_ARTIFACT_STORE, the config, the study's record), checked and shown without credentials.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from hpo.storage.artifacts.errors import ArtifactStoreError
from hpo.storage.artifacts.manifest import SAFE_PART
from hpo.storage.url import mask_text

ENV_VAR = "HPO_ARTIFACT_STORE"
EXAMPLE_URLS = "file:///mnt/shared/hpo or s3://bucket/prefix"
# S3's bucket rules (lowercase, digits, dots and hyphens, 3 to 63 characters).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


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
    if prefix and not all(SAFE_PART.fullmatch(p) for p in prefix.split("/")):
        raise ArtifactStoreError(
            f"{where} has a prefix hpo will not use ({shown}); use letters, digits, '.', '_' "
            "and '-' between slashes"
        )
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
