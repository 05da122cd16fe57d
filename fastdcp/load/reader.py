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
import resource
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
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
from ..format.table_metadata import TableMetadata, TableStorageData, referenced_files, table_file_extents
from ..io.phases import timed
from ..io.checkpoint_files import (
    check_data_paths,
    check_file_extents,
    check_relative_path,
    file_extents,
    resolve_data_file,
)
from ..io.engine import IoOptions, env_flag, get_engine
from ..io.gc import gc_paused
from ..io.read_mode import ReadMode, read_mode_for, record_read
from .deadline import DEADLINE_FROM_ENV, END, START, LoadCheckIns, begin_load, reading_files_status, \
    resolve_load_deadline, stall_point
from .header_pass import KnownBlobs, Window, parse_blob, read_windows, window_bytes
from .metadata_cache import metadata_cache
from .read_once import ReadOnceShare, ReplicaGroup, ReplicaKey, replica_groups, replica_key
from .sectioned_metadata import SectionedTableMetadata, SectionStorageData
from .pieces import Placement, plan_placement
from .placement import run_placements
from .verify import verify_checksums

__all__ = ["FastFileSystemReader", "ConcurrentOverwriteError", "pin_limit"]

logger = logging.getLogger("fastdcp")  # the library's one logger: it prints nothing by itself

_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemReader.__init__).parameters)

# The most data files opened right after reading .metadata (a quarter of the descriptor limit at
# most). Beyond it (thousands of ranks' files), files are opened when read, and a load racing an
# overwrite may find one gone and fail with a clear error.
_PIN_FILES_LIMIT = 1024


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


