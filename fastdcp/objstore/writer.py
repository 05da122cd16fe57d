"""FastObjectWriter: a DCP checkpoint written to object storage (``s3://bucket/prefix``,
``az://container/prefix``).

The same planning as :class:`fastdcp.FastFileSystemWriter` (files per rank, each planned as an
image of segments by :mod:`fastdcp.save.file_image`; ``dcp.async_save`` staging), with the images
uploaded by concurrent multipart uploads streamed from that memory (:mod:`.transfer`) instead of
written by the native engine. The commit (:mod:`.commit`) is one PUT of the finished ``.metadata``
after every rank's objects (and, for a save planned in bulk, its chunk index) are complete: never
a rename, a LIST or a COPY.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import traceback
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StoragePrefix
from torch.distributed.checkpoint.filesystem import FileSystemWriter as _StockFileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..compat.renamed import S3_WRITER_RENAMES, renamed_arguments
from ..format.metadata import METADATA_NAME
from ..io.gc import gc_paused
from ..save.file_image import FilePlan
from ..save import file_sink
from ..save.writer import FastFileSystemWriter
from . import commit
from .azure import AZURE_SCHEMES
from .client import AzureOptions, S3Options
from .location import ObjectLocation
from .located import AtObjectLocation, options_signature
from .device_upload import UploadRing, ring_slots, upload_device_image
from .transfer import delete_objects, transfer_pool, upload_image, wait_all

__all__ = ["FastObjectWriter", "FastS3Writer", "FastAzureWriter", "key_prefixes_from", "MAX_KEY_PREFIXES"]

# The most sub-prefixes a checkpoint's data objects are spread over.
MAX_KEY_PREFIXES = 1 << 16


def key_prefixes_from(value: int | None) -> int:
    """``key_prefixes`` as given, else ``FASTDCP_S3_KEY_PREFIXES``, else 1; checked."""
    where = "key_prefixes"
    if value is None:
        raw = os.environ.get("FASTDCP_S3_KEY_PREFIXES", "").strip()
        if not raw:
            return 1
        where = "FASTDCP_S3_KEY_PREFIXES"
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{where} must be an integer from 1 to {MAX_KEY_PREFIXES}, got {raw!r}") from None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_KEY_PREFIXES:
        raise ValueError(f"{where} must be an integer from 1 to {MAX_KEY_PREFIXES}, got {value!r}")
    return value


class FastObjectWriter(AtObjectLocation, FastFileSystemWriter):
    """Drop-in for stock's ``FsspecWriter`` on object storage paths, one class for every store
    (:class:`FastS3Writer`, :class:`FastAzureWriter` name its options keyword for theirs).

    Takes stock's arguments and :class:`fastdcp.FastFileSystemWriter`'s (``sync_files`` means
    nothing more here: an object is durable once its upload completes); ``store_options``:
    :class:`S3Options` or :class:`AzureOptions` (unset: the store's usual environment);
    ``key_prefixes``: data objects spread over that many sub-prefixes. Files are uploaded by
    :class:`ObjectFileSink`; ``.metadata`` is written last by one PUT (conditional with
    ``overwrite=False``), so a failed save leaves the previous checkpoint loadable
    (docs/GUARANTEES.md, object storage)."""

    @renamed_arguments(S3_WRITER_RENAMES)
    def __init__(
        self,
        path: str,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        store_options: S3Options | AzureOptions | None = None,
        checksums: bool | None = None,
        async_staging: bool | None = None,
        snapshot_limit_bytes: int | None = None,
        io_threads: int | None = None,
        pinned_ring_limit_bytes: int | None = None,
        key_prefixes: int | None = None,
    ) -> None:
        self.location = ObjectLocation.parse(path)
        self.key_prefixes = key_prefixes_from(key_prefixes)
        super().__init__(
            self.location.url(),
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
            checksums=checksums,
            async_staging=async_staging,
            snapshot_limit_bytes=snapshot_limit_bytes,
            io_threads=io_threads,
            pinned_ring_limit_bytes=pinned_ring_limit_bytes,
            direct_io=False,
        )
        self._settle(self.location, store_options)
        self.sink = ObjectFileSink(self)
        # Accepted for compatibility, asks for nothing: an object is durable once its PUT returns
        # (stock code writing through object streams would otherwise os.sync() the host per file).
        self.sync_files = False
        # This rank's uploads in the save in progress (deleted if the save fails).
        self._uploaded: list[str] = []
        # Parts the last save uploaded from the pinned ring (its GPU tensor bytes).
        self.last_ring_parts = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._uploaded = []

    # --- planning ---------------------------------------------------------------------------- #

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite:
            name = METADATA_NAME if getattr(self, "use_collectives", True) else f"__0{METADATA_NAME}"
            if commit.object_exists(self._store(), self.location, name, self.store_options):
                raise RuntimeError(f"Checkpoint already exists and self.overwrite=False: {self.location.url(name)}")
        if self._rank_local():
            self._save_token = self.sink.claim_token()
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(self.sink.storage_prefix(self.rank, self._save_token)))
        return plan

    # --- writing ----------------------------------------------------------------------------- #

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._uploaded = []
        self.last_ring_parts = 0
        try:
            if self._stock_writes_everything():
                # Stock's writer code, through object streams (each file one PUT when complete).
                storage_plan = plan.storage_data
                self._uploaded = [f"{storage_plan.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(plan.items))]
                return _StockFileSystemWriter.write_data(self, plan, planner)
            with gc_paused():
                return self._write_data_fast(plan.storage_data, plan, planner)
        except BaseException as error:
            if error.__traceback__ is not None:
                traceback.clear_frames(error.__traceback__.tb_next)
            uploaded, self._uploaded = self._uploaded, []
            if uploaded:
                try:
                    delete_objects(self._store(), self.location, uploaded, self.store_options)
                except Exception:  # noqa: BLE001 - the save's own error is the one to report
                    pass
            raise
        finally:
            self._release_staging(planner)

    # --- commit ------------------------------------------------------------------------------ #

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator, after every rank's uploads completed): the chunk index (a save
        planned in bulk) and then ``.metadata``, each in one PUT; then the objects of the
        checkpoint it replaced are deleted."""
        new_files = self._complete_metadata(metadata, results)
        rank_local = self._rank_local()
        name = f"__{self.rank}{METADATA_NAME}" if rank_local else METADATA_NAME
        token = self._save_token or self.sink.claim_token()  # names the chunk index, as the data objects
        self._claimed_tokens = set()
        commit.commit_metadata(self._store(), self.location, name, metadata, new_files,
                               create_only=not self.overwrite, options=self.store_options, token=token)


class ObjectFileSink:
    """A save's data files as objects (:class:`fastdcp.save.file_sink.FileSink`): random save
    tokens (no marker object, no LIST), names under the checkpoint's prefix (spread over
    ``key_prefixes`` sub-prefixes), every image uploaded concurrently.

    Args:
        writer: the object writer whose location, options and upload list it uses.
    """

    def __init__(self, writer: "FastObjectWriter") -> None:
        self.writer = writer

    def claim_token(self) -> str:
        # Object names are made unique by a random token (64 bits): no marker object, no LIST.
        token = secrets.token_hex(8)
        self.writer._claimed_tokens.add(token)
        return token

    def storage_prefix(self, rank: int, token: str) -> str:
        # With key_prefixes, rank r's objects go under sub-prefix r % key_prefixes (hex).
        name = f"__{rank}_{token}_"
        prefixes = self.writer.key_prefixes
        if prefixes <= 1:
            return name
        width = len(format(prefixes - 1, "x"))
        return f"{rank % prefixes:0{width}x}/{name}"

    def data_file_path(self, storage_key: str) -> str:
        return storage_key  # the object's name under the checkpoint's prefix

    def write_threads(self) -> int:
        return self.writer.io_options.io_threads

    def files_written_here(self, new_files: set[str]) -> set[str]:
        return set(new_files)

    def write_files(self, files: list[FilePlan], options: Any) -> None:
        """Upload every file image concurrently: files share the process's request threads, each
        with an equal share of the parts in flight; files holding device tensor bytes upload them
        through one pinned ring (:mod:`.device_upload`)."""
        store = self.writer._store()
        s3 = self.writer.store_options
        per_file = max(2, s3.concurrency // max(1, len(files)))
        pool = transfer_pool(max(len(files), 1))
        on_device = [f for f in files if f.device_segments]
        ring = None
        if on_device:
            slots = ring_slots(self.writer.pinned_ring_limit_bytes, s3.part_bytes, len(on_device), per_file)
            ring = UploadRing(s3.part_bytes, slots, file_sink.make_copier())
        try:
            futures = []
            for f in files:
                self.writer._uploaded.append(f.path)
                if f.device_segments:
                    futures.append(pool.submit(upload_device_image, store, self.writer.location, f.path, f.segments,
                                               f.device_segments, f.size, ring, s3, per_file))
                else:
                    futures.append(pool.submit(upload_image, store, self.writer.location, f.path, f.segments, f.size, s3,
                                               per_file))
            wait_all(futures)
        finally:
            if ring is not None:
                ring.close()
                self.writer.last_ring_parts = ring.parts


class FastS3Writer(FastObjectWriter):
    """:class:`FastObjectWriter` for ``s3://bucket/prefix``; ``s3_options``: :class:`S3Options`
    (unset: the ``AWS_*`` environment)."""

    schemes = ("s3",)

    @renamed_arguments(S3_WRITER_RENAMES)
    def __init__(self, path: str, *args: Any, s3_options: S3Options | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, store_options=s3_options, **kwargs)

    __init__.__signature__ = options_signature(FastObjectWriter.__init__, "s3_options", S3Options)  # type: ignore[attr-defined]


class FastAzureWriter(FastObjectWriter):
    """:class:`FastObjectWriter` for Azure Blob Storage, ``az://container/prefix`` or
    ``abfs://container/prefix``; ``azure_options``: :class:`AzureOptions` (unset: the
    ``AZURE_STORAGE_*`` environment). A create-only commit is a conditional PUT (``If-None-Match``)."""

    schemes = AZURE_SCHEMES

    @renamed_arguments(S3_WRITER_RENAMES)
    def __init__(self, path: str, *args: Any, azure_options: AzureOptions | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, store_options=azure_options, **kwargs)

    __init__.__signature__ = options_signature(FastObjectWriter.__init__, "azure_options", AzureOptions)  # type: ignore[attr-defined]
