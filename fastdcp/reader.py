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
"""

from __future__ import annotations

import inspect
import io
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import _C
from ._blob import BlobFormatError, TensorBlobInfo, parse_tensor_blob
from ._engine import IoOptions, _env_flag, get_engine
from . import _integrity
from ._metadata import check_data_paths, check_file_extents, file_extents, load_metadata, resolve_data_file
from ._placement import Placement, find_window, plan_placement, run_placements

__all__ = ["FastFileSystemReader"]

_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemReader.__init__).parameters)

# Blobs up to this size are read whole in the header pass (their data comes along for free).
_WHOLE_BLOB_BYTES = 256 << 10
_HEAD_WINDOW = 8 << 10  # covers data.pkl and, in fastdcp blobs, the padded data/0 header
_TAIL_WINDOW = 4 << 10  # covers the central directory and end records
_MERGE_GAP = 64 << 10  # windows closer than this are read as one request


@dataclass(frozen=True)
class _Window:
    """Bytes [start, start+len(data)) of one file, as read in the header pass."""

    start: int
    data: memoryview
    tensor: torch.Tensor  # the uint8 tensor owning the memory (for addresses)

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start and end <= self.start + len(self.data)

    def slice(self, start: int, end: int) -> bytes:
        return bytes(self.data[start - self.start : end - self.start])


class FastFileSystemReader(FileSystemReader):
    """Drop-in replacement for :class:`torch.distributed.checkpoint.FileSystemReader`.

    fastdcp's own keyword arguments:
        direct_io: read with O_DIRECT (default False: a warm page cache is far faster than any
            disk; environment ``FASTDCP_DIRECT_IO``).
        io_threads, task_bytes: engine workers and the unit large reads are split into (default
            32 MiB: larger requests read cold files faster).
        memory_budget_bytes: the most staging memory held at once (default 512 MiB).
        allow_unsafe_metadata: unpickle ``.metadata`` with plain :mod:`pickle` (default False).
            By default only stock DCP metadata classes are built and a file naming anything
            else is refused (plain pickle runs whatever code the file names); set True only
            for a trusted checkpoint whose metadata holds custom classes.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: Any = None,
        *,
        direct_io: bool | None = None,
        io_threads: int | None = None,
        task_bytes: int | None = None,
        memory_budget_bytes: int | None = None,
        allow_unsafe_metadata: bool = False,
        verify_checksums: bool | None = None,
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
            memory_budget_bytes=memory_budget_bytes,
            for_reading=True,
        )
        self.last_stats: dict[str, int] = {}
        self._direct = False
        self.allow_unsafe_metadata = bool(allow_unsafe_metadata)
        env_verify = _env_flag("FASTDCP_VERIFY_CHECKSUMS")
        self.verify_checksums = bool(verify_checksums if verify_checksums is not None else (env_verify or False))
        self._extents: tuple[Any, dict] | None = None  # (storage_data, file_extents(storage_data))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        stock_items: list[ReadItem] = []
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                stock_items.append(item)
            else:
                per_file[info.relative_path].append(item)
        if stock_items:
            super().read_data(LoadPlan(stock_items), planner).wait()
        if per_file:
            self._read_native(per_file, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Stock ``read_metadata`` (``.metadata``, or ``__{rank}.metadata`` with ``rank=``), read
        through :func:`fastdcp._metadata.load_metadata`: restricted unpickling unless
        ``allow_unsafe_metadata``, then structural validation and a check that no data file
        path leads out of the checkpoint; errors name the file."""
        metadata = load_metadata(self.path, rank=kwargs.get("rank"), allow_unsafe=self.allow_unsafe_metadata)
        # Every data file the metadata names must stay inside the checkpoint (stock code reads
        # the items fastdcp hands back to it, so this is checked up front, not only in _open).
        check_data_paths(self.path, metadata.storage_data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _open(self, relative_path: str) -> _C.File:
        # Refuses paths leading out of the checkpoint (absolute, "..", symlinks), non-regular
        # files, and (before anything is allocated) byte ranges past the end of the file.
        path = resolve_data_file(self.path, relative_path)
        file = _C.File(path, "r", self._direct)
        try:
            if self._extents is None or self._extents[0] is not self.storage_data:
                self._extents = (self.storage_data, file_extents(self.storage_data))
            check_file_extents(self._extents[1], relative_path, path, file.size())
        except BaseException:
            file.close()
            raise
        return file

    def _read_native(self, per_file: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        started = time.perf_counter()
        engine = get_engine(self.io_options)
        self._direct = self.io_options.direct_for(str(self.path))
        files: dict[str, _C.File] = {}
        # Blobs that are valid torch.save archives but not one plain strided tensor (quantized,
        # sparse, ...): stock's torch.load(weights_only=True) reads those items.
        unparsed: list[tuple[ReadItem, BlobFormatError]] = []
        try:
            for rel in per_file:
                files[rel] = self._open(rel)
            if self.verify_checksums:
                self._verify(engine, files, per_file)
            windows = self._read_windows(engine, files, per_file)
            placements: list[Placement] = []
            for rel, items in per_file.items():
                file = files[rel]
                blob_cache: dict[int, TensorBlobInfo | BlobFormatError] = {}
                for item in items:
                    info: _StorageInfo = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        self._load_bytes(windows[rel], info, item, planner)
                        continue
                    blob = blob_cache.get(info.offset)
                    if blob is None:
                        try:
                            blob = self._parse_blob(engine, file, windows[rel], info)
                        except BlobFormatError as error:
                            blob = error
                        blob_cache[info.offset] = blob
                    if isinstance(blob, BlobFormatError):
                        unparsed.append((item, blob))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    placements.append(plan_placement(item, info, blob, target, file, windows[rel]))
            plan_seconds = time.perf_counter() - started
            self.last_stats = run_placements(engine, placements, planner, self.io_options, self._direct)
            self.last_stats["plan_seconds"] = plan_seconds
        finally:
            for f in files.values():
                f.close()
        if unparsed:
            try:
                super().read_data(LoadPlan([item for item, _ in unparsed]), planner).wait()
            except BaseException as stock_error:  # CheckpointException is a BaseException
                raise unparsed[0][1] from stock_error

    def _verify(self, engine: _C.Engine, files: dict[str, _C.File], per_file: dict[str, list[ReadItem]]) -> None:
        """Check the items this load reads against their recorded checksums; raise on mismatch."""
        wanted = {item.storage_index: self.storage_data[item.storage_index] for items in per_file.values() for item in items}
        items = _integrity.checksummed_items(wanted)
        problems = _integrity.verify_checksums(engine, files, items, self.io_options.memory_budget_bytes)
        if problems:
            raise _integrity.ChecksumError("; ".join(problems))

    def _read_windows(
        self, engine: _C.Engine, files: dict[str, _C.File], per_file: dict[str, list[ReadItem]]
    ) -> dict[str, list[_Window]]:
        """The header pass: one parallel batch of merged reads covering every needed blob's
        headers (and whole small blobs and byte items)."""
        jobs = []
        windows: dict[str, list[_Window]] = {}
        for rel, items in per_file.items():
            ranges: list[tuple[int, int]] = []
            seen: set[int] = set()
            for item in items:
                info: _StorageInfo = self.storage_data[item.storage_index]
                if info.offset in seen:
                    continue
                seen.add(info.offset)
                if item.type == LoadItemType.BYTE_IO or info.length <= _WHOLE_BLOB_BYTES:
                    ranges.append((info.offset, info.offset + info.length))
                else:
                    ranges.append((info.offset, info.offset + _HEAD_WINDOW))
                    ranges.append((info.offset + info.length - _TAIL_WINDOW, info.offset + info.length))
            merged: list[list[int]] = []
            for start, end in sorted(ranges):
                if merged and start <= merged[-1][1] + _MERGE_GAP:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            file_windows = []
            for start, end in merged:
                buffer = bytearray(end - start)
                tensor = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
                file_windows.append(_Window(start, memoryview(buffer), tensor))
                if buffer:
                    jobs.append((files[rel], start, tensor.data_ptr(), end - start))
            windows[rel] = file_windows
        engine.read(jobs, self._direct)
        return windows

    def _parse_blob(self, engine: _C.Engine, file: _C.File, windows: list[_Window], info: _StorageInfo) -> TensorBlobInfo:
        start, end = info.offset, info.offset + info.length
        head_end = min(end, start + _HEAD_WINDOW)
        tail_start = max(start, end - _TAIL_WINDOW)
        head = _window_bytes(windows, start, head_end)
        tail = _window_bytes(windows, tail_start, end)

        def read_more(rel_offset: int, nbytes: int) -> bytes:
            if rel_offset < 0 or nbytes < 0 or rel_offset + nbytes > info.length:
                raise BlobFormatError(f"{file.path}: blob at offset {start} refers to bytes outside itself")
            buffer = bytearray(nbytes)
            if nbytes:
                engine.read([(file, start + rel_offset, buffer, nbytes)], False)
            return bytes(buffer)

        try:
            return parse_tensor_blob(head, tail, info.length, read_more, f"{file.path} (blob at offset {start})")
        except BlobFormatError:
            raise
        except EOFError as e:
            raise BlobFormatError(f"{file.path}: truncated tensor blob at offset {start}: {e}") from None

    def _load_bytes(self, windows: list[_Window], info: _StorageInfo, item: ReadItem, planner: LoadPlanner) -> None:
        data = _window_bytes(windows, info.offset, info.offset + info.length)
        planner.load_bytes(item, io.BytesIO(data))


def _window_bytes(windows: list[_Window], start: int, end: int) -> bytes:
    window = find_window(windows, start, end)
    if window is None:
        raise AssertionError(f"bytes [{start}, {end}) were not read in the header pass")
    return window.slice(start, end)
