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

:func:`read_chunk_index` treats the file as hostile: the declared sizes must add up to the file's
size before anything is allocated, the CRC must match, and every column is checked (row_start
monotonic from 0 to rows, one row per bytes entry, chunks inside their tensors, file indexes in
range, byte ranges non-negative and bounded, checksums 32-bit or absent). Every failure is a
:class:`~fastdcp.format.metadata.CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as _md

from .. import _C
from .chunk_table import NO_CHECKSUM, ChunkTable, StorageColumns
from .metadata import CheckpointFormatError, shown, unpickle_restricted
from .metadata_emit import CHUNK_INDEX_ATTRIBUTE, _tensor_view

__all__ = [
    "EDGE_BYTES",
    "ChunkIndex",
    "write_chunk_index",
    "read_chunk_index",
    "find_chunk_index_name",
    "metadata_facts",
    "crc32c",
]

EDGE_BYTES = 64 << 10  # the .metadata's first and last bytes whose CRC-32C the index records
_MAGIC = b"FDCPCHIX"
_TRAILER_MAGIC = b"FDCE"
_FORMAT_VERSION = 1
_HEADER_SIZE = 128
# magic, version, header size, flags, width, entries, rows, metadata size, head crc, tail crc,
# element sizes of the 6 stored columns (+2 spare), objects offset, objects length
_HEADER = struct.Struct("<8sIIIIQQQII8sQQ")
_TRAILER = struct.Struct("<4sI")
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


# ---------------------------------------------------------------------------------------------
# CRC-32C (on the native engine's threads; one small engine per process)
# ---------------------------------------------------------------------------------------------

_engine_lock = threading.Lock()
_engine: tuple[int, Any] | None = None  # (pid, engine): threads do not survive fork


def _crc_engine() -> Any:
    global _engine
    with _engine_lock:
        if _engine is None or _engine[0] != os.getpid():
            _engine = (os.getpid(), _C.Engine(1, 1 << 20))
        return _engine[1]


def crc32c(data: Any, seed: int = 0) -> int:
    """CRC-32C of a bytes-like object (continuing ``seed``, the CRC of the bytes before it)."""
    if not len(memoryview(data)):
        return seed
    return int(_crc_engine().crc32c([(data, None, seed)])[0])


def metadata_facts(f: BinaryIO) -> tuple[int, int, int]:
    """(size, CRC-32C of the first ``EDGE_BYTES``, CRC-32C of the last ``EDGE_BYTES``) of a
    ``.metadata`` open for reading (seekable; the position is left at the end)."""
    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    head = f.read(min(size, EDGE_BYTES))
    f.seek(max(0, size - EDGE_BYTES))
    tail = f.read(min(size, EDGE_BYTES))
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
    this index goes with (:func:`metadata_facts` of it); ``planner_data``, ``storage_meta`` and
    ``version`` are the ones given to ``write_metadata``. Preconditions: ``table`` is consistent
    (as :func:`read_chunk_index` checks). Memory: one column at a time is narrowed to int32."""
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
    header = _HEADER.pack(
        _MAGIC, _FORMAT_VERSION, _HEADER_SIZE, _FLAG_STORAGE if table.storage is not None else 0, width,
        entries, rows, metadata_size, metadata_head_crc, metadata_tail_crc, bytes(element_sizes).ljust(8, b"\0"),
        objects_offset, len(objects),
    ).ljust(_HEADER_SIZE, b"\0")

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
    return written + _TRAILER.size


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
        dtype = torch.int32 if element_size == 4 else torch.int64
        t = torch.empty(count, dtype=dtype)
        if count:
            self.read_into(_tensor_view(t.view(torch.uint8)))
            if not _LITTLE_ENDIAN:
                t = t.view(torch.uint8).view(-1, element_size).flip(1).contiguous().view(dtype).view(-1)
        return t


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
    if version != _FORMAT_VERSION:
        raise fail(f"chunk index format version {version} is not supported (this fastdcp reads {_FORMAT_VERSION})")
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
    if objects_offset != at or expected != src.size:
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

    if allow_unsafe:
        try:
            objects = pickle.loads(objects_bytes)
        except Exception as e:
            raise fail(f"unreadable objects section ({type(e).__name__}: {str(e)[:200]})") from e
    else:
        objects = unpickle_restricted(objects_bytes, where)
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
    )


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


def _check_columns(fail: Any, table: ChunkTable) -> None:
    """Every column against the others (vectorised; a bounded number of rows at a time)."""
    entries, rows, width = len(table.fqns), table.rows, int(table.offsets.shape[1])
    row_start = table.row_start
    if int(row_start[0]) != 0 or int(row_start[-1]) != rows:
        raise fail(f"row_start runs from {int(row_start[0])} to {int(row_start[-1])}, not from 0 to {rows}")
    counts = row_start[1:] - row_start[:-1]
    if entries and bool((counts < 0).any()):
        e = int(torch.nonzero(counts < 0)[0])
        raise fail(f"row_start decreases at entry {shown(table.fqns[e])}")
    ndims = torch.tensor([-1 if s is None else len(s) for s in table.sizes], dtype=torch.int64)
    is_bytes = ndims < 0
    if bool((is_bytes & (counts != 1)).any()):
        e = int(torch.nonzero(is_bytes & (counts != 1))[0])
        raise fail(f"bytes entry {shown(table.fqns[e])} has {int(counts[e])} rows (must be 1)")
    if bool(((ndims > width) & (counts > 0)).any()):
        e = int(torch.nonzero((ndims > width) & (counts > 0))[0])
        raise fail(f"entry {shown(table.fqns[e])} has {int(ndims[e])} dimensions, more than the table's {width}")
    # Each entry's size padded with zeros to the width: a row's chunk must lie inside it (columns
    # past ndim, and bytes rows, must be zero).
    bounds = torch.zeros((entries, width), dtype=torch.int64)
    for e, size in enumerate(table.sizes):
        if size is not None and len(size) and len(size) <= width:
            bounds[e, : len(size)] = torch.tensor(list(size), dtype=torch.int64)
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

