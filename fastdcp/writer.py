"""FastFileSystemWriter: stock DCP's file layout, written by the native engine.

Each rank writes the files stock ``FileSystemWriter`` would (one per ``thread_count`` bucket, or one
per item), each tensor as a complete ``torch.save``-compatible zip blob, so stock DCP reads the
result. What differs is how the bytes get there: the file is planned as an image (blob headers,
tensor bytes at 4096-aligned offsets, blob trailers) and the engine writes it with parallel,
O_DIRECT-capable positional writes straight from tensor memory, with no per-tensor ``torch.save``
and no CRC pass.

Crash consistency (docs/GUARANTEES.md). Data files get save-unique names,
``__{rank}_{token}_{i}.distcp``, where ``token`` is 8 random hex digits the coordinator picks per
save (so a save never touches the files the current ``.metadata`` points at). Commit protocol, on
the coordinator, after every rank has fsynced its data files: fsync the directory, write
``.metadata.{token}.tmp``, fsync it, ``rename`` it over ``.metadata`` (atomic: there is never a
moment without a valid ``.metadata``), fsync the directory, and only then delete what the new
``.metadata`` does not reference: data files named like ours or stock's (``__{rank}_{i}.distcp``,
``__{rank}_{token}_{i}.distcp``) and stale metadata temp files (``.metadata.tmp``,
``.metadata.{token}.tmp``, and the ``__{rank}.`` variants). No other file is ever removed.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import io
import os
import pickle
import re
import secrets
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as _stock_fs
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _C
from ._blob import DATA_ALIGN, ZIP_ALIGN, is_plain_dense, tensor_blob_layout
from ._device_writes import CudaCopier, DeviceRing, cut_ranges, write_device_images
from ._engine import DIRECT_ALIGN, IoOptions, _env_flag, get_engine
from ._gc import gc_paused
from ._metadata import CHECKSUM_ATTRIBUTE, load_metadata
from ._stager import StateDictStager

try:  # torch >= 2.7
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - older torch
    SerializationFormat = None  # type: ignore[assignment,misc]

__all__ = ["FastFileSystemWriter"]

_DEFAULT_RING_BYTES = 256 << 20
_PAGE_ALIGNED_FROM_BYTES = 64 << 10
_RING_SLOTS = 4
_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemWriter.__init__).parameters)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


_UNLOADABLE_DTYPES = frozenset(d for d in (getattr(torch, "quint4x2", None), getattr(torch, "quint2x4", None)) if d)


@dataclass
class _FilePlan:
    """One output file: its image as sorted segments, and the results to report for it."""

    path: str
    size: int = 0
    segments: list[tuple] = field(default_factory=list)
    results: list[WriteResult] = field(default_factory=list)
    blob_segments: list[range] = field(default_factory=list)  # per result: its segments, in order
    device_segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (offset, flat uint8 device bytes)
    keep_alive: list[Any] = field(default_factory=list)  # tensors/buffers the segments point into

    def append_bytes(self, item: WriteItem, storage_key: str, data: bytes | memoryview) -> None:
        offset, first_segment = self.size, len(self.segments)
        if len(data):
            self.segments.append((offset, data))
            self.keep_alive.append(data)
        self._finish_item(item, storage_key, offset, len(data), first_segment)

    def append_tensor(self, item: WriteItem, storage_key: str, tensor: torch.Tensor, through_ring: bool = False) -> None:
        """Place ``tensor``'s blob; ``through_ring``: its bytes are device memory, written through
        the pinned ring (``fastdcp._device_writes``) instead of from host memory."""
        offset = _round_up(self.size, ZIP_ALIGN)
        nbytes = tensor.numel() * tensor.element_size()
        # Large tensors get their bytes on a 4096 boundary (written with O_DIRECT straight from
        # aligned memory); small ones are packed at torch's 64-byte alignment, as stock packs them:
        # they go through a bounce buffer either way, and padding would inflate the file.
        data_align = DATA_ALIGN if nbytes >= _PAGE_ALIGNED_FROM_BYTES else ZIP_ALIGN
        layout = tensor_blob_layout(tensor, offset, data_align=data_align)
        data_at = offset + layout.data_offset
        first_segment = len(self.segments)
        self.segments.append((offset, layout.head))
        if layout.data_nbytes and through_ring:
            self.device_segments.append((data_at, tensor.reshape(-1).view(torch.uint8)))
        elif layout.data_nbytes:
            self.segments.append((data_at, tensor.data_ptr(), layout.data_nbytes))
            self.keep_alive.append(tensor)
        self.segments.append((data_at + layout.data_nbytes, layout.tail))
        self._finish_item(item, storage_key, offset, layout.length, first_segment)

    def _finish_item(self, item: WriteItem, storage_key: str, offset: int, length: int, first_segment: int) -> None:
        self.size = offset + length
        self.blob_segments.append(range(first_segment, len(self.segments)))
        self.results.append(
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(storage_key, offset, length),
            )
        )


def _stays_on_device(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes go to disk through the pinned ring (``fastdcp._device_writes``)
    rather than from host memory. Tests replace this to drive the ring with CPU tensors."""
    return tensor.device.type == "cuda"


