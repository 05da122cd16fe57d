"""The chunk index file's layout: its header, trailer, section and directory records, the byte
order and padding of its columns, and the ``.metadata`` edges its CRC-32C cover; the header's
version 2 part read and checked. Shared by :mod:`fastdcp.format.index_writer`,
:mod:`fastdcp.format.index_reader` and :mod:`fastdcp.format.index_sections`.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .checksums import crc32c
from .chunk_table import ChunkTable

__all__ = [
    "EDGE_BYTES", "SECTION_EDGE_BYTES", "MAGIC", "TRAILER_MAGIC", "FORMAT_VERSION", "SECTIONS_VERSION", "HEADER_SIZE",
    "HEADER", "TRAILER", "HEADER_V2", "HEADER_CRC_AT", "FLAG_STORAGE", "DIRECTORY_ENTRY", "SECTION_MAGIC",
    "NARROW_SECTION_MAGIC", "SECTION_HEADER", "SECTION_FIXED", "WIDE_FIELDS", "OBJECT_KEYS", "COMMON_KEYS",
    "MAX_WIDTH", "MAX_FILE_OFFSET", "CHECK_ROWS", "V2Header", "columns_of", "edge_bytes_for", "element_size",
    "entry_bounds", "from_le", "has_rank_sections", "pad", "parse_v2_header", "to_le",
]

# The layout (all integers little-endian):
#
# * a 128-byte header: magic ``FDCPCHIX``, format version, header size, flags (bit 0: storage
#   columns present), table width, entries, rows, the ``.metadata`` facts (size, CRC-32C of its
#   first and last EDGE_BYTES), the element size (4 or 8) of each stored column, and the offset
#   and length of the objects section;
# * the columns, each starting at a multiple of 8 bytes: ``row_start`` (int64, entries + 1), then
#   ``offsets`` and ``lengths`` (rows x width), then, with storage, ``file_index``, ``byte_offset``,
#   ``byte_length`` and ``checksums`` (rows each); a column whose values fit int32 is stored as int32;
# * the objects section: a pickle of a dict with OBJECT_KEYS, read back with the restricted
#   unpickler of ``.metadata``;
# * an 8-byte trailer: ``FDCE`` and the CRC-32C of every byte before it.
#
# Format version 2 (a save planned in bulk on several ranks: ``ChunkTable.rank_rows``) keeps all of
# the above byte for byte and adds, so that a rank reads its own rows without the whole index:
#
# * in the header, after version 1's fields (HEADER_V2): the ``.metadata`` edge length the facts
#   cover (SECTION_EDGE_BYTES), the CRC-32C, offset and length of the shared objects, the
#   directory's offset, the number of sections, the file's size, and at HEADER_CRC_AT the CRC-32C
#   of the header's bytes before it (a rank reads the header alone);
# * after the trailer, the shared objects: a zlib-compressed pickle of what a rank needs besides
#   its rows (COMMON_KEYS: fqns, properties, sizes, each entry's chunk count and extents, the
#   entries with empty chunks inside their tensor, planner_data, storage_meta, version);
# * one section per rank: SECTION_HEADER, the rows that rank planned in the save (replicated
#   items' rows included) that can be read, as records with each row's position in its entry,
#   then the numbers and names of the files those rows are in. Records are int64 (SECTION_MAGIC)
#   or, when every value but byte offsets and checksums fits int32, narrow (NARROW_SECTION_MAGIC):
#   per row the WIDE_FIELDS as int64, then, after all rows, the other fields as int32. A chunk
#   with no elements at its tensor's edge is left out (it overlaps no box, so no load plan reads
#   it); entries with an empty chunk inside the tensor keep every row;
# * the directory: per rank, its section's offset, length and CRC-32C (DIRECTORY_ENTRY).
#
# A version 1 reader refuses version 2 (and fastdcp falls back to ``.metadata``); this one reads both.

EDGE_BYTES = 64 << 10  # the .metadata's first and last bytes whose CRC-32C a version 1 index records
SECTION_EDGE_BYTES = 4 << 10  # version 2's .metadata edges: a rank reads 8 KiB of .metadata
MAGIC = b"FDCPCHIX"
TRAILER_MAGIC = b"FDCE"
FORMAT_VERSION = 1  # the table alone
SECTIONS_VERSION = 2  # the table, then the shared objects and a section per rank
HEADER_SIZE = 128
# magic, version, header size, flags, width, entries, rows, metadata size, head crc, tail crc,
# element sizes of the 6 stored columns (+2 spare), objects offset, objects length
HEADER = struct.Struct("<8sIIIIQQQII8sQQ")
TRAILER = struct.Struct("<4sI")
# Version 2 only, after HEADER: .metadata edge bytes, CRC-32C of the shared objects, their offset,
# the directory's offset, the number of sections, the file's size; then the shared objects' length
# (at HEADER_CRC_AT - 4) and the header's CRC-32C (at HEADER_CRC_AT).
HEADER_V2 = struct.Struct("<IIQQQQ")
HEADER_CRC_AT = 124
FLAG_STORAGE = 1
DIRECTORY_ENTRY = struct.Struct("<QQII")  # section offset, length, CRC-32C, 0
SECTION_MAGIC = b"FDRS"  # records as int64s
NARROW_SECTION_MAGIC = b"FDRN"  # records split: the fields that need int64, then the rest as int32s
SECTION_HEADER = struct.Struct("<4sIQII")  # magic, width, rows, files, bytes of file names
SECTION_FIXED = 6  # record columns before the box: entry, ordinal, file, byte offset, byte length, checksum
WIDE_FIELDS = (3, 5)  # of a narrow section's records, stored as int64: byte offset, checksum
OBJECT_KEYS = ("fqns", "properties", "sizes", "files", "planner_data", "storage_meta", "version")
COMMON_KEYS = ("fqns", "properties", "sizes", "row_counts", "extents", "inner_empty", "planner_data", "storage_meta",
               "version")
MAX_WIDTH = 1024  # as fastdcp.format.metadata's _MAX_NDIM
MAX_FILE_OFFSET = 1 << 62  # as fastdcp.format.metadata: byte ranges past this cannot be real
CHECK_ROWS = 1 << 20  # rows checked at once (bounds the temporaries)
_LITTLE_ENDIAN = sys.byteorder == "little"


def to_le(t: torch.Tensor) -> torch.Tensor:
    """The little-endian bytes of a contiguous int tensor, as uint8."""
    raw = t.contiguous().view(torch.uint8)
    if _LITTLE_ENDIAN:
        return raw
    return raw.view(-1, t.element_size()).flip(1).contiguous().view(-1)


def from_le(t: torch.Tensor) -> torch.Tensor:
    """A 1-D int tensor read as little-endian bytes, in native byte order (the reverse of
    :func:`to_le`; ``t`` itself on little-endian machines)."""
    if _LITTLE_ENDIAN or not t.numel():
        return t
    size = t.element_size()
    return t.view(torch.uint8).view(-1, size).flip(1).contiguous().view(t.dtype).view(-1)


def pad(n: int) -> int:
    """The zero bytes after byte ``n`` up to the next multiple of 8 (where a column starts)."""
    return -n % 8


def element_size(name: str, t: torch.Tensor) -> int:
    """4 when every value of column ``t`` fits int32 (file_index always does), else 8."""
    if name == "file_index" or t.numel() == 0:
        return 4
    lo, hi = (int(v) for v in torch.aminmax(t))
    return 4 if -(1 << 31) <= lo and hi < 1 << 31 else 8


def columns_of(table: ChunkTable) -> list[tuple[str, torch.Tensor]]:
    """The stored columns after ``row_start``, in file order, with their names."""
    cols = [("offsets", table.offsets), ("lengths", table.lengths)]
    if table.storage is not None:
        s = table.storage
        cols += [("file_index", s.file_index), ("byte_offset", s.byte_offset), ("byte_length", s.byte_length),
                 ("checksums", s.checksums)]
    return cols


def has_rank_sections(table: ChunkTable) -> bool:
    """Whether the index of ``table`` gets per-rank sections (format version 2)."""
    return table.storage is not None and table.rank_rows is not None and len(table.rank_rows.start) > 2


def edge_bytes_for(table: ChunkTable) -> int:
    """The ``.metadata`` edge length whose CRC-32C the index of ``table`` records."""
    return SECTION_EDGE_BYTES if has_rank_sections(table) else EDGE_BYTES


def entry_bounds(sizes: list[Any], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ndims, bounds): each entry's dimension count (-1: bytes) and its size padded with zeros
    to ``width`` (a row's chunk must lie inside it; columns past ndim, and bytes rows, must be 0)."""
    ndims = torch.tensor([-1 if s is None else len(s) for s in sizes], dtype=torch.int64)
    flat = [0] * (len(sizes) * width)
    for e, size in enumerate(sizes):
        if size is not None and len(size) <= width:
            flat[e * width: e * width + len(size)] = list(size)
    return ndims, torch.tensor(flat, dtype=torch.int64).view(len(sizes), width)


