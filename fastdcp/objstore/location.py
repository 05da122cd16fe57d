"""Where a checkpoint lives in object storage: ``s3://bucket/prefix`` parsed once, object keys and
URLs built from it."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ObjectLocation", "is_object_url", "SCHEMES"]

SCHEMES = ("s3",)


def is_object_url(path: object) -> bool:
    """Whether ``path`` names object storage (``s3://...``) rather than a local path."""
    if isinstance(path, os.PathLike):
        return False  # a pathlib.Path collapses "s3://" to "s3:/": it was never meant as a URL
    return isinstance(path, str) and any(path.startswith(f"{scheme}://") for scheme in SCHEMES)


@dataclass(frozen=True)
class ObjectLocation:
    """A checkpoint's place in a bucket: ``bucket`` and a key ``prefix`` (no slashes at its ends;
    empty for the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    @staticmethod
    def parse(url: str | os.PathLike) -> "ObjectLocation":
        """``s3://bucket[/prefix]``; ValueError naming the URL when it is not one."""
        text = os.fspath(url) if not isinstance(url, str) else url
        if not is_object_url(text):
            raise ValueError(f"'{text}' is not an object storage URL (expected s3://bucket/prefix)")
        scheme, rest = text.split("://", 1)
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise ValueError(f"'{text}' names no bucket (expected s3://bucket/prefix)")
        if any(part in (".", "..") for part in prefix.split("/")) or "//" in prefix:
            raise ValueError(f"'{text}': the key prefix may not contain '.', '..' or empty parts")
        return ObjectLocation(scheme, bucket, prefix)

    def key(self, name: str) -> str:
        """The object key of ``name`` (a checkpoint-relative file name) under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str | None = None) -> str:
        """The URL of the checkpoint, or of one of its objects."""
        base = f"{self.scheme}://{self.bucket}"
        key = self.key(name) if name is not None else self.prefix
        return f"{base}/{key}" if key else base

    def __str__(self) -> str:
        return self.url()
