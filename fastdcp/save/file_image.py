"""One data file of a save, planned as an image: sorted segments (zip headers, tensor bytes, byte
items) at their file offsets, and the write results to report for it.

Tensor bytes of 64 KiB or more sit at 4096-aligned offsets (written with O_DIRECT straight from
aligned memory); smaller ones are packed at torch's 64-byte alignment. The engine writes the
whole image in a few large requests however many tensors it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .._native import _C
from ..format.blob import DATA_ALIGN, ZIP_ALIGN, tensor_blob_layout
from ..format.metadata import CHECKSUM_ATTRIBUTE

__all__ = ["FilePlan", "round_up", "tensor_for_writing", "record_checksums", "UNLOADABLE_DTYPES"]

_PAGE_ALIGNED_FROM_BYTES = 64 << 10


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


UNLOADABLE_DTYPES = frozenset(d for d in (getattr(torch, "quint4x2", None), getattr(torch, "quint2x4", None)) if d)


@dataclass
class FilePlan:
    """One output file: its image as sorted segments, and the results to report for it."""

    path: str
    size: int = 0
    segments: list[tuple] = field(default_factory=list)
    results: list[WriteResult] = field(default_factory=list)
    blob_segments: list[range] = field(default_factory=list)  # per result: its segments, in order
    device_segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (offset, flat uint8 device bytes)
    keep_alive: list[Any] = field(default_factory=list)  # tensors/buffers the segments point into

    def append_bytes(self, item: WriteItem, storage_key: str, data: bytes | memoryview) -> None:
        offset, first_segment = self.size, len(self.segments)
        if len(data):
            self.segments.append((offset, data))
            self.keep_alive.append(data)
        self._finish_item(item, storage_key, offset, len(data), first_segment)

    def append_tensor(self, item: WriteItem, storage_key: str, tensor: torch.Tensor, through_ring: bool = False) -> None:
        """Place ``tensor``'s blob; ``through_ring``: its bytes are device memory, written through
        the pinned ring (``fastdcp.save.device_ring``) instead of from host memory."""
        offset = round_up(self.size, ZIP_ALIGN)
        nbytes = tensor.numel() * tensor.element_size()
        # Large tensors get their bytes on a 4096 boundary (written with O_DIRECT straight from
        # aligned memory); small ones are packed at torch's 64-byte alignment, as stock packs them:
        # they go through a bounce buffer either way, and padding would inflate the file.
        data_align = DATA_ALIGN if nbytes >= _PAGE_ALIGNED_FROM_BYTES else ZIP_ALIGN
        layout = tensor_blob_layout(tensor, offset, data_align=data_align)
        data_at = offset + layout.data_offset
        first_segment = len(self.segments)
        self.segments.append((offset, layout.head))
        if layout.data_nbytes and through_ring:
            self.device_segments.append((data_at, tensor.reshape(-1).view(torch.uint8)))
        elif layout.data_nbytes:
            self.segments.append((data_at, tensor.data_ptr(), layout.data_nbytes))
            self.keep_alive.append(tensor)
        self.segments.append((data_at + layout.data_nbytes, layout.tail))
        self._finish_item(item, storage_key, offset, layout.length, first_segment)

    def _finish_item(self, item: WriteItem, storage_key: str, offset: int, length: int, first_segment: int) -> None:
        self.size = offset + length
        self.blob_segments.append(range(first_segment, len(self.segments)))
        self.results.append(
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(storage_key, offset, length),
            )
        )


def tensor_for_writing(tensor: torch.Tensor, keep_on_device: bool) -> torch.Tensor:
    """A contiguous tensor holding exactly the values to store (conj/neg views resolved): on the
    CPU, or, with ``keep_on_device``, on the device it is on (written through the ring)."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu" and not keep_on_device:
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def record_checksums(engine: "_C.Engine", files: list[FilePlan]) -> None:
    """Store the CRC-32C of every item's stored bytes (the whole blob) on its ``_StorageInfo``.

    The attribute travels inside ``.metadata``; stock readers ignore it. A blob is a few segments
    (zip head, tensor bytes, zip tail), so the checksum is chained segment by segment: round r
    checksums every blob's r-th segment, in parallel, seeded with the checksum of the rounds before.
    """
    chains = [(f, r) for f in files for r in range(len(f.results))]
    crcs = [0] * len(chains)
    depth = max((len(f.blob_segments[r]) for f, r in chains), default=0)
    for round_ in range(depth):
        todo = [i for i, (f, r) in enumerate(chains) if round_ < len(f.blob_segments[r])]
        regions = []
        for i in todo:
            f, r = chains[i]
            segment = f.segments[f.blob_segments[r][round_]]
            regions.append((segment[1], segment[2] if len(segment) > 2 else None, crcs[i]))
        for i, crc in zip(todo, engine.crc32c(regions)):
            crcs[i] = crc
    for (f, r), crc in zip(chains, crcs):
        setattr(f.results[r].storage_data, CHECKSUM_ATTRIBUTE, crc)
