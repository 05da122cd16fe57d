"""One rank's part of a version 2 chunk index (:mod:`fastdcp.format.index_layout`), read alone
by ranged reads: the header (:func:`read_index_header`), the shared objects, one rank's section
(:func:`read_rank_section`), each checked as the whole table is (CRC-32C, bounded decompression,
every record against the entries' sizes and the file list); and :func:`merge_sections`, the rows
of a few sections as one.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .checksums import crc32c
from .chunk_table import ChunkTable, StorageColumns
from .index_layout import (
    COMMON_KEYS,
    DIRECTORY_ENTRY,
    EDGE_BYTES,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NARROW_SECTION_MAGIC,
    SECTION_FIXED,
    SECTION_HEADER,
    SECTION_MAGIC,
    SECTIONS_VERSION,
    WIDE_FIELDS,
    V2Header,
    entry_bounds,
    from_le,
    parse_v2_header,
)
from .index_reader import check_columns, check_objects, unpickle_objects
from .metadata import CheckpointFormatError, shown
from .sources import PositionalSource, read_exactly

__all__ = ["IndexHeader", "RankSection", "read_index_header", "read_shared_objects", "read_rank_section",
           "merge_sections"]

_MAX_COMMON_RATIO = 64  # decompressed shared objects per compressed byte, at most (zip bombs)


@dataclass(frozen=True)
class IndexHeader:
    """What a chunk index's first bytes say: the ``.metadata`` facts it was written for, its
    version, and (version 2) where the shared objects and the sections are."""

    version: int
    metadata_size: int
    metadata_head_crc: int
    metadata_tail_crc: int
    edge_bytes: int
    entries: int
    width: int
    v2: V2Header | None


@dataclass
class RankSection:
    """One rank's section of a version 2 chunk index: the rows that rank planned in the save as a
    :class:`ChunkTable` naming every entry of the checkpoint (entries the rank did not save have
    no rows), plus what planning from part of the table needs to stay exactly stock's plan.

    ``ordinals[i]`` is row ``i``'s position among all chunks of its entry (its index hint);
    ``row_counts[e]`` entry ``e``'s chunks in the whole checkpoint; ``extents[e]`` the largest
    chunk end per dimension over all of them; ``inner_empty`` the entries with an empty chunk
    strictly inside the tensor (see ``inner_empty_entries``)."""

    rank: int
    table: ChunkTable
    ordinals: torch.Tensor
    row_counts: list[int]
    extents: list[tuple[int, ...]]
    inner_empty: frozenset[int]
    planner_data: Any
    storage_meta: Any
    version: str | None
    bytes_read: int


def read_index_header(source: PositionalSource, where: str) -> IndexHeader:
    """The first bytes of the chunk index ``source``, by one positional read. Raises
    :class:`CheckpointFormatError` for anything not a chunk index of a supported version, and for
    a version 2 header whose own checksum or layout is wrong."""
    fail = lambda problem: CheckpointFormatError(f"{where}: {problem}")  # noqa: E731
    header = read_exactly(source, 0, HEADER_SIZE, fail)
    (magic, version, header_size, flags, width, entries, rows, md_size, head_crc, tail_crc, _, _, _) = \
        HEADER.unpack_from(header)
    if magic != MAGIC:
        raise fail(f"not a fastdcp chunk index (magic {shown(magic)})")
    if version not in (FORMAT_VERSION, SECTIONS_VERSION) or header_size != HEADER_SIZE:
        raise fail(f"chunk index format version {version} is not supported")
    v2 = parse_v2_header(header, fail) if version == SECTIONS_VERSION else None
    if v2 is not None and source.size() != v2.file_size:
        raise fail(f"is {source.size()} bytes, its header says {v2.file_size} (truncated or appended to)")
    return IndexHeader(version, md_size, head_crc, tail_crc, v2.edge_bytes if v2 else EDGE_BYTES, entries, width, v2)


def read_shared_objects(source: PositionalSource, header: IndexHeader, where: str, *,
                        allow_unsafe: bool = False) -> dict[str, Any]:
    """The shared objects of the version 2 chunk index ``source`` (see :func:`read_index_header`;
    one ranged read): every entry's fqn, properties, size, chunk count and extents, the entries
    with inner empty chunks, ``planner_data``, ``storage_meta``, ``version``; and ``"bytes_read"``.
    Checked (CRC-32C, bounded decompression, restricted unpickling unless ``allow_unsafe``);
    failures raise :class:`CheckpointFormatError` naming ``where``."""
    v2 = header.v2
    fail = lambda problem: CheckpointFormatError(f"{where}: {problem}")  # noqa: E731
    if v2 is None:
        raise fail("has no shared objects (format version 1)")
    packed = read_exactly(source, v2.common_offset, v2.common_length, fail)
    if crc32c(packed) != v2.common_crc:
        raise fail("the shared objects' checksum does not match: the file is damaged")
    common = _common_objects(packed, header, fail, allow_unsafe)
    common["bytes_read"] = HEADER_SIZE + v2.common_length
    return common


def read_rank_section(source: PositionalSource, header: IndexHeader, rank: int, where: str, *,
                      allow_unsafe: bool = False, shared: dict[str, Any] | None = None) -> RankSection | None:
    """Rank ``rank``'s section of the version 2 chunk index ``source`` (see
    :func:`read_index_header`), by ranged reads: the directory entry, the section, and the shared
    objects unless given (``shared``, from :func:`read_shared_objects`). None when the index has
    no section for ``rank`` (version 1, or a save with fewer ranks).

    Everything read is checked as ``read_chunk_index`` checks the whole table (CRC-32C of
    the section and of the shared objects, every record against the entries' sizes and the
    file list); failures raise :class:`CheckpointFormatError` naming ``where``. Memory: the
    section and the shared objects (decompressed at most ``_MAX_COMMON_RATIO`` times their size)."""
    v2 = header.v2
    if v2 is None or not 0 <= rank < v2.sections:
        return None
    fail = lambda problem: CheckpointFormatError(f"{where}: section of rank {rank}: {problem}")  # noqa: E731
    entry = read_exactly(source, v2.directory_offset + rank * DIRECTORY_ENTRY.size, DIRECTORY_ENTRY.size, fail)
    offset, length, crc, zero = DIRECTORY_ENTRY.unpack(entry)
    sections_start = v2.common_offset + v2.common_length
    if zero or not (sections_start <= offset and length >= SECTION_HEADER.size
                    and offset + length <= v2.directory_offset):
        raise fail(f"directory entry (offset {offset}, length {length}) lies outside the sections")
    raw = read_exactly(source, offset, length, fail)
    if crc32c(raw) != crc:
        raise fail(f"checksum mismatch (recorded {crc:#010x}): the file is damaged")
    bytes_read = DIRECTORY_ENTRY.size + length
    if shared is None:
        shared = read_shared_objects(source, header, where, allow_unsafe=allow_unsafe)
        bytes_read += shared["bytes_read"]
    table, ordinals = _section_table(raw, header, shared, fail)
    return RankSection(
        rank=rank, table=table, ordinals=ordinals, row_counts=shared["row_counts"], extents=shared["extents"],
        inner_empty=frozenset(shared["inner_empty"]), planner_data=shared["planner_data"],
        storage_meta=shared["storage_meta"], version=shared["version"], bytes_read=bytes_read,
    )


def merge_sections(sections: list[RankSection]) -> RankSection:
    """One :class:`RankSection` holding the rows of every section in ``sections`` (sections of
    one index), each row once, in table order; named after the first section's rank. What a rank
    plans from when its own section does not cover its load but a few others do."""
    first = sections[0]
    if len(sections) == 1:
        return first
    names: dict[str, int] = {}
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("entry", "ordinal", "offsets", "lengths", "file",
                                                            "byte_offset", "byte_length", "checksums")}
    for section in sections:
        t = section.table
        storage = t.storage
        assert storage is not None
        remap = torch.tensor([names.setdefault(n, len(names)) for n in storage.files] or [0], dtype=torch.int64)
        parts["entry"].append(t.entry_of_rows())
        parts["ordinal"].append(section.ordinals)
        parts["offsets"].append(t.offsets)
        parts["lengths"].append(t.lengths)
        parts["file"].append(remap.index_select(0, storage.file_index.to(torch.int64)))
        parts["byte_offset"].append(storage.byte_offset)
        parts["byte_length"].append(storage.byte_length)
        parts["checksums"].append(storage.checksums)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    entry, ordinal = cat["entry"], cat["ordinal"]
    key = entry * (int(ordinal.max()) + 1 if len(ordinal) else 1) + ordinal
    order = torch.argsort(key, stable=True)
    ordered = key.index_select(0, order)
    keep = torch.ones(len(order), dtype=torch.bool)
    if len(order) > 1:
        keep[1:] = ordered[1:] != ordered[:-1]
    rows = order[keep]
    entries = len(first.table.fqns)
    row_start = torch.zeros(entries + 1, dtype=torch.int64)
    row_start[1:] = torch.cumsum(torch.bincount(entry.index_select(0, rows), minlength=entries), 0)
    storage = StorageColumns(files=list(names), file_index=cat["file"].index_select(0, rows).to(torch.int32),
                             byte_offset=cat["byte_offset"].index_select(0, rows),
                             byte_length=cat["byte_length"].index_select(0, rows),
                             checksums=cat["checksums"].index_select(0, rows))
    table = ChunkTable(list(first.table.fqns), list(first.table.properties), list(first.table.sizes), row_start,
                       cat["offsets"].index_select(0, rows), cat["lengths"].index_select(0, rows), storage)
    return dataclasses.replace(first, table=table, ordinals=ordinal.index_select(0, rows),
                               bytes_read=sum(s.bytes_read for s in sections))


def _common_objects(packed: bytes, header: IndexHeader, fail: Any, allow_unsafe: bool) -> dict[str, Any]:
    """The shared objects of a version 2 index, decompressed (bounded) and checked."""
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(packed, _MAX_COMMON_RATIO * len(packed) + (1 << 20))
    except zlib.error as e:
        raise fail(f"the shared objects do not decompress ({e})") from None
    if not inflate.eof or inflate.unconsumed_tail:
        raise fail("the shared objects are truncated or decompress implausibly large")
    where_fail = fail
    common = unpickle_objects(data, "shared objects", fail, "shared objects", allow_unsafe)
    if type(common) is not dict or set(common) != set(COMMON_KEYS):
        raise fail("the shared objects are not the expected dict")
    entries = header.entries
    check_objects(where_fail, entries, common["fqns"], common["properties"], common["sizes"], [], True, common)
    counts, extents, inner = common["row_counts"], common["extents"], common["inner_empty"]
    if (type(counts) is not list or len(counts) != entries or not all(type(c) is int and c >= 0 for c in counts)
            or type(extents) is not list or len(extents) != entries
            or not all(type(x) is tuple and all(type(v) is int for v in x) for x in extents)
            or type(inner) is not list or not all(type(e) is int and 0 <= e < entries for e in inner)):
        raise fail("the shared objects' row counts, extents or inner-empty entries are malformed")
    return common


def _section_numbers(raw: bytearray, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` little-endian ``dtype`` values of ``raw`` from byte ``offset``, in native order."""
    if not count:
        return torch.zeros(0, dtype=dtype)
    return from_le(torch.frombuffer(raw, dtype=dtype, offset=offset, count=count))


