"""The chunk index: a checkpoint's chunk table as raw columns in a file beside ``.metadata``, so a
rank reads the columns instead of unpickling millions of objects.

At 4,096 ranks a 7B state's ``.metadata`` is ~580 MB of pickle that every rank would unpickle into
~5 GB of objects (~2 minutes). The writer (:func:`fastdcp.format.metadata_emit.write_metadata`)
names the index in the ``.metadata`` itself (``fastdcp_chunk_index``, within its first bytes:
:func:`find_chunk_index_name`); ``.metadata`` stays a complete stock pickle, so stock readers and
fastdcp without the index read it as before. The index records the size of the ``.metadata`` it
describes and the CRC-32C of its first and last 64 KiB (:func:`metadata_facts`): a reader uses it
only when both still match.

Layout (all integers little-endian):

* a 128-byte header: magic ``FDCPCHIX``, format version, header size, flags (bit 0: storage
  columns present), table width, entries, rows, the ``.metadata`` facts, the element size (4 or 8)
  of each stored column, and the offset and length of the objects section;
* the columns, each starting at a multiple of 8 bytes: ``row_start`` (int64, entries + 1), then
  ``offsets`` and ``lengths`` (rows x width), then, with storage, ``file_index``, ``byte_offset``,
  ``byte_length`` and ``checksums`` (rows each); a column whose values fit int32 is stored as int32;
* the objects section: a pickle of a dict with ``fqns``, ``properties``, ``sizes``, ``files``,
  ``planner_data``, ``storage_meta`` and ``version``, read back with the restricted unpickler of
  :mod:`fastdcp.format.metadata`;
* a 8-byte trailer: ``FDCE`` and the CRC-32C of every byte before it.

Format version 2 (a save planned in bulk on several ranks: ``ChunkTable.rank_rows``) keeps all of
the above byte for byte and adds, so that a rank of a 16,384-rank job reads ~100 KB instead of the
whole index (:func:`read_rank_section`):

* in the header, after version 1's fields: the ``.metadata`` edge length the facts cover (4 KiB:
  a rank reads 8 KiB of ``.metadata``, not 128), the CRC-32C, offset and length of the shared
  objects, the directory's offset, the number of sections, the file's size, and the CRC-32C of
  the header itself (a rank reads the header alone);
* after the trailer, the shared objects: a zlib-compressed pickle of what a rank needs besides its
  rows (fqns, properties, sizes, each entry's chunk count and extents, the entries with empty
  chunks inside their tensor, ``planner_data``, ``storage_meta``, ``version``);
* one section per rank: the rows that rank planned in the save (replicated items' rows included)
  that can be read, as records with each row's position in its entry, then the numbers and
  names of the files those rows are in. Records are int64 (section magic ``FDRS``) or, when every
  value but byte offsets and checksums fits int32 (the usual case), narrow (``FDRN``): per row the
  byte offset and checksum as int64, then, after all rows, the other fields as int32 (48 bytes a
  row instead of 80 for 2-D tensors; an earlier reader refuses such a section and falls back to
  ``.metadata``). A chunk with no elements at its tensor's edge is left out: it overlaps no
  box, so no load plan reads it (at 16,384 ranks of a 7B model most ranks hold such a chunk of
  most tensors, and listing them made the index 4.2x the ``.metadata``);
  entries with an empty chunk inside the tensor keep every row;
* the directory: per rank, its section's offset, length and CRC-32C.

A version 1 reader refuses version 2 (and fastdcp falls back to ``.metadata``); this reader reads
both, the whole table from either.

:func:`read_chunk_index` treats the file as hostile: the declared sizes must add up to the file's
size before anything is allocated, the CRC must match, and every column is checked (row_start
monotonic from 0 to rows, one row per bytes entry, chunks inside their tensors, file indexes in
range, byte ranges non-negative and bounded, checksums 32-bit or absent). Every failure is a
:class:`~fastdcp.format.metadata.CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as _md

from .._native import _C
from .chunk_table import NO_CHECKSUM, ChunkTable, RankRows, StorageColumns
from .metadata import CheckpointFormatError, shown, unpickle_restricted
from .metadata_emit import CHUNK_INDEX_ATTRIBUTE
from .pickle_stream import tensor_view as _tensor_view

__all__ = [
    "EDGE_BYTES",
    "SECTION_EDGE_BYTES",
    "ChunkIndex",
    "IndexHeader",
    "RankSection",
    "edge_bytes_for",
    "has_rank_sections",
    "merge_sections",
    "read_index_header",
    "read_rank_section",
    "read_shared_objects",
    "pread_exactly",
    "source_metadata_facts",
    "write_chunk_index",
    "read_chunk_index",
    "find_chunk_index_name",
    "metadata_facts",
    "crc32c",
]

EDGE_BYTES = 64 << 10  # the .metadata's first and last bytes whose CRC-32C the index records
_MAGIC = b"FDCPCHIX"
_TRAILER_MAGIC = b"FDCE"
_FORMAT_VERSION = 1  # the table alone
_SECTIONS_VERSION = 2  # the table, then the shared objects and a section per rank
_HEADER_SIZE = 128
SECTION_EDGE_BYTES = 4 << 10  # version 2's .metadata edges: a rank reads 8 KiB of .metadata, not 128
# magic, version, header size, flags, width, entries, rows, metadata size, head crc, tail crc,
# element sizes of the 6 stored columns (+2 spare), objects offset, objects length
_HEADER = struct.Struct("<8sIIIIQQQII8sQQ")
_TRAILER = struct.Struct("<4sI")
# Version 2 only, after _HEADER: .metadata edge bytes, CRC-32C of the shared objects, their offset,
# the directory's offset, the number of sections, the file's size, the shared objects' length; then
# at _HEADER_CRC_AT the CRC-32C of the header's bytes before it (a rank reads the header alone).
_HEADER_V2 = struct.Struct("<IIQQQQ")
_HEADER_CRC_AT = 124
_DIRECTORY_ENTRY = struct.Struct("<QQII")  # section offset, length, CRC-32C, 0
_SECTION_MAGIC = b"FDRS"  # records as int64s
_NARROW_SECTION_MAGIC = b"FDRN"  # records split: the fields that need int64, then the rest as int32s
_SECTION_HEADER = struct.Struct("<4sIQII")  # magic, width, rows, files, bytes of file names
_SECTION_FIXED = 6  # record columns before the box: entry, ordinal, file, byte offset, byte length, checksum
_WIDE_FIELDS = (3, 5)  # of a narrow section's records, stored as int64: byte offset, checksum
_MAX_COMMON_RATIO = 64  # decompressed shared objects per compressed byte, at most (zip bombs)
_SECTION_BLOCK_ROWS = 1 << 20  # rank rows turned into sections at once (bounds the temporaries)
_SECTION_GATHER_ROWS = 1 << 18  # rank rows gathered field by field, then transposed into records, at once
_FLAG_STORAGE = 1
_MAX_WIDTH = 1024  # as fastdcp.format.metadata's _MAX_NDIM
_MAX_FILE_OFFSET = 1 << 62  # as fastdcp.format.metadata: byte ranges past this cannot be real
_CHECK_ROWS = 1 << 20  # rows validated at once (bounds the temporaries)
_LITTLE_ENDIAN = sys.byteorder == "little"
_OBJECT_KEYS = ("fqns", "properties", "sizes", "files", "planner_data", "storage_meta", "version")


@dataclass
class ChunkIndex:
    """A chunk index file's contents: the checkpoint's chunk table, the ``Metadata`` fields that
    are not per chunk, and the facts of the ``.metadata`` it was written for."""

    table: ChunkTable
    planner_data: Any
    storage_meta: Any
    version: str | None
    metadata_size: int
    metadata_head_crc: int
    metadata_tail_crc: int
    edge_bytes: int = EDGE_BYTES  # the .metadata edges the two CRCs cover


def crc32c(data: Any, seed: int = 0) -> int:
    """CRC-32C of a bytes-like object, computed natively with the GIL released.

    Args:
        data: any C-contiguous buffer (bytes, bytearray, memoryview, mmap, numpy array).
        seed: the CRC-32C of the bytes before ``data``; ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
    """
    return _C.crc32c(data, seed)


def metadata_facts(f: BinaryIO, edge_bytes: int = EDGE_BYTES) -> tuple[int, int, int]:
    """(size, CRC-32C of the first ``edge_bytes``, CRC-32C of the last ``edge_bytes``) of a
    ``.metadata`` open for reading (seekable; the position is left at the end)."""
    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    head = f.read(min(size, edge_bytes))
    f.seek(max(0, size - edge_bytes))
    tail = f.read(min(size, edge_bytes))
    return size, crc32c(head), crc32c(tail)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _le(t: torch.Tensor) -> torch.Tensor:
    """The little-endian bytes of a contiguous int tensor, as uint8."""
    raw = t.contiguous().view(torch.uint8)
    if _LITTLE_ENDIAN:
        return raw
    return raw.view(-1, t.element_size()).flip(1).contiguous().view(-1)


def _element_size(name: str, t: torch.Tensor) -> int:
    """4 when every value of column ``t`` fits int32 (file_index always does), else 8."""
    if name == "file_index" or t.numel() == 0:
        return 4
    lo, hi = (int(v) for v in torch.aminmax(t))
    return 4 if -(1 << 31) <= lo and hi < 1 << 31 else 8


def _native(t: torch.Tensor) -> torch.Tensor:
    """A 1-D int tensor read as little-endian bytes, in native byte order (the reverse of
    :func:`_le`; ``t`` itself on little-endian machines)."""
    if _LITTLE_ENDIAN or not t.numel():
        return t
    size = t.element_size()
    return t.view(torch.uint8).view(-1, size).flip(1).contiguous().view(t.dtype).view(-1)


def _pad(n: int) -> int:
    return -n % 8


def _columns_of(table: ChunkTable) -> list[tuple[str, torch.Tensor]]:
    cols = [("offsets", table.offsets), ("lengths", table.lengths)]
    if table.storage is not None:
        s = table.storage
        cols += [("file_index", s.file_index), ("byte_offset", s.byte_offset), ("byte_length", s.byte_length),
                 ("checksums", s.checksums)]
    return cols


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
    this index goes with (:func:`metadata_facts` of it, with :func:`edge_bytes_for` ``table``);
    ``planner_data``, ``storage_meta`` and ``version`` are the ones given to ``write_metadata``.
    A table with storage and ``rank_rows`` gets format version 2: the shared objects and one
    section per rank follow the table (see :func:`read_rank_section`). Preconditions: ``table``
    is consistent (as :func:`read_chunk_index` checks). Memory: one column at a time is narrowed
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
    columns = _columns_of(table)
    element_sizes = [_element_size(name, t) for name, t in columns]
    # Offsets of each section, as read_chunk_index recomputes them.
    at = _HEADER_SIZE + entries * 8 + 8
    for (_, t), size in zip(columns, element_sizes):
        at += _pad(at) + t.numel() * size
    objects_offset = at + _pad(at)
    sizes_by_name = dict(zip((name for name, _ in columns), element_sizes))
    sections = _SectionWriter(table, width, _fits_narrow_records(table, sizes_by_name),
                              dict(planner_data=planner_data, storage_meta=storage_meta, version=version)) \
        if has_rank_sections(table) else None
    header = _HEADER.pack(
        _MAGIC, _SECTIONS_VERSION if sections else _FORMAT_VERSION, _HEADER_SIZE,
        _FLAG_STORAGE if table.storage is not None else 0, width,
        entries, rows, metadata_size, metadata_head_crc, metadata_tail_crc, bytes(element_sizes).ljust(8, b"\0"),
        objects_offset, len(objects),
    )
    if sections is not None:
        common_offset = objects_offset + len(objects) + _TRAILER.size
        header += _HEADER_V2.pack(SECTION_EDGE_BYTES, crc32c(sections.common), common_offset,
                                  *sections.layout(common_offset))
        header += struct.pack("<I", len(sections.common))
        assert len(header) == _HEADER_CRC_AT
        header += struct.pack("<I", crc32c(header))
    header = header.ljust(_HEADER_SIZE, b"\0")

    written = 0
    crc = 0

    def emit(data: Any) -> None:
        nonlocal written, crc
        if len(data):
            out.write(data)
            crc = crc32c(data, crc)
            written += len(data)

    emit(header)
    emit(_tensor_view(_le(table.row_start.to(torch.int64))))
    for (_, t), size in zip(columns, element_sizes):
        emit(bytes(_pad(written)))
        stored = t.to(torch.int32 if size == 4 else torch.int64)  # one narrowed column at a time
        emit(_tensor_view(_le(stored)))
        del stored
    emit(bytes(_pad(written)))
    assert written == objects_offset
    emit(objects)
    out.write(_TRAILER.pack(_TRAILER_MAGIC, crc))
    written += _TRAILER.size
    if sections is not None:
        written += sections.write(out)
    return written


def has_rank_sections(table: ChunkTable) -> bool:
    """Whether :func:`write_chunk_index` gives ``table`` per-rank sections (format version 2)."""
    return table.storage is not None and table.rank_rows is not None and len(table.rank_rows.start) > 2


def edge_bytes_for(table: ChunkTable) -> int:
    """The ``.metadata`` edge length whose CRC-32C the index of ``table`` records."""
    return SECTION_EDGE_BYTES if has_rank_sections(table) else EDGE_BYTES


def _gather_into(dest: torch.Tensor, source: torch.Tensor, rows: torch.Tensor) -> None:
    """``dest[:] = source[rows]`` for a 1-D ``dest`` of ``len(rows)`` int64 values, gathered
    straight into ``dest`` when the dtypes match (no temporary)."""
    if source.dtype == dest.dtype:
        torch.index_select(source, 0, rows, out=dest)
    else:
        dest.copy_(source.index_select(0, rows))


class _SectionWriter:
    """Version 2's parts after the table: the shared objects (zlib-compressed pickle of what a
    rank needs besides its rows), one section per rank, the directory.

    A section holds the rows rank ``r`` planned in the save (``table.rank_rows``) but those of
    chunks with no elements at their tensor's edge (:func:`_readable_rank_rows`), ascending, as
    records ``entry, ordinal (the row's position in its entry), file, byte offset, byte length,
    checksum, offsets[width], lengths[width]``, where ``file`` is a checkpoint-wide file number
    (int64, or narrow: :func:`_fits_narrow_records`, :meth:`_parts`); then the numbers and names
    of the files it references.

    Ranks are handled in blocks of about ``_SECTION_BLOCK_ROWS`` rows (whole ranks, in order),
    each with tensor operations and batched native calls whose number does not grow with the
    block's ranks: at 16,384 ranks, native calls per rank (a CRC-32C, a write for each part of a
    section) would cost more than the whole table."""

    def __init__(self, table: ChunkTable, width: int, narrow: bool, facts: dict[str, Any]) -> None:
        """``narrow``: records in the narrow layout (:func:`_fits_narrow_records` of ``table``).
        Preconditions: ``table`` has storage columns and ``rank_rows`` and is consistent (as
        :func:`read_chunk_index` checks; each rank's rows ascending). Everything but the records
        is computed here, so that the header's layout (:meth:`layout`) is known before a byte of
        the sections is written."""
        assert table.storage is not None and table.rank_rows is not None
        self.table, self.width = table, width
        self.narrow = narrow
        counts = table.row_start[1:] - table.row_start[:-1]
        common = {
            "fqns": list(table.fqns), "properties": list(table.properties), "sizes": list(table.sizes),
            "row_counts": counts.tolist(), "extents": _entry_extents(table), "inner_empty": _inner_empty(table),
            **facts,
        }
        self.common = zlib.compress(pickle.dumps(common, protocol=4), 6)
        self.entry_of_row = table.entry_of_rows()  # (the records' first column, and which rows are readable)
        self.rank_rows = _readable_rank_rows(table, self.entry_of_row, common["inner_empty"])
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
        magic = _NARROW_SECTION_MAGIC if self.narrow else _SECTION_MAGIC
        for count, files in zip(self.counts, self.files_of_rank):
            names = b"\0".join([encoded[f] for f in files])
            self.headers.append(_SECTION_HEADER.pack(magic, width, count, len(files), len(names)))
            self.tails.append(struct.pack(f"<{len(files)}q", *files) + names)
        self.lengths = [_SECTION_HEADER.size + count * self._record_bytes() + len(tail)
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
        return _SECTION_FIXED + 2 * self.width

    def _record_bytes(self) -> int:
        columns = self._record_columns()
        return 8 * len(_WIDE_FIELDS) + 4 * (columns - len(_WIDE_FIELDS)) if self.narrow else 8 * columns

    def layout(self, common_offset: int) -> tuple[int, int, int]:
        """(directory offset, sections, file size) for shared objects at ``common_offset``."""
        self.sections_start = common_offset + len(self.common)
        directory = self.sections_start + sum(self.lengths)
        return directory, self.ranks, directory + self.ranks * _DIRECTORY_ENTRY.size

    def _field_order(self) -> list[int]:
        """The record fields (0 entry, 1 ordinal, 2 file, 3 byte offset, 4 byte length, 5 checksum,
        then offsets and lengths) in the order they are stored: narrow records put the int64
        fields first (:meth:`_parts`)."""
        fields = range(self._record_columns())
        return list(fields) if not self.narrow else [*_WIDE_FIELDS, *(f for f in fields if f not in _WIDE_FIELDS)]

    def _parts(self) -> list[tuple[int, int, torch.dtype]]:
        """Each record's stored parts as (first, end) positions in :meth:`_field_order` and the
        dtype: one int64 part, or (narrow) the int64 fields, then the rest as int32. A section
        holds a part's values for all its rows before the next part's."""
        columns = self._record_columns()
        if not self.narrow:
            return [(0, columns, torch.int64)]
        return [(0, len(_WIDE_FIELDS), torch.int64), (len(_WIDE_FIELDS), columns, torch.int32)]

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
            raw_tensors = [_le(block.reshape(-1)) for block in blocks]  # kept alive while their views are written
            raws = [_tensor_view(t) for t in raw_tensors]
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
            entries.append(_DIRECTORY_ENTRY.pack(at_byte, length, crc, 0))
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


def _fits_narrow_records(table: ChunkTable, element_sizes: dict[str, int] | None = None) -> bool:
    """Whether every section record of ``table`` fits the narrow layout: all fields but the byte
    offset and the checksum within int32, by the rule the table part's columns are narrowed by
    (:func:`_element_size`; ``element_sizes`` by column name when already known). Entries,
    ordinals and file numbers are below the row and file counts."""
    storage = table.storage
    assert storage is not None
    if table.rows >= 1 << 31 or len(storage.files) >= 1 << 31:
        return False
    if element_sizes is None:
        element_sizes = {name: _element_size(name, t) for name, t in _columns_of(table)}
    return all(element_sizes[name] == 4 for name in ("offsets", "lengths", "byte_length"))


def _readable_rank_rows(table: ChunkTable, entry: torch.Tensor, inner_empty: list[int]) -> RankRows:
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


def _entry_extents(table: ChunkTable) -> list[tuple[int, ...]]:
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


def _inner_empty(table: ChunkTable) -> list[int]:
    """Entries with a chunk of no elements lying strictly inside its tensor in a dimension where
    it has length 0: by stock's overlap test such a chunk overlaps boxes around it, so a rank
    cannot plan from its own section alone (entries whose empty chunks sit at an edge, the
    usual uneven split, are not listed)."""
    if not table.rows:
        return []
    width = int(table.offsets.shape[1])
    _, bounds = _entry_bounds(table.sizes, width)
    found: set[int] = set()
    starts = table.row_start
    for a in range(0, table.rows, _CHECK_ROWS):  # a bounded number of rows at a time
        b = min(table.rows, a + _CHECK_ROWS)
        empty = (table.lengths[a:b] == 0).any(1)
        if not bool(empty.any()):
            continue
        rows = empty.nonzero()[:, 0] + a
        entry = torch.searchsorted(starts, rows, right=True) - 1
        offsets, lengths = table.offsets.index_select(0, rows), table.lengths.index_select(0, rows)
        inner = ((lengths == 0) & (offsets > 0) & (offsets < bounds.index_select(0, entry))).any(1)
        found.update(entry[inner].tolist())
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


class _Source:
    """Sequential reads from bytes or a file object, with the running CRC of what was read."""

    def __init__(self, data: Any, where: str) -> None:
        self.where = where
        self.crc = 0
        self.pos = 0
        if hasattr(data, "readinto") or hasattr(data, "read"):
            self.file: Any = data
            self.buffer: memoryview | None = None
            try:
                self.size = os.fstat(data.fileno()).st_size - data.tell()
            except (AttributeError, OSError, io.UnsupportedOperation):
                here = data.tell()
                self.size = data.seek(0, io.SEEK_END) - here
                data.seek(here)
        else:
            self.file = None
            self.buffer = memoryview(data).cast("B")
            self.size = len(self.buffer)

    def fail(self, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.where}: {problem}")

    def read_into(self, dest: memoryview) -> None:
        n = len(dest)
        if self.pos + n > self.size:
            raise self.fail(f"truncated: needs bytes up to {self.pos + n}, the file has {self.size}")
        if self.buffer is not None:
            dest[:] = self.buffer[self.pos : self.pos + n]
        else:
            got = 0
            while got < n:
                k = self.file.readinto(dest[got:]) if hasattr(self.file, "readinto") else None
                if k is None:
                    chunk = self.file.read(n - got)
                    k = len(chunk)
                    dest[got : got + k] = chunk
                if not k:
                    raise self.fail(f"truncated: the file ended at byte {self.pos + got} while {n - got} more "
                                    f"bytes were expected")
                got += k
        self.crc = crc32c(dest, self.crc)
        self.pos += n

    def read_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def read_column(self, count: int, element_size: int) -> torch.Tensor:
        """``count`` little-endian ints of ``element_size`` bytes as int64 (file_index: int32)."""
        skip = _pad(self.pos)
        if skip:
            if any(self.read_bytes(skip)):
                raise self.fail(f"non-zero padding before byte {self.pos}")
        t = torch.empty(count, dtype=torch.int32 if element_size == 4 else torch.int64)
        if count:
            self.read_into(_tensor_view(t.view(torch.uint8)))
        return _native(t)


def read_chunk_index(data: Any, where: str, *, allow_unsafe: bool = False) -> ChunkIndex:
    """Read and check a chunk index (bytes-like, or a binary file object positioned at its start);
    ``where`` names it in errors. The small objects (fqns, properties, planner_data, ...) are
    unpickled with the restricted unpickler of ``.metadata``, or with plain :mod:`pickle` when
    ``allow_unsafe`` (only for a trusted checkpoint, as ``allow_unsafe_metadata``).

    Raises :class:`CheckpointFormatError` unless every size, column and object is consistent:
    see the module docstring. Memory: the table's columns (int64; file_index int32) plus one
    stored column at a time."""
    src = _Source(data, where)
    fail = src.fail
    if src.size < _HEADER_SIZE + _TRAILER.size:
        raise fail(f"is {src.size} bytes, too short for a chunk index")
    header = src.read_bytes(_HEADER_SIZE)
    (magic, version, header_size, flags, width, entries, rows, md_size, head_crc, tail_crc, elem, objects_offset,
     objects_length) = _HEADER.unpack_from(header)
    if magic != _MAGIC:
        raise fail(f"not a fastdcp chunk index (magic {shown(magic)})")
    if version not in (_FORMAT_VERSION, _SECTIONS_VERSION):
        raise fail(f"chunk index format version {version} is not supported (this fastdcp reads "
                   f"{_FORMAT_VERSION} and {_SECTIONS_VERSION})")
    if header_size != _HEADER_SIZE or flags & ~_FLAG_STORAGE:
        raise fail(f"unexpected header (size {header_size}, flags {flags:#x})")
    if width > _MAX_WIDTH:
        raise fail(f"table width {width} exceeds {_MAX_WIDTH} dimensions")
    has_storage = bool(flags & _FLAG_STORAGE)
    ncols = 6 if has_storage else 2
    sizes = list(elem[:ncols])
    if any(s not in (4, 8) for s in sizes) or any(elem[ncols:]) or (has_storage and sizes[2] != 4):
        raise fail(f"invalid column element sizes {list(elem)}")
    counts = [rows * width, rows * width] + ([rows] * 4 if has_storage else [])
    # The layout the header declares must add up to the file's size before anything is allocated.
    at = _HEADER_SIZE + (entries + 1) * 8
    for count, size in zip(counts, sizes):
        at += _pad(at) + count * size
    at += _pad(at)
    expected = at + objects_length + _TRAILER.size
    if version == _SECTIONS_VERSION:
        v2 = _parse_v2_header(header, fail)
        if v2.file_size != src.size or v2.common_offset != expected:
            raise fail(f"the header declares a {v2.file_size}-byte file with shared objects at {v2.common_offset}, "
                       f"but the file is {src.size} bytes and its table ends at {expected} (truncated, or lengths "
                       f"that lie)")
        table_size = expected
    else:
        table_size = src.size
    if objects_offset != at or expected != table_size:
        raise fail(
            f"the header declares {entries} entries, {rows} rows of width {width} and {objects_length} bytes of "
            f"objects ({expected} bytes in all, objects at {at}), but the file is {src.size} bytes with objects "
            f"declared at {objects_offset} (truncated, or lengths that lie)"
        )

    row_start = src.read_column(entries + 1, 8)
    cols = [src.read_column(count, size) for count, size in zip(counts, sizes)]
    src.read_column(0, 8)  # padding before the objects
    objects_bytes = src.read_bytes(objects_length)
    crc_before_trailer = src.crc
    trailer = src.read_bytes(_TRAILER.size)
    tmagic, crc = _TRAILER.unpack(trailer)
    if tmagic != _TRAILER_MAGIC or crc != crc_before_trailer:
        raise fail(f"checksum mismatch (recorded {crc:#010x}, computed {crc_before_trailer:#010x}): the file is "
                   f"damaged or truncated")

    objects = _unpickle_objects(objects_bytes, "objects section", fail, where, allow_unsafe)
    if type(objects) is not dict or set(objects) != set(_OBJECT_KEYS):
        raise fail("the objects section is not the expected dict")
    fqns, properties, table_sizes, files = (objects[k] for k in ("fqns", "properties", "sizes", "files"))
    _check_objects(fail, entries, fqns, properties, table_sizes, files, has_storage, objects)

    offsets = cols[0].to(torch.int64).view(rows, width)
    lengths = cols[1].to(torch.int64).view(rows, width)
    storage = None
    if has_storage:
        storage = StorageColumns(
            files=list(files),
            file_index=cols[2],
            byte_offset=cols[3].to(torch.int64),
            byte_length=cols[4].to(torch.int64),
            checksums=cols[5].to(torch.int64),
        )
    cols.clear()
    table = ChunkTable(list(fqns), list(properties), list(table_sizes), row_start, offsets, lengths, storage)
    _check_columns(fail, table)
    return ChunkIndex(
        table=table,
        planner_data=objects["planner_data"],
        storage_meta=objects["storage_meta"],
        version=objects["version"],
        metadata_size=md_size,
        metadata_head_crc=head_crc,
        metadata_tail_crc=tail_crc,
        edge_bytes=SECTION_EDGE_BYTES if version == _SECTIONS_VERSION else EDGE_BYTES,
    )


def _unpickle_objects(data: bytes, what: str, fail: Any, where: str, allow_unsafe: bool) -> Any:
    """The index's pickled objects: restricted unpickling (errors name ``where``), or plain
    :mod:`pickle` when ``allow_unsafe`` (errors through ``fail``)."""
    if not allow_unsafe:
        try:
            return unpickle_restricted(data, where)
        except CheckpointFormatError as e:
            if where == what:  # (a section's shared objects: the message gets the index's name)
                raise fail(str(e)) from None
            raise
    try:
        return pickle.loads(data)
    except Exception as e:
        raise fail(f"unreadable {what} ({type(e).__name__}: {str(e)[:200]})") from e


def _check_objects(fail: Any, entries: int, fqns: Any, properties: Any, sizes: Any, files: Any, has_storage: bool,
                   objects: dict) -> None:
    for name, value in (("fqns", fqns), ("properties", properties), ("sizes", sizes), ("files", files)):
        if type(value) is not list:
            raise fail(f"{name} is a {type(value).__name__}, not a list")
    if not len(fqns) == len(properties) == len(sizes) == entries:
        raise fail(f"the header declares {entries} entries but the objects name {len(fqns)} fqns, "
                   f"{len(properties)} properties and {len(sizes)} sizes")
    if not all(type(f) is str for f in fqns):
        raise fail("an fqn is not a string")
    if len(set(fqns)) != len(fqns):
        raise fail("an fqn is listed twice")
    for fqn, props, size in zip(fqns, properties, sizes):
        if (props is None) != (size is None):
            raise fail(f"entry {shown(fqn)} has properties {type(props).__name__} but size {shown(size)}")
        if size is None:
            continue
        if not isinstance(props, _md.TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise fail(f"entry {shown(fqn)} has invalid properties (no dtype)")
        if type(size) is not torch.Size or len(size) > _MAX_WIDTH or any(d < 0 for d in size):
            raise fail(f"entry {shown(fqn)} has an invalid size {shown(size)}")
    if not all(type(f) is str and f for f in files):
        raise fail("a data file name is not a non-empty string")
    if not has_storage and files:
        raise fail("files are listed but there are no storage columns")
    sm = objects["storage_meta"]
    if sm is not None and not isinstance(sm, _md.StorageMeta):
        raise fail(f"storage_meta is a {type(sm).__name__}, not StorageMeta")
    version = objects["version"]
    if version is not None and type(version) is not str:
        raise fail(f"version is a {type(version).__name__}, not a string")


def _entry_bounds(sizes: list[Any], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ndims, bounds): each entry's dimension count (-1: bytes) and its size padded with zeros
    to ``width`` (a row's chunk must lie inside it; columns past ndim, and bytes rows, must be 0)."""
    ndims = torch.tensor([-1 if s is None else len(s) for s in sizes], dtype=torch.int64)
    flat = [0] * (len(sizes) * width)
    for e, size in enumerate(sizes):
        if size is not None and len(size) <= width:
            flat[e * width: e * width + len(size)] = list(size)
    return ndims, torch.tensor(flat, dtype=torch.int64).view(len(sizes), width)


def _check_columns(fail: Any, table: ChunkTable, partial: bool = False,
                   entry_bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Every column against the others (vectorised; a bounded number of rows at a time).
    ``partial``: the table is one rank's section, where a bytes entry may have no row;
    ``entry_bounds``: :func:`_entry_bounds` of the table's sizes, when already known."""
    entries, rows, width = len(table.fqns), table.rows, int(table.offsets.shape[1])
    row_start = table.row_start
    if int(row_start[0]) != 0 or int(row_start[-1]) != rows:
        raise fail(f"row_start runs from {int(row_start[0])} to {int(row_start[-1])}, not from 0 to {rows}")
    counts = row_start[1:] - row_start[:-1]
    if entries and bool((counts < 0).any()):
        e = int(torch.nonzero(counts < 0)[0])
        raise fail(f"row_start decreases at entry {shown(table.fqns[e])}")
    ndims, bounds = entry_bounds if entry_bounds is not None else _entry_bounds(table.sizes, width)
    is_bytes = ndims < 0
    wrong = (counts > 1) if partial else (counts != 1)
    if bool((is_bytes & wrong).any()):
        e = int(torch.nonzero(is_bytes & wrong)[0])
        raise fail(f"bytes entry {shown(table.fqns[e])} has {int(counts[e])} rows (must be 1)")
    if bool(((ndims > width) & (counts > 0)).any()):
        e = int(torch.nonzero((ndims > width) & (counts > 0))[0])
        raise fail(f"entry {shown(table.fqns[e])} has {int(ndims[e])} dimensions, more than the table's {width}")
    storage = table.storage
    nfiles = len(storage.files) if storage is not None else 0
    for start in range(0, rows, _CHECK_ROWS):
        end = min(rows, start + _CHECK_ROWS)
        entry = torch.searchsorted(row_start, torch.arange(start, end, dtype=torch.int64), right=True) - 1
        limit = bounds[entry]
        off, length = table.offsets[start:end], table.lengths[start:end]
        bad = (off < 0) | (length < 0) | (off > limit) | (length > limit - off)
        if width and bool(bad.any()):
            r = int(torch.nonzero(bad.any(1))[0])
            e = int(entry[r])
            raise fail(
                f"row {start + r} of entry {shown(table.fqns[e])}: chunk (offsets {shown(off[r].tolist())}, lengths "
                f"{shown(length[r].tolist())}) lies outside the tensor of size {shown(table.sizes[e])}"
            )
        if storage is None:
            continue
        fi = storage.file_index[start:end]
        bo, bl, ck = storage.byte_offset[start:end], storage.byte_length[start:end], storage.checksums[start:end]
        checks = (
            ((fi < 0) | (fi >= nfiles), lambda r: f"names file number {int(fi[r])} of {nfiles}"),
            ((bo < 0) | (bl < 0) | (bo > _MAX_FILE_OFFSET) | (bl > _MAX_FILE_OFFSET - bo),
             lambda r: f"has an invalid byte range (offset {int(bo[r])}, length {int(bl[r])})"),
            (((ck < 0) & (ck != NO_CHECKSUM)) | (ck >= 1 << 32), lambda r: f"has an invalid checksum {int(ck[r])}"),
        )
        for bad_rows, problem in checks:
            if bool(bad_rows.any()):
                r = int(torch.nonzero(bad_rows)[0])
                raise fail(f"row {start + r} of entry {shown(table.fqns[int(entry[r])])} {problem(r)}")


# ---------------------------------------------------------------------------------------------
# Reading one rank's section (version 2)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _V2Header:
    edge_bytes: int
    common_crc: int
    common_offset: int
    directory_offset: int
    sections: int
    file_size: int
    common_length: int


def _parse_v2_header(header: bytes, fail: Any) -> _V2Header:
    (common_length, recorded) = struct.unpack_from("<II", header, _HEADER_CRC_AT - 4)
    fields = _V2Header(*_HEADER_V2.unpack_from(header, _HEADER.size), common_length)
    if recorded != crc32c(header[:_HEADER_CRC_AT]):
        raise fail("header checksum mismatch: the file is damaged")
    if fields.edge_bytes != SECTION_EDGE_BYTES:
        raise fail(f"unexpected version 2 header (edge bytes {fields.edge_bytes})")
    if not (_HEADER_SIZE <= fields.common_offset <= fields.common_offset + common_length <= fields.directory_offset
            <= fields.file_size
            and fields.file_size - fields.directory_offset == fields.sections * _DIRECTORY_ENTRY.size):
        raise fail(f"the header's layout does not add up (shared objects at {fields.common_offset}, directory at "
                   f"{fields.directory_offset} for {fields.sections} sections, {fields.file_size} bytes)")
    return fields


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
    v2: _V2Header | None


@dataclass
class RankSection:
    """One rank's section of a version 2 chunk index: the rows that rank planned in the save as a
    :class:`ChunkTable` naming every entry of the checkpoint (entries the rank did not save have
    no rows), plus what planning from part of the table needs to stay exactly stock's plan.

    ``ordinals[i]`` is row ``i``'s position among all chunks of its entry (its index hint);
    ``row_counts[e]`` entry ``e``'s chunks in the whole checkpoint; ``extents[e]`` the largest
    chunk end per dimension over all of them; ``inner_empty`` the entries with an empty chunk
    strictly inside the tensor (see ``_inner_empty``)."""

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


def _size_of(source: Any) -> int:
    """The size of ``source``: a file descriptor, or a positional source (``size()``)."""
    return os.fstat(source).st_size if isinstance(source, int) else int(source.size())


def pread_exactly(source: Any, offset: int, length: int, fail: Any) -> bytearray:
    """``length`` bytes of ``source`` from ``offset`` in a writable buffer. ``source``: a file
    descriptor (read with ``pread``: the file position is not used) or a positional source
    (:class:`fastdcp.io.positional.PositionalSource`: a file, or an object read by ranged GETs);
    ``fail(problem)`` makes the error raised when it ends first."""
    data = bytearray(length)
    view = memoryview(data)
    done = 0
    while done < length:
        if isinstance(source, int):
            n = os.preadv(source, [view[done:done + (64 << 20)]], offset + done)
        else:
            n = source.read_into(offset + done, view[done:])
        if not n:
            raise fail(f"truncated: needs bytes up to {offset + length}, the file ended at {offset + done}")
        done += n
    return data


def source_metadata_facts(source: Any, edge_bytes: int, head: bytes = b"") -> tuple[int, int, int]:
    """:func:`metadata_facts` of a ``.metadata`` read through ``source`` (a file descriptor or a
    positional source), by positional reads; ``head``: its first bytes when already read (used
    for as many of the edges as they cover, so a small file costs no second read)."""
    fail = lambda problem: CheckpointFormatError(f"'{getattr(source, 'name', source)}': {problem}")  # noqa: E731
    size = _size_of(source)
    first = min(size, edge_bytes)
    head_part = head[:first] if len(head) >= first else bytes(pread_exactly(source, 0, first, fail))
    start = max(0, size - edge_bytes)
    tail_part = head[start:size] if len(head) >= size else bytes(pread_exactly(source, start, size - start, fail))
    return size, crc32c(head_part), crc32c(tail_part)


def read_index_header(source: Any, where: str) -> IndexHeader:
    """The first bytes of the chunk index ``source`` (a file descriptor or a positional source, see
    :func:`pread_exactly`), by one positional read. Raises
    :class:`CheckpointFormatError` for anything not a chunk index of a supported version, and for
    a version 2 header whose own checksum or layout is wrong."""
    fail = lambda problem: CheckpointFormatError(f"{where}: {problem}")  # noqa: E731
    header = pread_exactly(source, 0, _HEADER_SIZE, fail)
    (magic, version, header_size, flags, width, entries, rows, md_size, head_crc, tail_crc, _, _, _) = \
        _HEADER.unpack_from(header)
    if magic != _MAGIC:
        raise fail(f"not a fastdcp chunk index (magic {shown(magic)})")
    if version not in (_FORMAT_VERSION, _SECTIONS_VERSION) or header_size != _HEADER_SIZE:
        raise fail(f"chunk index format version {version} is not supported")
    v2 = _parse_v2_header(header, fail) if version == _SECTIONS_VERSION else None
    if v2 is not None and _size_of(source) != v2.file_size:
        raise fail(f"is {_size_of(source)} bytes, its header says {v2.file_size} (truncated or appended to)")
    return IndexHeader(version, md_size, head_crc, tail_crc, v2.edge_bytes if v2 else EDGE_BYTES, entries, width, v2)


def read_shared_objects(source: Any, header: IndexHeader, where: str, *, allow_unsafe: bool = False) -> dict[str, Any]:
    """The shared objects of the version 2 chunk index ``source`` (see :func:`read_index_header`;
    one ranged read): every
    entry's fqn, properties, size, chunk count and extents, the entries with inner empty chunks,
    ``planner_data``, ``storage_meta``, ``version``; and ``"bytes_read"``. Checked (CRC-32C,
    bounded decompression, restricted unpickling unless ``allow_unsafe``); failures raise
    :class:`CheckpointFormatError` naming ``where``."""
    v2 = header.v2
    fail = lambda problem: CheckpointFormatError(f"{where}: {problem}")  # noqa: E731
    if v2 is None:
        raise fail("has no shared objects (format version 1)")
    packed = pread_exactly(source, v2.common_offset, v2.common_length, fail)
    if crc32c(packed) != v2.common_crc:
        raise fail("the shared objects' checksum does not match: the file is damaged")
    common = _common_objects(packed, header, fail, allow_unsafe)
    common["bytes_read"] = _HEADER_SIZE + v2.common_length
    return common


def read_rank_section(source: Any, header: IndexHeader, rank: int, where: str, *, allow_unsafe: bool = False,
                      shared: dict[str, Any] | None = None) -> RankSection | None:
    """Rank ``rank``'s section of the version 2 chunk index ``source`` (see
    :func:`read_index_header`), by ranged reads: the directory entry, the section, and the shared
    objects unless given (``shared``, from :func:`read_shared_objects`). None when the index has
    no section for ``rank`` (version 1, or a save with fewer ranks).

    Everything read is checked as :func:`read_chunk_index` checks the whole table (CRC-32C of
    the section and of the shared objects, every record against the entries' sizes and the
    file list); failures raise :class:`CheckpointFormatError` naming ``where``. Memory: the
    section and the shared objects (decompressed at most ``_MAX_COMMON_RATIO`` times their size)."""
    v2 = header.v2
    if v2 is None or not 0 <= rank < v2.sections:
        return None
    fail = lambda problem: CheckpointFormatError(f"{where}: section of rank {rank}: {problem}")  # noqa: E731
    entry = pread_exactly(source, v2.directory_offset + rank * _DIRECTORY_ENTRY.size, _DIRECTORY_ENTRY.size, fail)
    offset, length, crc, zero = _DIRECTORY_ENTRY.unpack(entry)
    sections_start = v2.common_offset + v2.common_length
    if zero or not (sections_start <= offset and length >= _SECTION_HEADER.size
                    and offset + length <= v2.directory_offset):
        raise fail(f"directory entry (offset {offset}, length {length}) lies outside the sections")
    raw = pread_exactly(source, offset, length, fail)
    if crc32c(raw) != crc:
        raise fail(f"checksum mismatch (recorded {crc:#010x}): the file is damaged")
    bytes_read = _DIRECTORY_ENTRY.size + length
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


_COMMON_KEYS = ("fqns", "properties", "sizes", "row_counts", "extents", "inner_empty", "planner_data", "storage_meta",
                "version")


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
    common = _unpickle_objects(data, "shared objects", fail, "shared objects", allow_unsafe)
    if type(common) is not dict or set(common) != set(_COMMON_KEYS):
        raise fail("the shared objects are not the expected dict")
    entries = header.entries
    _check_objects(where_fail, entries, common["fqns"], common["properties"], common["sizes"], [], True, common)
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
    return _native(torch.frombuffer(raw, dtype=dtype, offset=offset, count=count))


def _section_table(raw: bytearray, header: IndexHeader, common: dict[str, Any], fail: Any
                   ) -> tuple[ChunkTable, torch.Tensor]:
    """A section's records as a :class:`ChunkTable` (every entry named, the section's rows) and
    the rows' ordinals; checked like a whole table."""
    magic, width, rows, nfiles, names_length = _SECTION_HEADER.unpack_from(raw)
    columns = _SECTION_FIXED + 2 * width
    if magic not in (_SECTION_MAGIC, _NARROW_SECTION_MAGIC) or width != header.width:
        raise fail(f"not a section (magic {shown(magic)}, width {width} of the table's {header.width})")
    narrow = magic == _NARROW_SECTION_MAGIC
    wide_columns = len(_WIDE_FIELDS) if narrow else columns
    records_bytes = rows * (wide_columns * 8 + (columns - wide_columns) * 4)
    expected = _SECTION_HEADER.size + records_bytes + nfiles * 8 + names_length
    if expected != len(raw):
        raise fail(f"declares {rows} rows and {nfiles} files ({expected} bytes) but is {len(raw)} bytes")
    body = _SECTION_HEADER.size  # where the records start in ``raw`` (read into a writable buffer)
    wide = _section_numbers(raw, body, rows * wide_columns, torch.int64).view(rows, wide_columns)
    if narrow:  # the records rebuilt as int64 [rows, columns], fields in their logical order
        rest = _section_numbers(raw, body + rows * wide_columns * 8, rows * (columns - wide_columns), torch.int32)
        records = torch.empty((rows, columns), dtype=torch.int64)
        others = [f for f in range(columns) if f not in _WIDE_FIELDS]
        records[:, list(_WIDE_FIELDS)] = wide
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
                       records[:, _SECTION_FIXED:_SECTION_FIXED + width].clone(),
                       records[:, _SECTION_FIXED + width:].clone(), storage)
    if not all(names):  # (the entries were checked with the shared objects)
        raise fail("a data file name is empty")
    if "entry_bounds" not in common:  # once per shared objects, not per section
        common["entry_bounds"] = _entry_bounds(table.sizes, width)
    _check_columns(fail, table, partial=True, entry_bounds=common["entry_bounds"])
    return table, ordinal


# ---------------------------------------------------------------------------------------------
# Finding the index from the head of a .metadata
# ---------------------------------------------------------------------------------------------

_MD_MODULE = "torch.distributed.checkpoint.metadata"


def find_chunk_index_name(head: bytes) -> str | None:
    """The chunk index file named by a ``.metadata`` :func:`write_metadata` wrote, from its first
    bytes (4 KiB are plenty); ``None`` for anything else (stock-written metadata, garbage, too few
    bytes). Never raises.

    Recognises exactly the opening ``write_metadata`` emits: PROTO, an optional FRAME, the
    ``Metadata`` class (``STACK_GLOBAL`` of memoised strings), ``EMPTY_TUPLE NEWOBJ EMPTY_DICT``,
    then the key ``fastdcp_chunk_index`` and a string value set with ``SETITEM``."""
    try:
        return _find_chunk_index_name(bytes(head[:1 << 16]))
    except Exception:  # noqa: BLE001 - garbage in, None out
        return None


def _find_chunk_index_name(data: bytes) -> str | None:
    if len(data) < 2 or data[0] != pickle.PROTO[0] or not 2 <= data[1] <= 5:
        return None
    p = 2
    stack: list[Any] = []
    memo: list[Any] = []
    n = len(data)
    for _ in range(64):  # the opening is a dozen opcodes
        if p >= n:
            return None
        op = data[p : p + 1]
        p += 1
        if op == pickle.FRAME:
            p += 8
        elif op in (pickle.SHORT_BINUNICODE, pickle.BINUNICODE):
            if op == pickle.SHORT_BINUNICODE:
                if p >= n:
                    return None
                length, p = data[p], p + 1
            else:
                (length,), p = struct.unpack_from("<I", data, p), p + 4
            if p + length > n:
                return None
            stack.append(data[p : p + length].decode("utf-8", "surrogatepass"))
            p += length
        elif op == pickle.MEMOIZE:
            memo.append(stack[-1])
        elif op == pickle.BINGET:
            stack.append(memo[data[p]])
            p += 1
        elif op == pickle.LONG_BINGET:
            stack.append(memo[struct.unpack_from("<I", data, p)[0]])
            p += 4
        elif op == pickle.STACK_GLOBAL:
            name, module = stack.pop(), stack.pop()
            stack.append(("global", module, name))
        elif op == pickle.EMPTY_TUPLE:
            stack.append(())
        elif op == pickle.NEWOBJ:
            args, cls = stack.pop(), stack.pop()
            if cls != ("global", _MD_MODULE, "Metadata") or args != ():
                return None
            stack.append("metadata")
        elif op == pickle.EMPTY_DICT:
            stack.append({})
        elif op == pickle.SETITEM:
            if len(stack) != 4 or stack[:2] != ["metadata", {}]:
                return None
            key, value = stack[2], stack[3]
            if key != CHUNK_INDEX_ATTRIBUTE or type(value) is not str or not value:
                return None
            return value
        else:
            return None
    return None

