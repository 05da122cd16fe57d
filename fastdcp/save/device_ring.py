"""Writing file images whose tensor bytes live on a device: device-to-host copies into a pinned
ring, overlapped with the engine's (O_DIRECT) writes, several files at a time.

A file image (see ``fastdcp.save.file_image``) is sorted host segments (blob headers, CPU tensor bytes) plus
*device segments* (device tensor bytes at 4096-aligned file offsets). A file with device segments is
cut into aligned ranges of at most one ring slot; each slot mirrors its range (a byte at file
offset ``o`` sits at ``slot + o - range.start``), so device bytes keep their 4096 alignment in host
memory; the range's host segments (blob headers, CPU tensor bytes) are copied into the slot beside
them and its gaps zeroed, so the engine writes the whole range from the slot as one aligned
segment, with O_DIRECT and no bounce copy (a file's last range up to its next block, zeros the
writer truncates away).

The ranges of all files are taken round-robin (range 0 of every file, then range 1, ...) and written
in **batches** of up to ``batch`` ranges, one engine call per batch, so the engine's threads write
that many files at once (tmpfs and buffered filesystems serialise the writers of one file). For
batch ``b``:

1. the device pieces of its ranges are copied into free slots with asynchronous copies (a
   :class:`~fastdcp.io.copy_engine.Copier`, all pieces of a range in one ``copy_many``: on a GPU a
   side stream that first waits for the work already queued on the tensors' current stream), and a
   token is recorded per range;
2. the ranges after it are copied ahead into the slots still free;
3. the host waits for the batch's tokens and hands the batch to a write lane (a thread calling the
   engine); with ``writes_in_flight`` lanes the engine holds the next batch's tasks while it
   finishes the current one, so its threads never wait for the slowest write of a batch.

A slot is refilled only after the write of the range it held has returned. Ranges without device
bytes take no slot and wait for nothing. The ring is ``slots * slot_bytes`` bytes of pinned memory
leased from the process-wide pool (``fastdcp.io.pinned_pool``) for one save, so a new writer object
reuses the memory of the previous one.
"""

from __future__ import annotations

import ctypes
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..io.engine import DIRECT_ALIGN
from ..io.copy_engine import Copier, CudaCopier
from ..io.phases import span

__all__ = ["RangeJob", "cut_ranges", "CudaCopier", "DeviceRing", "write_device_images", "interleave"]


@dataclass
class RangeJob:
    """``[start, end)`` of one file: its host segments (clipped) and device pieces
    ``(file_offset, flat uint8 device tensor)``."""

    file_index: int
    start: int
    end: int
    segments: list[tuple] = field(default_factory=list)
    device: list[tuple[int, torch.Tensor]] = field(default_factory=list)


def _clip(segment: tuple, start: int, end: int) -> tuple | None:
    """The part of a host segment inside ``[start, end)``, or None."""
    offset = segment[0]
    length = len(segment[1]) if len(segment) == 2 else segment[2]
    lo, hi = max(offset, start), min(offset + length, end)
    if lo >= hi:
        return None
    if lo == offset and hi == offset + length:
        return segment
    if len(segment) == 2:
        return (lo, memoryview(segment[1])[lo - offset : hi - offset])
    return (lo, segment[1] + (lo - offset), hi - lo)


def cut_ranges(
    file_index: int, size: int, segments: list[tuple], device: list[tuple[int, torch.Tensor]], slot_bytes: int
) -> list[RangeJob]:
    """Cut the image ``[0, size)`` into ranges of at most ``slot_bytes`` (a multiple of
    DIRECT_ALIGN) starting on aligned offsets, each with its clipped host segments and device
    pieces. Preconditions: segments and device pieces sorted by offset, not overlapping."""
    if slot_bytes <= 0 or slot_bytes % DIRECT_ALIGN:
        raise ValueError(f"slot_bytes must be a positive multiple of {DIRECT_ALIGN}, got {slot_bytes}")
    ranges = []
    host_i = dev_i = 0
    for start in range(0, max(size, 1), slot_bytes):
        end = min(start + slot_bytes, size)
        job = RangeJob(file_index, start, end)
        # Segments can span range boundaries: keep the index at the first that may still overlap.
        while host_i < len(segments) and _end_of(segments[host_i]) <= start:
            host_i += 1
        i = host_i
        while i < len(segments) and segments[i][0] < end:
            piece = _clip(segments[i], start, end)
            if piece is not None:
                job.segments.append(piece)
            i += 1
        while dev_i < len(device) and device[dev_i][0] + device[dev_i][1].numel() <= start:
            dev_i += 1
        i = dev_i
        while i < len(device) and device[i][0] < end:
            offset, source = device[i]
            lo, hi = max(offset, start), min(offset + source.numel(), end)
            if lo < hi:
                job.device.append((lo, source[lo - offset : hi - offset]))
            i += 1
        ranges.append(job)
    return ranges


def _end_of(segment: tuple) -> int:
    return segment[0] + (len(segment[1]) if len(segment) == 2 else segment[2])


class DeviceRing:
    """``slots`` host slots of ``slot_bytes`` each over ``memory`` (flat uint8, at least
    ``slots * slot_bytes`` bytes, page-aligned: a pinned buffer leased for one save)."""

    def __init__(self, slot_bytes: int, slots: int, memory: torch.Tensor) -> None:
        if slots < 1 or memory.numel() < slot_bytes * slots:
            raise ValueError(f"a ring of {slots} slots of {slot_bytes} bytes needs that much memory, "
                             f"got {memory.numel()} bytes")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.memory = memory

    def slot(self, index: int) -> torch.Tensor:
        base = (index % self.slots) * self.slot_bytes
        return self.memory[base : base + self.slot_bytes]