def pin_limit() -> int:
    """How many data files a load opens right after reading ``.metadata``."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return _PIN_FILES_LIMIT
    if soft == resource.RLIM_INFINITY:
        return _PIN_FILES_LIMIT
    return max(0, min(_PIN_FILES_LIMIT, soft // 4))


def _unreadable(error: Exception, rank: int) -> CheckpointException:
    """``error`` (reading a checkpoint's ``.metadata``) as DCP reports a rank's failed load step."""
    return CheckpointException(str(error), {rank: (error, traceback.extract_tb(error.__traceback__))})


class FastFileSystemReader(FileSystemReader):
    """Drop-in replacement for :class:`torch.distributed.checkpoint.FileSystemReader`.

    fastdcp's own keyword arguments:
        direct_io: read with O_DIRECT (True) or through the page cache (False); environment
            ``FASTDCP_DIRECT_IO``. Left unset (None), chosen for each load (``fastdcp.io.read_mode``):
            the page cache when at least half of the files' bytes are in it (a warm page cache is
            far faster than any disk), for loads under 64 MiB and on memory filesystems; a cold
            load learns from this process's own cold loads from that filesystem (the first
            buffered, the second O_DIRECT, later ones the faster). ``last_read_mode`` says what
            the last load used and why.
        io_threads, task_bytes: engine workers (default ``min(8, cpus)``, at least 4; left unset,
            O_DIRECT loads use at least 8, since without readahead the requests in flight are the
            device's queue) and the unit large reads are split into (default 32 MiB: larger
            requests read cold files faster).
        read_buffer_limit_bytes: the most memory the load's read buffers hold at once (default
            512 MiB; environment ``FASTDCP_READ_BUFFER_LIMIT_BYTES``; formerly ``memory_budget_bytes``).
        allow_unsafe_metadata: unpickle ``.metadata`` with plain :mod:`pickle` (default False).
            By default only stock DCP metadata classes are built and a file naming anything
            else is refused (plain pickle runs whatever code the file names); set True only
            for a trusted checkpoint whose metadata holds custom classes.
        load_deadline_s: the most seconds a load's rank waits for the other ranks (default:
            environment ``FASTDCP_LOAD_DEADLINE_S``, else none; None or 0: no deadline; 1800 is
            torch's usual process-group timeout). Off by default: a reader cannot tell a load on
            some of the ranks from one on all of them. In a multi-rank job every rank checks in through the
            default process group's store after reading ``.metadata`` and after its reads
            (:mod:`fastdcp.load.deadline`); a rank that waits longer fails, and with it every rank
            still running, with :class:`~fastdcp.load.deadline.LoadDeadlineError` naming the
            ranks it waited for and what each was last doing (``rank 1 was reading data file
            '__1_0.distcp' of /ckpt``). It waits for every rank of the default process group: a
            load on only some of the ranks (``dcp.load(process_group=...)`` over a subset, or
            ``no_dist=True``), or a ``read_metadata()`` of one's own on some ranks, needs
            ``load_deadline_s=None``.
        read_once: ranks whose load plans are the same (data-parallel replicas) split the reads
            and send each other what they read over the default process group, so each stored
            byte of a replicated shard is read once per job (default False; environment
            ``FASTDCP_READ_ONCE``; :mod:`fastdcp.load.read_once`). Ranks with different plans read
            as without it. Every rank of a group waits at most ``load_deadline_s`` (else 30
            minutes) for the others; a rank that fails its reads fails the load on its group.
            ``last_stats`` says what this rank read and received.
    """

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
        # Data files opened right after reading .metadata (see the module docstring), by
        # relative path; consumed by read_data, closed when the load ends.
        self._pinned: dict[str, tuple[_C.File, bool]] = {}  # relative path -> (file, opened O_DIRECT)
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
            self._unpin()  # this rank's reads are done: files it did not need are closed too
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
        self._unpin()

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
                metadata = self._read_metadata(rank)
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

    def _read_metadata(self, rank: int | None) -> Metadata:
        """This load's metadata, its data files pinned. A data file missing right after
        ``.metadata`` was read means a concurrent save committed in between (its cleanup removed
        the file): ``.metadata`` is read again, as long as it keeps being replaced (up to
        ``_METADATA_READS`` times: saves committing back to back on a loaded machine can do that
        more than once). A file missing while ``.metadata`` is unchanged is a damaged checkpoint,
        reported by the read that needs the file."""
        group_rank = _default_group_rank() if rank is None else None
        for attempt in range(_METADATA_READS):
            committed = _metadata_identity(self.path)

            def settled(pinned: bool) -> bool:  # pinned; or the last try; or damage, not a commit
                return pinned or attempt == _METADATA_READS - 1 or _metadata_identity(self.path) == committed

            metadata = metadata_cache.load(self.path, rank, self.allow_unsafe_metadata,
                                           sectioned=group_rank is not None)
            if isinstance(metadata, SectionedTableMetadata):
                # This rank's section (the default group's rank for now; set_up_storage_reader
                # rebinds when DCP names another): its files are checked and pinned, not all.
                metadata.bind_rank(group_rank)
                section = metadata.rank_section()
                if section is not None:
                    for rel in section.table.storage.files:  # type: ignore[union-attr]
                        check_relative_path(self.path, rel)
                    if settled(self._pin_names(set(section.table.storage.files))):  # type: ignore[union-attr]
                        break
                    logger.info("a data file of %s vanished right after its .metadata was read (a concurrent "
                                "save committed): reading .metadata again", self.path)
                    continue
            # Every data file the metadata names must stay inside the checkpoint (stock code reads
            # the items fastdcp hands back to it, so this is checked up front, not only in _open).
            if isinstance(metadata, TableMetadata) and metadata.table_answers_storage():
                for rel in metadata.chunk_table.storage.files:  # type: ignore[union-attr]
                    check_relative_path(self.path, rel)
            else:
                check_data_paths(self.path, metadata.storage_data)
            if settled(self._pin(metadata)):
                break  # a file missing under an unchanged .metadata is reported when read
            logger.info("a data file of %s vanished right after its .metadata was read (a concurrent save "
                        "committed): reading .metadata again", self.path)
        return self._remember(metadata)

    def _remember(self, metadata: Metadata) -> Metadata:
        """``metadata`` as this load's (its save id checked across ranks), stamped with the load id."""
        self._metadata_read = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _pin(self, metadata: Metadata) -> bool:
        """Open every data file ``metadata`` names (when they are few enough), replacing earlier
        pins. False when one of them does not exist (no pins are kept then)."""
        if isinstance(metadata, TableMetadata) and metadata.table_answers_storage():
            names = set(referenced_files(metadata.chunk_table))
        else:
            names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        return self._pin_names(names)

    def _pin_names(self, names: set[Any]) -> bool:
        """Open the data files ``names`` (when they are few enough), replacing earlier pins. False
        when one of them does not exist (no pins are kept then)."""
        self._unpin()
        if not names or len(names) > pin_limit():
            return True
        direct = self.io_options.direct_for(str(self.path))
        try:
            for rel in sorted(names):
                path = resolve_data_file(self.path, rel)
                self._pinned[rel] = (_C.File(path, "r", direct), direct)
        except FileNotFoundError:
            self._unpin()
            return False
        except Exception:  # noqa: BLE001 - anything else is reported by the read that needs the file
            self._unpin()
        return True

    def _unpin(self) -> None:
        pinned, self._pinned = self._pinned, {}
        for file, _ in pinned.values():
            file.close()

    def _open(self, relative_path: str) -> _C.File:
        # Refuses paths leading out of the checkpoint (absolute, "..", symlinks), non-regular
        # files, and (before anything is allocated) byte ranges past the end of the file.
        pinned = self._pinned.pop(relative_path, None)
        if pinned is not None:
            file = pinned[0] if pinned[1] == self._direct else _in_mode(pinned[0], self._direct)
            path = os.path.join(str(self.path), relative_path)
        else:
            path = resolve_data_file(self.path, relative_path)
            file = _C.File(path, "r", self._direct)
        try:
            answering = self.storage_data
            if isinstance(answering, SectionStorageData):
                answering = answering.current()  # the section's view, or the whole table's once read
            if self._extents is None or self._extents[0] is not answering:
                self._extents = (answering, _file_extents(answering))
            check_file_extents(self._extents[1], relative_path, path, file.size())
        except BaseException:
            file.close()
            raise
        return file

    def _read_native(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]], planner: LoadPlanner) -> None:
        started = time.perf_counter()
        # With verify_checksums the mode is chosen after the checksum pass, which reads every item
        # buffered and so leaves it in the page cache (read from there, not from the disk again).
        mode = None if self.verify_checksums else self._choose_read_mode(per_file)
        self._direct = mode.direct if mode is not None else self.io_options.direct_for(str(self.path))
        files: dict[str, _C.File] = {}
        # Blobs that are valid torch.save archives but not one plain strided tensor (quantized,
        # sparse, ...): stock's torch.load(weights_only=True) reads those items.
        unparsed: list[tuple[ReadItem, BlobFormatError]] = []
        try:
            for rel in per_file:
                files[rel] = self._open(rel)
            if self.verify_checksums:
                self._verify(self._read_engine(False), files, per_file)  # buffered reads
                mode = self._choose_read_mode(per_file)
                if mode is not None and mode.direct != self._direct:
                    self._direct = mode.direct
                    for rel, file in files.items():
                        files[rel] = _in_mode(file, mode.direct)
            read_started = time.perf_counter()  # the read phase: first read to last placement
            engine = self._read_engine(self._direct)
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

    def _read_engine(self, direct: bool) -> Any:
        """What this load's reads go through: the native engine for the chosen mode."""
        return get_engine(self.io_options.read_with(direct))

    def _choose_read_mode(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]) -> ReadMode | None:
        """The mode of this load (fastdcp.io.read_mode), from the files it reads and the bytes of
        the stored blobs it needs (an upper bound when it reads parts of them)."""
        directory = str(self.path)
        planned = 0
        for pairs in per_file.values():
            planned += sum({info.offset: info.length for _, info in pairs}.values())
        paths = [os.path.join(directory, rel) for rel in per_file]
        mode = self.last_read_mode = read_mode_for(directory, self.io_options, paths, planned)
        logger.debug("reading %d files (%d bytes) of %s %s (%s)", len(paths), planned, directory,
                     "with O_DIRECT" if mode.direct else "buffered", mode.reason)
        return mode

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




