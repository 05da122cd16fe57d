"""Reading a whole chunk index (:mod:`fastdcp.format.index_layout`) as hostile input: the declared
sizes must add up to the file's size before anything is allocated, the CRC-32C must match, and
every column is checked against the others (row_start monotonic from 0 to rows, one row per bytes
entry, chunks inside their tensors, file indexes in range, byte ranges non-negative and bounded,
checksums 32-bit or absent). Every failure is a
:class:`~fastdcp.format.metadata.CheckpointFormatError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md

from .checksums import crc32c
from .chunk_table import NO_CHECKSUM, ChunkTable, StorageColumns
from .index_layout import (
    CHECK_ROWS,
    EDGE_BYTES,
    FLAG_STORAGE,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_FILE_OFFSET,
    MAX_WIDTH,
    OBJECT_KEYS,
    SECTION_EDGE_BYTES,
    SECTIONS_VERSION,
    TRAILER,
    TRAILER_MAGIC,
    entry_bounds,
    from_le,
    pad,
    parse_v2_header,
)
from .metadata import CheckpointFormatError, shown, unpickle_restricted
from .pickle_stream import tensor_view
from .pickles import load_pickle
from .sources import PositionalSource, as_source

__all__ = ["ChunkIndex", "read_chunk_index", "check_objects", "check_columns", "unpickle_objects"]


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


class _Cursor:
    """Reads a source front to back, with the running CRC-32C of what was read."""

    def __init__(self, source: PositionalSource, where: str) -> None:
        self.source = source
        self.where = where
        self.crc = 0
        self.pos = 0
        self.size = source.size()

    def fail(self, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.where}: {problem}")

    def read_into(self, dest: memoryview) -> None:
        n = len(dest)
        if self.pos + n > self.size:
            raise self.fail(f"truncated: needs bytes up to {self.pos + n}, the file has {self.size}")
        got = 0
        while got < n:
            k = self.source.read_into(self.pos + got, dest[got:])
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
        skip = pad(self.pos)
        if skip:
            if any(self.read_bytes(skip)):
                raise self.fail(f"non-zero padding before byte {self.pos}")
        t = torch.empty(count, dtype=torch.int32 if element_size == 4 else torch.int64)
        if count:
            self.read_into(tensor_view(t.view(torch.uint8)))
        return from_le(t)


def read_chunk_index(data: Any, where: str, *, allow_unsafe: bool = False) -> ChunkIndex:
    """Read and check a whole chunk index: bytes-like, or a
    :class:`~fastdcp.format.sources.PositionalSource` (read front to back); ``where`` names it in
    errors. The small objects (fqns, properties, planner_data, ...) are
    unpickled with the restricted unpickler of ``.metadata``, or with plain :mod:`pickle` when
    ``allow_unsafe`` (only for a trusted checkpoint, as ``allow_unsafe_metadata``).

    Raises :class:`CheckpointFormatError` unless every size, column and object is consistent:
    see the module docstring. Memory: the table's columns (int64; file_index int32) plus one
    stored column at a time."""
    src = _Cursor(as_source(data), where)
    fail = src.fail
    if src.size < HEADER_SIZE + TRAILER.size:
        raise fail(f"is {src.size} bytes, too short for a chunk index")
    header = src.read_bytes(HEADER_SIZE)
    (magic, version, header_size, flags, width, entries, rows, md_size, head_crc, tail_crc, elem, objects_offset,
     objects_length) = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise fail(f"not a fastdcp chunk index (magic {shown(magic)})")
    if version not in (FORMAT_VERSION, SECTIONS_VERSION):
        raise fail(f"chunk index format version {version} is not supported (this fastdcp reads "
                   f"{FORMAT_VERSION} and {SECTIONS_VERSION})")
    if header_size != HEADER_SIZE or flags & ~FLAG_STORAGE:
        raise fail(f"unexpected header (size {header_size}, flags {flags:#x})")
    if width > MAX_WIDTH:
        raise fail(f"table width {width} exceeds {MAX_WIDTH} dimensions")
    has_storage = bool(flags & FLAG_STORAGE)
    ncols = 6 if has_storage else 2
    sizes = list(elem[:ncols])
    if any(s not in (4, 8) for s in sizes) or any(elem[ncols:]) or (has_storage and sizes[2] != 4):
        raise fail(f"invalid column element sizes {list(elem)}")
    counts = [rows * width, rows * width] + ([rows] * 4 if has_storage else [])
    # The layout the header declares must add up to the file's size before anything is allocated.
    at = HEADER_SIZE + (entries + 1) * 8
    for count, size in zip(counts, sizes):
        at += pad(at) + count * size
    at += pad(at)
    expected = at + objects_length + TRAILER.size
    if version == SECTIONS_VERSION:
        v2 = parse_v2_header(header, fail)
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
    trailer = src.read_bytes(TRAILER.size)
    tmagic, crc = TRAILER.unpack(trailer)
    if tmagic != TRAILER_MAGIC or crc != crc_before_trailer:
        raise fail(f"checksum mismatch (recorded {crc:#010x}, computed {crc_before_trailer:#010x}): the file is "
                   f"damaged or truncated")

    objects = unpickle_objects(objects_bytes, "objects section", fail, where, allow_unsafe)
    if type(objects) is not dict or set(objects) != set(OBJECT_KEYS):
        raise fail("the objects section is not the expected dict")
    fqns, properties, table_sizes, files = (objects[k] for k in ("fqns", "properties", "sizes", "files"))
    check_objects(fail, entries, fqns, properties, table_sizes, files, has_storage, objects)

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
    check_columns(fail, table)
    return ChunkIndex(
        table=table,
        planner_data=objects["planner_data"],
        storage_meta=objects["storage_meta"],
        version=objects["version"],
        metadata_size=md_size,
        metadata_head_crc=head_crc,
        metadata_tail_crc=tail_crc,
        edge_bytes=SECTION_EDGE_BYTES if version == SECTIONS_VERSION else EDGE_BYTES,
    )


def unpickle_objects(data: bytes, what: str, fail: Any, where: str, allow_unsafe: bool) -> Any:
    """The index's pickled objects: restricted unpickling as ``.metadata``'s (errors name ``where``),
    or plain :mod:`pickle` when ``allow_unsafe`` (errors through ``fail``)."""

    def restricted(data: bytes) -> Any:
        try:
            return unpickle_restricted(data, where)
        except CheckpointFormatError as e:
            if where == what:  # (a section's shared objects: the message gets the index's name)
                raise fail(str(e)) from None
            raise

    return load_pickle(data, allow_unsafe=allow_unsafe, restricted=restricted, fail=fail,
                       unreadable=f"unreadable {what}")


def check_objects(fail: Any, entries: int, fqns: Any, properties: Any, sizes: Any, files: Any, has_storage: bool,
                  objects: dict) -> None:
    """The objects an index names every entry with (fqns, properties, sizes) and its files,
    ``storage_meta`` and ``version`` (in ``objects``), checked against the header's ``entries``."""
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
        if type(size) is not torch.Size or len(size) > MAX_WIDTH or any(d < 0 for d in size):
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


