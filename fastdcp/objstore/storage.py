"""A checkpoint's objects as a :class:`fastdcp.io.backends.FileStore`: the shared side of a tiered
checkpoint in S3 or Azure Blob, through the same client and transfers as the object writer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .client import AzureOptions, S3Options, object_error, options_for, require_obstore, store_for
from .commit import object_exists, read_object
from .location import ObjectLocation
from .transfer import delete_objects, upload_image

__all__ = ["ObjectStorage", "object_storage"]


class ObjectStorage:
    """The objects under ``s3://bucket/prefix`` or ``az://container/prefix``."""

    def __init__(self, url: str, options: S3Options | AzureOptions | None = None) -> None:
        self.location = ObjectLocation.parse(url)
        self.options = options if options is not None else options_for(self.location)

    def _store(self) -> Any:
        return store_for(self.location, self.options)

    def url(self, name: str | None = None) -> str:
        return self.location.url(name)

    def put_images(self, images: list[tuple[str, int, list[tuple]]]) -> None:
        """One upload per file (multipart, streamed from the image's memory), one after another:
        each already has ``concurrency`` parts in flight."""
        for name, size, segments in images:
            upload_image(self._store(), self.location, name, segments, size, self.options, self.options.concurrency)

    def put_bytes(self, name: str, data: bytes, *, create_only: bool = False) -> None:
        obstore = require_obstore()
        try:
            obstore.put(self._store(), self.location.key(name), data, use_multipart=False,
                        mode="create" if create_only else "overwrite")
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self.location.url(name), "writing", self.options) from error

    def delete(self, names: Iterable[str]) -> list[str]:
        return delete_objects(self._store(), self.location, list(names), self.options)

    def existing(self, names: set[str]) -> set[str]:
        return {name for name in names if object_exists(self._store(), self.location, name, self.options)}

    def read_bytes(self, name: str) -> bytes:
        return read_object(self._store(), self.location, name, self.options)

    def size(self, name: str) -> int:
        obstore = require_obstore()
        try:
            return int(obstore.head(self._store(), self.location.key(name))["size"])
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self.location.url(name), "checking", self.options) from error

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        obstore = require_obstore()
        try:
            data = bytes(obstore.get_range(self._store(), self.location.key(name), start=offset, length=length))
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self.location.url(name), "reading", self.options) from error
        if len(data) != length:
            raise OSError(f"reading {self.location.url(name)}: {len(data)} bytes at {offset}, expected {length}")
        return data

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        obstore = require_obstore()
        base = self.location.key("")
        try:
            for batch in obstore.list(self._store(), base + prefix or None):
                for meta in batch:
                    yield meta["path"][len(base):], int(meta["size"])
        except Exception as error:  # noqa: BLE001 - translated, naming the prefix
            raise object_error(error, self.location.url(prefix or None), "listing", self.options) from error


def object_storage(url: str, *, s3_options: S3Options | None = None,
                   azure_options: AzureOptions | None = None) -> ObjectStorage:
    """The :class:`ObjectStorage` at ``url`` with the options for its store (the registry's
    ``file_store`` of the S3 and Azure backends)."""
    location = ObjectLocation.parse(url)
    return ObjectStorage(url, options_for(location, s3_options, azure_options))
