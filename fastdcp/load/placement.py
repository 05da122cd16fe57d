"""Carrying out a load's pieces (:mod:`fastdcp.load.pieces`): reads, copies, and the commit.

Pieces read straight into their destination go out as one batch of run tables. The others are
read into staging memory: one buffer of at most ``IoOptions.read_buffer_limit_bytes``, reused for the
whole load as two halves (a :class:`~fastdcp.io.staging_pipeline.StagingPipeline` of two slots), so
the next batch is read into one half while the previous one is placed from the other (a piece
larger than a half is split along its outer dimensions first) by the native batched box copy.
Pieces whose destination is a GPU tensor go to :mod:`fastdcp.load.gpu_placement`. Every item is
committed to the planner at the end.
"""

from __future__ import annotations

import math
import time

import torch
from torch.distributed.checkpoint.planner import LoadPlanner

from .._native import _C
from ..io.boxes import MAX_BOX_DIMS, RAW, Box
from ..io.engine import IoOptions
from ..io.copy_engine import is_standin_device_tensor
from ..io.cuda_build import warn_if_slow_gpu_path
from ..io.staging_pipeline import Filled, StagingPipeline
from . import gpu_placement
from .placement_stats import PlacementStats
from .pieces import (
    REQUEST_COST_BYTES,
    REQUEST_COST_BYTES_DIRECT,
    STAGING_ALIGN,
    Piece,
    Placement,
    direct_run_table,
    split_to_budget,
    staged_read_table,
)

__all__ = ["run_placements"]


def _copy_box(boxes: list[Box], piece: Piece, src_address: int, src_holder: torch.Tensor, src_offset: int) -> None:
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
        and len(piece.shape) <= MAX_BOX_DIMS
    )
    if native:
        size = piece.src_dtype.itemsize
        boxes.append(Box(src_address, dest.data_ptr(), RAW, RAW, size, size, piece.shape, piece.src_stride, dest.stride()))
        return
    raw = src_holder[src_offset : src_offset + piece.span_nbytes]
    if src_address % piece.src_dtype.itemsize:
        raw = raw.clone()  # .view(dtype) needs element-aligned memory
    typed = raw.view(piece.src_dtype)
    dest.copy_(typed.as_strided(piece.shape, piece.src_stride, typed.storage_offset()))


def run_placements(engine: "_C.Engine", placements: list[Placement], planner: LoadPlanner,
                   options: IoOptions, direct: bool) -> PlacementStats:
    """Read and place every piece, then commit every item. Returns counters for benchmarks:
    bytes needed vs. read, requests issued, staging use, and seconds per phase."""
    stats = PlacementStats()
    request_cost = REQUEST_COST_BYTES_DIRECT if direct else REQUEST_COST_BYTES
    half_budget = max(STAGING_ALIGN, options.read_buffer_limit_bytes // 2 // STAGING_ALIGN * STAGING_ALIGN)

    def read(tables: list[tuple]) -> None:
        started = time.perf_counter()
        engine.read_runs([(f, t.data_ptr(), t.shape[0]) for f, t in tables], direct)
        stats.read_seconds += time.perf_counter() - started
        for _, t in tables:
            stats.requests += t.shape[0]
            stats.bytes_read += int(t[:, 2].sum())

    def place(boxes: list[Box]) -> None:
        if boxes:
            started = time.perf_counter()
            engine.box_copy(boxes)
            stats.place_seconds += time.perf_counter() - started

    boxes: list[Box] = []
    run_tables: list[tuple] = []
    staged: list[Piece] = []
    # --- Device destinations (fastdcp/load/gpu_placement.py): pieces for CUDA tensors are collected
    # and placed by the CUDA kernel when the extension has it (otherwise they take the paths below,
    # Tensor.copy_ from host memory); pieces for stand-in device tensors (fastdcp/io/copy_engine.py)
    # go through the same pipeline on the stand-in device.
    gpu_pieces: list[Piece] = []
    use_gpu = gpu_placement.gpu_placement_available()
    slow_cuda = False  # a CUDA destination without the CUDA placement (an extension built without CUDA)

    def on_device(dest: torch.Tensor) -> bool:
        nonlocal slow_cuda
        if dest.device.type == "cuda":
            slow_cuda = slow_cuda or not use_gpu
            return use_gpu
        return is_standin_device_tensor(dest)
    # --- end device destinations
    for placement in placements:
        for piece in placement.pieces:
            stats.bytes_needed += math.prod(piece.shape) * piece.src_dtype.itemsize
            if on_device(piece.dest):  # device destinations
                stats.window_pieces += int(piece.mode == "window")
                gpu_pieces.append(piece)
            elif piece.mode == "window":
                stats.window_pieces += 1
                assert piece.window_tensor is not None
                _copy_box(boxes, piece, piece.window_tensor.data_ptr() + piece.window_offset,
                          piece.window_tensor, piece.window_offset)
            elif piece.mode == "runs":
                stats.runs_pieces += 1
                run_tables.append((piece.file, direct_run_table(piece)))
            else:
                staged.extend(split_to_budget(piece, half_budget))
    warn_if_slow_gpu_path(slow_cuda)
    if run_tables:
        read(run_tables)
    place(boxes)

    if staged:
        _run_staged(staged, half_budget, request_cost, stats, read, place)

    if gpu_pieces:  # GPU destinations: leaves their current streams ordered after the copies
        gpu_placement.place_on_gpu(gpu_pieces, half_budget, request_cost, stats, read)

    for placement in placements:
        planner.commit_tensor(placement.item, placement.target)
    return stats


def _run_staged(staged: list[Piece], half_budget: int, request_cost: int, stats: PlacementStats, read,
                place) -> None:
    """Stream staged pieces through a two-half staging buffer (``fastdcp.io.staging_pipeline``):
    batch i+1 is read (reader thread, GIL released) while batch i is placed."""
    staged.sort(key=lambda p: (p.file.path, p.span_start))
    batches: list[list[tuple[Piece, int]]] = [[]]
    used = 0
    for piece in staged:
        size = -(-piece.span_nbytes // STAGING_ALIGN) * STAGING_ALIGN
        if batches[-1] and used + size > half_budget:
            batches.append([])
            used = 0
        batches[-1].append((piece, used))
        used += size
    largest = max(sum(-(-p.span_nbytes // STAGING_ALIGN) * STAGING_ALIGN for p, _ in b) for b in batches)
    halves = 2 if len(batches) > 1 else 1
    staging = torch.empty(largest * halves, dtype=torch.uint8)
    stats.staging_batches = len(batches)
    stats.max_staging_bytes = staging.numel()
    stats.staged_pieces = len(staged)

    def read_batch(index: int, half: torch.Tensor) -> None:
        base = half.data_ptr()
        read([(p.file, staged_read_table(p, base + off, request_cost)) for p, off in batches[index]])

    def place_batch(items: list[Filled]) -> None:
        ((index, half, _),) = items
        half_offset = half.data_ptr() - staging.data_ptr()
        copies: list[Box] = []
        for p, off in batches[index]:
            _copy_box(copies, p, half.data_ptr() + off, staging, half_offset + off)
        place(copies)

    StagingPipeline(largest, halves, staging).run(len(batches), read_batch, place_batch, fill_thread="fastdcp-read")
