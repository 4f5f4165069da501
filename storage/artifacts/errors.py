"""The artifact store's errors, and which of the store's own errors are a refusal that no wait
will change (no credentials, access denied, no such bucket, a folder that cannot be written).
"""

from __future__ import annotations

import errno
import sys

from hpo.storage.errors import StorageError


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


def is_refusal(error: BaseException) -> bool:
    """Whether the store's error is permanent (see StoreRefused), not a dropped connection,
    a timeout, a busy server or a full disk, which may pass."""
    if isinstance(error, StoreRefused):
        return True
    if isinstance(error, OSError):
        return error.errno in _REFUSED_ERRNOS
    exceptions = sys.modules.get("botocore.exceptions")
    if exceptions is None:  # botocore never loaded (hpo[s3] may not be installed): not its error
        return False
    if isinstance(error, exceptions.NoCredentialsError | exceptions.PartialCredentialsError):
        return True
    if isinstance(error, exceptions.ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _REFUSED_CODES or status in (401, 403)
    return False


def store_error(message: str, error: BaseException) -> ArtifactStoreError:
    """`message` as the error it is: StoreRefused when `error` is permanent."""
    return (StoreRefused if is_refusal(error) else ArtifactStoreError)(message)