def _in_mode(file: _C.File, direct: bool) -> _C.File:
    """``file`` (open for reading) opened again with or without O_DIRECT, and closed. Through its own
    descriptor, not its path: a pinned file stays the one the metadata named even when a
    concurrent save has replaced or unlinked its path since. Without /proc (the reopen fails) the
    file is kept as it is: the right bytes, in the other mode."""
    try:
        reopened = file.reopen(direct)
    except OSError:
        return file
    try:
        file.close()
    except OSError:
        pass  # read-only: nothing was written that a close could report lost
    return reopened


# How many times a load reads .metadata while saves keep committing new ones under it.
_METADATA_READS = 8


def _metadata_identity(path: Any) -> tuple[int, int, int] | None:
    """What changes when a save commits a new ``.metadata`` (it is renamed into place): inode,
    modification time and size; None when it cannot be read."""
    try:
        st = os.stat(os.path.join(str(path), ".metadata"))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _default_group_rank() -> int | None:
    """This process's rank in the default process group when that group has several ranks (a
    load that may read one rank's section of the chunk index), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.get_rank() if dist.get_world_size() > 1 else None
    except (RuntimeError, ValueError):
        return None


def _file_extents(storage_data: Any) -> Mapping[str, tuple[int, Any]]:
    """:func:`fastdcp.io.checkpoint_files.file_extents`, from the columns when ``storage_data`` is
    still a chunk table's view (iterating it would build every item)."""
    if isinstance(storage_data, SectionStorageData):
        storage_data = storage_data.current()
    if isinstance(storage_data, TableStorageData) and not storage_data.materialised:
        return table_file_extents(storage_data.chunk_table)
    return file_extents(storage_data)
