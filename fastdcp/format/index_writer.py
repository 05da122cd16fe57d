"""Writing a chunk index (:mod:`fastdcp.format.index_layout`): the table's columns, its small
objects and the trailer (format version 1); with ``ChunkTable.rank_rows``, version 2's shared
objects, one section per rank and the directory after them (:class:`SectionWriter`, which builds
the sections of many ranks at once with tensor operations and batched native calls).
"""

from __future__ import annotations

import pickle
import struct
import zlib
from typing import Any, BinaryIO

import torch

from .checksums import crc32c
from .chunk_table import ChunkTable, RankRows
from .index_layout import (
    CHECK_ROWS,
    DIRECTORY_ENTRY,
    FLAG_STORAGE,
    FORMAT_VERSION,
    HEADER,
    HEADER_CRC_AT,
    HEADER_SIZE,
    HEADER_V2,
    MAGIC,
    NARROW_SECTION_MAGIC,
    SECTION_EDGE_BYTES,
    SECTION_FIXED,
    SECTION_HEADER,
    SECTION_MAGIC,
    SECTIONS_VERSION,
    TRAILER,
    TRAILER_MAGIC,
    WIDE_FIELDS,
    columns_of,
    element_size,
    entry_bounds,
    has_rank_sections,
    pad,
    to_le,
)
from .pickle_stream import tensor_view

__all__ = ["write_chunk_index", "SectionWriter", "fits_narrow_records", "inner_empty_entries"]

_SECTION_BLOCK_ROWS = 1 << 20  # rank rows turned into sections at once (bounds the temporaries)
_SECTION_GATHER_ROWS = 1 << 18  # rank rows gathered field by field, then transposed into records, at once


def write_chunk_index(
    out: BinaryIO,
    table: ChunkTable,
    *,
    planner_data: Any,
    storage_meta: Any,
    version: str | None,
    metadata_size: int,
    metadata_head_crc: int,
    metadata_tail_crc: int,
) -> int:
    """Write the chunk index of ``table`` to ``out`` (written in order, never seeked); returns the
    bytes written.

    ``metadata_size``/``metadata_head_crc``/``metadata_tail_crc`` describe the ``.metadata``
    this index goes with (:func:`~fastdcp.format.index_link.metadata_facts` of it, with
    :func:`~fastdcp.format.index_layout.edge_bytes_for` ``table``);
    ``planner_data``, ``storage_meta`` and ``version`` are the ones given to ``write_metadata``.
    A table with storage and ``rank_rows`` gets format version 2: the shared objects and one
    section per rank follow the table (see :mod:`fastdcp.format.index_sections`). Preconditions:
    ``table`` is consistent (as ``read_chunk_index`` checks). Memory: one column at a time is narrowed
    to int32; sections are cut from blocks of ``_SECTION_BLOCK_ROWS`` rows."""
    entries, rows = len(table.fqns), table.rows
    width = int(table.offsets.shape[1]) if table.offsets.dim() == 2 else 0
    objects = pickle.dumps(
        {
            "fqns": list(table.fqns),
            "properties": list(table.properties),
            "sizes": list(table.sizes),
            "files": list(table.storage.files) if table.storage is not None else [],
            "planner_data": planner_data,
            "storage_meta": storage_meta,
            "version": version,
        },
        protocol=4,
    )
    columns = columns_of(table)
    element_sizes = [element_size(name, t) for name, t in columns]
    # Offsets of each section, as read_chunk_index recomputes them.
    at = HEADER_SIZE + entries * 8 + 8
    for (_, t), size in zip(columns, element_sizes):
        at += pad(at) + t.numel() * size
    objects_offset = at + pad(at)
    sizes_by_name = dict(zip((name for name, _ in columns), element_sizes))
    sections = SectionWriter(table, width, fits_narrow_records(table, sizes_by_name),
                              dict(planner_data=planner_data, storage_meta=storage_meta, version=version)) \
        if has_rank_sections(table) else None
    header = HEADER.pack(
        MAGIC, SECTIONS_VERSION if sections else FORMAT_VERSION, HEADER_SIZE,
        FLAG_STORAGE if table.storage is not None else 0, width,
        entries, rows, metadata_size, metadata_head_crc, metadata_tail_crc, bytes(element_sizes).ljust(8, b"\0"),
        objects_offset, len(objects),
    )
    if sections is not None:
        common_offset = objects_offset + len(objects) + TRAILER.size
        header += HEADER_V2.pack(SECTION_EDGE_BYTES, crc32c(sections.common), common_offset,
                                  *sections.layout(common_offset))
        header += struct.pack("<I", len(sections.common))
        assert len(header) == HEADER_CRC_AT
        header += struct.pack("<I", crc32c(header))
    header = header.ljust(HEADER_SIZE, b"\0")

    written = 0
    crc = 0

    def emit(data: Any) -> None:
        nonlocal written, crc
        if len(data):
            out.write(data)
            crc = crc32c(data, crc)
            written += len(data)

    emit(header)
    emit(tensor_view(to_le(table.row_start.to(torch.int64))))
    for (_, t), size in zip(columns, element_sizes):
        emit(bytes(pad(written)))
        stored = t.to(torch.int32 if size == 4 else torch.int64)  # one narrowed column at a time
        emit(tensor_view(to_le(stored)))
        del stored
    emit(bytes(pad(written)))
    assert written == objects_offset
    emit(objects)
    out.write(TRAILER.pack(TRAILER_MAGIC, crc))
    written += TRAILER.size
    if sections is not None:
        written += sections.write(out)
    return written


