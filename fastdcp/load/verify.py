"""Checking the items a load (or ``python -m fastdcp verify``) reads against their recorded CRC-32C.

Each checksummed item (:func:`fastdcp.format.checksums.checksummed_items`) is read whole, in
batches bounded by a memory budget, checksummed on the engine's threads; every mismatch is named
with its item, file and offset.
"""

from __future__ import annotations

import torch

from .._native import _C
from ..format.checksums import ChecksummedItem

__all__ = ["verify_checksums"]


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
