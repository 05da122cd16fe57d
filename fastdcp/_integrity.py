"""Checking stored items against the CRC-32C checksums a fastdcp writer recorded.

``FastFileSystemWriter(checksums=True)`` stores the CRC-32C of each item's stored bytes (the whole
zip blob of a tensor, or the bytes of a byte item) as an extra attribute of its ``_StorageInfo`` in
``.metadata``; stock readers ignore it. Verification reads each such item whole (in batches bounded
by a memory budget), checksums it on the engine's threads, and names the item, file and offset of
every mismatch. Items without a recorded checksum (stock-written checkpoints) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _C
from ._metadata import CHECKSUM_ATTRIBUTE

__all__ = ["ChecksumError", "ChecksummedItem", "checksummed_items", "verify_checksums"]


class ChecksumError(ValueError):
    """A stored item's bytes do not match the checksum recorded when it was written."""


@dataclass(frozen=True)
class ChecksummedItem:
    fqn: str
    relative_path: str
    offset: int
    length: int
    crc32c: int


def checksummed_items(storage_data: dict) -> list[ChecksummedItem]:
    """Every item of a checkpoint's ``storage_data`` that carries a recorded checksum, once per
    stored range (several chunks can share one)."""
    seen: set[tuple[str, int]] = set()
    items = []
    for index, info in storage_data.items():
        crc = getattr(info, CHECKSUM_ATTRIBUTE, None)
        if crc is None or (info.relative_path, info.offset) in seen:
            continue
        seen.add((info.relative_path, info.offset))
        items.append(ChecksummedItem(index.fqn, info.relative_path, info.offset, info.length, int(crc)))
    return items


def verify_checksums(engine: "_C.Engine", files: dict[str, "_C.File"], items: list[ChecksummedItem],
                     budget_bytes: int) -> list[str]:
    """Read and checksum ``items`` (``files`` maps each relative path to an open file). Returns one
    message per mismatch; an empty list means every item matched."""
    problems: list[str] = []
    batch: list[ChecksummedItem] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        buffer = torch.empty(batch_bytes, dtype=torch.uint8)
        base, offsets, cursor = buffer.data_ptr(), [], 0
        for item in batch:
            offsets.append(cursor)
            cursor += item.length
        engine.read([(files[it.relative_path], it.offset, base + off, it.length)
                     for it, off in zip(batch, offsets) if it.length], False)
        crcs = engine.crc32c([(base + off, it.length) for it, off in zip(batch, offsets)])
        for item, crc in zip(batch, crcs):
            if crc != item.crc32c:
                problems.append(
                    f"checksum mismatch for '{item.fqn}' in '{files[item.relative_path].path}' at offset "
                    f"{item.offset} ({item.length} bytes): recorded crc32c {item.crc32c:08x}, found {crc:08x}"
                )
        batch, batch_bytes = [], 0

    for item in items:
        if batch and batch_bytes + item.length > budget_bytes:
            flush()
        batch.append(item)
        batch_bytes += item.length
    flush()
    return problems
