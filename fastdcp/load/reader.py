"""FastFileSystemReader: reads stock- and fastdcp-written checkpoints with planned range reads.

Stock ``FileSystemReader`` ``torch.load``s every stored chunk whole on one thread, then narrows and
copies. This reader instead:

1. reads the zip headers of every blob it needs (small blobs whole, large ones as a head and a tail
   window, adjacent windows merged into one read) and parses them without ``torch.load``;
2. turns each ReadItem into the byte span of the stored tensor it covers;
3. reads spans in parallel through the engine, straight into the destination when the span maps
   1:1 onto a contiguous destination of the same dtype, otherwise into staging memory bounded by a
   budget, from which a batched C++ strided copy (with dtype conversion) places the boxes.

Items with ``transform_descriptors`` (stream extensions) go through stock code.

A load sees one committed checkpoint even while another save overwrites the directory: right
after reading ``.metadata`` the reader opens every data file it names (up to
``_PIN_FILES_LIMIT``) and reads through those handles, so files the overwrite's cleanup unlinks
stay readable; a file that vanished between reading the metadata and opening it means a commit
happened in between, so the metadata is read again (as long as it keeps being replaced, up to
``_METADATA_READS`` times). With several ranks, the coordinator checks
that every rank read the same save (``StorageMeta.save_id``) and otherwise fails with a clear error
instead of loading a mix.

When ``.metadata`` names a chunk index (fastdcp's writer), the metadata is read from the index
(:func:`fastdcp.load.metadata_cache.load_table_metadata`) as a
:class:`~fastdcp.format.table_metadata.TableMetadata`, and the reader's passes over the whole
metadata (data paths, pins, file extents, recognising blobs) work on its columns: a rank loading
with :class:`fastdcp.FastLoadPlanner` builds objects only for the items it reads.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import os
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._native import _C
from ..compat.renamed import READER_RENAMES, renamed_arguments
from ..format.blob import BlobFormatError
from ..format.blob_parse import TensorBlobInfo
from ..format.checksums import ChecksumError, checksummed_items
from ..format.table_metadata import TableMetadata
from ..io.phases import timed
from ..io.engine import IoOptions, env_flag
from ..io.gc import gc_paused
from ..io.read_mode import ReadMode, record_read
from .deadline import DEADLINE_FROM_ENV, END, START, LoadCheckIns, begin_load, reading_files_status, \
    resolve_load_deadline, stall_point
from .header_pass import KnownBlobs, Window, parse_blob, read_windows, window_bytes
from .read_once import ReadOnceShare, ReplicaGroup, ReplicaKey, replica_groups, replica_key
from .sectioned_metadata import SectionedTableMetadata
from .pieces import Placement, plan_placement
from .read_source import LocalReadSource, ReadSource, pin_limit, reopen_in_mode
from .placement import run_placements
from .verify import verify_checksums

__all__ = ["FastFileSystemReader", "ConcurrentOverwriteError", "pin_limit"]

logger = logging.getLogger("fastdcp")  # the library's one logger: it prints nothing by itself

_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemReader.__init__).parameters)

@dataclasses.dataclass(frozen=True)
class _SaveIdentity:
    """A rank's local load plan carries the save its metadata came from (``StorageMeta.save_id``;
    None for checkpoints that record none) and, for a read-once load, its replica key; the global
    plan hands back the rank's replica group (``fastdcp.load.read_once``)."""

    save_id: str | None
    replica: ReplicaKey | None = None
    group: ReplicaGroup | None = None


class ConcurrentOverwriteError(RuntimeError):
    """The ranks of one load read different saves of the checkpoint: a concurrent save replaced it
    between their ``.metadata`` reads."""


def _unreadable(error: Exception, rank: int) -> CheckpointException:
    """``error`` (reading a checkpoint's ``.metadata``) as DCP reports a rank's failed load step."""
    return CheckpointException(str(error), {rank: (error, traceback.extract_tb(error.__traceback__))})