def check_columns(fail: Any, table: ChunkTable, partial: bool = False,
                  known_bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Every column against the others (vectorised; a bounded number of rows at a time).
    ``partial``: the table is one rank's section, where a bytes entry may have no row;
    ``known_bounds``: ``index_layout.entry_bounds`` of the table's sizes, when already known."""
    entries, rows, width = len(table.fqns), table.rows, int(table.offsets.shape[1])
    row_start = table.row_start
    if int(row_start[0]) != 0 or int(row_start[-1]) != rows:
        raise fail(f"row_start runs from {int(row_start[0])} to {int(row_start[-1])}, not from 0 to {rows}")
    counts = row_start[1:] - row_start[:-1]
    if entries and bool((counts < 0).any()):
        e = int(torch.nonzero(counts < 0)[0])
        raise fail(f"row_start decreases at entry {shown(table.fqns[e])}")
    ndims, bounds = known_bounds if known_bounds is not None else entry_bounds(table.sizes, width)
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
    for start in range(0, rows, CHECK_ROWS):
        end = min(rows, start + CHECK_ROWS)
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
            ((bo < 0) | (bl < 0) | (bo > MAX_FILE_OFFSET) | (bl > MAX_FILE_OFFSET - bo),
             lambda r: f"has an invalid byte range (offset {int(bo[r])}, length {int(bl[r])})"),
            (((ck < 0) & (ck != NO_CHECKSUM)) | (ck >= 1 << 32), lambda r: f"has an invalid checksum {int(ck[r])}"),
        )
        for bad_rows, problem in checks:
            if bool(bad_rows.any()):
                r = int(torch.nonzero(bad_rows)[0])
                raise fail(f"row {start + r} of entry {shown(table.fqns[int(entry[r])])} {problem(r)}")

