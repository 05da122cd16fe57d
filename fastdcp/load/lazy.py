"""``fastdcp.open(path)``: a DCP checkpoint directory as a read-only, lazy ``Mapping``.

    with fastdcp.open("ckpt/step_100") as ckpt:
        ckpt.keys()                          # flattened names, e.g. "model.layer.weight"
        w = ckpt["model.layer.weight"]       # the whole tensor, assembled from every shard
        rows = ckpt.get_slice("model.embed.weight")[1000:2000]   # reads only those rows
        ckpt.metadata("model.layer.weight")  # shape, dtype, chunks (file, byte range): no data read
        for name, value in ckpt.items(): ... # one entry at a time, in file/offset order

Keys are the keys of the checkpoint's ``.metadata`` (``state_dict_metadata``): DCP flattens a
nested state dict before saving, joining the path with dots (``{"model": {"w": t}}`` is stored as
``"model.w"``; a list that holds tensors or dicts contributes its indices:
``"optim.state.0.exp_avg"``, ``"optim.param_groups.0.lr"``; any other list, and every tuple, is
one entry). The path each key came from is ``metadata(key).path`` (DCP's ``planner_data``).

Nothing is read until asked for. A tensor (or a box of it) is read the way
:class:`fastdcp.load.reader.FastFileSystemReader` reads one: every chunk that overlaps the box
becomes a ``ReadItem``; the chunk's blob headers are read once (head and tail windows, small
blobs whole: :mod:`fastdcp.load.header_pass`) and parsed without ``torch.load`` (the parse is
cached); :mod:`fastdcp.load.pieces` turns each item into byte runs (a box of a row-major chunk
along its outer dimensions is one span) and :mod:`fastdcp.load.placement` reads them through the
engine straight into the result. Blobs fastdcp cannot parse (quantized tensors) and items stored
through stream transforms (compression extensions) go through stock ``FileSystemReader.read_data``,
which reads those chunks whole. ``bytes_read`` counts what was read.

The same checks as the reader: ``.metadata`` through the restricted unpickler
(``allow_unsafe_metadata`` opts out), every data path kept inside the checkpoint, byte ranges
checked against file sizes. Data files are opened when the checkpoint is opened (at most
``read_source._PIN_FILES_LIMIT``; the rest when read), so a save that overwrites the directory
meanwhile does not change what this object reads.

Non-tensor entries (``BYTE_IO``) are returned as DCP's ``load`` returns them: ``torch.load(...,
weights_only=False)`` of their bytes (plain unpickling: it runs code the checkpoint names, so only
for trusted checkpoints); :meth:`LazyCheckpoint.read_bytes` gives the raw bytes without unpickling.

``device=``: a CUDA device gets the reader's GPU placement path (the result is allocated on the
GPU and the pieces go through pinned staging and the batched kernel, as ``dcp.load`` into GPU
tensors does); any other device gets the tensor read into CPU memory, then ``Tensor.to(device)``.
Quantized tensors are always read on the CPU. One thread at a time per object.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .._native import _C
from ..compat.renamed import READER_RENAMES, renamed_arguments
from ..format.blob import BlobFormatError
from ..format.blob_parse import TensorBlobInfo
from ..format.metadata import CheckpointFormatError
from ..io.checkpoint_files import check_data_paths, check_file_extents, file_extents, load_metadata, resolve_data_file
from ..io.engine import IoOptions, get_engine
from .header_pass import KnownBlobs, parse_blob, read_windows
from .pieces import Placement, plan_placement
from .placement import run_placements
from .read_source import pin_limit
from .slicing import Box, box_of_index

__all__ = ["ChunkInfo", "TensorInfo", "ObjectInfo", "StoredRun", "TensorSlice", "LazyCheckpoint", "open_checkpoint"]


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk of a tensor: the box it holds and where its ``torch.save`` blob lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # data file, relative to the checkpoint directory
    byte_offset: int  # the blob's first byte in that file
    byte_length: int  # the blob's length (zip headers included)


@dataclass(frozen=True)
class TensorInfo:
    """What the metadata says about a tensor entry (nothing read from data files)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[ChunkInfo, ...]
    path: tuple[str | int, ...] | None  # the nested state-dict path the key was flattened from

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class StoredRun:
    """A tensor stored as one run of bytes in one data file: row-major, in its own dtype, so a
    byte copy of the run is the tensor (what ``convert`` copies file to file)."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ObjectInfo:
    """A non-tensor entry: a pickled object stored as bytes."""

    key: str
    file: str
    byte_offset: int
    byte_length: int
    path: tuple[str | int, ...] | None


class _CollectingPlanner:
    """The two planner calls the placement and stock's ``read_data`` make: destinations by item,
    no commit (the result is the destination itself), byte items kept."""

    def __init__(self, destinations: dict[MetadataIndex, torch.Tensor] | None = None) -> None:
        self.destinations = destinations or {}
        self.loaded_bytes: dict[str, bytes] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.destinations[item.storage_index]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.loaded_bytes[item.storage_index.fqn] = value.read()


@dataclass
class _OpenFile:
    file: _C.File | None
    error: BaseException | None  # why it could not be opened or fails the extent check


class TensorSlice:
    """``ckpt.get_slice(key)``: index it (``[a:b, :, 3]``, ints, step-1 slices, ``...``) to read
    that part of the tensor only."""

    def __init__(self, checkpoint: "LazyCheckpoint", info: TensorInfo) -> None:
        self._checkpoint = checkpoint
        self._info = info

    @property
    def shape(self) -> tuple[int, ...]:
        return self._info.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._info.dtype

    def __len__(self) -> int:
        if not self._info.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._info.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._checkpoint._read_tensor(self._info, box_of_index(index, self._info.shape))

    def __repr__(self) -> str:
        return f"TensorSlice({self._info.key!r}, shape={self._info.shape}, dtype={self._info.dtype})"


class CheckpointFiles(Protocol):
    """Where a :class:`LazyCheckpoint`'s bytes come from (built by ``files(checkpoint)``, after
    the checkpoint's ``path`` and ``io_options`` are set)."""

    def read_metadata(self, allow_unsafe: bool) -> Metadata:
        """The checkpoint's validated metadata, every data file it names inside the checkpoint."""

    def direct(self) -> bool:
        """Whether reads use O_DIRECT."""

    def engine(self) -> Any:
        """What reads go through: the native engine's read surface (``read``, ``read_runs``, ...)."""

    def open(self, rel: str) -> Any:
        """Data file ``rel`` opened for reading, its size checked against the metadata's extents."""

    def local_path(self, rel: str) -> str | None:
        """The local path of data file ``rel`` (None where there is none: objects)."""

    def stock_reader(self) -> FileSystemReader:
        """A stock reader of the checkpoint, for the items fastdcp leaves to stock code."""


