"""Writes a checkpoint's ``.metadata`` straight from a :class:`~fastdcp.format.chunk_table.ChunkTable`,
as a pickle stock DCP reads (``pickle.load``) into the very objects it would have pickled itself.

Stock DCP builds ``Metadata`` as objects (a ``ChunkStorageMetadata`` with two ``torch.Size``, a
``MetadataIndex`` and a ``_StorageInfo`` per chunk) and pickles them: at 4,096 ranks of a 7B state
that is ~4.9 million chunks, 75 s and ~4 GB on the coordinator. :func:`write_metadata` emits the
pickle's opcodes itself, streaming frames of a few MB:

* the per-chunk parts (a chunk of ``state_dict_metadata[fqn].chunks``, and the
  ``MetadataIndex`` -> ``_StorageInfo`` pair of ``storage_data``) are fixed-size byte records,
  one template per run of rows with the same shape, filled for up to ``_BLOCK_ROWS`` rows at a
  time with tensor operations (each integer in the narrowest opcode that holds every value of
  its column in the block: ``BININT1``/``BININT2``/``BININT``, else ``LONG1`` of 5 to 8 bytes);
* class globals, field names, fqns and file names are memoised once and referenced with
  ``BINGET``/``LONG_BINGET`` (the per-chunk objects themselves are not memoised, so the memo of
  whoever unpickles it stays small);
* small self-contained objects (``TensorProperties``, ``planner_data``, ``storage_meta``,
  ``version``) are pickled by :class:`pickle.Pickler` and spliced in.

The result unpickles (stock ``pickle.load``, or :func:`fastdcp.format.metadata.parse_metadata`)
to a ``Metadata`` equal to ``table_to_metadata(table, planner_data, storage_meta, version)``,
attribute for attribute, plus one attribute when a chunk index is named:
``fastdcp_chunk_index`` (:data:`CHUNK_INDEX_ATTRIBUTE`), the first key of the Metadata's state, so
that it lies in the file's first few hundred bytes (:func:`fastdcp.format.chunk_index.find_chunk_index_name`).
Stock ignores the extra attribute (``Metadata.__eq__`` compares the dataclass fields only).
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import sys
from typing import Any, BinaryIO

import torch

from .chunk_table import NO_CHECKSUM, ChunkTable
from .metadata import CHECKSUM_ATTRIBUTE

__all__ = ["CHUNK_INDEX_ATTRIBUTE", "write_metadata"]

# The Metadata attribute naming the chunk index file written beside .metadata (stock ignores it).
CHUNK_INDEX_ATTRIBUTE = "fastdcp_chunk_index"

_PROTOCOL = 4
_BLOCK_ROWS = 1 << 16  # rows filled per tensor pass: ~2-6 MB of records
_FRAME_BYTES = 4 << 20  # a frame is written once this much is pending
_LITTLE_ENDIAN = sys.byteorder == "little"

_MD_MODULE = "torch.distributed.checkpoint.metadata"
_FS_MODULE = "torch.distributed.checkpoint.filesystem"

# Opcodes (pickle's own constants, as bytes).
_MARK, _STOP, _POP_MARK = pickle.MARK, pickle.STOP, pickle.POP_MARK
_NONE, _EMPTY_TUPLE, _EMPTY_DICT, _EMPTY_LIST = pickle.NONE, pickle.EMPTY_TUPLE, pickle.EMPTY_DICT, pickle.EMPTY_LIST
_TUPLE, _TUPLES = pickle.TUPLE, (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_TUPLE1 = pickle.TUPLE1
_NEWOBJ, _BUILD, _REDUCE = pickle.NEWOBJ, pickle.BUILD, pickle.REDUCE
_SETITEM, _SETITEMS, _APPENDS = pickle.SETITEM, pickle.SETITEMS, pickle.APPENDS
_MEMOIZE, _STACK_GLOBAL = pickle.MEMOIZE, pickle.STACK_GLOBAL
_BINGET, _LONG_BINGET = pickle.BINGET, pickle.LONG_BINGET
_BININT1, _BININT2, _BININT, _LONG1, _LONG4 = pickle.BININT1, pickle.BININT2, pickle.BININT, pickle.LONG1, pickle.LONG4
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.BINUNICODE8
_FRAME = pickle.FRAME
_NEW = _EMPTY_TUPLE + _NEWOBJ  # cls () NEWOBJ: what copyreg.__newobj__ pickles to

# ---------------------------------------------------------------------------------------------
# Opcode helpers for single values
# ---------------------------------------------------------------------------------------------


def _unicode(text: str) -> bytes:
    """A str as pickle writes it (UTF-8 with lone surrogates passed through, like pickle)."""
    data = text.encode("utf-8", "surrogatepass")
    n = len(data)
    if n < 256:
        return _SHORT_BINUNICODE + bytes((n,)) + data
    if n < 1 << 32:
        return _BINUNICODE + struct.pack("<I", n) + data
    return _BINUNICODE8 + struct.pack("<Q", n) + data


def _int(value: int) -> bytes:
    """An int in the opcode stock's pickler would use."""
    if 0 <= value < 256:
        return _BININT1 + bytes((value,))
    if 0 <= value < 65536:
        return _BININT2 + struct.pack("<H", value)
    if -(1 << 31) <= value < 1 << 31:
        return _BININT + struct.pack("<i", value)
    data = pickle.encode_long(value)
    if len(data) < 256:
        return _LONG1 + bytes((len(data),)) + data
    return _LONG4 + struct.pack("<i", len(data)) + data