def _section_table(raw: bytearray, header: IndexHeader, common: dict[str, Any], fail: Any
                   ) -> tuple[ChunkTable, torch.Tensor]:
    """A section's records as a :class:`ChunkTable` (every entry named, the section's rows) and
    the rows' ordinals; checked like a whole table."""
    magic, width, rows, nfiles, names_length = SECTION_HEADER.unpack_from(raw)
    columns = SECTION_FIXED + 2 * width
    if magic not in (SECTION_MAGIC, NARROW_SECTION_MAGIC) or width != header.width:
        raise fail(f"not a section (magic {shown(magic)}, width {width} of the table's {header.width})")
    narrow = magic == NARROW_SECTION_MAGIC
    wide_columns = len(WIDE_FIELDS) if narrow else columns
    records_bytes = rows * (wide_columns * 8 + (columns - wide_columns) * 4)
    expected = SECTION_HEADER.size + records_bytes + nfiles * 8 + names_length
    if expected != len(raw):
        raise fail(f"declares {rows} rows and {nfiles} files ({expected} bytes) but is {len(raw)} bytes")
    body = SECTION_HEADER.size  # where the records start in ``raw`` (read into a writable buffer)
    wide = _section_numbers(raw, body, rows * wide_columns, torch.int64).view(rows, wide_columns)
    if narrow:  # the records rebuilt as int64 [rows, columns], fields in their logical order
        rest = _section_numbers(raw, body + rows * wide_columns * 8, rows * (columns - wide_columns), torch.int32)
        records = torch.empty((rows, columns), dtype=torch.int64)
        others = [f for f in range(columns) if f not in WIDE_FIELDS]
        records[:, list(WIDE_FIELDS)] = wide
        records[:, others] = rest.view(rows, columns - wide_columns).to(torch.int64)
    else:
        records = wide
    numbers = _section_numbers(raw, body + records_bytes, nfiles, torch.int64)
    names_bytes = bytes(raw[body + records_bytes + nfiles * 8:])
    names = names_bytes.decode("utf-8", "surrogatepass").split("\0") if nfiles else []
    if len(names) != nfiles or (not nfiles and names_bytes):
        raise fail(f"lists {len(names)} file names for {nfiles} file numbers")
    if nfiles > 1 and bool((numbers[1:] <= numbers[:-1]).any()):
        raise fail("its file numbers are not ascending")
    entries = header.entries
    entry, ordinal, file = records[:, 0].contiguous(), records[:, 1].clone(), records[:, 2].contiguous()
    if rows:
        if bool(((entry < 0) | (entry >= entries)).any()):
            raise fail("a record names an entry that does not exist")
        counts = torch.tensor(common["row_counts"], dtype=torch.int64)
        if bool(((ordinal < 0) | (ordinal >= counts.index_select(0, entry))).any()):
            raise fail("a record's position in its entry is out of range")
        if rows > 1:
            step = (entry[1:] > entry[:-1]) | ((entry[1:] == entry[:-1]) & (ordinal[1:] > ordinal[:-1]))
            if not bool(step.all()):
                raise fail("its records are not in table order")
    local = torch.searchsorted(numbers, file) if nfiles else torch.zeros_like(file)
    if rows and (not nfiles or bool((local >= nfiles).any())
                 or not bool((numbers.index_select(0, local.clamp(max=max(nfiles - 1, 0))) == file).all())):
        raise fail("a record names a file the section does not list")
    row_start = torch.zeros(entries + 1, dtype=torch.int64)
    if rows:
        row_start[1:] = torch.cumsum(torch.bincount(entry, minlength=entries), 0)
    storage = StorageColumns(
        files=names, file_index=local.to(torch.int32), byte_offset=records[:, 3].clone(),
        byte_length=records[:, 4].clone(), checksums=records[:, 5].clone(),
    )
    table = ChunkTable(list(common["fqns"]), list(common["properties"]), list(common["sizes"]), row_start,
                       records[:, SECTION_FIXED:SECTION_FIXED + width].clone(),
                       records[:, SECTION_FIXED + width:].clone(), storage)
    if not all(names):  # (the entries were checked with the shared objects)
        raise fail("a data file name is empty")
    if "entry_bounds" not in common:  # once per shared objects, not per section
        common["entry_bounds"] = entry_bounds(table.sizes, width)
    check_columns(fail, table, partial=True, known_bounds=common["entry_bounds"])
    return table, ordinal