def fill_host_bytes(slot: torch.Tensor, job: RangeJob) -> None:
    """Make ``slot`` hold the whole range ``job`` but its device pieces (which the copier fills):
    its host segments copied in at their offsets, every byte no segment or piece covers zeroed.
    Then the range is written from the slot as one aligned segment (O_DIRECT without a bounce
    copy). Precondition: the slot is at least ``job.end - job.start`` bytes."""
    covered: list[tuple[int, int]] = []
    view = slot.numpy()
    for segment in job.segments:
        at = segment[0] - job.start
        if len(segment) == 2:
            data = np.frombuffer(segment[1], dtype=np.uint8)
            view[at : at + data.size] = data
            covered.append((at, at + data.size))
        else:
            ctypes.memmove(slot.data_ptr() + at, segment[1], segment[2])
            covered.append((at, at + segment[2]))
    covered += [(offset - job.start, offset - job.start + source.numel()) for offset, source in job.device]
    covered.sort()
    at = 0
    for lo, hi in covered:
        if lo > at:
            view[at:lo] = 0
        at = max(at, hi)
    if at < job.end - job.start:
        view[at : job.end - job.start] = 0


def interleave(ranges: list[RangeJob]) -> list[RangeJob]:
    """``ranges`` round-robin by file: range 0 of every file (in order of first appearance), then
    range 1, ...; each file's ranges keep their order."""
    by_file: dict[int, list[RangeJob]] = {}
    for job in ranges:
        by_file.setdefault(job.file_index, []).append(job)
    out: list[RangeJob] = []
    queues = list(by_file.values())
    depth = max((len(q) for q in queues), default=0)
    for i in range(depth):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def write_device_images(engine: Any, handles: list[Any], ranges: list[RangeJob], ring: DeviceRing, copier: Copier,
                        batch: int = 1, writes_in_flight: int = 1) -> None:
    """Write every range (see the module docstring): ranges round-robin by file, ``batch`` ranges
    per engine call, up to ``writes_in_flight`` engine calls at once (each on a thread of its own;
    the engine queues their tasks, so its threads go from one batch to the next without waiting for
    the slowest write of a batch), copies ahead into every free slot. Returns once every range is
    written; on an error, once no write still reads a slot.
    Preconditions: ``1 <= batch`` and ``writes_in_flight * batch <= ring.slots``."""
    if batch < 1 or writes_in_flight < 1 or writes_in_flight * batch > ring.slots:
        raise ValueError(f"{writes_in_flight} writes in flight of a batch of {batch} ranges need "
                         f"{writes_in_flight * batch} slots, the ring has {ring.slots}")
    order = interleave(ranges)
    free = list(range(ring.slots))
    slot_of: dict[int, int] = {}
    tokens: dict[int, Any] = {}
    writing: deque[tuple[Any, range]] = deque()  # (future, the ranges it writes), oldest first
    lanes = ThreadPoolExecutor(max_workers=writes_in_flight, thread_name_prefix="fastdcp-ring-write") \
        if writes_in_flight > 1 else None
    issued = 0

    def issue(k: int) -> bool:
        job = order[k]
        if not job.device:
            return True
        if not free:
            return False
        slot_index = free.pop(0)
        slot = ring.slot(slot_index)
        slot_of[k] = slot_index
        copier.copy_many([(slot[offset - job.start : offset - job.start + source.numel()], source)
                          for offset, source in job.device])
        tokens[k] = copier.record()
        fill_host_bytes(slot, job)
        return True

    def retire_oldest() -> None:
        """Wait for the oldest write in flight and give its slots back."""
        future, written = writing.popleft()
        with span("write"):
            future.result()
        for k in written:
            if k in slot_of:
                free.append(slot_of.pop(k))

    def write(jobs: list[tuple], written: range) -> None:
        if lanes is None:
            with span("write"):
                engine.write(jobs)
            for k in written:
                if k in slot_of:
                    free.append(slot_of.pop(k))
            return
        writing.append((lanes.submit(engine.write, jobs), written))

    try:
        pos = 0
        while pos < len(order):
            end = min(pos + batch, len(order))
            # This batch first (waiting for the oldest writes to give slots back), then ahead.
            while issued < end:
                with span("d2h_issue"):
                    while issued < len(order) and issue(issued):
                        issued += 1
                if issued < end:
                    if not writing:
                        raise AssertionError("fastdcp: the device ring has fewer free slots than a batch")
                    retire_oldest()
            jobs = []
            for k in range(pos, end):
                job = order[k]
                segments = list(job.segments)
                if job.device:
                    with span("d2h_wait"):
                        copier.wait(tokens.pop(k))
                    # The whole range from its slot: one aligned segment, no bounce copy. A file's
                    # last range is written up to the next block (zeros in the slot; the writer
                    # truncates the file to its size), so its tail needs no bounce copy either.
                    stop = min(-(-job.end // DIRECT_ALIGN) * DIRECT_ALIGN, job.start + ring.slot_bytes)
                    slot = ring.slot(slot_of[k])
                    slot[job.end - job.start : stop - job.start].zero_()
                    jobs.append((handles[job.file_index], job.start, stop, [(job.start, slot.data_ptr(), stop - job.start)]))
                    continue
                jobs.append((handles[job.file_index], job.start, job.end, segments))
            write(jobs, range(pos, end))
            while len(writing) >= writes_in_flight:
                retire_oldest()
            pos = end
        while writing:
            retire_oldest()
    finally:
        if lanes is not None:
            for future, _ in writing:
                future.exception()  # wait: no write may still read a slot (the first error is raised above)
            lanes.shutdown(wait=True)