def _get(index: int) -> bytes:
    return _BINGET + bytes((index,)) if index < 256 else _LONG_BINGET + struct.pack("<I", index)


def _tuple_ops(n: int) -> tuple[bytes, bytes]:
    """(opcodes before the n items, opcodes after them) of an n-tuple."""
    return (b"", _TUPLES[n]) if n <= 3 else (_MARK, _TUPLE)


def _int_format(lo: int, hi: int) -> tuple[bytes, int]:
    """(opcode prefix, value bytes) of the narrowest fixed-width int opcode holding [lo, hi]."""
    if lo >= 0 and hi < 256:
        return _BININT1, 1
    if lo >= 0 and hi < 65536:
        return _BININT2, 2
    if lo >= -(1 << 31) and hi < 1 << 31:
        return _BININT, 4
    for width in (5, 6, 7, 8):  # LONG1 accepts a non-minimal two's-complement encoding
        bound = 1 << (8 * width - 1)
        if -bound <= lo and hi < bound:
            return _LONG1 + bytes((width,)), width
    raise AssertionError("an int64 always fits 8 bytes")


def _get_format(hi: int) -> tuple[bytes, int]:
    return (_BINGET, 1) if hi < 256 else (_LONG_BINGET, 4)


def _strip_pickle(data: bytes) -> bytes:
    """The opcodes of a whole protocol-4 pickle without its PROTO, FRAME headers and STOP, to be
    spliced into another stream."""
    assert data[:1] == pickle.PROTO, "expected a protocol 2+ pickle"
    pos, parts, frame = 2, [], _FRAME[0]
    while pos < len(data) and data[pos] == frame:
        (n,) = struct.unpack_from("<Q", data, pos + 1)
        parts.append(data[pos + 9 : pos + 9 + n])
        pos += 9 + n
    parts.append(data[pos:])
    body = b"".join(parts)
    assert body[-1:] == _STOP, "a pickle ends with STOP"
    return body[:-1]


def _pickled_fast(obj: Any) -> bytes:
    """``obj`` pickled without memo (no MEMOIZE, no BINGET): the bytes can be spliced anywhere,
    any number of times. For small acyclic objects only."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=_PROTOCOL)
    pickler.fast = True
    pickler.dump(obj)
    return _strip_pickle(buf.getvalue())


def _tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy (the caller keeps ``t`` alive)."""
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


# ---------------------------------------------------------------------------------------------
# The output stream: frames of whole opcodes, memo bookkeeping
# ---------------------------------------------------------------------------------------------


