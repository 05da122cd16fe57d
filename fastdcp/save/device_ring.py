"""Writing file images whose tensor bytes live on a device: device-to-host copies into a pinned
ring, overlapped with the engine's (O_DIRECT) writes, several files at a time.

A file with device segments is cut into aligned ranges of at most one slot; a slot mirrors its
range (device bytes keep their 4096 alignment, host segments copied beside them, gaps zeroed), so
the engine writes it as one aligned segment without a bounce copy. Ranges are taken round-robin
by file through a :class:`~fastdcp.io.staging_pipeline.StagingPipeline`: its fill step enqueues a
range's copies (a :class:`~fastdcp.io.copy_engine.Copier`; on a GPU a side stream ordered after the
tensors' current stream) ahead into every free slot; its drain step waits for a batch's copies
and writes up to ``batch`` ranges per engine call, ``writes_in_flight`` calls at once. A slot is
refilled only after the write of its range returned; ranges without device bytes take no slot.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..io.engine import DIRECT_ALIGN
from ..io.copy_engine import Copier, CudaCopier
from ..io.phases import span
from ..io.staging_pipeline import Filled, StagingPipeline

__all__ = ["RangeJob", "cut_ranges", "CudaCopier", "write_device_images", "interleave"]


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


def write_device_images(engine: Any, handles: list[Any], ranges: list[RangeJob], ring: StagingPipeline,
                        copier: Copier, batch: int = 1, writes_in_flight: int = 1) -> None:
    """Write every range (see the module docstring) through ``ring``'s slots: ranges round-robin by
    file, ``batch`` ranges per engine call, up to ``writes_in_flight`` engine calls at once (each on
    a thread of its own; the engine queues their tasks, so its threads go from one batch to the next
    without waiting for the slowest write of a batch), copies ahead into every free slot. Returns
    once every range is written; on an error, once no write or copy still uses a slot.
    Preconditions: ``1 <= batch`` and ``writes_in_flight * batch <= ring.slots``."""
    if batch < 1 or writes_in_flight < 1 or writes_in_flight * batch > ring.slots:
        raise ValueError(f"{writes_in_flight} writes in flight of a batch of {batch} ranges need "
                         f"{writes_in_flight * batch} slots, the ring has {ring.slots}")
    order = interleave(ranges)
    tokens: dict[int, Any] = {}  # copies issued into a slot, not yet waited for

    def issue(k: int, slot: torch.Tensor) -> None:
        job = order[k]
        copier.copy_many([(slot[offset - job.start : offset - job.start + source.numel()], source)
                          for offset, source in job.device])
        tokens[k] = copier.record()
        fill_host_bytes(slot, job)

    def write(items: list[Filled]) -> Any:
        jobs = []
        for k, slot, _ in items:
            job = order[k]
            segments = list(job.segments)
            if job.device:
                assert slot is not None
                with span("d2h_wait"):
                    copier.wait(tokens.pop(k))
                # The whole range from its slot: one aligned segment, no bounce copy. A file's
                # last range is written up to the next block (zeros in the slot; the writer
                # truncates the file to its size), so its tail needs no bounce copy either.
                stop = min(-(-job.end // DIRECT_ALIGN) * DIRECT_ALIGN, job.start + ring.slot_bytes)
                slot[job.end - job.start : stop - job.start].zero_()
                jobs.append((handles[job.file_index], job.start, stop, [(job.start, slot.data_ptr(), stop - job.start)]))
                continue
            jobs.append((handles[job.file_index], job.start, job.end, segments))
        return lambda: engine.write(jobs)

    def wait_for_copies() -> None:
        """After a failure: the copies still landing in slots, waited for before the ring's memory
        can go back to the pool (their own errors are not the one to raise)."""
        for token in tokens.values():
            try:
                copier.wait(token)
            except BaseException:  # noqa: BLE001
                pass

    ring.run(len(order), issue, write, uses_slot=lambda k: bool(order[k].device), issue_span="d2h_issue",
             batch=batch, drains_in_flight=writes_in_flight, drain_thread="fastdcp-ring-write", drain_span="write",
             on_error=wait_for_copies)
