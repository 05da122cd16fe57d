"""FastFileSystemWriter: stock DCP's file layout, written by the native engine.

Each rank writes the same files stock ``FileSystemWriter`` would (``__{rank}_{i}.distcp``, one per
``thread_count`` bucket, or one per item), each tensor as a complete ``torch.save``-compatible zip
blob, so stock DCP reads the result. What differs is how the bytes get there: the file is planned
as an image (blob headers, tensor bytes at 4096-aligned offsets, blob trailers) and the engine
writes it with parallel, O_DIRECT-capable positional writes straight from tensor memory, with no
per-tensor ``torch.save`` and no CRC pass.
"""

from __future__ import annotations

import inspect
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
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
from ._blob import ZIP_ALIGN, tensor_blob_layout
from ._engine import DIRECT_ALIGN, IoOptions, get_engine

try:  # torch >= 2.7
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - older torch
    SerializationFormat = None  # type: ignore[assignment,misc]

__all__ = ["FastFileSystemWriter"]

_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemWriter.__init__).parameters)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


_UNLOADABLE_DTYPES = frozenset(d for d in (getattr(torch, "quint4x2", None), getattr(torch, "quint2x4", None)) if d)


def _is_plain_dense(tensor: torch.Tensor) -> bool:
    """Tensors whose bytes we can describe with one dtype/shape blob (everything torch.save stores
    as a single strided storage); anything else keeps stock's torch.save serialization."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and type(tensor) in (torch.Tensor, torch.nn.Parameter)
    )


@dataclass
class _FilePlan:
    """One output file: its image as sorted segments, and the results to report for it."""

    path: str
    size: int = 0
    segments: list[tuple] = field(default_factory=list)
    results: list[WriteResult] = field(default_factory=list)
    keep_alive: list[Any] = field(default_factory=list)  # tensors/buffers the segments point into

    def append_bytes(self, item: WriteItem, storage_key: str, data: bytes | memoryview) -> None:
        offset = self.size
        if len(data):
            self.segments.append((offset, data))
            self.keep_alive.append(data)
        self._finish_item(item, storage_key, offset, len(data))

    def append_tensor(self, item: WriteItem, storage_key: str, tensor: torch.Tensor) -> None:
        offset = _round_up(self.size, ZIP_ALIGN)
        layout = tensor_blob_layout(tensor, offset)
        data_at = offset + layout.data_offset
        self.segments.append((offset, layout.head))
        if layout.data_nbytes:
            self.segments.append((data_at, tensor.data_ptr(), layout.data_nbytes))
            self.keep_alive.append(tensor)
        self.segments.append((data_at + layout.data_nbytes, layout.tail))
        self._finish_item(item, storage_key, offset, layout.length)

    def _finish_item(self, item: WriteItem, storage_key: str, offset: int, length: int) -> None:
        self.size = offset + length
        self.results.append(
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(storage_key, offset, length),
            )
        )


def _tensor_for_writing(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous tensor holding exactly the values to store (conj/neg views resolved)."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


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

    def _stock_writes_everything(self) -> bool:
        transforms = getattr(self, "transforms", None)
        if transforms is not None and len(getattr(transforms, "extensions", ())) > 0:
            return True
        fmt = getattr(self, "serialization_format", None)
        return SerializationFormat is not None and fmt is not None and fmt != SerializationFormat.TORCH_SAVE

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._stock_writes_everything():
            return super().write_data(plan, planner)
        storage_plan: _StoragePrefix = plan.storage_data
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
        if _is_plain_dense(data):
            file_plan.append_tensor(item, storage_key, _tensor_for_writing(data))
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
                jobs.append((handle, 0, f.size, f.segments))
            engine.write(jobs)
            for f, handle in zip(files, handles):
                handle.truncate(f.size)  # drop the O_DIRECT padding of the last block
            if self.sync_files:
                engine.sync(handles, False)
            for handle in handles:
                handle.close()
        finally:
            for handle in handles:
                if not handle.closed:
                    try:
                        handle.close()
                    except OSError:
                        pass  # the original error is the one to report

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if self.sync_files:
            _fsync_directory(str(self.path))


def _fsync_directory(path: str) -> None:
    """Make the directory entries (data files, the renamed .metadata) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

