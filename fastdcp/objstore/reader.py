"""FastObjectReader: a DCP checkpoint read from object storage (``s3://bucket/prefix``,
``az://container/prefix``).

The load path of :class:`fastdcp.FastFileSystemReader` (blob headers read in one merged pass,
pieces planned from the run tables, placed straight into destinations or through bounded staging),
with its reads served by concurrent ranged GETs of exactly the byte runs the plan needs
(:class:`~fastdcp.objstore.transfer.ObjectReadEngine`) instead of ``pread``: only the bytes this
rank loads cross the network, so a resharded load does not download whole files.

The metadata is read as the local reader reads it (:mod:`.indexed_metadata`): from the chunk index
a bulk-planned save wrote beside ``.metadata``, a rank of a multi-rank load fetching only the
index's header, shared objects and its own section by ranged GETs.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner

from ..compat.renamed import READER_RENAMES, renamed_arguments
from ..format.metadata import METADATA_NAME, CheckpointFormatError
from ..io.engine import get_engine
from ..load.deadline import DEADLINE_FROM_ENV
from ..load.read_source import default_group_rank
from ..load.reader import FastFileSystemReader
from ..load.sectioned_metadata import SectionedTableMetadata, metadata_bytes_read
from .azure import AZURE_SCHEMES
from .client import AzureOptions, S3Options
from .commit import is_object_name
from .indexed_metadata import ObjectFetches, check_object_names, read_object_metadata
from .location import ObjectLocation
from .located import AtObjectLocation, options_signature
from .transfer import ObjectFile, ObjectReadEngine

__all__ = ["FastObjectReader", "FastS3Reader", "FastAzureReader"]


class FastObjectReader(AtObjectLocation, FastFileSystemReader):
    """Drop-in for stock's ``FsspecReader`` on object storage paths, one class for every store;
    :class:`FastS3Reader` and :class:`FastAzureReader` name its options keyword for theirs:
    ``FastS3Reader("s3://bucket/run1/step100")``.

    ``store_options``: :class:`S3Options` or :class:`AzureOptions` (endpoint, credentials,
    retries, request size, requests in flight); unset, the store's usual environment.
    ``read_buffer_limit_bytes``, ``allow_unsafe_metadata``, ``verify_checksums``, ``load_deadline_s``,
    ``read_once``: as
    :class:`fastdcp.FastFileSystemReader`. ``last_stats`` counts the GET requests and bytes
    fetched by the last load: for data (``object_requests``, ``object_bytes``) and for its metadata,
    ``.metadata`` and the chunk index, from reading them to the data reads
    (``metadata_requests``, ``metadata_bytes``)."""

    @renamed_arguments(READER_RENAMES)
    def __init__(
        self,
        path: str,
        _extension_registry: Any = None,
        *,
        store_options: S3Options | AzureOptions | None = None,
        read_buffer_limit_bytes: int | None = None,
        allow_unsafe_metadata: bool = False,
        verify_checksums: bool | None = None,
        load_deadline_s: float | None = DEADLINE_FROM_ENV,
        read_once: bool | None = None,
    ) -> None:
        self.location = ObjectLocation.parse(path)
        super().__init__(
            self.location.url(),
            _extension_registry,
            direct_io=False,
            read_buffer_limit_bytes=read_buffer_limit_bytes,
            allow_unsafe_metadata=allow_unsafe_metadata,
            verify_checksums=verify_checksums,
            load_deadline_s=load_deadline_s,
            read_once=read_once,
        )
        self._settle(self.location, store_options)
        self.source = ObjectReadSource(self)
        # The metadata requests and bytes of every load through this reader, and where the
        # current load's began (metadata_bytes_read(), requests).
        self.metadata_fetched = ObjectFetches()
        self._metadata_mark: tuple[int, int] | None = None

    def read_data(self, plan: Any, planner: LoadPlanner) -> Any:
        engine = self.source.read_engine(False)
        requests, fetched = engine.requests, engine.bytes_fetched
        mark, self._metadata_mark = self._metadata_mark, None
        metadata = None
        if mark is not None:
            metadata = (metadata_bytes_read() - mark[0], self.metadata_fetched.requests - mark[1])
        future = super().read_data(plan, planner)
        self.last_stats["object_requests"] = engine.requests - requests
        self.last_stats["object_bytes"] = engine.bytes_fetched - fetched
        if metadata is not None:
            self.last_stats["metadata_bytes"], self.last_stats["metadata_requests"] = metadata
        return future


class ObjectReadSource:
    """A load's objects (:class:`fastdcp.load.read_source.ReadSource`): the metadata from the chunk
    index by ranged GETs, data objects read by concurrent ranged GETs, no read mode to choose.

    Args:
        reader: the object reader whose location, options and fetch counts it uses.
    """

    def __init__(self, reader: "FastObjectReader") -> None:
        self.reader = reader
        self._engine: ObjectReadEngine | None = None

    def read_metadata(self, rank: int | None) -> Metadata:
        """This load's metadata: from the chunk index ``.metadata`` names (on several ranks, this
        rank's section of it), else ``.metadata`` parsed whole; every data object it names
        checked to lie directly under the checkpoint's prefix."""
        self.reader._metadata_mark = (metadata_bytes_read(), self.reader.metadata_fetched.requests)
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        group_rank = default_group_rank() if rank is None else None
        metadata = read_object_metadata(self.reader._store(), self.reader.location, name, self.reader.store_options,
                                        self.reader.allow_unsafe_metadata, sectioned=group_rank is not None,
                                        fetches=self.reader.metadata_fetched)
        if isinstance(metadata, SectionedTableMetadata):
            # This rank's section (the default group's rank for now; set_up_storage_reader rebinds
            # when DCP names another), read now as the local reader does.
            metadata.bind_rank(group_rank)
            section = metadata.rank_section()
            if section is not None:
                check_object_names(self.reader.location, name, section.table.storage.files)  # type: ignore[union-attr]
        return metadata

    def choose_read_mode(self, per_file: Any) -> None:
        return None  # no page cache, no O_DIRECT: ranged GETs

    def read_engine(self, direct: bool) -> ObjectReadEngine:
        if self._engine is None:
            self._engine = ObjectReadEngine(get_engine(self.reader.io_options), self.reader.store_options)
        return self._engine

    def open(self, relative_path: str) -> ObjectFile:
        # The object's length is checked by every ranged read (a short one names the object), so
        # opening costs no request.
        if not is_object_name(relative_path):
            raise CheckpointFormatError(f"{self.reader.location.url()}: the metadata names a data object {relative_path!r} "
                                        "outside the checkpoint")
        return ObjectFile(self.reader._store(), self.reader.location, relative_path, self.reader.store_options)

    def release(self) -> None:
        pass  # nothing held between loads: objects are opened per read


class FastS3Reader(FastObjectReader):
    """:class:`FastObjectReader` for ``s3://bucket/prefix``; ``s3_options``: :class:`S3Options`
    (unset: the ``AWS_*`` environment)."""

    schemes = ("s3",)

    @renamed_arguments(READER_RENAMES)
    def __init__(self, path: str, *args: Any, s3_options: S3Options | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, store_options=s3_options, **kwargs)

    __init__.__signature__ = options_signature(FastObjectReader.__init__, "s3_options", S3Options)  # type: ignore[attr-defined]


class FastAzureReader(FastObjectReader):
    """:class:`FastObjectReader` for Azure Blob Storage (``az://`` or ``abfs://``);
    ``azure_options``: :class:`AzureOptions` (unset: the ``AZURE_STORAGE_*`` environment)."""

    schemes = AZURE_SCHEMES

    @renamed_arguments(READER_RENAMES)
    def __init__(self, path: str, *args: Any, azure_options: AzureOptions | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, store_options=azure_options, **kwargs)

    __init__.__signature__ = options_signature(FastObjectReader.__init__, "azure_options", AzureOptions)  # type: ignore[attr-defined]