class _Stream:
    """Buffers opcodes into frames of about ``_FRAME_BYTES`` and writes them to ``out``.

    Every piece added is made of whole opcodes, so no opcode straddles a frame boundary (the
    pure-Python unpickler requires that). Large pieces are memoryviews of record tensors and are
    written without copying; ``owners`` keeps those tensors alive until their frame is written."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.pieces: list[bytes | bytearray | memoryview] = []
        self.owners: list[torch.Tensor] = []
        self.small = bytearray()
        self.pending = 0
        self.written = 0
        self.memo_size = 0  # entries the unpickler's memo will hold (MEMOIZE opcodes so far)

    def raw(self, data: bytes) -> None:
        """Bytes outside any frame (only the PROTO opcode)."""
        self.out.write(data)
        self.written += len(data)

    def add(self, data: bytes) -> None:
        self.small += data
        self.pending += len(data)
        if self.pending >= _FRAME_BYTES:
            self.flush()

    def add_records(self, view: memoryview, owner: torch.Tensor) -> None:
        if not len(view):
            return
        if self.small:
            self.pieces.append(self.small)
            self.small = bytearray()
        self.pieces.append(view)
        self.owners.append(owner)
        self.pending += len(view)
        if self.pending >= _FRAME_BYTES:
            self.flush()

    def memoize(self) -> tuple[bytes, int]:
        """(the MEMOIZE opcode, the memo index it assigns)."""
        index = self.memo_size
        self.memo_size += 1
        return _MEMOIZE, index

    def flush(self) -> None:
        if self.small:
            self.pieces.append(self.small)
            self.small = bytearray()
        if not self.pending:
            return
        self.out.write(_FRAME + struct.pack("<Q", self.pending))
        for piece in self.pieces:
            self.out.write(piece)
        self.written += 9 + self.pending
        self.pieces.clear()
        self.owners.clear()
        self.pending = 0

    def pickled(self, obj: Any) -> bytes:
        """``obj`` pickled in this stream's memo: a pickler whose memo already holds
        ``memo_size`` placeholder entries numbers its own MEMOIZEs from there on (the C pickler
        assigns index = memo size), so its BINGETs stay right and shared or cyclic references in
        ``obj`` survive; the stream's memo grows by what it memoised."""
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=_PROTOCOL)
        if self.memo_size:
            pickler.memo = {i: (i, object()) for i in range(self.memo_size)}
        pickler.dump(obj)
        body = _strip_pickle(buf.getvalue())
        self.memo_size = len(pickler.memo.copy())
        return body


# ---------------------------------------------------------------------------------------------
# Fixed-size records filled with tensor operations
# ---------------------------------------------------------------------------------------------


class _Record:
    """A record template: constant opcodes and int slots, each slot filled from an int64 column
    (one value per row)."""

    def __init__(self, size_get: bytes) -> None:
        self.parts: list[bytes | tuple[torch.Tensor, str]] = []
        self.size_get = size_get  # BINGET of torch.Size

    def const(self, data: bytes) -> None:
        self.parts.append(data)

    def ints(self, values: torch.Tensor) -> None:
        self.parts.append((values, "int"))

    def memo_ref(self, values: torch.Tensor) -> None:
        self.parts.append((values, "get"))

    def size(self, columns: torch.Tensor) -> None:
        """A torch.Size of the row's values in ``columns`` [n, d]."""
        before, after = _tuple_ops(columns.shape[1])
        self.const(self.size_get + before)
        for j in range(columns.shape[1]):
            self.ints(columns[:, j])
        self.const(after + _TUPLE1 + _REDUCE)

    def build(self, n: int) -> torch.Tensor:
        """uint8 [n, record bytes]: row i holds the record of value row i."""
        template = bytearray()
        slots: list[tuple[int, torch.Tensor, int]] = []
        for part in self.parts:
            if isinstance(part, (bytes, bytearray)):
                template += part
                continue
            values, kind = part
            lo, hi = (int(v) for v in torch.aminmax(values)) if n else (0, 0)
            prefix, width = _int_format(lo, hi) if kind == "int" else _get_format(hi)
            template += prefix
            slots.append((len(template), values, width))
            template += bytes(width)
        records = torch.empty((n, len(template)), dtype=torch.uint8)
        records.copy_(torch.frombuffer(template, dtype=torch.uint8).expand(n, len(template)))
        for at, values, width in slots:
            records[:, at : at + width] = _le_bytes(values, width)
        return records


