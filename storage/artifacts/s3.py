"""The artifact store in S3 or an S3-compatible store (`s3://bucket/prefix`), through boto3,
with short timeouts and botocore's errors turned into ArtifactStoreError, credentials masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

from hpo.storage.artifacts.backend import probe
from hpo.storage.artifacts.errors import ArtifactStoreError, StoreRefused, store_error
from hpo.storage.artifacts.manifest import checked_key
from hpo.storage.url import mask_text

S3_EXTRA = "hpo[s3]"
# Seconds an S3 call waits to connect, or for the next bytes of an answer, before a retry.
S3_TIMEOUT_S = 10


class S3Backend:
    """A bucket and prefix, through boto3: credentials, profiles, regions and the endpoint
    (`$AWS_ENDPOINT_URL`, for MinIO, Ceph or R2) come from the usual AWS settings."""

    def __init__(self, bucket: str, prefix: str) -> None:
        try:
            import boto3
            from botocore.config import Config as BotoConfig
            from botocore.exceptions import BotoCoreError
        except ImportError as e:  # boto3 is an extra: most stores are a folder
            raise StoreRefused(
                f"an s3:// artifact store needs boto3, not installed; pip install '{S3_EXTRA}'"
            ) from e

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
        probe(self, listed=True)

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
            checked_key(prefix.rstrip("/"))
        strip = len(self._under_prefix(""))
        with self._errors(f"cannot list {prefix}"):
            pages = self.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=self._under_prefix(prefix)):
                for item in page.get("Contents", []):
                    yield item["Key"][strip:], int(item["Size"])

    def _key(self, key: str) -> str:
        """The object's key in the bucket: `key`, checked, under the store's prefix."""
        return self._under_prefix(checked_key(key))

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


def _reason(error: BaseException) -> str:
    """The error in a line, with anything that looks like a URL's password masked."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return mask_text(text)[:300]
