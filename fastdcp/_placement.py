"""Placement of stored tensor bytes into destination tensors.

A ReadItem asks for a box (``storage_offsets`` + ``lengths``) of a stored tensor. Given the stored
tensor's layout (parsed from its blob) the box covers one byte span of the file. Each piece of work
(:class:`Piece`) is that span plus where it goes:

- ``window``: the span already sits in memory from the header pass (small blobs): copy only;
- ``direct``: the span maps 1:1 onto a contiguous destination of the same dtype: read into it;
- ``staged``: read into staging memory, then copy the box (strided; dtype conversion by torch).

Staging memory is bounded by ``IoOptions.memory_budget_bytes``: pieces are read in batches that fit,
and a piece larger than the budget is first split along its outer dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from . import _C
from ._blob import BlobFormatError, TensorBlobInfo
from ._engine import IoOptions

__all__ = ["Piece", "Placement", "plan_placement", "run_placements"]

# Raw elements for the native box copy (csrc/box_copy.hpp ScalarKind::kRawBytes): a byte copy.
_RAW = -1
_MAX_BOX_DIMS = 8
_STAGING_ALIGN = 64


@dataclass
class Piece:
    """One box of one stored tensor: the file span holding it and the destination view."""

    file: "_C.File"
    span_start: int  # absolute file offset of the box's first element
    span_nbytes: int
    src_dtype: torch.dtype
    shape: tuple[int, ...]
    src_stride: tuple[int, ...]  # elements, relative to the span start
    dest: torch.Tensor
    mode: str  # "window" | "direct" | "staged"
    window_tensor: torch.Tensor | None = None  # for "window": memory holding the span
    window_offset: int = 0


@dataclass
class Placement:
    item: ReadItem
    target: torch.Tensor
    pieces: list[Piece] = field(default_factory=list)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _box_is_dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the box's elements are contiguous in row-major order (size-1 dims ignored)."""
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True


def plan_placement(item: ReadItem, info: _StorageInfo, blob: TensorBlobInfo, target: torch.Tensor,
                   file: "_C.File", windows: list) -> Placement:
    """Describe how ``item`` gets from the file into ``target`` (validating the request against the
    stored tensor, since metadata and files may disagree in a damaged checkpoint)."""
    where = f"{file.path} (blob at offset {info.offset}, item {item.storage_index.fqn})"
    ndim = len(blob.size)
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if len(offsets) != ndim or len(lengths) != ndim:
        raise BlobFormatError(f"{where}: request has {len(lengths)} dims, stored tensor has {ndim}")
    for d, (o, n, size) in enumerate(zip(offsets, lengths, blob.size)):
        if o < 0 or n < 0 or o + n > size:
            raise BlobFormatError(f"{where}: request [{o}, {o + n}) on dim {d} is outside the stored size {size}")
    if tuple(target.shape) != lengths:
        raise AssertionError(f"req {item.storage_index} mismatch sizes {tuple(target.shape)} vs {lengths}")
    placement = Placement(item, target)
    if math.prod(lengths) == 0:
        return placement
    itemsize = blob.dtype.itemsize
    first = blob.storage_offset + sum(o * s for o, s in zip(offsets, blob.stride))
    last = first + sum((n - 1) * s for n, s in zip(lengths, blob.stride))
    if (last + 1) * itemsize > blob.storage_nbytes:
        raise BlobFormatError(f"{where}: the requested elements end past the stored data ({blob.storage_nbytes} bytes)")
    span_start = info.offset + blob.data_offset + first * itemsize
    span_nbytes = (last - first + 1) * itemsize
    _add_pieces(placement, file, span_start, span_nbytes, blob.dtype, lengths, tuple(blob.stride), target, windows)
    return placement


def _add_pieces(placement: Placement, file, span_start: int, span_nbytes: int, dtype: torch.dtype,
                shape: tuple[int, ...], stride: tuple[int, ...], dest: torch.Tensor, windows: list) -> None:
    window = _find_window(windows, span_start, span_start + span_nbytes)
    if window is not None:
        placement.pieces.append(Piece(file, span_start, span_nbytes, dtype, shape, stride, dest, "window",
                                      window.tensor, span_start - window.start))
        return
    direct = (
        dest.device.type == "cpu"
        and dest.dtype == dtype
        and dest.is_contiguous()
        and not dest.is_conj()
        and not dest.is_neg()
        and _box_is_dense(shape, stride)
    )
    placement.pieces.append(Piece(file, span_start, span_nbytes, dtype, shape, stride, dest,
                                  "direct" if direct else "staged"))


def _find_window(windows: list, start: int, end: int):
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


