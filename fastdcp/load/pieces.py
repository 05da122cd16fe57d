"""What a load reads: the pieces of stored tensors a ReadItem covers, and their run tables.

A ReadItem asks for a box (``storage_offsets`` + ``lengths``) of a stored tensor. Given the stored
tensor's layout (parsed from its blob) the box covers one byte span of the file, made of *runs*:
the box's innermost contiguous element ranges (a Shard(0)->Shard(1) reshard of a row-major matrix
gives one run per row). Each piece of work (:class:`Piece`) is that span plus where it goes:

- ``window``: the span already sits in memory from the header pass (small blobs): copy only;
- ``runs``: every run maps 1:1 onto a contiguous range of a same-dtype destination: each run is
  read straight into the destination (a dense box is the one-run case), no staging, no copy;
- ``staged``: only the runs are read (runs separated by small gaps are merged into one request
  when that is cheaper than another request) into staging memory at their offsets within the span,
  then the box is copied out (strided; dtype conversion by torch).

Run tables are built with vectorised torch ops and handed to the engine as int64 tables, so a
reshard's many thousands of runs never become Python objects. Carrying the pieces out is
:mod:`fastdcp.load.placement` (CPU destinations) and :mod:`fastdcp.load.gpu_placement`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from .._native import _C
from ..format.blob import BlobFormatError
from ..format.blob_parse import TensorBlobInfo
from .header_pass import find_window

__all__ = [
    "Piece",
    "Placement",
    "plan_placement",
    "split_to_budget",
    "staged_read_table",
    "direct_run_table",
    "STAGING_ALIGN",
    "REQUEST_COST_BYTES",
    "REQUEST_COST_BYTES_DIRECT",
]

STAGING_ALIGN = 64

# Runs at least this long are read straight into a destination, one request each.
_MIN_DIRECT_RUN_BYTES = 1024

# What one more request costs, in bytes one could read instead (a syscall vs. a page-cache copy).
REQUEST_COST_BYTES = 4096

REQUEST_COST_BYTES_DIRECT = 64 << 10  # an O_DIRECT request goes to the device


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
    mode: str  # "window" | "runs" | "staged"
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
    def where() -> str:  # for error messages only: formatting it costs more than the checks
        return f"{file.path} (blob at offset {info.offset}, item {item.storage_index.fqn})"

    ndim = len(blob.size)
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if len(offsets) != ndim or len(lengths) != ndim:
        raise BlobFormatError(f"{where()}: request has {len(lengths)} dims, stored tensor has {ndim}")
    for d, (o, n, size) in enumerate(zip(offsets, lengths, blob.size)):
        if o < 0 or n < 0 or o + n > size:
            raise BlobFormatError(f"{where()}: request [{o}, {o + n}) on dim {d} is outside the stored size {size}")
    if tuple(target.shape) != lengths:
        raise AssertionError(f"req {item.storage_index} mismatch sizes {tuple(target.shape)} vs {lengths}")
    placement = Placement(item, target)
    if math.prod(lengths) == 0:
        return placement
    itemsize = blob.dtype.itemsize
    first = blob.storage_offset + sum(o * s for o, s in zip(offsets, blob.stride))
    last = first + sum((n - 1) * s for n, s in zip(lengths, blob.stride))
    if (last + 1) * itemsize > blob.storage_nbytes:
        raise BlobFormatError(
            f"{where()}: the requested elements end past the stored data ({blob.storage_nbytes} bytes)"
        )
    span_start = info.offset + blob.data_offset + first * itemsize
    span_nbytes = (last - first + 1) * itemsize
    _add_pieces(placement, file, span_start, span_nbytes, blob.dtype, lengths, tuple(blob.stride), target, windows)
    return placement


def _add_pieces(placement: Placement, file, span_start: int, span_nbytes: int, dtype: torch.dtype,
                shape: tuple[int, ...], stride: tuple[int, ...], dest: torch.Tensor, windows: list) -> None:
    window = find_window(windows, span_start, span_start + span_nbytes)
    if window is not None:
        placement.pieces.append(Piece(file, span_start, span_nbytes, dtype, shape, stride, dest, "window",
                                      window.tensor, span_start - window.start))
        return
    runs_mode = (
        dest.device.type == "cpu"
        and dest.dtype == dtype
        and not dest.is_conj()
        and not dest.is_neg()
        and _inner_run_matches(shape, stride, tuple(dest.stride()))
        and (_run_elements(shape, stride) * dtype.itemsize >= _MIN_DIRECT_RUN_BYTES or _box_is_dense(shape, stride))
    )
    placement.pieces.append(Piece(file, span_start, span_nbytes, dtype, shape, stride, dest,
                                  "runs" if runs_mode else "staged"))


def _run_split(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Index k such that dims k.. form the innermost contiguous run (size-1 dims never break it)."""
    run, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    return k