def _gather_into(dest: torch.Tensor, source: torch.Tensor, rows: torch.Tensor) -> None:
    """``dest[:] = source[rows]`` for a 1-D ``dest`` of ``len(rows)`` int64 values, gathered
    straight into ``dest`` when the dtypes match (no temporary)."""
    if source.dtype == dest.dtype:
        torch.index_select(source, 0, rows, out=dest)
    else:
        dest.copy_(source.index_select(0, rows))


class SectionWriter:
    """Version 2's parts after the table: the shared objects (zlib-compressed pickle of what a
    rank needs besides its rows), one section per rank, the directory. A section holds the rows
    rank ``r`` planned (``table.rank_rows``) but unreadable ones (:func:`readable_rank_rows`),
    ascending, as records ``entry, ordinal (the row's position in its entry), file, byte offset,
    byte length, checksum, offsets[width], lengths[width]`` (``file`` a checkpoint-wide number;
    int64, or narrow: :meth:`_parts`), then the numbers and names of its files. Ranks are handled
    in blocks of about ``_SECTION_BLOCK_ROWS`` rows (whole ranks) with tensor operations and
    batched native calls whose number does not grow with the block's ranks."""

    def __init__(self, table: ChunkTable, width: int, narrow: bool, facts: dict[str, Any]) -> None:
        """``narrow``: records in the narrow layout (:func:`fits_narrow_records` of ``table``).
        Preconditions: ``table`` has storage columns and ``rank_rows`` and is consistent (as
        ``read_chunk_index`` checks; each rank's rows ascending). Everything but the records
        is computed here, so that the header's layout (:meth:`layout`) is known before a byte of
        the sections is written."""
        assert table.storage is not None and table.rank_rows is not None
        self.table, self.width = table, width
        self.narrow = narrow
        counts = table.row_start[1:] - table.row_start[:-1]
        common = {
            "fqns": list(table.fqns), "properties": list(table.properties), "sizes": list(table.sizes),
            "row_counts": counts.tolist(), "extents": entry_extents(table), "inner_empty": inner_empty_entries(table),
            **facts,
        }
        self.common = zlib.compress(pickle.dumps(common, protocol=4), 6)
        self.entry_of_row = table.entry_of_rows()  # (the records' first column, and which rows are readable)
        self.rank_rows = readable_rank_rows(table, self.entry_of_row, common["inner_empty"])
        start = self.rank_rows.start
        self.ranks = len(start) - 1
        self.counts = (start[1:] - start[:-1]).tolist()
        self.blocks = self._blocks()
        self.files_of_rank: list[list[int]] = [[] for _ in range(self.ranks)]
        for a, b in self.blocks:
            self._find_files(a, b)
        # Each section is header, records, tail (the file numbers, then the names "\0"-joined).
        self.headers: list[bytes] = []
        self.tails: list[bytes] = []
        # (A section lists the files of the replicated items it holds too: ~80 a rank at 4,096
        # ranks, so each name is encoded once, not once per section that lists it.)
        encoded = [name.encode("utf-8", "surrogatepass") for name in table.storage.files]
        magic = NARROW_SECTION_MAGIC if self.narrow else SECTION_MAGIC
        for count, files in zip(self.counts, self.files_of_rank):
            names = b"\0".join([encoded[f] for f in files])
            self.headers.append(SECTION_HEADER.pack(magic, width, count, len(files), len(names)))
            self.tails.append(struct.pack(f"<{len(files)}q", *files) + names)
        self.lengths = [SECTION_HEADER.size + count * self._record_bytes() + len(tail)
                        for count, tail in zip(self.counts, self.tails)]

    def _blocks(self) -> list[tuple[int, int]]:
        """Consecutive rank ranges ``(a, b)`` covering every rank, each closed once it holds
        ``_SECTION_BLOCK_ROWS`` rows (ranks are not split: a block may pass the bound by one
        rank's rows)."""
        blocks, a, held = [], 0, 0
        for r, count in enumerate(self.counts):
            held += count
            if held >= _SECTION_BLOCK_ROWS:
                blocks.append((a, r + 1))
                a, held = r + 1, 0
        if a < self.ranks:
            blocks.append((a, self.ranks))
        return blocks

    def _rows(self, a: int, b: int) -> torch.Tensor:
        """The table rows ranks ``a..b-1`` planned, rank after rank."""
        start = self.rank_rows.start
        return self.rank_rows.rows[int(start[a]):int(start[b])]

    def _find_files(self, a: int, b: int) -> None:
        """Fill ``files_of_rank[a:b]`` (empty lists) with each rank's distinct file numbers,
        ascending. Precondition: file numbers index ``storage.files``."""
        storage = self.table.storage
        files = storage.file_index.index_select(0, self._rows(a, b))
        # Only the first row of each run of rows in one file, within one rank, can add a
        # (rank, file) pair. A rank's rows are mostly a few such runs (its own file; the file of
        # the replicated items it lists), so what is sorted below is a few pairs per rank.
        firsts = self.rank_rows.start[a:b + 1] - self.rank_rows.start[a]  # each rank's first row
        run_starts = torch.ones(len(files), dtype=torch.bool)
        run_starts[1:] = files[1:] != files[:-1]
        run_starts[firsts[firsts < len(files)]] = True
        at = run_starts.nonzero()[:, 0]
        # The rank of each run (right=True: an empty rank's first row is the next rank's).
        rank = torch.searchsorted(firsts, at, right=True) - 1 + a
        nfiles = max(1, len(storage.files))
        for key in torch.unique(rank * nfiles + files.index_select(0, at).to(torch.int64)).tolist():
            self.files_of_rank[key // nfiles].append(key % nfiles)

    def _record_columns(self) -> int:
        return SECTION_FIXED + 2 * self.width

    def _record_bytes(self) -> int:
        columns = self._record_columns()
        return 8 * len(WIDE_FIELDS) + 4 * (columns - len(WIDE_FIELDS)) if self.narrow else 8 * columns

    def layout(self, common_offset: int) -> tuple[int, int, int]:
        """(directory offset, sections, file size) for shared objects at ``common_offset``."""
        self.sections_start = common_offset + len(self.common)
        directory = self.sections_start + sum(self.lengths)
        return directory, self.ranks, directory + self.ranks * DIRECTORY_ENTRY.size

    def _field_order(self) -> list[int]:
        """The record fields (0 entry, 1 ordinal, 2 file, 3 byte offset, 4 byte length, 5 checksum,
        then offsets and lengths) in the order they are stored: narrow records put the int64
        fields first (:meth:`_parts`)."""
        fields = range(self._record_columns())
        return list(fields) if not self.narrow else [*WIDE_FIELDS, *(f for f in fields if f not in WIDE_FIELDS)]

    def _parts(self) -> list[tuple[int, int, torch.dtype]]:
        """Each record's stored parts as (first, end) positions in :meth:`_field_order` and the
        dtype: one int64 part, or (narrow) the int64 fields, then the rest as int32. A section
        holds a part's values for all its rows before the next part's."""
        columns = self._record_columns()
        if not self.narrow:
            return [(0, columns, torch.int64)]
        return [(0, len(WIDE_FIELDS), torch.int64), (len(WIDE_FIELDS), columns, torch.int32)]

    def _records(self, rows: torch.Tensor, entry_of_row: torch.Tensor, fields: torch.Tensor,
                 outputs: list[torch.Tensor]) -> None:
        """Fill ``outputs`` (one tensor [len(rows), part fields] per :meth:`_parts`) with the
        records of table ``rows`` (``entry_of_row`` is ``table.entry_of_rows()``), using
        ``fields`` (int64 [record columns, k]): ``k`` rows at a time are gathered field by field
        into ``fields`` (in :meth:`_field_order`), then transposed into each output in one pass.
        (Gathering straight into row-major records writes each field with the record's stride: a
        pass over all of the records per field.)"""
        table, storage, width = self.table, self.table.storage, self.width
        sources = [storage.file_index, storage.byte_offset, storage.byte_length, storage.checksums]
        sources += [table.offsets[:, j] for j in range(width)] + [table.lengths[:, j] for j in range(width)]
        row_of = {f: i for i, f in enumerate(self._field_order())}
        parts = self._parts()
        step = fields.shape[1]
        for at in range(0, len(rows), step):
            part = rows[at:at + step]
            gathered = fields[:, :len(part)]
            entries = gathered[row_of[0]]
            _gather_into(entries, entry_of_row, part)
            torch.sub(part, table.row_start.index_select(0, entries), out=gathered[row_of[1]])  # ordinals
            for f, source in enumerate(sources, start=2):
                _gather_into(gathered[row_of[f]], source, part)
            for out, (first, end, _) in zip(outputs, parts):
                out[at:at + len(part)].copy_(gathered[first:end].t())  # (int32 parts: checked to fit)

    def write(self, out: BinaryIO) -> int:
        """Write the shared objects, the sections and the directory (after :meth:`layout`); the
        bytes written. Memory: one block's records (reused block after block)."""
        out.write(self.common)
        written = len(self.common)
        entry_of_row = self.entry_of_row
        start = self.rank_rows.start
        most = max((int(start[b] - start[a]) for a, b in self.blocks), default=0)
        parts = self._parts()
        buffers = [torch.empty((most, end - first), dtype=dtype) for first, end, dtype in parts]
        row_bytes = [(end - first) * (8 if dtype == torch.int64 else 4) for first, end, dtype in parts]
        fields = torch.empty((self._record_columns(), max(1, min(most, _SECTION_GATHER_ROWS))), dtype=torch.int64)
        crcs: list[int] = []
        for a, b in self.blocks:
            rows = self._rows(a, b)
            blocks = [buffer[:len(rows)] for buffer in buffers]
            self._records(rows, entry_of_row, fields, blocks)
            raw_tensors = [to_le(block.reshape(-1)) for block in blocks]  # kept alive while their views are written
            raws = [tensor_view(t) for t in raw_tensors]
            sections, at = [], [0] * len(raws)
            for r in range(a, b):
                pieces = [self.headers[r]]
                for k, raw in enumerate(raws):
                    end = at[k] + self.counts[r] * row_bytes[k]
                    pieces.append(raw[at[k]:end])
                    at[k] = end
                pieces.append(self.tails[r])
                sections.append(tuple(pieces))
            assert at == [len(raw) for raw in raws]
            crcs += self._checksums(sections)
            # The parts as they are, not joined into one buffer (a copy of the block): ``out``
            # buffers the small ones, and a rank's records are large enough to go straight out.
            out.writelines(part for section in sections for part in section)
            written += sum(self.lengths[a:b])
            del sections, raws, raw_tensors
        entries = []
        at_byte = self.sections_start
        for length, crc in zip(self.lengths, crcs):
            entries.append(DIRECTORY_ENTRY.pack(at_byte, length, crc, 0))
            at_byte += length
        directory = b"".join(entries)
        out.write(directory)
        return written + len(directory)

    @staticmethod
    def _checksums(sections: list[tuple[Any, ...]]) -> list[int]:
        """The CRC-32C of each section given as its parts: each part continues the CRC of the parts
        before it (the CRC of a+b is the CRC of b seeded with the CRC of a), so no section is
        copied to be checksummed whole."""
        crcs = []
        for section in sections:
            crc = 0
            for part in section:
                crc = crc32c(part, crc)
            crcs.append(crc)
        return crcs


def fits_narrow_records(table: ChunkTable, element_sizes: dict[str, int] | None = None) -> bool:
    """Whether every section record of ``table`` fits the narrow layout: all fields but the byte
    offset and the checksum within int32, by the rule the table part's columns are narrowed by
    (``index_layout.element_size``; ``element_sizes`` by column name when already known).
    Entries, ordinals and file numbers are below the row and file counts."""
    storage = table.storage
    assert storage is not None
    if table.rows >= 1 << 31 or len(storage.files) >= 1 << 31:
        return False
    if element_sizes is None:
        element_sizes = {name: element_size(name, t) for name, t in columns_of(table)}
    return all(element_sizes[name] == 4 for name in ("offsets", "lengths", "byte_length"))


def readable_rank_rows(table: ChunkTable, entry: torch.Tensor, inner_empty: list[int]) -> RankRows:
    """``table.rank_rows`` without the rows no load plan can read: chunks with no elements (a
    length of 0 in one of their tensor's dimensions) of entries not in ``inner_empty``. Such a
    chunk lies at its tensor's edge (offset 0 or the dimension's size), where stock's overlap
    test finds no box it overlaps. Rows of bytes entries and 0-d tensors are kept. ``entry`` is
    ``table.entry_of_rows()``. Memory: a mask over the table's rows and one over the rank rows."""
    assert table.rank_rows is not None
    if not table.rows or table.offsets.dim() != 2:
        return table.rank_rows
    width = int(table.lengths.shape[1])
    ndim = torch.tensor([len(size) if size is not None else 0 for size in table.sizes], dtype=torch.int64)
    in_tensor = torch.arange(width, dtype=torch.int64) < ndim.index_select(0, entry).unsqueeze(1)
    unreadable = ((table.lengths == 0) & in_tensor).any(1)
    if inner_empty:
        unreadable &= ~torch.isin(entry, torch.tensor(inner_empty, dtype=torch.int64))
    del in_tensor
    if not bool(unreadable.any()):
        return table.rank_rows
    rows = table.rank_rows.rows
    keep = ~unreadable.index_select(0, rows)
    kept_before = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(keep, 0, out=kept_before[1:])
    return RankRows(start=kept_before.index_select(0, table.rank_rows.start), rows=rows[keep])


def entry_extents(table: ChunkTable) -> list[tuple[int, ...]]:
    """Per entry, the largest ``offset + length`` of its chunks in each dimension (what stock's
    sweep-dimension choice reads); ``()`` for bytes entries and entries without chunks."""
    extents: list[tuple[int, ...]] = []
    starts = table.row_start.tolist()
    for e, size in enumerate(table.sizes):
        if size is None or starts[e + 1] == starts[e] or not len(size):
            extents.append(())
            continue
        rows = slice(starts[e], starts[e + 1])
        ends = table.offsets[rows, :len(size)] + table.lengths[rows, :len(size)]  # one entry's rows at a time
        extents.append(tuple(int(v) for v in ends.amax(0).tolist()))
    return extents


def inner_empty_entries(table: ChunkTable) -> list[int]:
    """Entries with a chunk of no elements lying strictly inside its tensor in a dimension where
    it has length 0: by stock's overlap test such a chunk overlaps boxes around it, so a rank
    cannot plan from its own section alone (entries whose empty chunks sit at an edge, the
    usual uneven split, are not listed)."""
    if not table.rows:
        return []
    width = int(table.offsets.shape[1])
    _, bounds = entry_bounds(table.sizes, width)
    found: set[int] = set()
    starts = table.row_start
    for a in range(0, table.rows, CHECK_ROWS):  # a bounded number of rows at a time
        b = min(table.rows, a + CHECK_ROWS)
        empty = (table.lengths[a:b] == 0).any(1)
        if not bool(empty.any()):
            continue
        rows = empty.nonzero()[:, 0] + a
        entry = torch.searchsorted(starts, rows, right=True) - 1
        offsets, lengths = table.offsets.index_select(0, rows), table.lengths.index_select(0, rows)
        inner = ((lengths == 0) & (offsets > 0) & (offsets < bounds.index_select(0, entry))).any(1)
        found.update(entry[inner].tolist())
    return sorted(found)