class LocalCheckpointFiles:
    """A checkpoint directory, read by the native engine.

    Args:
        checkpoint: the lazy checkpoint whose path, options and metadata extents it uses.
    """

    def __init__(self, checkpoint: "LazyCheckpoint") -> None:
        self.checkpoint = checkpoint

    def read_metadata(self, allow_unsafe: bool) -> Metadata:
        path = self.checkpoint.path
        metadata = load_metadata(path, allow_unsafe=allow_unsafe)
        check_data_paths(path, metadata.storage_data or {})
        return metadata

    def direct(self) -> bool:
        return self.checkpoint.io_options.direct_for(self.checkpoint.path)

    def engine(self) -> Any:
        return get_engine(self.checkpoint.io_options.read_with(self.checkpoint._direct))

    def open(self, rel: str) -> Any:
        ckpt = self.checkpoint
        path = resolve_data_file(ckpt.path, rel)
        file = _C.File(path, "r", ckpt._direct)
        try:
            check_file_extents(ckpt._extents, rel, path, file.size())
        except CheckpointFormatError:
            file.close()
            raise
        return file

    def local_path(self, rel: str) -> str | None:
        return os.path.join(str(self.checkpoint.path), rel)

    def stock_reader(self) -> FileSystemReader:
        registry = self.checkpoint._extension_registry
        if registry is None:
            return FileSystemReader(self.checkpoint.path)
        return FileSystemReader(self.checkpoint.path, _extension_registry=registry)


