"""Where a checkpoint lives in object storage: ``s3://bucket/prefix`` or ``az://container/prefix``
(also ``abfs[s]://container[@account.dfs.core.windows.net]/prefix``) parsed once, object keys and
URLs built from it."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ObjectLocation", "is_object_url", "SCHEMES"]

# The object stores' schemes (S3; Azure Blob in its az:// and fsspec's abfs:// forms).
SCHEMES = ("s3", "az", "abfs", "abfss")


def is_object_url(path: object) -> bool:
    """Whether ``path`` names object storage (``s3://...``, ``az://...``) rather than a local path."""
    if isinstance(path, os.PathLike):
        return False  # a pathlib.Path collapses "s3://" to "s3:/": it was never meant as a URL
    return isinstance(path, str) and any(path.startswith(f"{scheme}://") for scheme in SCHEMES)


@dataclass(frozen=True)
class ObjectLocation:
    """A checkpoint's place in a bucket (an Azure container): ``bucket`` and a key ``prefix`` (no
    slashes at its ends; empty for the bucket's root); ``host``: the account host of an
    ``abfs://container@host/...`` URL, else empty."""

    scheme: str
    bucket: str
    prefix: str
    host: str = ""

    @staticmethod
    def parse(url: str | os.PathLike) -> "ObjectLocation":
        """``s3://bucket[/prefix]``; ValueError naming the URL when it is not one."""
        text = os.fspath(url) if not isinstance(url, str) else url
        if not is_object_url(text):
            raise ValueError(f"'{text}' is not an object storage URL (expected s3://bucket/prefix or "
                             "az://container/prefix)")
        scheme, rest = text.split("://", 1)
        scheme = scheme.lower()
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        bucket, _, host = bucket.partition("@") if scheme != "s3" else (bucket, "", "")
        if not bucket:
            raise ValueError(f"'{text}' names no bucket (expected {scheme}://bucket/prefix)")
        if any(part in (".", "..") for part in prefix.split("/")) or "//" in prefix:
            raise ValueError(f"'{text}': the key prefix may not contain '.', '..' or empty parts")
        return ObjectLocation(scheme, bucket, prefix, host)

    def key(self, name: str) -> str:
        """The object key of ``name`` (a checkpoint-relative file name) under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str | None = None) -> str:
        """The URL of the checkpoint, or of one of its objects."""
        base = f"{self.scheme}://{self.bucket}" + (f"@{self.host}" if self.host else "")
        key = self.key(name) if name is not None else self.prefix
        return f"{base}/{key}" if key else base

    def __str__(self) -> str:
        return self.url()
