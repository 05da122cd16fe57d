"""FastFileSystemWriter: stock DCP's file layout, written by the native engine.

Each rank writes data files as stock ``FileSystemWriter`` does (one per ``thread_count`` bucket, or
one per item; with ``thread_count`` left unset, one per engine thread: :mod:`fastdcp.save.file_split`),
each tensor as a complete ``torch.save``-compatible zip blob, so stock DCP reads the
result. What differs is how the bytes get there: the file is planned as an image (blob headers,
tensor bytes at 4096-aligned offsets, blob trailers) and the engine writes it with parallel,
O_DIRECT-capable positional writes straight from tensor memory, with no per-tensor ``torch.save``
and no CRC pass.

The pieces: :mod:`fastdcp.save.file_image` (each data file planned as an image),
:mod:`fastdcp.save.device_ring` (GPU tensor bytes through a pinned ring),
:mod:`fastdcp.save.staging` (``dcp.async_save`` staging), :mod:`fastdcp.save.commit` (save-unique
names, the atomic ``.metadata`` swap and the cleanup rule; docs/GUARANTEES.md).
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import io
import os
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as _stock_fs
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._native import _C
from ..compat.renamed import WRITER_RENAMES, renamed_arguments
from ..compat.stock_stager import mend_default_stager
from ..format.blob import ZIP_ALIGN, is_plain_dense
from ..format.metadata import METADATA_NAME
from ..format.table_metadata import TableMetadata, TableStorageData
from ..io.committed_metadata import CommittedIndex
from ..io.engine import DIRECT_ALIGN, IoOptions, cpu_share, default_copy_threads, env_bytes, env_flag, get_engine
from ..io.gc import gc_paused
from ..io.phases import span, timed
from ..io.write_mode import WriteMode, record_write, write_mode_for
from .async_staging import StagingFuture, StagingReport
from . import inflight
from .commit import (CommittedMetadata, claim_token, commit_metadata, remove_partial_files, remove_unreferenced,
                     unused_prefix)
from .crash_points import crash_point
from ..io.copy_engine import DeviceCopier, is_device_tensor
from ..io.pinned_pool import lease_pinned
from ..io.staging_pipeline import StagingPipeline
from .device_ring import cut_ranges, write_device_images
from .file_image import UNLOADABLE_DTYPES, FilePlan, record_checksums, round_up, tensor_for_writing
from .file_split import split_into_files
from .guard import guarded_storage_keys
from .results import pack_write_results, result_columns, storage_columns
from .staging import StateDictStager

try:  # torch >= 2.7
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - older torch
    SerializationFormat = None  # type: ignore[assignment,misc]

__all__ = ["FastFileSystemWriter"]

_DEFAULT_RING_BYTES = 256 << 20
_RING_SLOTS = 4  # the fewest slots of a ring
_MIN_SLOT_BYTES = 4 << 20  # a ring batches fewer files rather than use smaller slots
# Engine calls of the ring in flight at once: the engine's threads go on to the next batch's tasks
# while the last tasks of a batch finish, so the storage queue does not drain at batch boundaries.
_WRITES_IN_FLIGHT = 2
_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemWriter.__init__).parameters)


def _stays_on_device(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes go to disk through the pinned ring (``fastdcp.save.device_ring``)
    rather than from host memory: device tensors (``fastdcp.io.copy_engine.is_device_tensor``).
    Tests replace this to drive the ring with any CPU tensors."""
    return is_device_tensor(tensor)


def _make_copier() -> Any:
    """The device-to-host copier of the ring pipeline (tests replace it with a CPU one)."""
    return DeviceCopier()


