"""Placement of stored tensor bytes into GPU (CUDA or stand-in device) destination tensors.

:mod:`fastdcp.load.pieces` decides what to read; this module gets it onto the device through a
:class:`~fastdcp.io.staging_pipeline.StagingPipeline` of :data:`SLOTS` pinned slots. Fill (the
reader thread): a batch read into its slot. Drain: the batch's :class:`~fastdcp.io.boxes.Box`
descriptors packed behind its data, the slot uploaded with one ``non_blocking`` copy on a side
stream, then one ``_C.launch_box_copy`` for every box (pieces the kernel cannot take: ``copy_``
on the side stream); the slot is refilled once the event after its upload has completed. Stream
order: the side stream first waits for the current one; at the end the current stream waits for
the side stream and the host for the last batch, so any stream sees the bytes once the load returns.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable

import torch

from .._native import _C
from ..io.boxes import BOX_BYTES, MAX_BOX_DIMS, Box, box_kinds, pack_boxes
from ..io.copy_engine import is_standin_device_tensor
from ..io.phases import span
from ..io.pinned_pool import PinnedLease, lease_pinned
from ..io.staging_pipeline import Filled, StagingPipeline
from .pieces import STAGING_ALIGN, Piece, split_to_budget, staged_read_table
from .placement_stats import PlacementStats

__all__ = ["gpu_placement_available", "place_on_gpu", "SLOTS", "STANDIN"]

# The device key of stand-in device destinations (fastdcp.io.copy_engine).
STANDIN = "standin"

# Slots of pinned staging a load cycles through: reads of up to SLOTS - 1 batches run ahead of the
# batch being uploaded, so the storage queue never drains at a batch boundary.
SLOTS = 4


def gpu_placement_available() -> bool:
    """True when the extension has the CUDA kernel and torch sees a GPU."""
    return bool(_C.build_info().get("cuda")) and hasattr(_C, "launch_box_copy") and torch.cuda.is_available()


def _kernel_box(piece: Piece, src_address: int) -> Box | None:
    """The kernel descriptor placing ``piece`` from device memory at ``src_address``, or None when
    the piece must go through ``Tensor.copy_``."""
    dest = piece.dest
    if dest.is_conj() or dest.is_neg() or len(piece.shape) > MAX_BOX_DIMS:
        return None
    if any(s == 0 and n > 1 for s, n in zip(dest.stride(), dest.shape)):
        return None  # overlapping destination: let torch raise its own error
    kinds = box_kinds(piece.src_dtype, dest.dtype)
    if kinds is None:
        return None
    return Box(src_address, dest.data_ptr(), kinds[0], kinds[1], piece.src_dtype.itemsize, dest.element_size(),
               piece.shape, piece.src_stride, tuple(dest.stride()))


def _align(n: int, a: int = STAGING_ALIGN) -> int:
    return -(-n // a) * a


def _batch_bytes(data_bytes: int, num_boxes: int) -> int:
    """Bytes a batch occupies in a staging half: data, then descriptors, then the element prefix."""
    return _align(data_bytes) + num_boxes * BOX_BYTES + (num_boxes + 1) * 8


def _new_pinned(nbytes: int) -> PinnedLease:
    """Pinned staging for one load, leased from the process-wide pool (``fastdcp.io.pinned_pool``):
    later loads, and the save ring, reuse it without pinning again."""
    return lease_pinned(nbytes)


def _new_device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def place_on_gpu(pieces: list[Piece], half_budget: int, request_cost: int, stats: PlacementStats,
                 read: Callable[[list[tuple]], None]) -> None:
    """Read and place every piece (CUDA or stand-in device destinations); returns once every copy
    is complete on the device (any stream sees the bytes). ``read`` reads run tables as
    ``run_placements`` does."""
    by_device: dict[torch.device | str, list[Piece]] = defaultdict(list)
    for piece in pieces:
        by_device[STANDIN if is_standin_device_tensor(piece.dest) else piece.dest.device].append(piece)
    for device, device_pieces in by_device.items():
        ops = _CudaDevice(device) if device != STANDIN else _StandInDevice()
        with ops.context():
            _place_on_device(ops, device_pieces, half_budget, request_cost, stats, read)


class _CudaDevice:
    """The device operations of the pipeline on one CUDA device: streams, events, the kernel."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def context(self) -> Any:
        return torch.cuda.device(self.device)

    def streams(self) -> tuple[Any, Any]:
        """(current, side): the side stream first waits for the current one."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)  # pending work on the destinations comes first
        return current, side

    def buffer(self, nbytes: int, side: Any) -> torch.Tensor:
        with torch.cuda.stream(side):
            # Allocated on the side stream: the caching allocator reuses it only in that stream's order.
            return _new_device_buffer(nbytes, self.device)

    def upload(self, side: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Enqueue ``dst.copy_(src)`` on ``side``; returns an event recorded after it."""
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def launch(self, side: Any, table: int, prefix: int, num_boxes: int, total: int, any_conversion: bool) -> None:
        _C.launch_box_copy(table, prefix, num_boxes, total, side.cuda_stream, any_conversion=any_conversion)

    def fallback_copy(self, side: Any, dest: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(side):
            dest.copy_(src)

    def finish(self, current: Any, side: Any) -> None:
        """``current`` ordered after ``side``; the host waits for an event after its last work."""
        current.wait_stream(side)
        finished = torch.cuda.Event()
        finished.record(side)
        with span("h2d_wait"):
            finished.synchronize()

    def abort(self, side: Any) -> None:
        side.synchronize()


class _StandInStream:
    """An ordered queue of work run by a thread of its own: the stand-in device's side stream."""

    def __init__(self) -> None:
        import queue

        self._queue: Any = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fastdcp-standin-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            if self.error is None or isinstance(work, threading.Event):
                try:
                    work.set() if isinstance(work, threading.Event) else work()
                except BaseException as error:  # reported by the next wait
                    self.error = error

    def enqueue(self, work: Any) -> None:
        self._queue.put(work)

    def record(self) -> "_StandInEvent":
        event = threading.Event()
        self._queue.put(event)
        return _StandInEvent(event, self)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _StandInEvent:
    def __init__(self, event: threading.Event, stream: _StandInStream) -> None:
        self._event, self._stream = event, stream

    def synchronize(self) -> None:
        self._event.wait()
        if self._stream.error is not None:
            raise RuntimeError(f"fastdcp: a stand-in device copy failed: {self._stream.error}") from self._stream.error


class _StandInDevice:
    """The pipeline's device operations on the stand-in device (``fastdcp.io.copy_engine``): the
    side stream is a thread running uploads (memcpy), the kernel (the native box copy over the
    same packed descriptors, on engine threads) and fallback copies in order."""

    def context(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def streams(self) -> tuple[Any, Any]:
        return None, _StandInStream()  # the host's order is the "current stream": nothing pending

    def buffer(self, nbytes: int, side: Any) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def upload(self, side: _StandInStream, dst: torch.Tensor, src: torch.Tensor) -> Any:
        side.enqueue(lambda: dst.copy_(src))
        return side.record()

    def launch(self, side: _StandInStream, table: int, prefix: int, num_boxes: int, total: int,
               any_conversion: bool) -> None:
        side.enqueue(lambda: _standin_engine().box_copy_table(table, num_boxes))

    def fallback_copy(self, side: _StandInStream, dest: torch.Tensor, src: torch.Tensor) -> None:
        side.enqueue(lambda: dest.copy_(src))

    def finish(self, current: Any, side: _StandInStream) -> None:
        with span("h2d_wait"):
            side.record().synchronize()
        side.close()

    def abort(self, side: _StandInStream) -> None:
        side.close()


_standin_engines: dict[int, Any] = {}


def _standin_engine() -> Any:
    """The native engine that runs the stand-in device's box copies (one per process)."""
    import os

    engine = _standin_engines.get(os.getpid())
    if engine is None:
        from ..io.engine import default_copy_threads

        engine = _standin_engines[os.getpid()] = _C.Engine(max(2, default_copy_threads()), 1 << 20)
    return engine


def _place_on_device(ops: Any, pieces: list[Piece], half_budget: int, request_cost: int,
                     stats: PlacementStats, read: Callable[[list[tuple]], None]) -> None:
    # The reader's staging budget (two halves) is cut into SLOTS slots; a batch fills one. A window
    # piece too large for a slot (less room for its descriptor) becomes staged parts read from the file.
    slot_budget = max(2 * STAGING_ALIGN, 2 * half_budget // SLOTS // STAGING_ALIGN * STAGING_ALIGN)
    data_budget = max(STAGING_ALIGN, (slot_budget - BOX_BYTES - 16) // STAGING_ALIGN * STAGING_ALIGN)
    work: list[Piece] = []
    for piece in pieces:
        if piece.mode == "window" and piece.span_nbytes <= data_budget:
            work.append(piece)
        else:
            work.extend(split_to_budget(piece, data_budget))
    work.sort(key=lambda p: (p.mode != "window", p.file.path, p.span_start))

    # Batches of (piece, data offset within the slot).
    batches: list[list[tuple[Piece, int]]] = [[]]
    used = 0
    for piece in work:
        size = _align(piece.span_nbytes)
        if batches[-1] and _batch_bytes(used + size, len(batches[-1]) + 1) > slot_budget:
            batches.append([])
            used = 0
        batches[-1].append((piece, used))
        used += size
    largest = max(_align(_batch_bytes(sum(_align(p.span_nbytes) for p, _ in b), len(b))) for b in batches)
    slots = min(SLOTS, len(batches))

    current, side = ops.streams()
    with span("pin"):
        lease = _new_pinned(largest * slots)
    # On an error: no copy may still read the buffer when it goes back to the pool.
    with StagingPipeline.from_lease(lease, largest, slots, abort=lambda: ops.abort(side)) as pipeline:
        _run_batches(ops, len(work), batches, pipeline, side, current, stats, read, request_cost)


def _run_batches(ops: Any, pieces: int, batches: list, pipeline: StagingPipeline, side: Any, current: Any,
                 stats: PlacementStats, read: Callable[[list[tuple]], None], request_cost: int) -> None:
    """``batches`` through the pipeline's pinned slots (see the module docstring): the reader
    thread reads batch k into slot ``k % slots`` once the upload of batch ``k - slots`` from it has
    completed, while this thread packs, uploads and places the batches read before. Returns once
    every copy and kernel of the load is complete; on an error, once the reader thread has stopped
    (no read still writes into the slots)."""
    largest, slots = pipeline.slot_bytes, pipeline.slots
    device_staging = ops.buffer(largest, side)
    stats.gpu_pieces += pieces
    stats.gpu_batches += len(batches)
    stats.gpu_staging_bytes = max(stats.gpu_staging_bytes, largest * slots)
    stats.gpu_slots = slots

    def fill_slot(index: int, slot: torch.Tensor) -> int:
        """Read batch ``index`` into ``slot`` (reader thread); returns its data bytes."""
        base = slot.data_ptr()
        tables = []
        data_bytes = 0
        for piece, offset in batches[index]:
            data_bytes = max(data_bytes, offset + piece.span_nbytes)
            if piece.mode == "window":
                assert piece.window_tensor is not None
                window = piece.window_tensor[piece.window_offset : piece.window_offset + piece.span_nbytes]
                slot[offset : offset + piece.span_nbytes].copy_(window)
            else:
                tables.append((piece.file, staged_read_table(piece, base + offset, request_cost)))
        if tables:
            with span("read"):
                read(tables)
        return data_bytes

    def upload_and_place(items: list[Filled]) -> None:
        ((index, slot, data_bytes),) = items
        batch = batches[index]
        base = slot.data_ptr()
        device_base = device_staging.data_ptr()
        boxes: list[Box] = []
        fallbacks: list[tuple[Piece, int]] = []
        for piece, offset in batch:
            box = _kernel_box(piece, device_base + offset)
            if box is None:
                fallbacks.append((piece, offset))
            else:
                boxes.append(box)
        table_offset = _align(data_bytes)
        prefix_offset = table_offset + len(boxes) * BOX_BYTES
        upload_bytes = prefix_offset + (len(boxes) + 1) * 8
        total = 0
        if boxes:
            packed = pack_boxes(boxes)
            slot[table_offset:prefix_offset].copy_(torch.frombuffer(packed, dtype=torch.uint8))
            total = _C.prepare_boxes(base + table_offset, len(boxes), base + prefix_offset)
        else:
            upload_bytes = data_bytes

        with span("h2d_issue"):
            uploaded = ops.upload(side, device_staging[:upload_bytes], slot[:upload_bytes])
            pipeline.release(index, lambda: _wait_upload(uploaded))  # refilled once the upload completed
            if boxes and total:
                ops.launch(side, device_base + table_offset, device_base + prefix_offset, len(boxes), total,
                           any(b.src_kind != b.dst_kind for b in boxes))
            for piece, offset in fallbacks:
                raw = device_staging[offset : offset + piece.span_nbytes].view(piece.src_dtype)
                ops.fallback_copy(side, piece.dest, raw.as_strided(piece.shape, piece.src_stride,
                                                                   raw.storage_offset()))
        stats.gpu_kernel_boxes += len(boxes)
        stats.gpu_fallback_copies += len(fallbacks)

    pipeline.run(len(batches), fill_slot, upload_and_place, fill_thread="fastdcp-gpu-read",
                 fill_wait_span="read_wait")

    # Ready on any stream: the load returns once its last upload and kernel are complete, so that
    # every stream (another compute stream, NCCL's) and the host see the loaded bytes, as after
    # stock's load, with no wait of their own (docs/GUARANTEES.md). This waits for the last batch;
    # the earlier uploads were waited for by the reader before it refilled their slots. `current`
    # is also ordered after the copies, for work queued on it before this returns. Every copy from
    # the slots has completed then: the caller gives them back to the pool. `device_staging` was
    # allocated on `side`, so the caching allocator reuses it in stream order.
    ops.finish(current, side)


def _wait_upload(uploaded: Any) -> None:
    with span("h2d_wait"):
        uploaded.synchronize()  # the previous upload from this slot has finished
