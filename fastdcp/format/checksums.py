"""The CRC-32C checksums a fastdcp writer records in ``.metadata``, and which items carry one.

``FastFileSystemWriter(checksums=True)`` stores the CRC-32C of each item's stored bytes (the whole
zip blob of a tensor, or the bytes of a byte item) as an extra attribute of its ``_StorageInfo`` in
``.metadata``; stock readers ignore it. Verification reads each such item whole (in batches bounded
by a memory budget: :mod:`fastdcp.load.verify`), checksums it on the engine's threads, and names
the item, file and offset of every mismatch. Items without a recorded checksum (stock-written
checkpoints) are skipped. :func:`crc32c` is the function over bytes in memory (the chunk index's,
the replicas').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._native import _C
from .metadata import CHECKSUM_ATTRIBUTE

__all__ = ["ChecksumError", "ChecksummedItem", "checksummed_items", "crc32c"]


def crc32c(data: Any, seed: int = 0) -> int:
    """CRC-32C of a bytes-like object, computed natively with the GIL released.

    Args:
        data: any C-contiguous buffer (bytes, bytearray, memoryview, mmap, numpy array).
        seed: the CRC-32C of the bytes before ``data``; ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
    """
    return _C.crc32c(data, seed)


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


