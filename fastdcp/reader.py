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

import copy
import functools
import inspect
import io
import os
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import _C
from ._blob import DATA_ALIGN, ZIP_ALIGN, BlobFormatError, TensorBlobInfo, _blob_template, parse_tensor_blob
from ._engine import IoOptions, _env_flag, get_engine
from . import _integrity
from ._metadata import (
    check_data_paths,
    check_file_extents,
    file_extents,
    load_metadata,
    metadata_path,
    resolve_data_file,
)
from ._placement import Placement, find_window, plan_placement, run_placements
from ._gc import gc_paused

__all__ = ["FastFileSystemReader"]

_STOCK_INIT_PARAMS = frozenset(inspect.signature(FileSystemReader.__init__).parameters)

# Blobs up to this size are read whole in the header pass (their data comes along for free).
_WHOLE_BLOB_BYTES = 256 << 10
_HEAD_WINDOW = 8 << 10  # covers data.pkl and, in fastdcp blobs, the padded data/0 header
_TAIL_WINDOW = 4 << 10  # covers the central directory and end records
_MERGE_GAP = 64 << 10  # windows closer than this are read as one request


class _MetadataCache:
    """Parsed, validated ``.metadata`` of the last few files read, keyed by the file's identity
    (device, inode, size, mtime and ctime in ns) and the unpickling mode.

    Parsing a 5,000-entry ``.metadata`` with the restricted unpickler and validating it costs
    ~0.1 s; loading the same checkpoint again (evaluation loops, benchmarks) skips that. Writers
    replace ``.metadata`` by renaming a new file over it (a new inode), so a rewritten checkpoint
    never matches an old entry. Entries are stored only when the file's identity is the same
    before and after reading it; every caller gets its own shallow copy (``Metadata`` and its
    top-level dicts), since DCP and planners assign attributes on it."""

    def __init__(self, capacity: int = 4, max_items: int = 2_000_000) -> None:
        self.capacity = capacity
        self.max_items = max_items  # entries over all cached files: bounds the memory held
        self._entries: OrderedDict[tuple, Metadata] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _identity(path: str | os.PathLike, rank: int | None) -> tuple | None:
        path = os.fspath(path)
        file = metadata_path(path, rank) if os.path.isdir(path) else path
        try:
            st = os.stat(file)
        except OSError:
            return None  # load_metadata reports it
        return (os.path.abspath(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def load(self, path: str | os.PathLike, rank: int | None, allow_unsafe: bool) -> Metadata:
        before = self._identity(path, rank)
        key = None if before is None else (before, allow_unsafe)
        if key is not None:
            with self._lock:
                cached = self._entries.get(key)
                if cached is not None:
                    self._entries.move_to_end(key)
            if cached is not None:
                return _copy_metadata(cached)
        with gc_paused():  # tens of thousands of small objects; see fastdcp._gc
            metadata = load_metadata(path, rank=rank, allow_unsafe=allow_unsafe)
        if key is not None and self._identity(path, rank) == before:
            with self._lock:
                self._entries[key] = _copy_metadata(metadata)
                held = sum(len(m.state_dict_metadata) + len(m.storage_data or ()) for m in self._entries.values())
                while len(self._entries) > self.capacity or (held > self.max_items and len(self._entries) > 1):
                    _, dropped = self._entries.popitem(last=False)
                    held -= len(dropped.state_dict_metadata) + len(dropped.storage_data or ())
        return metadata

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _copy_metadata(metadata: Metadata) -> Metadata:
    """A ``Metadata`` sharing the entries of ``metadata`` but with its own top-level containers."""
    new = copy.copy(metadata)
    new.state_dict_metadata = dict(metadata.state_dict_metadata)
    if isinstance(metadata.storage_data, dict):
        new.storage_data = dict(metadata.storage_data)
    if isinstance(metadata.planner_data, dict):
        new.planner_data = dict(metadata.planner_data)
    if getattr(metadata, "storage_meta", None) is not None:
        new.storage_meta = copy.copy(metadata.storage_meta)
        if isinstance(getattr(metadata.storage_meta, "modules", None), list):
            new.storage_meta.modules = list(metadata.storage_meta.modules)
    return new


_metadata_cache = _MetadataCache()


def clear_metadata_cache() -> None:
    """Forget the parsed ``.metadata`` files this process remembers."""
    _metadata_cache.clear()


_SERIALIZATION_ID_LEN = 40  # the decimal digits of a blob's .data/serialization_id record


@dataclass(frozen=True)
class _KnownLayout:
    """Every byte but the tensor data and the serialization id of the blob fastdcp's writer emits
    for one (dtype, size, file offset modulo DATA_ALIGN), and what parsing such a blob yields."""

    head: bytes
    tail_before_id: bytes
    tail_after_id: bytes
    data_nbytes: int
    info: TensorBlobInfo

    @property
    def length(self) -> int:
        tail = len(self.tail_before_id) + _SERIALIZATION_ID_LEN + len(self.tail_after_id)
        return len(self.head) + self.data_nbytes + tail


# The data alignments fastdcp's writer uses (small tensors packed at torch's 64 bytes, large ones
# page-aligned); a blob laid out with any other is simply parsed.
_WRITER_DATA_ALIGNS = (ZIP_ALIGN, DATA_ALIGN)


@functools.lru_cache(maxsize=4096)
def _known_layout(dtype: torch.dtype, size: tuple[int, ...], phase: int, data_align: int) -> _KnownLayout | None:
    """The layout fastdcp's writer gives a contiguous tensor whose blob starts at ``phase``
    modulo ``data_align`` (the writer's own blob template, :func:`fastdcp._blob._blob_template`),
    or None when there is none (a dtype torch.save cannot store)."""
    try:
        stride = tuple(torch.empty(size, dtype=dtype, device="meta").stride())
        t = _blob_template(dtype, size, stride, phase, data_align, False)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return None
    return _KnownLayout(
        head=t.head_before_pad + b"Z" * t.pad,
        tail_before_id=t.tail_before_id,
        tail_after_id=t.tail_after_id,
        data_nbytes=t.data_nbytes,
        info=TensorBlobInfo(t.data_offset, t.data_nbytes, dtype, tuple(size), stride, 0),
    )


class _KnownBlobs:
    """Recognises, without parsing, blobs written by fastdcp's writer.

    The checkpoint metadata says what each stored chunk is (dtype and sizes); fastdcp's writer
    lays out such a tensor's blob deterministically (:func:`fastdcp._blob.tensor_blob_layout`),
    up to the tensor bytes and a 40-digit serialization id. When the bytes read in the header
    pass equal that layout, parsing them would give the layout's answer, so it is used directly
    (a few byte comparisons instead of ~35 us of zip and pickle parsing per blob). Anything
    else (stock ``torch.save`` blobs, other strides, damaged bytes) is parsed as before."""

    def __init__(self, state_dict_metadata: dict[str, Any] | None) -> None:
        self.state_dict_metadata = state_dict_metadata
        # (dtype, sizes, offset modulo DATA_ALIGN, length) -> the layout such a blob would have
        self._layouts: dict[tuple, _KnownLayout | None] = {}
        self.recognised = 0

    def _layout(self, dtype: torch.dtype, sizes: Any, offset: int, length: int) -> _KnownLayout | None:
        key = (dtype, sizes, offset % DATA_ALIGN, length)
        try:
            return self._layouts[key]
        except KeyError:
            pass
        size = tuple(sizes)
        layouts = (_known_layout(dtype, size, offset % align, align) for align in _WRITER_DATA_ALIGNS)
        layout = self._layouts[key] = next((lay for lay in layouts if lay is not None and lay.length == length), None)
        return layout

    def match(self, item: ReadItem, info: _StorageInfo, windows: list[_Window]) -> TensorBlobInfo | None:
        if self.state_dict_metadata is None or info.offset % ZIP_ALIGN:
            return None
        md = self.state_dict_metadata.get(item.storage_index.fqn)
        if type(md) is not TensorStorageMetadata:
            return None
        chunk = _stored_chunk(md, item.storage_index)
        if chunk is None:
            return None
        try:
            layout = self._layout(md.properties.dtype, chunk.sizes, info.offset, info.length)
        except TypeError:  # unhashable sizes or dtype in unusual metadata
            return None
        if layout is None:
            return None
        start, end = info.offset, info.offset + info.length
        head_end = start + len(layout.head)
        window = find_window(windows, start, head_end)
        if window is None or window.slice(start, head_end) != layout.head:
            return None
        tail_start = head_end + layout.data_nbytes
        window = find_window(windows, tail_start, end)
        if window is None:
            return None
        tail = window.slice(tail_start, end)
        at = len(layout.tail_before_id)
        id_end = at + _SERIALIZATION_ID_LEN
        if tail[:at] != layout.tail_before_id or tail[id_end:] != layout.tail_after_id:
            return None
        if not (tail[at:id_end].isdigit() and tail[at:id_end].isascii()):
            return None
        self.recognised += 1
        return layout.info


def _stored_chunk(md: TensorStorageMetadata, index: MetadataIndex) -> Any:
    """The chunk of ``md`` that ``index`` names (its index hint first, as DCP looks it up)."""
    chunks = md.chunks
    hint = index.index
    if hint is not None and 0 <= hint < len(chunks) and chunks[hint].offsets == index.offset:
        return chunks[hint]
    for chunk in chunks:
        if chunk.offsets == index.offset:
            return chunk
    return None


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
        self._state_dict_metadata: dict[str, Any] | None = None  # of the load set up last

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        stock_items: list[ReadItem] = []
        per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]] = defaultdict(list)
        storage_data = self.storage_data
        with gc_paused():  # a few small objects per item: see fastdcp._gc
            for item in plan.items:
                info: _StorageInfo = storage_data[item.storage_index]
                if getattr(info, "transform_descriptors", None):
                    stock_items.append(item)
                else:
                    per_file[info.relative_path].append((item, info))
        if stock_items:
            super().read_data(LoadPlan(stock_items), planner).wait()
        if per_file:
            with gc_paused():
                self._read_native(per_file, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # What each stored tensor should be (dtype, chunk sizes): lets _KnownBlobs recognise
        # blobs fastdcp's writer produced without parsing them.
        self._state_dict_metadata = metadata.state_dict_metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._state_dict_metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Stock ``read_metadata`` (``.metadata``, or ``__{rank}.metadata`` with ``rank=``), read
        through :func:`fastdcp._metadata.load_metadata`: restricted unpickling unless
        ``allow_unsafe_metadata``, then structural validation and a check that no data file
        path leads out of the checkpoint; errors name the file. The parsed file is remembered
        (:class:`_MetadataCache`) until it changes."""
        metadata = _metadata_cache.load(self.path, kwargs.get("rank"), self.allow_unsafe_metadata)
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

    def _read_native(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]], planner: LoadPlanner) -> None:
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
            known = _KnownBlobs(self._state_dict_metadata)
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
                                blob = self._parse_blob(engine, file, file_windows, info)
                            except BlobFormatError as error:
                                blob = error
                        blob_cache[info.offset] = blob
                    if isinstance(blob, BlobFormatError):
                        unparsed.append((item, blob))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    placements.append(plan_placement(item, info, blob, target, file, file_windows))
            plan_seconds = time.perf_counter() - started
            self.last_stats = run_placements(engine, placements, planner, self.io_options, self._direct)
            self.last_stats["plan_seconds"] = plan_seconds
            self.last_stats["blobs_recognised"] = known.recognised  # by layout, without parsing
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
        items = _integrity.checksummed_items(wanted)
        problems = _integrity.verify_checksums(engine, files, items, self.io_options.memory_budget_bytes)
        if problems:
            raise _integrity.ChecksumError("; ".join(problems))

    def _read_windows(
        self, engine: _C.Engine, files: dict[str, _C.File], per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]
    ) -> dict[str, list[_Window]]:
        """The header pass: one parallel batch of merged reads covering every needed blob's
        headers (and whole small blobs and byte items)."""
        jobs = []
        windows: dict[str, list[_Window]] = {}
        for rel, pairs in per_file.items():
            ranges: list[tuple[int, int]] = []
            seen: set[int] = set()
            for item, info in pairs:
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