def ring_shape(budget: int, files: int, threads: int) -> tuple[int, int, int, int]:
    """``(slot_bytes, slots, batch, writes_in_flight)`` of the ring for a save of ``files`` files
    with device bytes written by ``threads`` engine threads within ``budget`` bytes: batches of up
    to ``threads`` files (fewer when slots would fall under 4 MiB), :data:`_WRITES_IN_FLIGHT`
    batches being written while the next one is copied, at least :data:`_RING_SLOTS` slots."""
    sets = _WRITES_IN_FLIGHT + 1
    batch = max(1, min(files, threads, budget // (sets * _MIN_SLOT_BYTES)))
    slots = max(_RING_SLOTS, sets * batch)
    slot_bytes = max(DIRECT_ALIGN, budget // slots // DIRECT_ALIGN * DIRECT_ALIGN)
    return slot_bytes, slots, batch, _WRITES_IN_FLIGHT


class FastFileSystemWriter(FileSystemWriter):
    """Drop-in replacement for :class:`torch.distributed.checkpoint.FileSystemWriter`.

    Takes stock's arguments with stock's meaning (``path, single_file_per_rank, sync_files,
    thread_count, per_thread_copy_ahead, cache_staged_state_dict, overwrite, _extensions,
    serialization_format``). An explicit ``thread_count`` keeps stock's meaning of "files per rank";
    left unset (``None``), a rank's data is spread over one file per engine thread, none smaller
    than 32 MiB (``fastdcp.save.file_split``): filesystems that serialise the writers of one file
    (tmpfs, buffered ext4/xfs, NFS) then write in parallel. Items with
    ``_extensions`` transforms or a non-``torch_save`` serialization format are written by stock code.

    fastdcp's own keyword arguments:
        direct_io: write with O_DIRECT (True) or buffered + fsync (False); environment
            ``FASTDCP_DIRECT_IO``; never O_DIRECT on tmpfs/ramfs. Unset, it is learnt per filesystem
            from this process's own saves (``fastdcp.io.write_mode``: O_DIRECT first, one buffered
            try, then the faster); ``last_write_mode`` says what the last save used and why.
        io_threads: engine worker threads (default ``min(8, cpus)``, at least 4; on tmpfs/ramfs at
            most this rank's share of the CPUs, ``cpus // LOCAL_WORLD_SIZE``, since writing there is a
            memory copy).
        task_bytes: the unit large writes are split into (default 8 MiB).
        checksums: record a CRC-32C of every stored item in ``.metadata`` (default False;
            environment ``FASTDCP_CHECKSUMS``), checked by ``FastFileSystemReader(verify_checksums=True)``
            and ``python -m fastdcp verify``. Costs one extra pass over the data at memory speed.
            With checksums on, GPU tensors are copied to the host before writing (no ring).
        pinned_ring_limit_bytes: the most pinned host memory of the ring that GPU tensors are
            written through (default 256 MiB; formerly ``memory_budget_bytes``): slots that
            device-to-host copies fill while the engine writes the previous slots, several files at
            a time; leased from the process-wide pinned pool for each save
            (``fastdcp.io.pinned_pool``, limited by ``FASTDCP_PINNED_POOL_LIMIT_BYTES``).
        async_staging: ``stage()`` returns a Future and copies behind the ``dcp.async_save`` call
            (default False; environment ``FASTDCP_ASYNC_STAGING``; :mod:`fastdcp.save.async_staging`).
        snapshot_limit_bytes: with ``async_staging``, the most tensor bytes one stage copies into
            its staging slab (default None: the whole state; environment
            ``FASTDCP_SNAPSHOT_LIMIT_BYTES``; formerly ``staging_budget_bytes``); the tensors beyond
            it are written from the live tensors before the stage completes.

    ``dcp.async_save`` stages through :meth:`stage`, into a host slab (page-locked under CUDA) from
    the process-wide staging pool: every later save of the same state structure reuses it, through
    this writer or a new one, and it is refilled only once the save that read it is done
    (``fastdcp.save.staging``, ``fastdcp.save.staging_pool``; ``fastdcp.set_staging_pool_limit``
    caps the pool, ``fastdcp.release_staging`` frees its idle slabs). Staging memory is always
    reused, so ``cache_staged_state_dict`` changes nothing here (accepted for compatibility).
    """

    @renamed_arguments(WRITER_RENAMES)
    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        direct_io: bool | None = None,
        io_threads: int | None = None,
        task_bytes: int | None = None,
        checksums: bool | None = None,
        pinned_ring_limit_bytes: int | None = None,
        async_staging: bool | None = None,
        snapshot_limit_bytes: int | None = None,
    ) -> None:
        if thread_count is not None and (
            not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1
        ):
            raise ValueError(f"thread_count must be a positive int or None, got {thread_count!r}")
        stock_kwargs: dict[str, Any] = dict(
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=1 if thread_count is None else thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
        )
        if serialization_format is not None:
            stock_kwargs["serialization_format"] = serialization_format
        unsupported = [k for k in stock_kwargs if k not in _STOCK_INIT_PARAMS]
        for name in list(unsupported):
            # Defaults are fine to drop on an older torch; a real request is not.
            if stock_kwargs[name] in (None, False):
                del stock_kwargs[name]
                unsupported.remove(name)
        if unsupported:
            raise TypeError(f"this torch's FileSystemWriter does not support {unsupported}")
        super().__init__(path, **stock_kwargs)
        mend_default_stager()  # stock's DefaultStager, if the job passes one, works past its first save
        # None: files per rank chosen by fastdcp.save.file_split (one per engine thread); stock's
        # ``self.thread_count`` then reads 1, its default.
        self.files_per_rank: int | None = thread_count
        self.io_options = IoOptions.resolve(
            direct_io=direct_io, default_direct_io=True, io_threads=io_threads, task_bytes=task_bytes
        )
        self._save_token: str | None = None  # this save's file-name token (see prepare_global_plan)
        # Tokens this writer object claimed for the save in progress (their in-flight markers,
        # fastdcp.save.inflight): released by the commit, or here when this rank's write fails.
        self._claimed_tokens: set[str] = set()
        ring_limit = pinned_ring_limit_bytes if pinned_ring_limit_bytes is not None else _DEFAULT_RING_BYTES
        if not isinstance(ring_limit, int) or isinstance(ring_limit, bool) or ring_limit < _RING_SLOTS * DIRECT_ALIGN:
            raise ValueError(
                f"pinned_ring_limit_bytes must be an int of at least {_RING_SLOTS * DIRECT_ALIGN}, "
                f"got {pinned_ring_limit_bytes!r}"
            )
        self.pinned_ring_limit_bytes = ring_limit
        # How the last save wrote its files (fastdcp.io.write_mode): O_DIRECT or buffered, and why.
        self.last_write_mode: WriteMode | None = None
        env_checksums = env_flag("FASTDCP_CHECKSUMS")
        self.checksums = bool(checksums if checksums is not None else (env_checksums or False))
        self._stager: StateDictStager | None = None  # created by the first stage(); never pickled
        self._staged_on_thread: int | None = None  # see _yield_to_the_caller_of_async_save
        env_async = env_flag("FASTDCP_ASYNC_STAGING")
        if async_staging is not None and not isinstance(async_staging, bool):
            raise TypeError(f"async_staging must be a bool or None, got {async_staging!r}")
        self.async_staging = bool(async_staging if async_staging is not None else (env_async or False))
        if snapshot_limit_bytes is None:
            # The environment sets a default for writers that stage overlapped; others ignore it.
            snapshot_limit_bytes = env_bytes("FASTDCP_SNAPSHOT_LIMIT_BYTES") if self.async_staging else None
        elif not isinstance(snapshot_limit_bytes, int) or isinstance(snapshot_limit_bytes, bool) or snapshot_limit_bytes < 0:
            raise ValueError(f"snapshot_limit_bytes must be an int >= 0 or None, got {snapshot_limit_bytes!r}")
        elif not self.async_staging:
            raise ValueError(
                "snapshot_limit_bytes needs async_staging=True (FASTDCP_ASYNC_STAGING=1): a blocking stage "
                "always copies the whole state"
            )
        self.snapshot_limit_bytes = snapshot_limit_bytes
        self._written_prefix: str | None = None  # the data-file prefix this rank's last write_data used
        self._last_commit: CommittedMetadata | None = None  # what the last finish() committed

    def __getstate__(self) -> dict[str, Any]:
        # Process-mode async_save pickles the writer into the background process: its staging
        # leases stay with the process that owns the pool (the staged tensors travel as shared
        # memory; their views going away in this process frees the slab).
        state = self.__dict__.copy()
        state["_stager"] = None
        state["_staged_on_thread"] = None
        return state

    # ----------------------------------------------------------------------------------------- #
    # Async staging (AsyncStager protocol, used by dcp.async_save).

    @timed("stage")
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | StagingFuture:
        """Copy ``state_dict`` into a slab of the process-wide staging pool.

        Blocking (default): returns the staged copy once every byte is staged, so the caller may
        modify its tensors right away. With ``async_staging``: returns a Future at once (DCP's
        protocol: ``dcp.async_save`` then returns ``AsyncSaveResponse``), the copies run behind the
        call, and the Future resolves when no byte of the checkpoint can change any more
        (:mod:`fastdcp.save.async_staging`; :func:`fastdcp.guard` places the wait)."""
        if self._stager is None:
            self._stager = StateDictStager()
        self._staged_on_thread = threading.get_ident()
        if not self.async_staging:
            # The caller waits for this copy, so it may use every CPU of this rank.
            stage_engine = get_engine(dataclasses.replace(self.io_options, io_threads=cpu_share()))
            return self._stager.stage(state_dict, stage_engine)
        copy_engine = get_engine(dataclasses.replace(self.io_options, io_threads=default_copy_threads()))
        return self._stager.stage_overlapped(
            state_dict, copy_engine, self.snapshot_limit_bytes, guarded_storage_keys(), self._checkpoint_where()
        )

    def _checkpoint_where(self) -> str:
        """Where this writer saves, for messages: an object storage writer's URL, else the directory."""
        location = getattr(self, "location", None)
        return location.url() if location is not None else str(self.path)

    def synchronize_staging(self) -> None:
        """Wait until this writer's latest stage is complete (a blocking stage always is)."""
        session = self._stager.latest_session() if self._stager is not None else None
        if session is not None:
            session.wait()  # an error is the save's to report

    @property
    def last_staging_report(self) -> StagingReport | None:
        """What this writer's latest stage did (bytes copied and streamed, host memory, times)."""
        return self._stager.last_report if self._stager is not None else None

    def close(self) -> None:
        """Drop this writer's hold on staging memory. A save in flight keeps its slab until it ends;
        idle slabs stay in the process-wide pool for the next writer (``fastdcp.release_staging()``
        frees them)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _release_staging(self, planner: SavePlanner | None = None) -> None:
        """This writer's save is done reading its staged state dict: release the slab holding the
        planner's state dict (without a planner: this writer's only slab in use)."""
        if self._stager is not None:
            self._stager.release(getattr(planner, "state_dict", None) if planner is not None else None)

    def _stock_writes_everything(self) -> bool:
        transforms = getattr(self, "transforms", None)
        if transforms is not None and len(getattr(transforms, "extensions", ())) > 0:
            return True
        fmt = getattr(self, "serialization_format", None)
        return SerializationFormat is not None and fmt is not None and fmt != SerializationFormat.TORCH_SAVE

    # ----------------------------------------------------------------------------------------- #
    # Planning: save-unique file names.

    def _yield_to_the_caller_of_async_save(self) -> None:
        """On the first call from a thread other than the one that ran :meth:`stage`, give up the
        GIL once.

        ``dcp.async_save`` stages on the caller's thread, then starts the save thread, whose first
        call into this writer is ``reset(checkpoint_id)``. The caller is then waiting in
        ``Thread.start()`` and, once this thread has started, for the GIL, which this thread, busy
        planning, hands over only when the interpreter forces a switch (every 5 ms by default):
        measured 9.6 ms of a 1 GiB ``async_save``'s blocked 68.6 ms (reused writer, 334 keys).
        Yielding here lets the caller take the GIL and return to training at once."""
        staged_on = self._staged_on_thread
        if staged_on is not None and staged_on != threading.get_ident():
            self._staged_on_thread = None
            time.sleep(0)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._yield_to_the_caller_of_async_save()
        super().reset(checkpoint_id)
        self._save_token = None
        self._claimed_tokens = set()

    def _rank_local(self) -> bool:
        """``dcp.save(use_collectives=False)``: every rank commits its own ``__{rank}.metadata``."""
        return not getattr(self, "use_collectives", True) and getattr(self, "rank", None) is not None

    def _claim_token(self) -> str:
        """A save-unique token for this directory, with its in-flight marker."""
        token = claim_token(str(self.path))
        self._claimed_tokens.add(token)
        return token

    def _storage_prefix(self, rank: int) -> str:
        """What the names of rank ``rank``'s data files in this save start with."""
        return f"__{rank}_{self._save_token}_"

    @timed("plan")
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)  # mkdir, overwrite check, stock's rank-local prefix
        if self._rank_local() and isinstance(plan.storage_data, _StoragePrefix):
            if plan.storage_data.prefix == f"__{self.rank}_":
                self._save_token = self._claim_token()
                plan = dataclasses.replace(plan, storage_data=_StoragePrefix(self._storage_prefix(self.rank)))
                crash_point("plan")
        return plan

    @timed("plan")
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if all(plan.storage_data is not None for plan in plans):
            return super().prepare_global_plan(plans)  # rank-local prefixes were chosen already
        self._save_token = self._claim_token()
        new_plans = [
            dataclasses.replace(plan, storage_data=_StoragePrefix(self._storage_prefix(i)))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]
        crash_point("plan")
        return new_plans

    # ----------------------------------------------------------------------------------------- #
    # Writing data files.

    @timed("layout")
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_plan: _StoragePrefix = plan.storage_data
        written_prefix: str | None = None  # set once this save owns the prefix it writes under
        try:
            storage_plan, fresh_token = unused_prefix(str(self.path), storage_plan, getattr(self, "rank", 0))
            if fresh_token is not None:
                self._claimed_tokens.add(fresh_token)
            written_prefix = self._written_prefix = storage_plan.prefix
            plan = dataclasses.replace(plan, storage_data=storage_plan)
            if self._stock_writes_everything():
                return super().write_data(plan, planner)
            with gc_paused():  # a few objects per item (segments, results): see fastdcp.io.gc
                return self._write_data_fast(storage_plan, plan, planner)
        except BaseException as error:
            # Drop what the failed save holds (file images, staged copies) before the exception
            # travels on: DCP keeps it, with its frames, inside a CheckpointException.
            if error.__traceback__ is not None:
                traceback.clear_frames(error.__traceback__.tb_next)
            if written_prefix is not None:
                remove_partial_files(str(self.path), written_prefix)
            # This rank's write failed, so the whole save fails: files other ranks may still be
            # writing under these tokens are dead too, and may be removed by any later cleanup.
            for token in self._claimed_tokens:
                inflight.release(str(self.path), token)
            self._claimed_tokens = set()
            directory = str(self.path)
            if isinstance(error, FileNotFoundError) and not os.path.isdir(directory):
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"checkpoint directory '{directory}' disappeared before this save could write its data "
                    f"files ({error})",
                    directory,
                ) from error
            raise
        finally:
            # This rank's data is written (or the save failed): a staged state dict's slab may be
            # refilled by the next stage().
            self._release_staging(planner)

    def _write_data_fast(self, storage_plan: _StoragePrefix, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        write_options = dataclasses.replace(self.io_options, io_threads=self._write_threads())
        buckets = split_into_files(
            list(plan.items), self.single_file_per_rank, self.files_per_rank, write_options.io_threads
        )

        files: list[FilePlan] = []
        for i, bucket in enumerate(buckets):
            storage_key = f"{storage_plan.prefix}{i}{DEFAULT_SUFFIX}"
            file_plan = FilePlan(path=self._data_file_path(storage_key))
            # Stock order: byte items first, then tensors.
            for item in bucket:
                if item.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    if not isinstance(data, io.BytesIO):
                        raise TypeError(f"BYTE_IO item {item.index.fqn} resolved to {type(data).__name__}, not BytesIO")
                    file_plan.append_bytes(item, storage_key, data.getvalue())
            for item in bucket:
                if item.type != WriteItemType.BYTE_IO:
                    self._append_tensor_item(file_plan, item, storage_key, planner)
            files.append(file_plan)

        if self.checksums:
            record_checksums(get_engine(self.io_options), files)
        self._write_files(files, write_options)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(pack_write_results(plan, [r for f in files for r in f.results]))
        return fut

    def _write_threads(self) -> int:
        """Engine threads for this save's writes (and so, with the automatic split, its files)."""
        return self.io_options.write_threads_for(str(self.path))

    def _data_file_path(self, storage_key: str) -> str:
        """Where the data file ``storage_key`` is written."""
        return str(self.fs.concat_path(self.path, storage_key))

    def _append_tensor_item(self, file_plan: FilePlan, item: WriteItem, storage_key: str, planner: SavePlanner) -> None:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"tensor item {item.index.fqn} resolved to {type(data).__name__}, not a Tensor")
        if data.dtype in UNLOADABLE_DTYPES:
            # torch cannot copy_ these into a destination, so no DCP reader could load them back.
            raise TypeError(
                f"{item.index.fqn}: dtype {data.dtype} cannot be checkpointed with DCP (torch has no copy "
                "kernel for it, so it could not be loaded; stock FileSystemWriter refuses it as well)"
            )
        if is_plain_dense(data):
            # Checksums are computed from host memory: with them on, device tensors come over first.
            through_ring = not self.checksums and _stays_on_device(data)
            tensor = tensor_for_writing(data, keep_on_device=through_ring)
            file_plan.append_tensor(item, storage_key, tensor, through_ring=through_ring)
        else:
            # Sparse, quantized, tensor subclasses: stock's serialization, placed as opaque bytes.
            buffer = io.BytesIO()
            torch.save(data.detach().cpu(), buffer)
            offset = round_up(file_plan.size, ZIP_ALIGN)
            file_plan.size = offset
            file_plan.append_bytes(item, storage_key, buffer.getvalue())

    def _write_files(self, files: list[FilePlan], options: IoOptions) -> None:
        engine = get_engine(options)
        handles: list[_C.File] = []
        total_bytes = sum(f.size for f in files)
        mode = self.last_write_mode = write_mode_for(str(self.path), options, total_bytes)
        direct = mode.direct
        try:
            t_open = time.perf_counter()
            jobs = []
            with span("open"):
                for f in files:
                    handle = _C.File(f.path, "w", direct)
                    handles.append(handle)
                    if handle.direct:
                        # Allocate up to the padded end so no O_DIRECT write extends the file (ext4
                        # serialises extending direct writes). Buffered writes need no help, and on
                        # tmpfs preallocation would zero every page before it is written.
                        handle.allocate(-(-f.size // DIRECT_ALIGN) * DIRECT_ALIGN)
                    if not f.device_segments:
                        jobs.append((handle, 0, f.size, f.segments))
            crash_point("open")
            with span("write"):
                engine.write(jobs)
            device_files = [i for i, f in enumerate(files) if f.device_segments]
            if device_files:
                self._write_through_ring(engine, handles, [(i, files[i]) for i in device_files])
            with span("write"):
                for f, handle in zip(files, handles):
                    handle.truncate(f.size)  # drop the O_DIRECT padding of the last block
            crash_point("write")
            with span("fsync"):
                if self.sync_files:
                    engine.sync(handles, False)
                    # Without fsync a buffered write times only the page-cache copy: not comparable.
                    record_write(str(self.path), mode, total_bytes, time.perf_counter() - t_open,
                                 all(h.direct for h in handles))
                for handle in handles:
                    handle.close()
            crash_point("sync")
        finally:
            for handle in handles:
                if not handle.closed:
                    try:
                        handle.close()
                    except OSError:
                        pass  # the original error is the one to report

    def _write_through_ring(self, engine: "_C.Engine", handles: list["_C.File"], files: list[tuple[int, FilePlan]]) -> None:
        """Write files holding device tensor bytes: device-to-host copies into a pinned ring leased
        for this save, overlapped with the writes of the slots before, several files per engine
        call (``fastdcp.save.device_ring``)."""
        slot_bytes, slots, batch, in_flight = ring_shape(self.pinned_ring_limit_bytes, len(files), self._write_threads())
        ranges = [
            job
            for index, f in files
            for job in cut_ranges(index, f.size, f.segments, f.device_segments, slot_bytes)
        ]
        with span("pin"):
            lease = lease_pinned(slot_bytes * slots)
        with StagingPipeline.from_lease(lease, slot_bytes, slots) as ring:
            write_device_images(engine, handles, ranges, ring, _make_copier(), batch=batch, writes_in_flight=in_flight)

    # ----------------------------------------------------------------------------------------- #
    # Commit: atomic metadata swap, then cleanup.

    @timed("commit")
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the save (coordinator only, after every rank's data files are durable).

        Unlike stock (which removes ``.metadata`` and then renames the temp file over it), the new
        metadata is renamed straight over the old one, so every instant has a valid ``.metadata``
        naming files that exist: the old checkpoint's until the rename, the new one's after it."""
        new_files = self._complete_metadata(metadata, results)
        directory = str(self.path)
        rank_local = self._rank_local()
        metadata_name = f"__{self.rank}{METADATA_NAME}" if rank_local else METADATA_NAME
        token = self._save_token or self._claim_token()
        try:
            committed = commit_metadata(directory, metadata_name, token, metadata, new_files, self.sync_files,
                                        self._files_written_here(new_files))
        finally:
            self._claimed_tokens = set()  # released by commit_metadata, committed or not
        self._last_commit = committed
        if committed.chunk_index is not None and isinstance(metadata, TableMetadata):
            # DCP broadcasts this metadata to every rank: send where to read it, not all of it.
            metadata.send_as(CommittedIndex(directory, *committed.chunk_index).reduced())
        crash_point("cleanup")
        remove_unreferenced(directory, committed, self.rank if rank_local else None)

    def _files_written_here(self, new_files: set[str]) -> set[str]:
        """Which of the save's data files the ranks wrote into this writer's directory (all of them:
        every rank writes the one checkpoint directory); the commit checks they are all there."""
        return set(new_files)

    def _complete_metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> set[str]:
        """Fill ``metadata`` with every rank's write results (storage data, storage meta, version);
        returns the data files it names."""
        version = getattr(_stock_fs, "CURRENT_DCP_VERSION", None)
        if version is not None:
            metadata.version = version
        table = getattr(metadata, "chunk_table", None)
        columns = [result_columns(wr_list) for wr_list in results]
        if table is not None and columns and all(c is not None for c in columns):
            # Planned in bulk: the results are columns naming table rows (fastdcp.save.results).
            storage = storage_columns(table.rows, columns)
            metadata.chunk_table = dataclasses.replace(table, storage=storage)
            metadata.storage_data = TableStorageData(metadata.chunk_table)
            new_files = set(storage.files)
        else:
            storage_md = {}
            for wr_list in results:
                storage_md.update({wr.index: wr.storage_data for wr in wr_list})
            metadata.storage_data = storage_md
            new_files = {info.relative_path for info in storage_md.values()}
        metadata.storage_meta = self.storage_meta()
        return new_files