class FastFileSystemReader(FileSystemReader):
    """Drop-in replacement for :class:`torch.distributed.checkpoint.FileSystemReader`.

    Takes stock's arguments with stock's meaning. fastdcp's own keyword arguments, each with its
    default and environment variable in docs/api.md (FastFileSystemReader): ``direct_io`` (chosen
    per load by :mod:`fastdcp.io.read_mode` when unset; ``last_read_mode`` says why),
    ``io_threads``, ``task_bytes``, ``read_buffer_limit_bytes`` (the most read-buffer memory held
    at once), ``allow_unsafe_metadata`` (plain pickle for a trusted checkpoint's custom classes),
    ``load_deadline_s`` (:mod:`fastdcp.load.deadline`), ``read_once`` (data-parallel replicas
    read each stored byte once: :mod:`fastdcp.load.read_once`). The files are read through
    ``self.source`` (:mod:`fastdcp.load.read_source`)."""

    @renamed_arguments(READER_RENAMES)
    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: Any = None,
        *,
        direct_io: bool | None = None,
        io_threads: int | None = None,
        task_bytes: int | None = None,
        read_buffer_limit_bytes: int | None = None,
        allow_unsafe_metadata: bool = False,
        verify_checksums: bool | None = None,
        load_deadline_s: float | None = DEADLINE_FROM_ENV,
        read_once: bool | None = None,
    ) -> None:
        if _extension_registry is not None and "_extension_registry" not in _STOCK_INIT_PARAMS:
            raise TypeError("this torch's FileSystemReader does not support _extension_registry")
        if "_extension_registry" in _STOCK_INIT_PARAMS:
            super().__init__(path, _extension_registry=_extension_registry)
        else:  # pragma: no cover - older torch
            super().__init__(path)
        self.io_options = IoOptions.resolve(
            direct_io=direct_io,
            default_direct_io=False,
            io_threads=io_threads,
            task_bytes=task_bytes,
            read_buffer_limit_bytes=read_buffer_limit_bytes,
            for_reading=True,
        )
        self.last_stats: dict[str, int] = {}
        # How the last load read its files (fastdcp.io.read_mode): O_DIRECT or buffered, and why.
        self.last_read_mode: ReadMode | None = None
        self._direct = False  # the current load's mode (pinned files are opened before it is known)
        self.allow_unsafe_metadata = bool(allow_unsafe_metadata)
        env_verify = env_flag("FASTDCP_VERIFY_CHECKSUMS")
        self.verify_checksums = bool(verify_checksums if verify_checksums is not None else (env_verify or False))
        env_read_once = env_flag("FASTDCP_READ_ONCE")
        self.read_once = bool(read_once if read_once is not None else (env_read_once or False))
        self._extents: tuple[Any, Mapping] | None = None  # (storage_data, file_extents(storage_data))
        # The load set up last's state_dict_metadata (for a TableMetadata, its entry views: a
        # lookup builds one entry, and its chunks one at a time).
        self._state_dict_metadata: Mapping[str, Any] | None = None
        # Where the load's files come from (fastdcp.load.read_source); a storage that serves
        # them otherwise sets its own.
        self.source: ReadSource = LocalReadSource(self)
        self._metadata_read: Metadata | None = None
        # The error of the last read_metadata() without rank=, until the next read (see there).
        self._failed_global_read: Exception | None = None
        self.load_deadline_s = resolve_load_deadline(load_deadline_s)
        # The check-ins of the load whose .metadata was read last, until its read_data.
        self._check_ins: LoadCheckIns | None = None

    @timed("read")
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's reads. With the load's check-ins (see :meth:`read_metadata`), its status
        names the files it reads, and after its reads (also failed ones) it waits for every rank.
        In a read-once replica group it reads its share in rounds, each exchanged with the group
        while the next is read."""
        check_ins, self._check_ins = self._check_ins, None
        identity = plan.storage_data
        if isinstance(identity, _SaveIdentity) and identity.group is not None:
            storage_data = self.storage_data

            def where(item: ReadItem) -> tuple[str, int]:
                info = storage_data[item.storage_index]
                return (info.relative_path, info.offset)

            share = ReadOnceShare.deal(list(plan.items), planner, identity.group, where,
                                       timeout_s=self.load_deadline_s)
            return self._read_once(plan, planner, share, check_ins)
        try:
            return self._read_data(plan, planner, check_ins)
        finally:
            if check_ins is not None:
                check_ins.check_in(END)  # every rank finished reading (raises past the deadline)

    def _read_once(self, plan: LoadPlan, planner: LoadPlanner, share: ReadOnceShare,
                   check_ins: LoadCheckIns | None) -> Future[None]:
        """A read-once load's rounds (:mod:`fastdcp.load.read_once`): round k+1's own items read on
        a reader thread while round k is exchanged; after the last round (or a failure) every rank
        checks in as after its reads."""
        totals: dict[str, Any] = {}

        def read(k: int) -> dict[str, Any]:
            self.last_stats = {}  # a round without items of this rank reads nothing
            self._read_data(dataclasses.replace(plan, items=share.own_items(k)), planner, None)
            return dict(self.last_stats)

        rounds = max(1, len(share.rounds))
        reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdcp-read-once")
        pending: Any = reader.submit(read, 0)
        try:
            for k in range(rounds):
                error: BaseException | None = None
                try:
                    for name, value in pending.result().items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            totals[name] = totals.get(name, 0) + value
                        else:
                            totals[name] = value
                except BaseException as e:  # noqa: BLE001 - published to the group, then raised
                    error = e
                pending = reader.submit(read, k + 1) if error is None and k + 1 < rounds else None
                share.exchange(k, planner, error)
        finally:
            if pending is not None:
                try:
                    pending.result()  # no read may still write into a destination
                except BaseException:  # noqa: BLE001 - the error raised above is the one to report
                    pass
            reader.shutdown(wait=True)
            if check_ins is not None:
                check_ins.check_in(END)  # every rank finished reading (raises past the deadline)
        totals.update(read_once_replicas=len(share.group.members), read_once_read_bytes=share.read_bytes,
                      read_once_received_bytes=share.received_bytes, read_once_rounds=len(share.rounds))
        self.last_stats = totals
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner, check_ins: LoadCheckIns | None) -> Future[None]:
        self.last_read_mode = None  # set by the native reads, if this load has any
        stock_items: list[ReadItem] = []
        per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]] = defaultdict(list)
        storage_data = self.storage_data
        with gc_paused():  # a few small objects per item: see fastdcp.io.gc
            for item in plan.items:
                info: _StorageInfo = storage_data[item.storage_index]
                if getattr(info, "transform_descriptors", None):
                    stock_items.append(item)
                else:
                    per_file[info.relative_path].append((item, info))
        if check_ins is not None:
            stock_files = {storage_data[item.storage_index].relative_path for item in stock_items}
            check_ins.status(reading_files_status(str(self.path), [*per_file, *stock_files]))
        stall_point("read_data")
        if stock_items:
            super().read_data(LoadPlan(stock_items), planner).wait()
        try:
            if per_file:
                with gc_paused():
                    self._read_native(per_file, planner)
        finally:
            self.source.release()  # this rank's reads are done: files it did not need are closed too
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @timed("plan")
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata, SectionedTableMetadata) and isinstance(kwargs.get("rank"), int):
            metadata.bind_rank(kwargs["rank"])  # DCP's rank in the load's process group
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # What each stored tensor should be (dtype, chunk sizes): lets KnownBlobs recognise
        # blobs fastdcp's writer produced without parsing them.
        if isinstance(metadata, TableMetadata):
            self._state_dict_metadata = metadata.entry_views()
        else:
            self._state_dict_metadata = metadata.state_dict_metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._state_dict_metadata = None
        self._failed_global_read = None
        self.source.release()

    @timed("plan")
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        if plan.storage_data is not None:
            return plan  # a planner's own use of the field
        # Which save this rank's metadata came from, for the coordinator's check below (and, for a
        # read-once load, what the coordinator groups replicas by).
        replica = replica_key(list(plan.items)) if self.read_once else None
        return dataclasses.replace(plan, storage_data=_SaveIdentity(self._save_id(), replica))

    @timed("plan")
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        seen = {p.storage_data.save_id for p in plans if isinstance(p.storage_data, _SaveIdentity)}
        seen.discard(None)
        if len(seen) > 1:
            raise ConcurrentOverwriteError(
                f"the ranks of this load read different saves of '{self.path}' ({len(seen)} save ids): a "
                "concurrent save replaced the checkpoint while the load started. Nothing was loaded; load again"
            )
        keys = [p.storage_data.replica if isinstance(p.storage_data, _SaveIdentity) else None for p in plans]
        if any(key is not None for key in keys):
            groups = replica_groups(keys)
            plans = [dataclasses.replace(p, storage_data=dataclasses.replace(p.storage_data, replica=None, group=g))
                     if isinstance(p.storage_data, _SaveIdentity) else p for p, g in zip(plans, groups)]
        return plans

    def _save_id(self) -> str | None:
        meta = getattr(self._metadata_read, "storage_meta", None)
        save_id = getattr(meta, "save_id", None)
        return save_id if isinstance(save_id, str) and save_id else None

    @timed("metadata")
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Stock ``read_metadata`` (``.metadata``, or ``__{rank}.metadata`` with ``rank=``), read
        through :func:`fastdcp.io.checkpoint_files.load_metadata`: restricted unpickling unless
        ``allow_unsafe_metadata``, then structural validation and a check that no data file
        path leads out of the checkpoint; errors name the file. The parsed file is remembered
        (:class:`MetadataCache`) until it changes.

        DCP's load (torch 2.11 on) catches any ``Exception`` from ``read_metadata()``, asks for the
        rank-local metadata instead (``rank=``) and, when that fails too, raises an error that drops
        the first failure's message (2.11: ``AssertionError: metadata is None``) or quotes it among
        others (2.13). So a ``rank=`` read that fails right after this reader's global read failed
        raises the global read's error inside a :class:`CheckpointException` (DCP's own error for a
        failed load, a ``BaseException`` that stock's fallback does not catch): on every release
        the load fails with the error naming the file. A rank-local file that exists is read, as
        stock reads it.

        The global read starts a load's check-ins (``load_deadline_s``): this rank's status is
        published, and after the read (also a failed one) it waits for every rank."""
        rank = kwargs.get("rank")
        check_ins = None
        if rank is None:
            self._check_ins = None
            check_ins = begin_load(self.load_deadline_s, str(self.path), f"reading .metadata of {self.path}")
            stall_point("read_metadata")
        try:
            try:
                metadata = self._remember(self.source.read_metadata(rank))
            finally:
                if check_ins is not None:
                    check_ins.check_in(START)  # every rank reached the load (raises past the deadline)
        except Exception as error:
            failed_global_read, self._failed_global_read = self._failed_global_read, None
            if rank is None:
                self._failed_global_read = error
            elif failed_global_read is not None:
                raise _unreadable(failed_global_read, rank) from error
            raise
        self._failed_global_read = None
        if check_ins is not None:
            self._check_ins = check_ins  # read_data checks in at the end of this load's reads
        return metadata

    def _remember(self, metadata: Metadata) -> Metadata:
        """``metadata`` as this load's (its save id checked across ranks), stamped with the load id."""
        self._metadata_read = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_native(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]], planner: LoadPlanner) -> None:
        started = time.perf_counter()
        # With verify_checksums the mode is chosen after the checksum pass, which reads every item
        # buffered and so leaves it in the page cache (read from there, not from the disk again).
        mode = None if self.verify_checksums else self.source.choose_read_mode(per_file)
        self._direct = mode.direct if mode is not None else self.io_options.direct_for(str(self.path))
        files: dict[str, _C.File] = {}
        # Blobs that are valid torch.save archives but not one plain strided tensor (quantized,
        # sparse, ...): stock's torch.load(weights_only=True) reads those items.
        unparsed: list[tuple[ReadItem, BlobFormatError]] = []
        try:
            for rel in per_file:
                files[rel] = self.source.open(rel)
            if self.verify_checksums:
                self._verify(self.source.read_engine(False), files, per_file)  # buffered reads
                mode = self.source.choose_read_mode(per_file)
                if mode is not None and mode.direct != self._direct:
                    self._direct = mode.direct
                    for rel, file in files.items():
                        files[rel] = reopen_in_mode(file, mode.direct)
            read_started = time.perf_counter()  # the read phase: first read to last placement
            engine = self.source.read_engine(self._direct)
            windows = read_windows(engine, files, per_file, self._direct)
            placements: list[Placement] = []
            known = KnownBlobs(self._state_dict_metadata)
            for rel, pairs in per_file.items():
                file = files[rel]
                file_windows = windows[rel]
                blob_cache: dict[int, TensorBlobInfo | BlobFormatError] = {}
                for item, info in pairs:
                    if item.type == LoadItemType.BYTE_IO:
                        self._load_bytes(file_windows, info, item, planner)
                        continue
                    blob = blob_cache.get(info.offset)
                    if blob is None:
                        blob = known.match(item, info, file_windows)
                        if blob is None:
                            try:
                                blob = parse_blob(engine, file, file_windows, info)
                            except BlobFormatError as error:
                                blob = error
                        blob_cache[info.offset] = blob
                    if isinstance(blob, BlobFormatError):
                        unparsed.append((item, blob))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    placements.append(plan_placement(item, info, blob, target, file, file_windows))
            plan_seconds = time.perf_counter() - started
            placed = run_placements(engine, placements, planner, self.io_options, self._direct)
            self.last_stats = placed.as_dict()
            read_seconds = time.perf_counter() - read_started
            read_bytes = sum(len(w.data) for ws in windows.values() for w in ws) + placed.bytes_read
            # O_DIRECT granted: every file kept it (a refusal falls back per file, at open or at
            # the first read), as the writer judges its own files.
            if mode is not None:
                record_read(str(self.path), mode, read_bytes, read_seconds, all(f.direct for f in files.values()))
            self.last_stats["plan_seconds"] = plan_seconds
            self.last_stats["blobs_recognised"] = known.recognised  # by layout, without parsing
            logger.debug("read %d files of %s: %s", len(files), self.path, self.last_stats)
        finally:
            for f in files.values():
                f.close()
        if unparsed:
            try:
                super().read_data(LoadPlan([item for item, _ in unparsed]), planner).wait()
            except BaseException as stock_error:  # CheckpointException is a BaseException
                raise unparsed[0][1] from stock_error

    def _verify(self, engine: _C.Engine, files: dict[str, _C.File],
                per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]) -> None:
        """Check the items this load reads against their recorded checksums; raise on mismatch."""
        wanted = {item.storage_index: info for pairs in per_file.values() for item, info in pairs}
        items = checksummed_items(wanted)
        problems = verify_checksums(engine, files, items, self.io_options.read_buffer_limit_bytes)
        if problems:
            raise ChecksumError("; ".join(problems))

    def _load_bytes(self, windows: list[Window], info: _StorageInfo, item: ReadItem, planner: LoadPlanner) -> None:
        data = window_bytes(windows, info.offset, info.offset + info.length)
        planner.load_bytes(item, io.BytesIO(data))