def _split_to_budget(piece: Piece, budget: int) -> list[Piece]:
    """Split a staged piece along its outermost splittable dimension until every part fits."""
    if piece.span_nbytes <= budget:
        return [piece]
    itemsize = piece.src_dtype.itemsize
    for d, n in enumerate(piece.shape):
        if n <= 1:
            continue
        row_bytes = piece.span_nbytes // n if n else piece.span_nbytes
        rows = max(1, min(n, budget // max(row_bytes, 1)))
        parts: list[Piece] = []
        for begin in range(0, n, rows):
            count = min(rows, n - begin)
            shape = piece.shape[:d] + (count,) + piece.shape[d + 1 :]
            first = begin * piece.src_stride[d]
            last = first + sum((m - 1) * s for m, s in zip(shape, piece.src_stride))
            part = Piece(piece.file, piece.span_start + first * itemsize, (last - first + 1) * itemsize,
                         piece.src_dtype, shape, piece.src_stride, piece.dest.narrow(d, begin, count), "staged")
            parts.extend(_split_to_budget(part, budget))
        return parts
    return [piece]  # a single element larger than the budget cannot be split further


def _copy_box(boxes: list[tuple], piece: Piece, src_address: int, src_holder: torch.Tensor, src_offset: int) -> None:
    """Queue a native box copy (same dtype, CPU destination), or copy now with ``Tensor.copy_``.

    Dtype conversions use torch's own ``copy_``, exactly what the stock reader does: torch's
    results for NaN payloads differ between its vectorised and scalar paths, so only torch itself
    reproduces stock bit for bit."""
    dest = piece.dest
    native = (
        dest.device.type == "cpu"
        and dest.dtype == piece.src_dtype
        and not dest.is_conj()
        and not dest.is_neg()
        and len(piece.shape) <= _MAX_BOX_DIMS
    )
    if native:
        size = piece.src_dtype.itemsize
        boxes.append((src_address, dest.data_ptr(), _RAW, _RAW, size, size, piece.shape, piece.src_stride, dest.stride()))
        return
    raw = src_holder[src_offset : src_offset + piece.span_nbytes]
    if src_address % piece.src_dtype.itemsize:
        raw = raw.clone()  # .view(dtype) needs element-aligned memory
    typed = raw.view(piece.src_dtype)
    dest.copy_(typed.as_strided(piece.shape, piece.src_stride, typed.storage_offset()))


def run_placements(engine: "_C.Engine", placements: list[Placement], planner: LoadPlanner,
                   options: IoOptions, direct: bool) -> dict[str, int]:
    """Read and place every piece, then commit every item. Returns counters for benchmarks."""
    stats = {"bytes_needed": 0, "bytes_read_direct": 0, "bytes_read_staged": 0, "window_pieces": 0,
             "direct_pieces": 0, "staged_pieces": 0, "staging_batches": 0, "max_staging_bytes": 0}
    boxes: list[tuple] = []
    direct_jobs = []
    staged: list[Piece] = []
    for placement in placements:
        for piece in placement.pieces:
            stats["bytes_needed"] += math.prod(piece.shape) * piece.src_dtype.itemsize
            if piece.mode == "window":
                stats["window_pieces"] += 1
                assert piece.window_tensor is not None
                _copy_box(boxes, piece, piece.window_tensor.data_ptr() + piece.window_offset,
                          piece.window_tensor, piece.window_offset)
            elif piece.mode == "direct":
                stats["direct_pieces"] += 1
                stats["bytes_read_direct"] += piece.span_nbytes
                direct_jobs.append((piece.file, piece.span_start, piece.dest.data_ptr(), piece.span_nbytes))
            else:
                staged.extend(_split_to_budget(piece, options.memory_budget_bytes))
    if direct_jobs:
        engine.read(direct_jobs, direct)
    if boxes:
        engine.box_copy(boxes)
        boxes = []

    budget = options.memory_budget_bytes
    staged.sort(key=lambda p: (p.file.path, p.span_start))
    batch: list[tuple[Piece, int]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        staging = torch.empty(batch_bytes, dtype=torch.uint8)
        stats["staging_batches"] += 1
        stats["max_staging_bytes"] = max(stats["max_staging_bytes"], batch_bytes)
        base = staging.data_ptr()
        engine.read([(p.file, p.span_start, base + off, p.span_nbytes) for p, off in batch], direct)
        copies: list[tuple] = []
        for p, off in batch:
            _copy_box(copies, p, base + off, staging, off)
        if copies:
            engine.box_copy(copies)
        batch, batch_bytes = [], 0

    for piece in staged:
        stats["staged_pieces"] += 1
        stats["bytes_read_staged"] += piece.span_nbytes
        size = -(-piece.span_nbytes // _STAGING_ALIGN) * _STAGING_ALIGN
        if batch and batch_bytes + size > budget:
            flush()
        batch.append((piece, batch_bytes))
        batch_bytes += size
    flush()

    for placement in placements:
        planner.commit_tensor(placement.item, placement.target)
    return stats
