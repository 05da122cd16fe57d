"""Writing file images whose tensor bytes live on a GPU: device-to-host copies into a reused pinned
ring, overlapped with the engine's (O_DIRECT) writes.

A file image (see ``fastdcp.save.file_image``) is sorted host segments (blob headers, CPU tensor bytes) plus
*device segments* (GPU tensor bytes at 4096-aligned file offsets). A file with device segments is
cut into aligned ranges of at most one ring slot; each slot mirrors its range (a byte at file
offset ``o`` sits at ``slot + o - range.start``), so device bytes keep their 4096 alignment in host
memory and the engine writes them without a bounce copy. For range ``k``:

1. its device pieces are copied into slot ``k % slots`` with ``non_blocking`` copies on a side
   stream (which first waits for the work already queued on the tensors' current stream), and an
   event is recorded;
2. the writer thread writes range ``k - (slots - 1)`` as soon as that range's event fires, while
   the copies of the ranges after it are still running.

A slot is refilled only after the write of the range it held has returned (the writes run on the
calling thread). Ranges without device bytes are written straight from their segments. The ring
is the writer's memory budget for this: ``slots * slot_bytes`` bytes of pinned memory, allocated on
first use and reused by every later save of the writer.

The copier is an object with ``copy(dst, src)``, ``record() -> token`` and ``wait(token)``; the
CUDA one is :class:`CudaCopier`. Tests drive the same pipeline with a CPU copier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..io.engine import DIRECT_ALIGN
from ..io.host_memory import HostSlab, allocate_slab

__all__ = ["RangeJob", "cut_ranges", "CudaCopier", "DeviceRing", "write_device_images"]


class Copier(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def record(self) -> Any: ...
    def wait(self, token: Any) -> None: ...


class CudaCopier:
    """Device-to-host copies on one side stream per device, ordered after the current streams."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self._streams.get(src.device)
        if stream is None:
            stream = torch.cuda.Stream(device=src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
            self._streams[src.device] = stream
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> list[torch.cuda.Event]:
        events = []
        for stream in self._streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def order_current_streams_after(self) -> None:
        """Make each device's current stream wait (on the device, not the host) for the copies
        enqueued so far: kernels queued next cannot change what those copies read."""
        for device, stream in self._streams.items():
            event = torch.cuda.Event()
            event.record(stream)
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self, token: list[torch.cuda.Event]) -> None:
        for event in token:
            event.synchronize()


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
    """``slots`` pinned host slots of ``slot_bytes`` each, reused across saves."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._slab: HostSlab | None = None

    def slot(self, index: int) -> torch.Tensor:
        if self._slab is None:
            self._slab = allocate_slab(self.slot_bytes * self.slots, prefer_shared=False)
        base = (index % self.slots) * self.slot_bytes
        return self._slab.tensor[base : base + self.slot_bytes]


def write_device_images(engine: Any, handles: list[Any], ranges: list[RangeJob], ring: DeviceRing, copier: Copier) -> None:
    """Write every range in order (see the module docstring), with copies up to ``slots - 1``
    device ranges ahead of the write. A range without device pieces waits for nothing."""
    tokens: dict[int, Any] = {}
    slots_of: dict[int, int] = {}
    next_slot = 0

    def issue(k: int) -> None:
        nonlocal next_slot
        job = ranges[k]
        if not job.device:
            return
        slot = ring.slot(next_slot)
        slots_of[k] = next_slot
        next_slot += 1
        for offset, source in job.device:
            at = offset - job.start
            copier.copy(slot[at : at + source.numel()], source)
        tokens[k] = copier.record()

    issued = 0
    for k, job in enumerate(ranges):
        # Every slot holds a range not yet written (k and the ranges after it): a slot comes back
        # only once the write of the range it held has returned (writes happen in order, below).
        while issued < len(ranges) and (issued <= k or len(slots_of) < ring.slots):
            issue(issued)
            issued += 1
        segments = list(job.segments)
        if job.device:
            copier.wait(tokens.pop(k))
            base = ring.slot(slots_of.pop(k)).data_ptr()
            segments += [(offset, base + offset - job.start, source.numel()) for offset, source in job.device]
            segments.sort(key=lambda s: s[0])
        engine.write([(handles[job.file_index], job.start, job.end, segments)])