@dataclass(frozen=True)
class V2Header:
    """The version 2 fields of a chunk index header."""

    edge_bytes: int
    common_crc: int
    common_offset: int
    directory_offset: int
    sections: int
    file_size: int
    common_length: int


def parse_v2_header(header: bytes | bytearray, fail: Callable[[str], Exception]) -> V2Header:
    """The version 2 fields of ``header`` (the first HEADER_SIZE bytes), checked: the header's own
    CRC-32C, the edge length, and a layout that adds up; else ``fail(problem)`` is raised."""
    (common_length, recorded) = struct.unpack_from("<II", header, HEADER_CRC_AT - 4)
    fields = V2Header(*HEADER_V2.unpack_from(header, HEADER.size), common_length)
    if recorded != crc32c(header[:HEADER_CRC_AT]):
        raise fail("header checksum mismatch: the file is damaged")
    if fields.edge_bytes != SECTION_EDGE_BYTES:
        raise fail(f"unexpected version 2 header (edge bytes {fields.edge_bytes})")
    if not (HEADER_SIZE <= fields.common_offset <= fields.common_offset + common_length <= fields.directory_offset
            <= fields.file_size
            and fields.file_size - fields.directory_offset == fields.sections * DIRECTORY_ENTRY.size):
        raise fail(f"the header's layout does not add up (shared objects at {fields.common_offset}, directory at "
                   f"{fields.directory_offset} for {fields.sections} sections, {fields.file_size} bytes)")
    return fields