class LazyCheckpoint(Mapping):
    """A read-only mapping from a checkpoint's flattened keys to its tensors and objects; see the
    module docstring. Build with :func:`open_checkpoint` (``fastdcp.open``)."""

    @renamed_arguments(READER_RENAMES)
    def __init__(
        self,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        allow_unsafe_metadata: bool = False,
        direct_io: bool | None = None,
        io_threads: int | None = None,
        read_buffer_limit_bytes: int | None = None,
        extension_registry: Any = None,
        files: Callable[["LazyCheckpoint"], "CheckpointFiles"] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._extension_registry = extension_registry
        self.device = torch.device(device)
        self.io_options = IoOptions.resolve(
            direct_io=direct_io, default_direct_io=False, io_threads=io_threads, task_bytes=None,
            read_buffer_limit_bytes=read_buffer_limit_bytes, for_reading=True,
        )
        self.bytes_read = 0  # data-file bytes read so far (headers, tensor data, byte items)
        self.files: CheckpointFiles = (files or LocalCheckpointFiles)(self)
        self._metadata: Metadata = self.files.read_metadata(allow_unsafe_metadata)
        storage_data = self._metadata.storage_data or {}
        self._storage_data: dict[MetadataIndex, _StorageInfo] = storage_data
        self._entries: dict[str, Any] = dict(self._metadata.state_dict_metadata)
        self._planner_data = self._metadata.planner_data if isinstance(self._metadata.planner_data, dict) else {}
        self._extents = file_extents(storage_data)
        self._direct = self.files.direct()
        self._engine = self.files.engine()
        self._files: dict[str, _OpenFile] = {}
        self._blobs: dict[tuple[str, int], TensorBlobInfo | BlobFormatError] = {}  # parsed headers
        self._known = KnownBlobs(self._entries)
        self._stock_reader: FileSystemReader | None = None
        self._closed = False
        self._order = self._storage_order()
        names = {info.relative_path for info in storage_data.values()}
        if len(names) <= pin_limit():
            # Opened now: files a concurrent overwrite's cleanup unlinks stay readable through them.
            for rel in sorted(names):
                self._open(rel)

    # ---- the Mapping ------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        entry = self._entry(key)
        if isinstance(entry, TensorStorageMetadata):
            info = self.metadata(key)
            assert isinstance(info, TensorInfo)
            return self._read_tensor(info, Box((0,) * len(info.shape), info.shape, ()))
        # As DCP's DefaultLoadPlanner.load_bytes does.
        return torch.load(io.BytesIO(self.read_bytes(key)), weights_only=False)

    def __iter__(self) -> Iterator[str]:
        """Keys in storage order (data file, then byte offset): ``items()`` and ``values()`` then
        read each file front to back, one entry at a time."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} entries"
        return f"<fastdcp.LazyCheckpoint '{self.path}' ({state})>"

    # ---- beyond the Mapping -----------------------------------------------------------------

    def metadata(self, key: str) -> TensorInfo | ObjectInfo:
        """Shape, dtype and chunks (or an object's byte range) of ``key``, from ``.metadata`` only."""
        entry = self._entry(key)
        path = self._planner_data.get(key)
        path = tuple(path) if isinstance(path, (list, tuple)) else None
        if isinstance(entry, TensorStorageMetadata):
            chunks = []
            for i, chunk in enumerate(entry.chunks):
                info = self._storage_info(MetadataIndex(key, chunk.offsets, i))
                chunks.append(ChunkInfo(tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path,
                                        info.offset, info.length))
            return TensorInfo(key, tuple(entry.size), entry.properties.dtype, tuple(chunks), path)
        info = self._storage_info(MetadataIndex(key))
        return ObjectInfo(key, info.relative_path, info.offset, info.length, path)

    def get_slice(self, key: str) -> TensorSlice:
        """A handle to index: ``ckpt.get_slice(key)[a:b]`` reads only rows a..b of the tensor."""
        info = self.metadata(key)
        if not isinstance(info, TensorInfo):
            raise TypeError(f"'{key}' in checkpoint '{self.path}' is not a tensor but a stored object")
        return TensorSlice(self, info)

    def read_bytes(self, key: str) -> bytes:
        """The stored bytes of a non-tensor entry, not unpickled."""
        info = self.metadata(key)
        if not isinstance(info, ObjectInfo):
            raise TypeError(f"'{key}' in checkpoint '{self.path}' is a tensor, not a stored object")
        storage_info = self._storage_info(MetadataIndex(key))
        if getattr(storage_info, "transform_descriptors", None):
            item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(key), torch.Size(()), MetadataIndex(key),
                            torch.Size(()), torch.Size(()))
            planner = _CollectingPlanner()
            self._stock_read([item], planner)
            self.bytes_read += storage_info.length
            return planner.loaded_bytes[key]
        file = self._file(storage_info.relative_path)
        buffer = bytearray(storage_info.length)
        if buffer:
            self._engine.read([(file, storage_info.offset, buffer, len(buffer))], self._direct)
        self.bytes_read += len(buffer)
        return bytes(buffer)

    def close(self) -> None:
        """Close the data files; reads afterwards raise ``ValueError``."""
        self._closed = True
        files, self._files = self._files, {}
        for opened in files.values():
            if opened.file is not None:
                opened.file.close()

    def __enter__(self) -> "LazyCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- reading ----------------------------------------------------------------------------

    def _entry(self, key: Any) -> Any:
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise KeyError(f"{key!r} is not in checkpoint '{self.path}' ({len(self._entries)} entries)") from None

    def _storage_info(self, index: MetadataIndex) -> _StorageInfo:
        try:
            return self._storage_data[index]
        except KeyError:
            where = f" at offsets {tuple(index.offset)}" if index.offset is not None else ""
            raise CheckpointFormatError(
                f"checkpoint metadata '{self.path}' lists '{index.fqn}'{where} but says nowhere where it is "
                "stored (no storage_data entry): the checkpoint is damaged"
            ) from None

    def _storage_order(self) -> list[str]:
        def position(key: str) -> tuple:
            entry = self._entries[key]
            if isinstance(entry, TensorStorageMetadata):
                index = MetadataIndex(key, entry.chunks[0].offsets, 0) if entry.chunks else None
            else:
                index = MetadataIndex(key)
            info = self._storage_data.get(index) if index is not None else None
            if info is None:
                return ("", -1, key)
            return (str(info.relative_path), info.offset, key)

        return sorted(self._entries, key=position)

    def _open(self, rel: str) -> _OpenFile:
        try:
            opened = _OpenFile(self.files.open(rel), None)
        except (OSError, CheckpointFormatError) as error:
            opened = _OpenFile(None, error)
        self._files[rel] = opened
        return opened

    def _file(self, rel: str) -> _C.File:
        if self._closed:
            raise ValueError(f"checkpoint '{self.path}' is closed")
        opened = self._files.get(rel) or self._open(rel)
        if opened.error is not None:
            raise opened.error
        assert opened.file is not None
        return opened.file

    def _read_tensor(self, info: TensorInfo, box: Box) -> torch.Tensor:
        if self._closed:
            raise ValueError(f"checkpoint '{self.path}' is closed")
        if info.dtype in _QUANTIZED_DTYPES:
            out = self._read_quantized(info, box)
        else:
            # A CUDA destination is what dcp.load into GPU tensors hands the reader: the same
            # placement path then reads through pinned staging straight onto the device.
            out = torch.empty(box.sizes, dtype=info.dtype, device=self.device if self.device.type == "cuda" else "cpu")
            if math.prod(box.sizes) > 0:
                self._fill(info, box, out)
        result = out.reshape(box.result_shape) if box.dropped else out
        return result if result.device == self.device else result.to(self.device)

    def _fill(self, info: TensorInfo, box: Box, out: torch.Tensor) -> None:
        """Read every chunk's overlap with ``box`` into ``out`` (shaped like the box)."""
        items: list[tuple[ReadItem, _StorageInfo, torch.Tensor]] = []
        covered = 0
        for i, chunk in enumerate(info.chunks):
            lo = [max(b, c) for b, c in zip(box.starts, chunk.offsets)]
            hi = [min(b + n, c + m) for b, n, c, m in zip(box.starts, box.sizes, chunk.offsets, chunk.sizes)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            lengths = [h - low for low, h in zip(lo, hi)]
            dest = out
            for d, (low, n) in enumerate(zip(lo, lengths)):
                dest = dest.narrow(d, low - box.starts[d], n)
            item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(info.key, box.starts),
                dest_offsets=torch.Size([low - s for low, s in zip(lo, box.starts)]),
                storage_index=MetadataIndex(info.key, chunk.offsets, i),
                storage_offsets=torch.Size([low - c for low, c in zip(lo, chunk.offsets)]),
                lengths=torch.Size(lengths),
            )
            items.append((item, self._storage_info(item.storage_index), dest))
            covered += math.prod(lengths)
        if covered != math.prod(box.sizes):
            raise CheckpointFormatError(
                f"checkpoint metadata '{self.path}': the chunks of '{info.key}' cover {covered} of the "
                f"{math.prod(box.sizes)} elements requested (gaps or overlaps): the checkpoint is damaged"
            )
        native = [(item, si, dest) for item, si, dest in items if not getattr(si, "transform_descriptors", None)]
        stock = [(item, dest) for item, si, dest in items if getattr(si, "transform_descriptors", None)]
        unparsed = self._read_native(native)
        stock += [(item, dest) for item, dest, _ in unparsed]
        if stock:
            planner = _CollectingPlanner({item.storage_index: dest for item, dest in stock})
            try:
                self._stock_read([item for item, _ in stock], planner)
            except BaseException as stock_error:  # CheckpointException is a BaseException
                if unparsed:  # as the reader does: the parse error names the file and offset
                    raise unparsed[0][2] from stock_error
                raise
            self.bytes_read += sum(self._storage_data[item.storage_index].length for item, _ in stock)

    def _read_native(
        self, items: list[tuple[ReadItem, _StorageInfo, torch.Tensor]]
    ) -> list[tuple[ReadItem, torch.Tensor, BlobFormatError]]:
        """Read items through the engine; returns the ones whose blob it cannot parse (quantized,
        sparse, damaged), with the parse error."""
        if not items:
            return []
        files = {si.relative_path: self._file(si.relative_path) for _, si, _ in items}
        unparsed_headers: dict[str, list[tuple[ReadItem, _StorageInfo]]] = {}
        for item, si, _ in items:
            if (si.relative_path, si.offset) not in self._blobs:
                unparsed_headers.setdefault(si.relative_path, []).append((item, si))
        windows = read_windows(self._engine, files, unparsed_headers, self._direct) if unparsed_headers else {}
        self.bytes_read += sum(len(w.data) for file_windows in windows.values() for w in file_windows)
        placements: list[Placement] = []
        fallback: list[tuple[ReadItem, torch.Tensor, BlobFormatError]] = []
        for item, si, dest in items:
            file_windows = windows.get(si.relative_path, [])
            blob = self._blob(item, si, files[si.relative_path], file_windows)
            if isinstance(blob, BlobFormatError):
                fallback.append((item, dest, blob))
                continue
            placements.append(plan_placement(item, si, blob, dest, files[si.relative_path], file_windows))
        if placements:
            stats = run_placements(self._engine, placements, _CollectingPlanner(), self.io_options, self._direct)
            self.bytes_read += stats.bytes_read
        return fallback

    def _blob(self, item: ReadItem, si: _StorageInfo, file: _C.File, file_windows: list) -> TensorBlobInfo | BlobFormatError:
        """The parsed header of the blob ``si`` names (remembered per object), from the header
        windows already read (recognised by layout where possible, else parsed)."""
        key = (si.relative_path, si.offset)
        blob = self._blobs.get(key)
        if blob is None:
            blob = self._known.match(item, si, file_windows)
            if blob is None:
                try:
                    blob = parse_blob(self._engine, file, file_windows, si)
                except BlobFormatError as error:
                    blob = error
            self._blobs[key] = blob
        return blob

    def stored_run(self, key: str) -> StoredRun | None:
        """Where ``key``'s bytes lie when the tensor is stored whole as one row-major run in its own
        dtype (one chunk, no stream transform, not quantized); else None. Reads the blob's header
        only."""
        info = self.metadata(key)
        if not isinstance(info, TensorInfo) or len(info.chunks) != 1 or info.dtype in _QUANTIZED_DTYPES:
            return None
        chunk = info.chunks[0]
        if chunk.offsets != (0,) * len(info.shape) or chunk.sizes != info.shape:
            return None
        index = MetadataIndex(key, chunk.offsets, 0)
        si = self._storage_info(index)
        if getattr(si, "transform_descriptors", None):
            return None
        item = ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0] * len(info.shape)),
                        storage_index=index, storage_offsets=torch.Size([0] * len(info.shape)),
                        lengths=torch.Size(info.shape))
        file = self._file(si.relative_path)
        file_windows: list = []
        if (si.relative_path, si.offset) not in self._blobs:
            windows = read_windows(self._engine, {si.relative_path: file}, {si.relative_path: [(item, si)]}, self._direct)
            file_windows = windows.get(si.relative_path, [])
            self.bytes_read += sum(len(w.data) for w in file_windows)
        blob = self._blob(item, si, file, file_windows)
        if isinstance(blob, BlobFormatError) or blob.dtype != info.dtype or tuple(blob.size) != info.shape:
            return None
        if tuple(blob.stride) != tuple(torch.empty(info.shape, device="meta").stride()):
            return None
        start = si.offset + blob.data_offset + blob.storage_offset * blob.itemsize
        local = self.files.local_path(si.relative_path)
        return StoredRun(local, start, blob.nbytes) if local is not None else None

    def _read_quantized(self, info: TensorInfo, box: Box) -> torch.Tensor:
        """Quantized tensors carry their scale and zero point in the blob's pickle: the chunk is
        read whole and ``torch.load``ed (``weights_only=True``, as stock reads it), then narrowed.
        A box spanning several chunks is refused (it would need one set of quantization
        parameters for chunks that each have their own)."""
        inside = [
            (i, c) for i, c in enumerate(info.chunks)
            if all(c0 <= b0 and b0 + n <= c0 + m for b0, n, c0, m in zip(box.starts, box.sizes, c.offsets, c.sizes))
        ]
        if not inside:
            raise NotImplementedError(
                f"'{info.key}' in checkpoint '{self.path}' is a quantized tensor ({info.dtype}) and the box "
                f"{box.starts}+{box.sizes} spans several stored chunks: read the chunks separately"
            )
        i, chunk = inside[0]
        si = self._storage_info(MetadataIndex(info.key, chunk.offsets, i))
        if getattr(si, "transform_descriptors", None):
            raise NotImplementedError(f"'{info.key}': quantized tensors saved through stream transforms")
        buffer = bytearray(si.length)
        if buffer:
            self._engine.read([(self._file(si.relative_path), si.offset, buffer, len(buffer))], self._direct)
        self.bytes_read += len(buffer)
        tensor = torch.load(io.BytesIO(buffer), map_location="cpu", weights_only=True)
        for d, (b0, n, c0) in enumerate(zip(box.starts, box.sizes, chunk.offsets)):
            tensor = tensor.narrow(d, b0 - c0, n)
        return tensor.clone() if tensor.numel() < _chunk_numel(chunk) else tensor

    def _stock_read(self, items: list[ReadItem], planner: _CollectingPlanner) -> None:
        """Stock ``FileSystemReader.read_data`` for what fastdcp does not parse itself."""
        if self._stock_reader is None:
            reader = self.files.stock_reader()
            reader.storage_data = self._storage_data
            self._stock_reader = reader
        self._stock_reader.read_data(LoadPlan(items), planner).wait()  # type: ignore[arg-type]


_QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _chunk_numel(chunk: ChunkInfo) -> int:
    return math.prod(chunk.sizes)


@renamed_arguments(READER_RENAMES, name="fastdcp.open")
def open_checkpoint(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    allow_unsafe_metadata: bool = False,
    direct_io: bool | None = None,
    io_threads: int | None = None,
    read_buffer_limit_bytes: int | None = None,
    extension_registry: Any = None,
) -> LazyCheckpoint:
    """Open the DCP checkpoint directory ``path`` (stock- or fastdcp-written) as a lazy,
    read-only mapping (``fastdcp.open``); see :mod:`fastdcp.load.lazy`.

    ``device``: where returned tensors live (read on the CPU, then ``.to(device)``).
    ``read_buffer_limit_bytes``: the most read-buffer memory a read holds besides its result (boxes that
    do not map 1:1 onto the result). ``allow_unsafe_metadata``, ``direct_io``, ``io_threads``: as
    for :class:`fastdcp.FastFileSystemReader`. ``extension_registry``: the stream-transform
    extensions items were saved through (stock ``FileSystemReader``'s ``_extension_registry``).
    """
    return LazyCheckpoint(path, device=device, allow_unsafe_metadata=allow_unsafe_metadata, direct_io=direct_io,
                          io_threads=io_threads, read_buffer_limit_bytes=read_buffer_limit_bytes,
                          extension_registry=extension_registry)
