"""``fastdcp.open("s3://bucket/prefix")``: a checkpoint in object storage as the lazy, read-only
mapping of :mod:`fastdcp.load.lazy`, its reads served by ranged GETs of only the bytes asked for
(:class:`~fastdcp.objstore.transfer.ObjectReadEngine`): reading one tensor, or a slice of one,
fetches that tensor's (or slice's) bytes and its blob header, not the files that hold it."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..compat.renamed import READER_RENAMES, renamed_arguments
from ..format.metadata import METADATA_NAME
from ..io.engine import get_engine
from ..load.lazy import LazyCheckpoint
from ..io.backends import backend_for
from .client import AzureOptions, S3Options, options_for, store_for
from .commit import read_checkpoint_metadata
from .location import ObjectLocation
from .streams import ObjectStreams
from .transfer import ObjectFile, ObjectReadEngine

__all__ = ["ObjectCheckpoint", "open_object_checkpoint"]


class ObjectCheckpoint(LazyCheckpoint):
    """:class:`fastdcp.load.lazy.LazyCheckpoint` over ``s3://bucket/prefix`` or ``az://container/prefix``."""

    def __init__(self, url: str, *, s3_options: S3Options | None = None, azure_options: AzureOptions | None = None,
                 **kwargs: Any) -> None:
        self.location = ObjectLocation.parse(url)
        self.s3_options = options_for(self.location, s3_options, azure_options)
        kwargs.pop("direct_io", None)
        location, options = self.location, self.s3_options
        super().__init__(self.location.url(), direct_io=False,
                         files=lambda checkpoint: ObjectCheckpointFiles(checkpoint, location, options), **kwargs)


class ObjectCheckpointFiles:
    """A checkpoint's objects (:class:`fastdcp.load.lazy.CheckpointFiles`): ranged GETs, no
    O_DIRECT, no local paths; stock's reads through object streams.

    Args:
        checkpoint: the lazy checkpoint; location, options: where its objects are and how to reach them.
    """

    def __init__(self, checkpoint: LazyCheckpoint, location: ObjectLocation, options: Any) -> None:
        self.checkpoint = checkpoint
        self.location = location
        self.options = options

    def read_metadata(self, allow_unsafe: bool) -> Metadata:
        return read_checkpoint_metadata(store_for(self.location, self.options), self.location, METADATA_NAME,
                                        self.options, allow_unsafe)

    def direct(self) -> bool:
        return False

    def engine(self) -> ObjectReadEngine:
        return ObjectReadEngine(get_engine(self.checkpoint.io_options), self.options)

    def open(self, rel: str) -> ObjectFile:
        # Lengths are checked by every ranged read (a short object is named in the error).
        return ObjectFile(store_for(self.location, self.options), self.location, rel, self.options)

    def local_path(self, rel: str) -> None:
        return None  # no file to copy from inside the kernel: convert reads the bytes instead

    def stock_reader(self) -> FileSystemReader:
        registry = self.checkpoint._extension_registry
        reader = FileSystemReader(self.location.url()) if registry is None else \
            FileSystemReader(self.location.url(), _extension_registry=registry)
        reader.fs = ObjectStreams(self.location, self.options)  # stock's reads, from objects
        reader.path = self.location.url()  # stock made it a pathlib.Path, folding "s3://" into "s3:/"
        return reader


@renamed_arguments(READER_RENAMES, name="fastdcp.open")
def open_object_checkpoint(url: str | os.PathLike, *, device: str | torch.device = "cpu",
                           allow_unsafe_metadata: bool = False, io_threads: int | None = None,
                           read_buffer_limit_bytes: int | None = None, extension_registry: Any = None,
                           s3_options: S3Options | None = None, azure_options: AzureOptions | None = None,
                           direct_io: bool | None = None) -> ObjectCheckpoint:
    """``fastdcp.open`` for object storage URLs (``direct_io`` is accepted, as for a local path,
    and means nothing for objects)."""
    return ObjectCheckpoint(str(url), s3_options=s3_options, azure_options=azure_options, device=device,
                            allow_unsafe_metadata=allow_unsafe_metadata, io_threads=io_threads,
                            read_buffer_limit_bytes=read_buffer_limit_bytes, extension_registry=extension_registry)


@renamed_arguments(READER_RENAMES, name="fastdcp.open")
def open_any(path: str | os.PathLike, *, device: str | torch.device = "cpu", allow_unsafe_metadata: bool = False,
             direct_io: bool | None = None, io_threads: int | None = None, read_buffer_limit_bytes: int | None = None,
             extension_registry: Any = None, s3_options: S3Options | None = None,
             azure_options: AzureOptions | None = None) -> LazyCheckpoint:
    """``fastdcp.open(path)``: a local checkpoint directory (:func:`fastdcp.load.lazy.open_checkpoint`)
    or a URL, opened by the backend registered for its scheme (:mod:`fastdcp.io.backends`;
    ``s3_options`` / ``azure_options`` are for those stores, ``direct_io`` means nothing there)."""
    from ..load.lazy import open_checkpoint

    kwargs: dict[str, Any] = dict(device=device, allow_unsafe_metadata=allow_unsafe_metadata, direct_io=direct_io,
                                  io_threads=io_threads, read_buffer_limit_bytes=read_buffer_limit_bytes,
                                  extension_registry=extension_registry)
    backend = backend_for(path)
    if backend is None:
        return open_checkpoint(path, **kwargs)
    for name, value in (("s3_options", s3_options), ("azure_options", azure_options)):
        if value is not None:
            kwargs[name] = value
    return backend.load("opener")(str(path), **kwargs)
