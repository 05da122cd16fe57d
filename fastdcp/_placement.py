"""Placement of stored tensor bytes into destination tensors.

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
reshard's many thousands of runs never become Python objects. Staging memory is one buffer of at
most ``IoOptions.memory_budget_bytes``, reused for the whole load as two halves: the next batch is
read into one half while the previous one is placed from the other. A piece larger than a half is
split along its outer dimensions first.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from . import _C
from ._blob import BlobFormatError, TensorBlobInfo
from ._engine import IoOptions

__all__ = ["Piece", "Placement", "find_window", "plan_placement", "run_placements"]

# Raw elements for the native box copy (csrc/box_copy.hpp ScalarKind::kRawBytes): a byte copy.
_RAW = -1
_MAX_BOX_DIMS = 8
_STAGING_ALIGN = 64
# Runs at least this long are read straight into a destination, one request each.
_MIN_DIRECT_RUN_BYTES = 1024
# What one more request costs, in bytes one could read instead (a syscall vs. a page-cache copy).
_REQUEST_COST_BYTES = 4096
_REQUEST_COST_BYTES_DIRECT = 64 << 10  # an O_DIRECT request goes to the device


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


def _direct_run_table(piece: Piece) -> torch.Tensor:
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


def _staged_read_table(piece: Piece, staging_address: int, request_cost: int) -> torch.Tensor:
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


def _gpu_available() -> bool:
    """GPU destinations: True when the extension has the CUDA box-copy kernel and torch sees a GPU."""
    from ._gpu_placement import gpu_placement_available

    return gpu_placement_available()


def run_placements(engine: "_C.Engine", placements: list[Placement], planner: LoadPlanner,
                   options: IoOptions, direct: bool) -> dict[str, float]:
    """Read and place every piece, then commit every item. Returns counters for benchmarks:
    bytes needed vs. read, requests issued, staging use, and seconds per phase."""
    stats: dict[str, float] = {
        "bytes_needed": 0, "bytes_read": 0, "requests": 0, "window_pieces": 0, "runs_pieces": 0,
        "staged_pieces": 0, "staging_batches": 0, "max_staging_bytes": 0, "read_seconds": 0.0,
        "place_seconds": 0.0,
    }
    request_cost = _REQUEST_COST_BYTES_DIRECT if direct else _REQUEST_COST_BYTES
    half_budget = max(_STAGING_ALIGN, options.memory_budget_bytes // 2 // _STAGING_ALIGN * _STAGING_ALIGN)

    def read(tables: list[tuple]) -> None:
        started = time.perf_counter()
        engine.read_runs([(f, t.data_ptr(), t.shape[0]) for f, t in tables], direct)
        stats["read_seconds"] += time.perf_counter() - started
        for _, t in tables:
            stats["requests"] += t.shape[0]
            stats["bytes_read"] += int(t[:, 2].sum())

    def place(boxes: list[tuple]) -> None:
        if boxes:
            started = time.perf_counter()
            engine.box_copy(boxes)
            stats["place_seconds"] += time.perf_counter() - started

    boxes: list[tuple] = []
    run_tables: list[tuple] = []
    staged: list[Piece] = []
    # --- GPU destinations (fastdcp/_gpu_placement.py): pieces for CUDA tensors are collected and
    # placed by the CUDA kernel when the extension has it; otherwise they take the paths below
    # (Tensor.copy_ from host memory).
    gpu_pieces: list[Piece] = []
    use_gpu = any(p.dest.device.type == "cuda" for pl in placements for p in pl.pieces) and _gpu_available()
    # --- end GPU destinations
    for placement in placements:
        for piece in placement.pieces:
            stats["bytes_needed"] += math.prod(piece.shape) * piece.src_dtype.itemsize
            if use_gpu and piece.dest.device.type == "cuda":  # GPU destinations
                stats["window_pieces"] += int(piece.mode == "window")
                gpu_pieces.append(piece)
            elif piece.mode == "window":
                stats["window_pieces"] += 1
                assert piece.window_tensor is not None
                _copy_box(boxes, piece, piece.window_tensor.data_ptr() + piece.window_offset,
                          piece.window_tensor, piece.window_offset)
            elif piece.mode == "runs":
                stats["runs_pieces"] += 1
                run_tables.append((piece.file, _direct_run_table(piece)))
            else:
                staged.extend(_split_to_budget(piece, half_budget))
    if run_tables:
        read(run_tables)
    place(boxes)

    if staged:
        _run_staged(staged, half_budget, request_cost, stats, read, place)

    if gpu_pieces:  # GPU destinations: leaves their current streams ordered after the copies
        from ._gpu_placement import place_on_gpu

        place_on_gpu(gpu_pieces, half_budget, request_cost, stats, read)

    for placement in placements:
        planner.commit_tensor(placement.item, placement.target)
    return stats


def _run_staged(staged: list[Piece], half_budget: int, request_cost: int, stats: dict, read, place) -> None:
    """Stream staged pieces through a two-half staging buffer: batch i+1 is read (engine threads,
    GIL released) while batch i is placed."""
    staged.sort(key=lambda p: (p.file.path, p.span_start))
    batches: list[list[tuple[Piece, int]]] = [[]]
    used = 0
    for piece in staged:
        size = -(-piece.span_nbytes // _STAGING_ALIGN) * _STAGING_ALIGN
        if batches[-1] and used + size > half_budget:
            batches.append([])
            used = 0
        batches[-1].append((piece, used))
        used += size
    largest = max(sum(-(-p.span_nbytes // _STAGING_ALIGN) * _STAGING_ALIGN for p, _ in b) for b in batches)
    halves = 2 if len(batches) > 1 else 1
    staging = torch.empty(largest * halves, dtype=torch.uint8)
    stats["staging_batches"] = len(batches)
    stats["max_staging_bytes"] = staging.numel()
    stats["staged_pieces"] = len(staged)

    def read_batch(index: int) -> None:
        base = staging.data_ptr() + (index % halves) * largest
        read([(p.file, _staged_read_table(p, base + off, request_cost)) for p, off in batches[index]])

    def place_batch(index: int) -> None:
        half_offset = (index % halves) * largest
        copies: list[tuple] = []
        for p, off in batches[index]:
            _copy_box(copies, p, staging.data_ptr() + half_offset + off, staging, half_offset + off)
        place(copies)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdcp-read") as reader:
        pending = reader.submit(read_batch, 0)
        for index in range(len(batches)):
            pending.result()
            if index + 1 < len(batches):
                # The other half is free: its batch was placed in the previous iteration.
                pending = reader.submit(read_batch, index + 1)
            place_batch(index)