def _le_bytes(values: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [n, width]: the low ``width`` bytes of each int64, little-endian (two's complement)."""
    if values.dtype != torch.int64 or values.stride(-1) != 1:
        values = torch.empty(values.shape, dtype=torch.int64).copy_(values)  # (a [1] view may have stride 2)
    if _LITTLE_ENDIAN:
        return values.view(torch.uint8).view(-1, 8)[:, :width]
    return torch.stack([(values >> (8 * i)) & 0xFF for i in range(width)], dim=1).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# The writer
# ---------------------------------------------------------------------------------------------


def _blocks(table: ChunkTable, fqn_kind: list[int]) -> list[tuple[int, int]]:
    """The table's rows as blocks of at most ``_BLOCK_ROWS`` rows that share one record shape:
    same kind and ndim (entry-level, changes only at entry starts) and the same checksum
    presence (per row)."""
    rows = table.rows
    cuts = {0, rows}
    starts = table.row_start.tolist()
    for e in range(1, len(fqn_kind)):
        if fqn_kind[e] != fqn_kind[e - 1]:
            cuts.add(starts[e])
    if table.storage is not None and rows > 1:
        has = table.storage.checksums != NO_CHECKSUM
        cuts.update((torch.nonzero(has[1:] != has[:-1]).flatten() + 1).tolist())
    bounds = sorted(c for c in cuts if 0 <= c <= rows)
    blocks = []
    for a, b in zip(bounds, bounds[1:]):
        for s in range(a, b, _BLOCK_ROWS):
            blocks.append((s, min(b, s + _BLOCK_ROWS)))
    return blocks


def _check_table(table: ChunkTable) -> None:
    entries = len(table.fqns)
    if len(table.properties) != entries or len(table.sizes) != entries:
        raise ValueError("ChunkTable: fqns, properties and sizes differ in length")
    starts = table.row_start
    if starts.shape != (entries + 1,) or int(starts[0]) != 0 or int(starts[-1]) != table.rows:
        raise ValueError("ChunkTable: row_start does not span the rows")
    if table.lengths.shape != table.offsets.shape or table.offsets.dim() != 2:
        raise ValueError("ChunkTable: offsets and lengths must both be [rows, width]")
    if entries and bool((table.row_start[1:] < table.row_start[:-1]).any()):
        raise ValueError("ChunkTable: row_start decreases")
    width = table.offsets.shape[1]
    counts = (table.row_start[1:] - table.row_start[:-1]).tolist()
    for e, size in enumerate(table.sizes):
        if size is None and counts[e] != 1:
            raise ValueError(f"ChunkTable: bytes entry {table.fqns[e]!r} has {counts[e]} rows (must be 1)")
        if size is not None and len(size) > width and counts[e]:
            raise ValueError(f"ChunkTable: entry {table.fqns[e]!r} has more dimensions than the table's width")
    if table.storage is not None:
        s = table.storage
        for name in ("file_index", "byte_offset", "byte_length", "checksums"):
            if getattr(s, name).shape != (table.rows,):
                raise ValueError(f"ChunkTable: storage column {name} does not have one value per row")


def write_metadata(
    out: BinaryIO,
    table: ChunkTable,
    *,
    planner_data: Any,
    storage_meta: Any,
    version: str | None,
    chunk_index_name: str | None = None,
) -> int:
    """Write ``.metadata`` for ``table`` to ``out`` (anything with ``write(bytes-like)``; never
    seeked); returns the bytes written.

    The pickle unpickles to ``table_to_metadata(table, planner_data, storage_meta, version)``
    (equal, with the same attributes on every object and the same ``MetadataIndex.index`` hints),
    plus the attribute ``fastdcp_chunk_index = chunk_index_name`` when one is given.
    Preconditions: ``table`` is consistent (row_start spans the rows, a bytes entry has one row,
    columns past an entry's ndim are ignored); ``planner_data``/``storage_meta``/``version`` are
    picklable. Memory: the output is written in frames of ~4 MB, records built ``_BLOCK_ROWS``
    rows at a time; per-row temporaries are a few bytes per row.
    """
    _check_table(table)
    if chunk_index_name is not None and (type(chunk_index_name) is not str or not chunk_index_name):
        raise ValueError(f"chunk_index_name must be a non-empty str, got {chunk_index_name!r}")
    stream = _Stream(out)
    stream.raw(pickle.PROTO + bytes((_PROTOCOL,)))
    memo: dict[str, bytes] = {}  # name -> the BINGET of what was memoised under it

    def memoised_global(module_push: bytes, name: str) -> bytes:
        """Push class ``name`` of the module ``module_push`` pushes, memoising the class."""
        push = module_push + _unicode(name) + stream.memoize()[0] + _STACK_GLOBAL
        op, index = stream.memoize()
        memo[name] = _get(index)
        return push + op

    def memoised_module(module: str) -> bytes:
        """Push a module name, memoised (its first STACK_GLOBAL consumes it)."""
        op, index = stream.memoize()
        memo[module] = _get(index)
        return _unicode(module) + op

    # The Metadata object; the chunk index name first, where a reader finds it in the first bytes.
    head = bytearray(memoised_global(memoised_module(_MD_MODULE), "Metadata"))
    head += _NEW + _EMPTY_DICT
    if chunk_index_name is not None:
        head += _unicode(CHUNK_INDEX_ATTRIBUTE) + _unicode(chunk_index_name) + _SETITEM

    # Classes and field names, memoised once (pushed after a MARK and dropped with POP_MARK:
    # the memo keeps them, the object stays untouched).
    head += _MARK
    for name in ("TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex"):
        head += memoised_global(memo[_MD_MODULE], name)
    head += memoised_global(memoised_module("torch"), "Size")
    head += memoised_global(memoised_module(_FS_MODULE), "_StorageInfo")
    for field in ("properties", "size", "chunks", "offsets", "sizes", "fqn", "index", "offset", "relative_path",
                  "length", CHECKSUM_ATTRIBUTE):
        head += _unicode(field)
        op, index = stream.memoize()
        head += op
        memo[field] = _get(index)
    head += _POP_MARK
    stream.add(bytes(head))

    kinds = [(-1 if size is None else len(size)) for size in table.sizes]
    blocks = _blocks(table, kinds)
    fqn_memo = _write_state_dict_metadata(stream, memo, table, blocks)
    stream.add(_unicode("planner_data") + stream.pickled(planner_data) + _SETITEM)
    _write_storage_data(stream, memo, table, blocks, fqn_memo)
    stream.add(_unicode("storage_meta") + stream.pickled(storage_meta) + _SETITEM)
    stream.add(_unicode("version") + stream.pickled(version) + _SETITEM)
    stream.add(_BUILD + _STOP)
    stream.flush()
    return stream.written


class _BlockCursor:
    """Walks the blocks in row order, building each block's records once."""

    def __init__(self, blocks: list[tuple[int, int]], build: Any) -> None:
        self.blocks = blocks
        self.build = build
        self.i = 0
        self.current: tuple[int, int, torch.Tensor, memoryview, int] | None = None

    def records(self, row: int) -> tuple[int, int, torch.Tensor, memoryview, int]:
        """(start, end, records, their bytes, record size) of the block holding ``row``."""
        while self.blocks[self.i][1] <= row:
            self.i += 1
        start, end = self.blocks[self.i]
        if self.current is None or self.current[0] != start:
            records = self.build(start, end)
            self.current = (start, end, records, _tensor_view(records), records.shape[1])
        return self.current


def _props_body(cache: dict[Any, bytes], props: Any) -> bytes:
    try:
        key = (type(props), props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory)
        hash(key)
    except (AttributeError, TypeError):
        return _pickled_fast(props)
    body = cache.get(key)
    if body is None:
        body = cache[key] = _pickled_fast(props)
    return body


def _write_state_dict_metadata(
    stream: _Stream, memo: dict[str, bytes], table: ChunkTable, blocks: list[tuple[int, int]]
) -> list[int]:
    """The ``state_dict_metadata`` key and dict; returns each fqn string's memo index."""
    size_get = memo["Size"]

    def build_chunks(start: int, end: int) -> torch.Tensor:
        ndim = len(table.sizes[int(torch.searchsorted(table.row_start, start, right=True)) - 1])
        rec = _Record(size_get)
        rec.const(memo["ChunkStorageMetadata"] + _NEW + _EMPTY_DICT + _MARK + memo["offsets"])
        rec.size(table.offsets[start:end, :ndim])
        rec.const(memo["sizes"])
        rec.size(table.lengths[start:end, :ndim])
        rec.const(_SETITEMS + _BUILD)
        return rec.build(end - start)

    cursor = _BlockCursor(blocks, build_chunks)
    stream.add(_unicode("state_dict_metadata") + _EMPTY_DICT)
    starts = table.row_start.tolist()
    props_cache: dict[Any, bytes] = {}
    fqn_memo = []
    for e, fqn in enumerate(table.fqns):
        op, index = stream.memoize()
        fqn_memo.append(index)
        head = _unicode(fqn) + op
        size = table.sizes[e]
        if size is None:
            stream.add(head + memo["BytesStorageMetadata"] + _NEW + _SETITEM)
            continue
        before, after = _tuple_ops(len(size))
        head += memo["TensorStorageMetadata"] + _NEW + _EMPTY_DICT + _MARK
        head += memo["properties"] + _props_body(props_cache, table.properties[e])
        dims = b"".join(_int(int(v)) for v in size)
        head += memo["size"] + memo["Size"] + before + dims + after + _TUPLE1 + _REDUCE
        head += memo["chunks"] + _EMPTY_LIST
        stream.add(head)
        row, end = starts[e], starts[e + 1]
        while row < end:
            start, block_end, records, view, width = cursor.records(row)
            stop = min(end, block_end)
            stream.add(_MARK)
            stream.add_records(view[(row - start) * width : (stop - start) * width], records)
            stream.add(_APPENDS)
            row = stop
        stream.add(_SETITEMS + _BUILD + _SETITEM)
    stream.add(_SETITEM)
    return fqn_memo


def _write_storage_data(
    stream: _Stream, memo: dict[str, bytes], table: ChunkTable, blocks: list[tuple[int, int]], fqn_memo: list[int]
) -> None:
    """The ``storage_data`` key and dict (``None`` when the table has no storage columns)."""
    storage = table.storage
    if storage is None:
        stream.add(_unicode("storage_data") + _NONE + _SETITEM)
        return
    # File names, memoised once (and dropped from the stack again).
    files = bytearray(_MARK)
    file_memo = []
    for name in storage.files:
        op, index = stream.memoize()
        files += _unicode(name) + op
        file_memo.append(index)
    files += _POP_MARK
    stream.add(bytes(files))
    file_memo_t = torch.tensor(file_memo, dtype=torch.int64)
    fqn_memo_t = torch.tensor(fqn_memo, dtype=torch.int64)
    row_start = table.row_start
    size_get = memo["Size"]

    def build_items(start: int, end: int) -> torch.Tensor:
        rows = torch.arange(start, end, dtype=torch.int64)
        entry = torch.searchsorted(row_start, rows, right=True) - 1
        first = int(entry[0])
        size = table.sizes[first]
        rec = _Record(size_get)
        rec.const(memo["MetadataIndex"] + _NEW + _EMPTY_DICT + _MARK + memo["fqn"])
        rec.memo_ref(fqn_memo_t[entry])
        rec.const(memo["index"])
        if size is None:
            rec.const(_NONE)
        else:
            rec.ints(rows - row_start[entry])
            rec.const(memo["offset"])
            rec.size(table.offsets[start:end, : len(size)])
        rec.const(_SETITEMS + _BUILD)
        rec.const(memo["_StorageInfo"] + _NEW + _EMPTY_DICT + _MARK + memo["relative_path"])
        rec.memo_ref(file_memo_t[storage.file_index[start:end].to(torch.int64)])
        rec.const(memo["offset"])
        rec.ints(storage.byte_offset[start:end])
        rec.const(memo["length"])
        rec.ints(storage.byte_length[start:end])
        if int(storage.checksums[start]) != NO_CHECKSUM:
            rec.const(memo[CHECKSUM_ATTRIBUTE])
            rec.ints(storage.checksums[start:end])
        rec.const(_SETITEMS + _BUILD)
        return rec.build(end - start)

    stream.add(_unicode("storage_data") + _EMPTY_DICT)
    for start, end in blocks:
        records = build_items(start, end)
        stream.add(_MARK)
        stream.add_records(_tensor_view(records), records)
        stream.add(_SETITEMS)
    stream.add(_SETITEM)
