"""The load's header pass: one parallel batch of merged reads covering the zip headers of every
blob a load needs (small blobs and byte items whole), and what those bytes say.

Each blob's headers are then recognised (:class:`KnownBlobs`: blobs fastdcp's writer laid out,
compared byte for byte against the layout it would give them) or parsed
(:func:`parse_blob`, :func:`fastdcp.format.blob_parse.parse_tensor_blob`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .._native import _C
from ..format.blob import DATA_ALIGN, ZIP_ALIGN, BlobFormatError, blob_template
from ..format.blob_parse import TensorBlobInfo, parse_tensor_blob

__all__ = ["Window", "KnownBlobs", "read_windows", "parse_blob", "window_bytes", "find_window"]

# Blobs up to this size are read whole in the header pass (their data comes along for free).
_WHOLE_BLOB_BYTES = 256 << 10

_HEAD_WINDOW = 8 << 10  # covers data.pkl and, in fastdcp blobs, the padded data/0 header

_TAIL_WINDOW = 4 << 10  # covers the central directory and end records

_MERGE_GAP = 64 << 10  # windows closer than this are read as one request

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
    modulo ``data_align`` (the writer's own blob template, :func:`fastdcp.format.blob.blob_template`),
    or None when there is none (a dtype torch.save cannot store)."""
    try:
        stride = tuple(torch.empty(size, dtype=dtype, device="meta").stride())
        t = blob_template(dtype, size, stride, phase, data_align, False)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return None
    return _KnownLayout(
        head=t.head_before_pad + b"Z" * t.pad,
        tail_before_id=t.tail_before_id,
        tail_after_id=t.tail_after_id,
        data_nbytes=t.data_nbytes,
        info=TensorBlobInfo(t.data_offset, t.data_nbytes, dtype, tuple(size), stride, 0),
    )


class KnownBlobs:
    """Recognises, without parsing, blobs written by fastdcp's writer.

    The checkpoint metadata says what each stored chunk is (dtype and sizes); fastdcp's writer
    lays out such a tensor's blob deterministically (:func:`fastdcp.format.blob.tensor_blob_layout`),
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

    def match(self, item: ReadItem, info: _StorageInfo, windows: list[Window]) -> TensorBlobInfo | None:
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
class Window:
    """Bytes [start, start+len(data)) of one file, as read in the header pass."""

    start: int
    data: memoryview
    tensor: torch.Tensor  # the uint8 tensor owning the memory (for addresses)

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start and end <= self.start + len(self.data)

    def slice(self, start: int, end: int) -> bytes:
        return bytes(self.data[start - self.start : end - self.start])


def window_bytes(windows: list[Window], start: int, end: int) -> bytes:
    window = find_window(windows, start, end)
    if window is None:
        raise AssertionError(f"bytes [{start}, {end}) were not read in the header pass")
    return window.slice(start, end)
def find_window(windows: list, start: int, end: int):
    """The header-pass window holding bytes [start, end) of a file, or None."""
    # Windows are sorted by start; the one that can contain `start` is the last starting at or before it.
    lo, hi = 0, len(windows)
    while lo < hi:
        mid = (lo + hi) // 2
        if windows[mid].start <= start:
            lo = mid + 1
        else:
            hi = mid
    if lo and windows[lo - 1].covers(start, end):
        return windows[lo - 1]
    return None


def read_windows(
    engine: _C.Engine,
    files: dict[str, _C.File],
    per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]],
    direct: bool,
) -> dict[str, list[Window]]:
    """The header pass: one parallel batch of merged reads covering every needed blob's
    headers (and whole small blobs and byte items)."""
    jobs = []
    windows: dict[str, list[Window]] = {}
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
            file_windows.append(Window(start, memoryview(buffer), tensor))
            if buffer:
                jobs.append((files[rel], start, tensor.data_ptr(), end - start))
        windows[rel] = file_windows
    engine.read(jobs, direct)
    return windows

def parse_blob(engine: _C.Engine, file: _C.File, windows: list[Window], info: _StorageInfo) -> TensorBlobInfo:
    """Parse the blob at ``info`` from the header-pass ``windows``, reading more of ``file`` only
    if its headers reach past them (unusual zip layouts)."""
    start, end = info.offset, info.offset + info.length
    head_end = min(end, start + _HEAD_WINDOW)
    tail_start = max(start, end - _TAIL_WINDOW)
    head = window_bytes(windows, start, head_end)
    tail = window_bytes(windows, tail_start, end)

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
