"""``inspect`` and ``verify`` of a checkpoint in object storage (``s3://bucket/prefix``): the same
checks as on a local directory, its bytes fetched by ranged GETs (blob headers, and for the
checksum pass the recorded items, through :class:`fastdcp.objstore.transfer.ObjectReadEngine`).
Unlike the save and load paths, these commands LIST the prefix: for per-rank ``__N.metadata``
objects when there is no ``.metadata``, and for the data objects no metadata names."""

from __future__ import annotations

from typing import Any

from ..format.metadata import METADATA_NAME, RANK_METADATA_RE, CheckpointNotFoundError
from ..objstore.client import (AzureOptions, ObjectNotFoundError, ObjectStoreError, S3Options, default_options, object_error,
                               require_obstore, store_for)
from ..objstore.commit import object_exists, read_checkpoint_metadata
from ..objstore.leftovers import list_objects
from ..objstore.location import ObjectLocation
from ..objstore.transfer import ObjectFile, ObjectReadEngine
from .checkpoint import Checkpoint, NotACheckpoint

__all__ = ["ObjectDataFile", "ObjectFiles", "open_object_checkpoint"]


class ObjectDataFile:
    """A data object opened for ranged reads (``DataFile``'s surface); ``error`` is set instead
    when it cannot be (missing, refused). Opening sends one HEAD, for its size."""

    def __init__(self, store: Any, location: ObjectLocation, relative_path: str, options: S3Options) -> None:
        self.store = store
        self.location = location
        self.relative_path = relative_path
        self.options = options
        self.path = location.url(relative_path)
        self.size = 0
        self.error: str | None = None
        obstore = require_obstore()
        try:
            self.size = int(obstore.head(store, location.key(relative_path))["size"])
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            self.error = str(object_error(error, self.path, "opening", options))

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` at ``offset`` (EOFError naming the object when it ends first)."""
        if nbytes == 0:
            return b""
        if offset + nbytes > self.size:
            raise EOFError(f"'{self.path}' ends at {self.size} bytes, wanted {nbytes} bytes at {offset}")
        obstore = require_obstore()
        try:
            data = obstore.get_range(self.store, self.location.key(self.relative_path), start=offset,
                                     end=offset + nbytes)
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self.path, f"reading bytes {offset}-{offset + nbytes} of", self.options) from error
        if len(data) != nbytes:
            raise EOFError(f"'{self.path}' ends before byte {offset + nbytes} (got {len(data)} of {nbytes} bytes "
                           f"from offset {offset})")
        return bytes(data)

    def close(self) -> None:
        pass


class ObjectFiles:
    """:class:`fastdcp.cli.checkpoint.LocalFiles`' surface over an ``s3://`` prefix."""

    def __init__(self, store: Any, location: ObjectLocation, options: S3Options) -> None:
        self.store = store
        self.location = location
        self.options = options

    def open_data_file(self, relative_path: str, entry: Any) -> ObjectDataFile:
        return ObjectDataFile(self.store, self.location, str(relative_path), self.options)

    def checksum_reader(self, data_files: dict[str, ObjectDataFile], options: Any) -> tuple[Any, dict[str, Any]]:
        from ..io.engine import get_engine

        engine = ObjectReadEngine(get_engine(options), self.options)
        return engine, {rel: ObjectFile(self.store, self.location, rel, self.options) for rel in data_files}

    def object_names(self) -> list[str]:
        """The names directly under the prefix (one LIST, paged by the client)."""
        return [obj.name for obj in list_objects(self.store, self.location, self.options)]

    def data_file_names(self) -> list[str]:
        try:
            return [n for n in self.object_names() if n.endswith(".distcp")]
        except ObjectStoreError:
            return []


def open_object_checkpoint(url: str, allow_unsafe: bool, options: S3Options | AzureOptions | None = None) -> Checkpoint:
    """The checkpoint at ``url`` for ``inspect``/``verify``. Raises NotACheckpoint (naming the URL)
    when there is none or the store refuses, CheckpointFormatError for damaged metadata."""
    try:
        location = ObjectLocation.parse(url)
    except ValueError as error:
        raise NotACheckpoint(str(error)) from None
    options = options if options is not None else default_options(location)
    try:
        store = store_for(location, options)
        files = ObjectFiles(store, location, options)
        if object_exists(store, location, METADATA_NAME, options):
            names = [METADATA_NAME]
        else:
            ranks = sorted(int(m.group(1)) for m in map(RANK_METADATA_RE.match, files.object_names()) if m)
            if not ranks:
                raise NotACheckpoint(f"'{location.url()}' is not a DCP checkpoint: no {METADATA_NAME} object")
            names = [f"__{r}{METADATA_NAME}" for r in ranks]
        metadata = [read_checkpoint_metadata(store, location, name, options, allow_unsafe) for name in names]
    except (CheckpointNotFoundError, ObjectNotFoundError, ObjectStoreError) as error:
        raise NotACheckpoint(str(error)) from None
    return Checkpoint(location.url(), names, metadata, source=files)