def _make_copier() -> Any:
    """The device-to-host copier of the ring pipeline (tests replace it with a CPU one)."""
    return CudaCopier()


def _tensor_for_writing(tensor: torch.Tensor, keep_on_device: bool) -> torch.Tensor:
    """A contiguous tensor holding exactly the values to store (conj/neg views resolved): on the
    CPU, or, with ``keep_on_device``, on the device it is on (written through the ring)."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu" and not keep_on_device:
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


# --------------------------------------------------------------------------------------------- #
# Save-unique naming, the commit protocol's helpers, and the cleanup rule.

_METADATA_NAME = ".metadata"  # stock's _metadata_fn
_TOKEN_HEX = 8
# A prefix this writer generated: "__{rank}_{token}_". Only files under such a prefix are ever
# removed after a failed save (they cannot belong to any other save: the token is checked unique).
_OWNED_PREFIX_RE = re.compile(rf"^__(\d+)_([0-9a-f]{{{_TOKEN_HEX}}})_$")
# Data files as stock (__{rank}_{i}.distcp) or fastdcp (__{rank}_{token}_{i}.distcp) name them.
_DATA_FILE_RE = re.compile(rf"^__(\d+)_(?:[0-9a-f]{{{_TOKEN_HEX}}}_)?\d+{re.escape(DEFAULT_SUFFIX)}$")
# Metadata temp files: stock's (.metadata.tmp, __{rank}.metadata.tmp) and ours (.{token}.tmp).
_METADATA_TMP_RE = re.compile(rf"^(?:__(\d+))?\.metadata(?:\.[0-9a-f]{{{_TOKEN_HEX}}})?\.tmp$")
_RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")


def _new_token(directory: str) -> str:
    """A token no file in ``directory`` carries yet, so this save's names are unique there."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        names = []
    while True:
        token = secrets.token_hex(_TOKEN_HEX // 2)
        if not any(f"_{token}_" in name or f".{token}." in name for name in names):
            return token


def _test_pause(phase: str) -> None:
    """Test hook: with ``FASTDCP_TEST_PAUSE_AT`` naming ``phase`` (comma-separated list), note the
    phase in the file ``FASTDCP_TEST_PAUSE_NOTIFY`` (if set) and sleep ``FASTDCP_TEST_PAUSE_S``
    seconds (default 60), so a crash test can SIGKILL the process exactly there. Phases: ``plan``,
    ``open``, ``write``, ``sync``, ``commit``, ``cleanup``, ``cleanup_mid``."""
    wanted = os.environ.get("FASTDCP_TEST_PAUSE_AT")
    if not wanted or phase not in wanted.split(","):
        return
    notify = os.environ.get("FASTDCP_TEST_PAUSE_NOTIFY")
    if notify:
        with open(notify, "a") as f:
            f.write(f"{phase} {os.getpid()}\n")
    time.sleep(float(os.environ.get("FASTDCP_TEST_PAUSE_S", "60")))


def _fsync_directory(path: str) -> None:
    """Make the directory entries (data files, the renamed .metadata) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # best effort: the next successful save removes it


def _referenced_files(path: str) -> set[str] | None:
    """The data files a metadata file references, or None when it cannot be read safely."""
    try:
        metadata = load_metadata(path)  # the reader's restricted unpickler: builds nothing else
        return {info.relative_path for info in metadata.storage_data.values()}
    except Exception:  # noqa: BLE001 - unreadable for any reason: the caller stays conservative
        return None


def _record_checksums(engine: "_C.Engine", files: list[_FilePlan]) -> None:
    """Store the CRC-32C of every item's stored bytes (the whole blob) on its ``_StorageInfo``.

    The attribute travels inside ``.metadata``; stock readers ignore it. A blob is a few segments
    (zip head, tensor bytes, zip tail), so the checksum is chained segment by segment: round r
    checksums every blob's r-th segment, in parallel, seeded with the checksum of the rounds before.
    """
    chains = [(f, r) for f in files for r in range(len(f.results))]
    crcs = [0] * len(chains)
    depth = max((len(f.blob_segments[r]) for f, r in chains), default=0)
    for round_ in range(depth):
        todo = [i for i, (f, r) in enumerate(chains) if round_ < len(f.blob_segments[r])]
        regions = []
        for i in todo:
            f, r = chains[i]
            segment = f.segments[f.blob_segments[r][round_]]
            regions.append((segment[1], segment[2] if len(segment) > 2 else None, crcs[i]))
        for i, crc in zip(todo, engine.crc32c(regions)):
            crcs[i] = crc
    for (f, r), crc in zip(chains, crcs):
        setattr(f.results[r].storage_data, CHECKSUM_ATTRIBUTE, crc)


class FastFileSystemWriter(FileSystemWriter):
    """Drop-in replacement for :class:`torch.distributed.checkpoint.FileSystemWriter`.

    Takes stock's arguments with stock's meaning (``path, single_file_per_rank, sync_files,
    thread_count, per_thread_copy_ahead, cache_staged_state_dict, overwrite, _extensions,
    serialization_format``); ``thread_count`` keeps stock's meaning of "files per rank". Items with
    ``_extensions`` transforms or a non-``torch_save`` serialization format are written by stock code.

    fastdcp's own keyword arguments:
        direct_io: write with O_DIRECT where the filesystem allows it (default True; environment
            ``FASTDCP_DIRECT_IO``; never on tmpfs/ramfs). Network filesystems are often faster
            buffered.
        io_threads: engine worker threads (default ``min(8, cpus)``, at least 4).
        task_bytes: the unit large writes are split into (default 8 MiB).
        checksums: record a CRC-32C of every stored item in ``.metadata`` (default False;
            environment ``FASTDCP_CHECKSUMS``), checked by ``FastFileSystemReader(verify_checksums=True)``
            and ``python -m fastdcp verify``. Costs one extra pass over the data at memory speed.
            With checksums on, GPU tensors are copied to the host before writing (no ring).
        memory_budget_bytes: pinned host memory for writing GPU tensors (default 256 MiB): a ring
            of 4 slots that device-to-host copies fill while the engine writes the previous slots.

    ``dcp.async_save`` stages through :meth:`stage`: one host slab (shared memory; page-locked under
    CUDA) reused across saves, refilled only once the save that read it is done (``fastdcp._stager``).
    It always reuses its slab, so ``cache_staged_state_dict`` changes nothing here (it is accepted
    for compatibility); call :meth:`close` to free the slab.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
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
        memory_budget_bytes: int | None = None,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        stock_kwargs: dict[str, Any] = dict(
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
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
        self.io_options = IoOptions.resolve(
            direct_io=direct_io, default_direct_io=True, io_threads=io_threads, task_bytes=task_bytes
        )
        self._save_token: str | None = None  # this save's file-name token (see prepare_global_plan)
        ring_budget = memory_budget_bytes if memory_budget_bytes is not None else _DEFAULT_RING_BYTES
        if not isinstance(ring_budget, int) or isinstance(ring_budget, bool) or ring_budget < _RING_SLOTS * DIRECT_ALIGN:
            raise ValueError(
                f"memory_budget_bytes must be an int of at least {_RING_SLOTS * DIRECT_ALIGN}, got {memory_budget_bytes!r}"
            )
        self.memory_budget_bytes = ring_budget
        self._ring: DeviceRing | None = None  # pinned ring for GPU tensors; created on first use, never pickled
        env_checksums = _env_flag("FASTDCP_CHECKSUMS")
        self.checksums = bool(checksums if checksums is not None else (env_checksums or False))
        self._stager: StateDictStager | None = None  # created by the first stage(); never pickled

    def __getstate__(self) -> dict[str, Any]:
        # Process-mode async_save pickles the writer into the background process: the staging
        # slab stays with the process that owns it (the staged tensors travel as shared memory).
        state = self.__dict__.copy()
        state["_stager"] = None
        state["_ring"] = None
        return state

    # ----------------------------------------------------------------------------------------- #
    # Async staging (AsyncStager protocol, used by dcp.async_save).

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into this writer's reused staging slab and return the staged copy;
        returns once every byte is staged, so the caller may modify its tensors right away."""
        if self._stager is None:
            self._stager = StateDictStager()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns with the copy complete."""

    def close(self) -> None:
        """Free the staging slab (tensors of a save in flight keep their memory until it ends)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _release_staging(self) -> None:
        if self._stager is not None:
            self._stager.release()

    def _stock_writes_everything(self) -> bool:
        transforms = getattr(self, "transforms", None)
        if transforms is not None and len(getattr(transforms, "extensions", ())) > 0:
            return True
        fmt = getattr(self, "serialization_format", None)
        return SerializationFormat is not None and fmt is not None and fmt != SerializationFormat.TORCH_SAVE

    # ----------------------------------------------------------------------------------------- #
    # Planning: save-unique file names.

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._save_token = None

    def _rank_local(self) -> bool:
        """``dcp.save(use_collectives=False)``: every rank commits its own ``__{rank}.metadata``."""
        return not getattr(self, "use_collectives", True) and getattr(self, "rank", None) is not None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)  # mkdir, overwrite check, stock's rank-local prefix
        if self._rank_local() and isinstance(plan.storage_data, _StoragePrefix):
            if plan.storage_data.prefix == f"__{self.rank}_":
                self._save_token = _new_token(str(self.path))
                plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_{self._save_token}_"))
                _test_pause("plan")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if all(plan.storage_data is not None for plan in plans):
            return super().prepare_global_plan(plans)  # rank-local prefixes were chosen already
        self._save_token = _new_token(str(self.path))
        new_plans = [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{self._save_token}_"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]
        _test_pause("plan")
        return new_plans

    # ----------------------------------------------------------------------------------------- #
    # Writing data files.

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_plan: _StoragePrefix = plan.storage_data
        written_prefix: str | None = None  # set once this save owns the prefix it writes under
        try:
            storage_plan = self._unused_prefix(storage_plan)
            written_prefix = storage_plan.prefix
            plan = dataclasses.replace(plan, storage_data=storage_plan)
            if self._stock_writes_everything():
                return super().write_data(plan, planner)
            with gc_paused():  # a few objects per item (segments, results): see fastdcp._gc
                return self._write_data_fast(storage_plan, plan, planner)
        except BaseException as error:
            # Drop what the failed save holds (file images, staged copies) before the exception
            # travels on: DCP keeps it, with its frames, inside a CheckpointException.
            if error.__traceback__ is not None:
                traceback.clear_frames(error.__traceback__.tb_next)
            if written_prefix is not None:
                self._remove_partial_files(written_prefix)
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
            self._release_staging()

    def _unused_prefix(self, storage_plan: _StoragePrefix) -> _StoragePrefix:
        """``storage_plan``, or a fresh ``__{rank}_{token}_`` prefix when files under it exist.

        A save never writes into an existing file (that is what keeps overwriting atomic). The
        prefix normally comes fresh from :meth:`prepare_global_plan`, but a planner may hand back
        an old final plan instead: stock ``DefaultSavePlanner(enable_plan_caching=True)`` reuses the
        previous save's plans, prefix included, which would rewrite the live checkpoint's files
        in place. The write results carry the file names, so the metadata names the new files."""
        prefix = storage_plan.prefix
        directory = str(self.path)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return storage_plan
        if not any(name.startswith(prefix) for name in names):
            return storage_plan
        match = re.match(r"^__(\d+)_", prefix)
        rank = match.group(1) if match else str(getattr(self, "rank", 0) or 0)
        return _StoragePrefix(f"__{rank}_{_new_token(directory)}_")

    def _remove_partial_files(self, prefix: str) -> None:
        """Best effort: delete the data files of a failed save. Only under a prefix this writer
        generated (save-unique), so no file of an existing checkpoint is touched."""
        if not _OWNED_PREFIX_RE.match(prefix):
            return
        directory = str(self.path)
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            if name.startswith(prefix) and name.endswith(DEFAULT_SUFFIX):
                _remove_quietly(os.path.join(directory, name))

    def _write_data_fast(self, storage_plan: _StoragePrefix, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, list(plan.items))
        else:
            buckets = [[item] for item in plan.items]

        files: list[_FilePlan] = []
        for i, bucket in enumerate(buckets):
            storage_key = f"{storage_plan.prefix}{i}{DEFAULT_SUFFIX}"
            file_plan = _FilePlan(path=str(self.fs.concat_path(self.path, storage_key)))
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
            _record_checksums(get_engine(self.io_options), files)
        self._write_files(files)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for f in files for r in f.results])
        return fut

    def _append_tensor_item(self, file_plan: _FilePlan, item: WriteItem, storage_key: str, planner: SavePlanner) -> None:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"tensor item {item.index.fqn} resolved to {type(data).__name__}, not a Tensor")
        if data.dtype in _UNLOADABLE_DTYPES:
            # torch cannot copy_ these into a destination, so no DCP reader could load them back.
            raise TypeError(
                f"{item.index.fqn}: dtype {data.dtype} cannot be checkpointed with DCP (torch has no copy "
                "kernel for it, so it could not be loaded; stock FileSystemWriter refuses it as well)"
            )
        if is_plain_dense(data):
            # Checksums are computed from host memory: with them on, device tensors come over first.
            through_ring = not self.checksums and _stays_on_device(data)
            tensor = _tensor_for_writing(data, keep_on_device=through_ring)
            file_plan.append_tensor(item, storage_key, tensor, through_ring=through_ring)
        else:
            # Sparse, quantized, tensor subclasses: stock's serialization, placed as opaque bytes.
            buffer = io.BytesIO()
            torch.save(data.detach().cpu(), buffer)
            offset = _round_up(file_plan.size, ZIP_ALIGN)
            file_plan.size = offset
            file_plan.append_bytes(item, storage_key, buffer.getvalue())

    def _write_files(self, files: list[_FilePlan]) -> None:
        engine = get_engine(self.io_options)
        handles: list[_C.File] = []
        direct = self.io_options.direct_for(str(self.path))
        try:
            jobs = []
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
            _test_pause("open")
            engine.write(jobs)
            device_files = [i for i, f in enumerate(files) if f.device_segments]
            if device_files:
                self._write_through_ring(engine, handles, [(i, files[i]) for i in device_files])
            for f, handle in zip(files, handles):
                handle.truncate(f.size)  # drop the O_DIRECT padding of the last block
            _test_pause("write")
            if self.sync_files:
                engine.sync(handles, False)
            for handle in handles:
                handle.close()
            _test_pause("sync")
        finally:
            for handle in handles:
                if not handle.closed:
                    try:
                        handle.close()
                    except OSError:
                        pass  # the original error is the one to report

    def _write_through_ring(self, engine: "_C.Engine", handles: list["_C.File"], files: list[tuple[int, _FilePlan]]) -> None:
        """Write files holding GPU tensor bytes: device-to-host copies into the pinned ring,
        overlapped with the writes of the slots before (``fastdcp._device_writes``)."""
        slot_bytes = max(DIRECT_ALIGN, self.memory_budget_bytes // _RING_SLOTS // DIRECT_ALIGN * DIRECT_ALIGN)
        if self._ring is None or self._ring.slot_bytes != slot_bytes:
            self._ring = DeviceRing(slot_bytes, _RING_SLOTS)
        ranges = [
            job
            for index, f in files
            for job in cut_ranges(index, f.size, f.segments, f.device_segments, slot_bytes)
        ]
        write_device_images(engine, handles, ranges, self._ring, _make_copier())

    # ----------------------------------------------------------------------------------------- #
    # Commit: atomic metadata swap, then cleanup.

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the save (coordinator only, after every rank's data files are durable).

        Unlike stock (which removes ``.metadata`` and then renames the temp file over it), the new
        metadata is renamed straight over the old one, so every instant has a valid ``.metadata``
        naming files that exist: the old checkpoint's until the rename, the new one's after it."""
        version = getattr(_stock_fs, "CURRENT_DCP_VERSION", None)
        if version is not None:
            metadata.version = version
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()

        directory = str(self.path)
        rank_local = self._rank_local()
        metadata_name = f"__{self.rank}{_METADATA_NAME}" if rank_local else _METADATA_NAME
        token = self._save_token or _new_token(directory)
        tmp_path = os.path.join(directory, f"{metadata_name}.{token}.tmp")
        metadata_path = os.path.join(directory, metadata_name)
        new_files = {info.relative_path for info in storage_md.values()}

        committed = False
        try:
            if self.sync_files:
                _fsync_directory(directory)  # the data files' entries, before anything names them
            with open(tmp_path, "wb") as f, gc_paused():
                pickle.dump(metadata, f)
                f.flush()
                if self.sync_files:
                    os.fsync(f.fileno())
            _test_pause("commit")
            os.replace(tmp_path, metadata_path)
            committed = True
        except BaseException:
            if not committed:
                # Nothing references this save's files: remove them and the temp file (best effort).
                _remove_quietly(tmp_path)
                for name in new_files:
                    if f"_{token}_" in name and _DATA_FILE_RE.match(name):
                        _remove_quietly(os.path.join(directory, name))
            raise
        if self.sync_files:
            _fsync_directory(directory)  # the commit is durable before anything old is removed
        _test_pause("cleanup")
        self._remove_unreferenced(directory, new_files, rank_local)

    def _remove_unreferenced(self, directory: str, keep: set[str], rank_local: bool) -> None:
        """Delete leftovers: data files (stock or fastdcp naming) and metadata temp files that no
        metadata in the directory references. Rank-local saves (``use_collectives=False``) only
        touch their own rank's files. Errors here never fail the (already committed) save."""
        try:
            names = os.listdir(directory)
        except OSError as error:
            warnings.warn(f"fastdcp: could not list {directory} to remove old checkpoint files: {error}", stacklevel=3)
            return
        protected = set(keep)
        # Metadata of the other kind (global vs rank-local) may describe another live checkpoint
        # in the same directory: never delete what it references.
        if rank_local:
            others = [_METADATA_NAME] if _METADATA_NAME in names else []
        else:
            others = [n for n in names if _RANK_METADATA_RE.match(n)]
        remove_data = True
        for name in others:
            refs = _referenced_files(os.path.join(directory, name))
            if refs is None:
                remove_data = False  # cannot tell what it needs: keep every data file
                warnings.warn(
                    f"fastdcp: kept every old data file in {directory}: {name} could not be read safely, "
                    "so it is unknown which of them it references",
                    stacklevel=3,
                )
            else:
                protected |= refs
        removed = 0
        for name in sorted(names):
            data = _DATA_FILE_RE.match(name)
            tmp = None if data else _METADATA_TMP_RE.match(name)
            match = data or tmp
            if match is None or name in protected or (data and not remove_data):
                continue
            if rank_local and match.group(1) != str(self.rank):
                continue
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            except OSError as error:
                warnings.warn(f"fastdcp: could not remove old checkpoint file {name}: {error}", stacklevel=3)
                continue
            removed += 1
            if removed == 1:
                _test_pause("cleanup_mid")