def _run_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    return math.prod(shape[_run_split(shape, stride):])


def _inner_run_matches(shape: tuple[int, ...], src_stride: tuple[int, ...], dst_stride: tuple[int, ...]) -> bool:
    """True when the destination holds each source run as one contiguous range too."""
    k = _run_split(shape, src_stride)
    expected = 1
    for d in range(len(shape) - 1, k - 1, -1):
        if shape[d] != 1 and dst_stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def _outer_offsets(shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """Element offsets of every index of the given (outer) dims, row-major, as an int64 tensor."""
    offsets = torch.zeros(1, dtype=torch.int64)
    for n, s in zip(shape, stride):
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return offsets


def direct_run_table(piece: Piece) -> torch.Tensor:
    """(file_offset, dest_address, nbytes) rows reading each run straight into the destination."""
    k = _run_split(piece.shape, piece.src_stride)
    itemsize = piece.src_dtype.itemsize
    run_bytes = math.prod(piece.shape[k:]) * itemsize
    src = _outer_offsets(piece.shape[:k], piece.src_stride[:k])
    dst = _outer_offsets(piece.shape[:k], tuple(piece.dest.stride())[:k])
    table = torch.empty((src.numel(), 3), dtype=torch.int64)
    table[:, 0] = src * itemsize + piece.span_start
    table[:, 1] = dst * itemsize + piece.dest.data_ptr()
    table[:, 2] = run_bytes
    return table


def staged_read_table(piece: Piece, staging_address: int, request_cost: int) -> torch.Tensor:
    """(file_offset, staging_address, nbytes) rows covering the piece's runs, each landing at its
    offset within the span; runs are merged across a gap when reading the gap costs less than a
    request, and (for long runs) adds at most 5% to the bytes read."""
    k = _run_split(piece.shape, piece.src_stride)
    itemsize = piece.src_dtype.itemsize
    run_bytes = math.prod(piece.shape[k:]) * itemsize
    starts = torch.sort(_outer_offsets(piece.shape[:k], piece.src_stride[:k]) * itemsize).values
    max_gap = request_cost if run_bytes < request_cost else min(request_cost, run_bytes // 20)
    if starts.numel() > 1:
        gaps = starts[1:] - (starts[:-1] + run_bytes)
        new_group = gaps > max_gap
        first = torch.cat([torch.ones(1, dtype=torch.bool), new_group])
        last = torch.cat([new_group, torch.ones(1, dtype=torch.bool)])
        group_starts, group_ends = starts[first], starts[last] + run_bytes
    else:
        group_starts, group_ends = starts, starts + run_bytes
    table = torch.empty((group_starts.numel(), 3), dtype=torch.int64)
    table[:, 0] = group_starts + piece.span_start
    table[:, 1] = group_starts + staging_address
    table[:, 2] = group_ends - group_starts
    return table


def split_to_budget(piece: Piece, budget: int) -> list[Piece]:
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
            parts.extend(split_to_budget(part, budget))
        return parts
    return [piece]  # a single element larger than the budget cannot be split further
