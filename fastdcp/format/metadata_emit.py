"""Writes a checkpoint's ``.metadata`` straight from a :class:`~fastdcp.format.chunk_table.ChunkTable`,
as a pickle stock DCP reads (``pickle.load``) into the very objects it would have pickled itself.

Stock DCP builds ``Metadata`` as objects (a ``ChunkStorageMetadata`` with two ``torch.Size``, a
``MetadataIndex`` and a ``_StorageInfo`` per chunk) and pickles them: at 4,096 ranks of a 7B state
that is ~4.9 million chunks, 75 s and ~4 GB on the coordinator. :func:`write_metadata` emits the
pickle's opcodes itself, streaming frames of a few MB:

* the per-chunk parts (a chunk of ``state_dict_metadata[fqn].chunks``, and the
  ``MetadataIndex`` -> ``_StorageInfo`` pair of ``storage_data``) are fixed-size byte records:
  the rows are taken ``_BLOCK_ROWS`` at a time (a window), and each row shape in a window (its
  ndim, checksum presence and which of its parts are shared objects) gets one template, filled
  for all of its rows with tensor operations (each integer in the narrowest opcode that holds
  every value of its column in the group: ``BININT1``/``BININT2``/``BININT``, else ``LONG1`` of
  5 to 8 bytes);
* equal objects are written once and referenced with ``BINGET``/``LONG_BINGET`` from then on, as
  stock's pickler does with the objects a plan shares: class globals, field names, fqns and file
  names; one ``TensorProperties`` per distinct (dtype, layout, requires_grad, memory_format,
  pin_memory); one ``torch.Size`` per repeated tensor size; and, for the chunk of a single-chunk
  entry (many small tensors), all-zero offsets (one ``torch.Size`` per ndim, also the storage
  key's offset) and a chunk size equal to its tensor's size (the tensor's own ``torch.Size``).
  The chunks of entries with more chunks are not memoised (the memo of whoever unpickles the file
  stays small, and their records stay one template per window);
* ``planner_data``, ``storage_meta`` and ``version`` are pickled by a :class:`pickle.Pickler` that
  shares the file's memo (so they reference the fqn strings and ``TensorProperties`` parts already
  written) and spliced in.

The result unpickles (stock ``pickle.load``, or :func:`fastdcp.format.metadata.parse_metadata`)
to a ``Metadata`` equal to ``table_to_metadata(table, planner_data, storage_meta, version)``,
attribute for attribute (equal objects may be one shared object, as in stock's own pickles of a
plan), plus one attribute when a chunk index is named: ``fastdcp_chunk_index``
(:data:`CHUNK_INDEX_ATTRIBUTE`), the first key of the Metadata's state, so that it lies in the
file's first few hundred bytes (:func:`fastdcp.format.chunk_index.find_chunk_index_name`).
Stock ignores the extra attribute (``Metadata.__eq__`` compares the dataclass fields only).
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import sys
from bisect import bisect_right
from collections import Counter
from typing import Any, BinaryIO

import torch

from ..compat.torch_internals import tensor_properties_key
from .chunk_table import NO_CHECKSUM, ChunkTable
from .metadata import CHECKSUM_ATTRIBUTE

__all__ = ["CHUNK_INDEX_ATTRIBUTE", "write_metadata"]

# The Metadata attribute naming the chunk index file written beside .metadata (stock ignores it).
CHUNK_INDEX_ATTRIBUTE = "fastdcp_chunk_index"

_PROTOCOL = 4
_BLOCK_ROWS = 1 << 16  # rows filled per tensor pass (a window): ~2-6 MB of records
# Entries with at most this many chunks share zero offsets and whole-tensor chunk sizes: single-
# chunk entries (many small tensors). Larger values work too (tests use them), but a shared first
# chunk then splits each entry's records in two runs: measured with 5,000 entries of 2..16 chunks,
# +110-125% write time for 1-5% smaller files.
_FEW_ROWS = 1
_EARLY_FILES = 32  # at most this many file names are memoised before the fqns
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
    written without copying; ``owners`` keeps those tensors alive until their frame is written.

    The memo: ``memo_objects[i]`` stands for what the unpickler's memo will hold at index ``i``:
    the very object when it is one of the caller's ``str`` (an fqn, a file name), else None (a
    placeholder). :meth:`pickled` hands these to its pickler, so it numbers its own MEMOIZEs
    right and references those strings instead of writing them again."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.pieces: list[bytes | bytearray | memoryview] = []
        self.owners: list[torch.Tensor] = []
        self.small = bytearray()
        self.pending = 0
        self.written = 0
        self.memo_objects: list[Any] = []  # per memo index: a caller's str, or None (a placeholder)
        self._memo_ids: set[int] = set()  # ids of the strs in memo_objects (each once)
        self._pickler: pickle.Pickler | None = None  # see pickled()
        self._pickler_out = io.BytesIO()
        self._pickler_memo_size = 0

    @property
    def memo_size(self) -> int:
        """Entries the unpickler's memo will hold (MEMOIZE opcodes so far)."""
        return len(self.memo_objects)

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

    def memoize(self, value: Any = None) -> tuple[bytes, int]:
        """(the MEMOIZE opcode, the memo index it assigns). ``value``: the object the memoised
        item unpickles equal to, when it is a plain ``str`` whose identity later pickled objects
        may share (an fqn in ``planner_data``); anything else is recorded as a placeholder (a
        str subclass would unpickle as a plain str, and one object is registered once only)."""
        if value is not None and (type(value) is not str or id(value) in self._memo_ids):
            value = None
        elif value is not None:
            self._memo_ids.add(id(value))
        self.memo_objects.append(value)
        return _MEMOIZE, len(self.memo_objects) - 1

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
        """``obj`` pickled in this stream's memo. The pickler starts from a memo of every object
        in ``memo_objects`` (a fresh placeholder for a None; the C pickler numbers new entries
        from the memo's size on), so its BINGETs are right, shared or cyclic references in
        ``obj`` survive, and the objects already memoised are referenced (an fqn in
        ``planner_data``); the stream's memo grows by what it memoised (as placeholders). One
        pickler serves consecutive calls while nothing else was memoised in between; building
        another costs O(memo): for a few objects per file."""
        if self._pickler is None or self._pickler_memo_size != self.memo_size:
            self._pickler_out = io.BytesIO()
            self._pickler = pickle.Pickler(self._pickler_out, protocol=_PROTOCOL)
            if self.memo_objects:
                self._pickler.memo = {i: (i, object() if o is None else o) for i, o in enumerate(self.memo_objects)}
        out = self._pickler_out
        out.seek(0)
        out.truncate()
        self._pickler.dump(obj)
        body = _strip_pickle(out.getvalue())
        size = len(self._pickler.memo.copy())
        if size < self.memo_size:
            raise AssertionError("the pickler's memo lost track of the stream's")
        self.memo_objects.extend([None] * (size - self.memo_size))
        self._pickler_memo_size = size
        return body


class _Shared:
    """The objects written once for the whole file and referenced from then on: ``torch.Size``
    values (keyed by their ints) and ``TensorProperties`` (keyed by their type and fields).
    Each takes one memo slot. Lives for one :func:`write_metadata` call (the identity cache of
    properties relies on the table keeping its objects alive meanwhile)."""

    def __init__(self, stream: _Stream, size_get: bytes) -> None:
        self.stream = stream
        self.size_get = size_get  # BINGET of the class torch.Size
        self.sizes: dict[tuple[int, ...], int] = {}  # value -> memo index
        self._size_gets: dict[tuple[int, ...], bytes] = {}  # value -> its BINGET
        self._properties: dict[tuple[Any, ...], bytes] = {}  # fields -> BINGET
        self._properties_by_id: dict[int, bytes] = {}  # id of a properties object seen -> BINGET

    def push_size(self, key: tuple[int, ...], memoise: bool = True) -> bytes:
        """Opcodes pushing ``torch.Size(key)``: a BINGET when it was written before, else the Size
        itself, memoised unless ``memoise`` is False (a value nothing will reference again: a memo
        slot costs a byte, and it pushes later memo indices past 255, where a reference takes 5
        bytes instead of 2). The caller adds the bytes to the stream before it memoises anything else."""
        get = self._size_gets.get(key)
        if get is not None:
            return get
        before, after = _tuple_ops(len(key))
        body = self.size_get + before + b"".join([_int(v) for v in key]) + after + _TUPLE1 + _REDUCE
        if not memoise:
            return body
        op, index = self.stream.memoize()
        self.sizes[key] = index
        self._size_gets[key] = _get(index)
        return body + op

    def push_properties(self, props: Any) -> bytes:
        """Opcodes pushing ``props`` (a ``TensorProperties``): a BINGET when an equal one was
        written before. Fallback: anything unhashable or not shaped like TensorProperties is
        pickled on its own each time."""
        get = self._properties_by_id.get(id(props))
        if get is not None:
            return get
        try:
            key = (type(props), *tensor_properties_key(props))
            hash(key)
        except (AttributeError, TypeError):
            return _pickled_fast(props)
        get = self._properties.get(key)
        if get is not None:
            self._properties_by_id[id(props)] = get
            return get
        # Pickled without a memo of its own and memoised whole: one memo slot per distinct
        # properties (its dozen inner objects would take a dozen, see push_size).
        op, index = self.stream.memoize()
        self._properties[key] = self._properties_by_id[id(props)] = _get(index)
        return _pickled_fast(props) + op


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
# Windows of rows: one record template per row shape, runs of rows in row order
# ---------------------------------------------------------------------------------------------

# A row's shape code: base * 4 + variant. ``base`` fixes the record's layout apart from sharing
# (its ndim, and for storage_data whether it has a checksum); the variant bits say which parts
# reference a shared object: _ZERO (offsets all zero: the zero Size of that ndim) and _WHOLE (chunk
# sizes equal to the tensor's: the tensor's Size). Variant 0 is the generic record of the base,
# valid for any row of that base.
_ZERO, _WHOLE = 1, 2


class _WindowRows:
    """What a window [start, end) of rows needs to pick its rows' shapes: their entries, the
    entries' kinds and, for rows of entries with at most ``_FEW_ROWS`` chunks, whether the
    chunk's offsets are all zero and its sizes the tensor's. Tensor ops over the window's rows, a
    Python step per entry at most."""

    def __init__(self, table: ChunkTable, kinds: list[int]) -> None:
        self.table = table
        self.starts = table.row_start.tolist()
        self.kinds = torch.tensor(kinds, dtype=torch.int64).reshape(-1)  # ndim, -1 for bytes entries
        self.counts = table.row_start[1:] - table.row_start[:-1]
        self.few = (self.counts <= _FEW_ROWS) & (self.counts > 0) & (self.kinds >= 0)  # tensor entries with few chunks
        width = table.offsets.shape[1]
        self.width_range = torch.arange(width, dtype=torch.int64)
        padded = [list(s) + [0] * (width - len(s)) if s is not None and len(s) <= width else [0] * width
                  for s in table.sizes]
        self.entry_sizes = torch.tensor(padded, dtype=torch.int64).reshape(-1, width)

    def entries(self, start: int, end: int) -> tuple[int, torch.Tensor]:
        """(first entry of the window, each of its entries' rows inside the window) for entries
        first .. the entry of row end - 1."""
        first = bisect_right(self.starts, start) - 1
        last = bisect_right(self.starts, end - 1) - 1
        bounds = self.table.row_start[first : last + 2]
        return first, bounds[1:].clamp(max=end) - bounds[:-1].clamp(min=start)

    def entry_of_rows(self, start: int, end: int) -> torch.Tensor:
        first, inside = self.entries(start, end)
        return torch.repeat_interleave(torch.arange(first, first + len(inside), dtype=torch.int64), inside)

    def codes(self, start: int, end: int, *, storage: bool) -> int | torch.Tensor:
        """The shape code of each row in [start, end) (an int when all rows share one): base
        ``ndim + 1`` (0 for bytes rows) for a chunk of state_dict_metadata, ``(kind + 1) * 2 +
        has_checksum`` for an item of storage_data; variants _ZERO and (chunks only) _WHOLE."""
        first, inside = self.entries(start, end)
        kinds = self.kinds[first : first + len(inside)]
        base = kinds + 1
        has: torch.Tensor | int = 0
        if storage:
            base = base * 2
            checks = self.table.storage.checksums[start:end] != NO_CHECKSUM
            has = int(checks[0]) if bool((checks == checks[0]).all()) else checks.to(torch.int64)
        few = self.few[first : first + len(inside)]
        any_few = bool(few.any())
        lo, hi = (int(v) for v in torch.aminmax(base))
        if lo == hi and isinstance(has, int) and not any_few:
            return (lo + has) * 4
        codes = (torch.repeat_interleave(base, inside) + has) * 4
        if any_few:
            rows = torch.nonzero(torch.repeat_interleave(few, inside)).flatten()
            entry = torch.repeat_interleave(torch.arange(first, first + len(inside), dtype=torch.int64), inside)[rows]
            outside = self.width_range >= self.kinds[entry][:, None]  # columns past the row's ndim
            zero = ((self.table.offsets[start + rows] == 0) | outside).all(1)
            variant = zero.to(torch.int64) * _ZERO
            if not storage:
                whole = ((self.table.lengths[start + rows] == self.entry_sizes[entry]) | outside).all(1)
                variant += whole.to(torch.int64) * _WHOLE
            codes[rows] += variant
        return codes


class _Window:
    """The records of the rows [start, end), built once: per shape code a group of records (for
    its rows, gathered, or for a span of rows holding them) and the runs of rows in row order,
    each naming its group and the record of its first row there."""

    def __init__(self, start: int, end: int, codes: int | torch.Tensor, build: Any) -> None:
        """``build(sel, code)``: uint8 records [rows, bytes] for the window rows ``sel`` (a slice
        or an int64 tensor of positions in the window) of shape ``code``, or None for rows that
        are never emitted."""
        self.start, self.end = start, end
        n = end - start
        if isinstance(codes, int):
            bounds, run_codes = [0, n], [codes]
        else:
            cuts = (torch.nonzero(codes[1:] != codes[:-1]).flatten() + 1).tolist()
            bounds = [0] + cuts + [n]
            run_codes = codes[bounds[:-1]].tolist()
        groups: dict[int, tuple[Any, int | None]] = {}  # code -> (records, views, width | None; first row of a span)
        distinct = set(run_codes)
        for code in distinct:
            if len(distinct) == 1:
                sel: slice | torch.Tensor = slice(0, n)
            else:
                where = torch.nonzero(codes == code).flatten()
                first, last = int(where[0]), int(where[-1])
                # Records for a span of rows (sliced columns, no gather) when the holes in it are
                # at most as many as the code's own rows and are rows of the same base: their
                # records go unused, and their values (same ndim) do not widen the int opcodes.
                span = last - first + 1 == len(where) or (
                    last - first + 1 <= 2 * len(where) and bool(((codes[first : last + 1] >> 2) == (code >> 2)).all())
                )
                sel = slice(first, last + 1) if span else where
            records = build(sel, code)
            group = None if records is None else (records, _tensor_view(records), records.shape[1])
            groups[code] = (group, sel.start if isinstance(sel, slice) else None)
        self.runs: list[tuple[int, int, Any, int]] = []  # (start, end, group, record of start)
        seen: dict[int, int] = {}
        for run_start, run_end, code in zip(bounds, bounds[1:], run_codes):
            group, span_start = groups[code]
            at = run_start - span_start if span_start is not None else seen.get(code, 0)
            seen[code] = seen.get(code, 0) + run_end - run_start
            self.runs.append((run_start, run_end, group, at))
        self.run_starts = bounds[:-1]

    def emit(self, stream: _Stream, lo: int, hi: int) -> None:
        """Add the records of the table rows [lo, hi) (inside this window) to ``stream``."""
        lo -= self.start
        hi -= self.start
        if len(self.runs) == 1:  # the common case: one group for the whole window
            records, view, width = self.runs[0][2]
            stream.add_records(view[lo * width : hi * width], records)
            return
        i = bisect_right(self.run_starts, lo) - 1
        while i < len(self.runs) and self.runs[i][0] < hi:
            run_start, run_end, group, at = self.runs[i]
            a, b = max(lo, run_start), min(hi, run_end)
            records, view, width = group
            stream.add_records(view[(at + a - run_start) * width : (at + b - run_start) * width], records)
            i += 1


class _WindowCursor:
    """Walks windows of ``_BLOCK_ROWS`` rows in row order, building each window once."""

    def __init__(self, rows: int, make: Any) -> None:
        self.rows = rows
        self.make = make  # make(start, end) -> _Window
        self.current: _Window | None = None

    def window(self, row: int) -> _Window:
        if self.current is None or not self.current.start <= row < self.current.end:
            start = row - row % _BLOCK_ROWS
            self.current = self.make(start, min(self.rows, start + _BLOCK_ROWS))
        return self.current


# ---------------------------------------------------------------------------------------------
# The writer
# ---------------------------------------------------------------------------------------------


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
    (equal, with the same attributes on every object and the same ``MetadataIndex.index`` hints;
    equal ``TensorProperties`` and ``torch.Size`` values may be one shared object), plus the
    attribute ``fastdcp_chunk_index = chunk_index_name`` when one is given.
    Preconditions: ``table`` is consistent (row_start spans the rows, a bytes entry has one row,
    columns past an entry's ndim are ignored); ``planner_data``/``storage_meta``/``version`` are
    picklable. Memory: the output is written in frames of ~4 MB, records built ``_BLOCK_ROWS``
    rows at a time; per-row temporaries are a few bytes per row; each entry's opening (~100 bytes)
    is composed before the first chunk is written.
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
    # A few file names take memo slots below 256 here, before the fqns: every storage_data item
    # references one (BINGET, 2 bytes, instead of LONG_BINGET, 5). Many files (one per rank) come
    # after the fqns, which keep those slots.
    file_memo = None
    if table.storage is not None and len(table.storage.files) <= _EARLY_FILES:
        file_memo = _memoise_files(head, stream, table.storage.files)
    # The all-zero offsets of each ndim the chunks of few-chunk entries may have (a chunk record
    # references them: they must be memoised before the entries, see _write_state_dict_metadata).
    shared = _Shared(stream, memo["Size"])
    rows = _WindowRows(table, [(-1 if size is None else len(size)) for size in table.sizes])
    for ndim in sorted(set(rows.kinds[rows.few].tolist())):
        head += shared.push_size((0,) * ndim)
    head += _POP_MARK
    stream.add(bytes(head))

    fqn_memo = _write_state_dict_metadata(stream, memo, shared, table, rows)
    stream.add(_unicode("planner_data") + stream.pickled(planner_data) + _SETITEM)
    _write_storage_data(stream, memo, shared, table, rows, fqn_memo, file_memo)
    stream.add(_unicode("storage_meta") + stream.pickled(storage_meta) + _SETITEM)
    stream.add(_unicode("version") + stream.pickled(version) + _SETITEM)
    stream.add(_BUILD + _STOP)
    stream.flush()
    return stream.written


def _memoise_files(out: bytearray, stream: _Stream, files: list[str]) -> list[int]:
    """Append the file names, each memoised, to ``out`` (inside a MARK the caller drops with
    POP_MARK); returns their memo indices."""
    file_memo = []
    for name in files:
        op, index = stream.memoize(name)
        out += _unicode(name) + op
        file_memo.append(index)
    return file_memo


def _rows_of(start: int, sel: slice | torch.Tensor) -> slice | torch.Tensor:
    """The table rows of window positions ``sel`` (a window starting at row ``start``)."""
    return slice(start + sel.start, start + sel.stop) if isinstance(sel, slice) else sel + start


def _write_state_dict_metadata(
    stream: _Stream, memo: dict[str, bytes], shared: _Shared, table: ChunkTable, window_rows: _WindowRows
) -> list[int]:
    """The ``state_dict_metadata`` key and dict; returns each fqn string's memo index.

    Every entry's opening (fqn, properties, size) is composed first, so that the memo index of
    each tensor's Size is known before any window of chunk records that references it is built;
    emitting the chunks then memoises nothing (the zero Sizes were memoised in the header)."""
    heads: list[bytes] = []
    fqn_memo: list[int] = []
    size_memo: list[int] = []  # per entry: the memo index of its Size, -1 when not memoised
    # A tensor's Size is memoised when something may reference it again: another entry of that
    # size, or the whole-tensor chunk of an entry with few chunks.
    size_keys = [None if size is None else tuple(int(v) for v in size) for size in table.sizes]
    repeated = {key for key, n in Counter(size_keys).items() if n > 1}
    few = window_rows.few.tolist()
    bytes_entry = memo["BytesStorageMetadata"] + _NEW + _SETITEM
    tensor_entry = memo["TensorStorageMetadata"] + _NEW + _EMPTY_DICT + _MARK + memo["properties"]
    size_field, chunks_field = memo["size"], memo["chunks"] + _EMPTY_LIST
    push_properties, push_size, size_index = shared.push_properties, shared.push_size, shared.sizes.get
    for e, fqn in enumerate(table.fqns):
        # In memo order: the fqn, then what the properties and the size memoise.
        op, index = stream.memoize(fqn)
        fqn_memo.append(index)
        key = size_keys[e]
        if key is None:
            heads.append(_unicode(fqn) + op + bytes_entry)
            size_memo.append(-1)
            continue
        props = push_properties(table.properties[e])
        size = push_size(key, few[e] or key in repeated)
        heads.append(b"".join((_unicode(fqn), op, tensor_entry, props, size_field, size, chunks_field)))
        size_memo.append(size_index(key, -1))
    size_memo_t = torch.tensor(size_memo, dtype=torch.int64)

    def build_chunks(start: int, entry_of: Any, sel: slice | torch.Tensor, code: int) -> torch.Tensor | None:
        ndim, variant = (code >> 2) - 1, code & 3
        if ndim < 0:
            return None  # bytes rows: no chunk
        rows = _rows_of(start, sel)
        rec = _Record(shared.size_get)
        rec.const(memo["ChunkStorageMetadata"] + _NEW + _EMPTY_DICT + _MARK + memo["offsets"])
        if variant & _ZERO:
            rec.const(_get(shared.sizes[(0,) * ndim]))  # memoised in the header
        else:
            rec.size(table.offsets[rows, :ndim])
        rec.const(memo["sizes"])
        if variant & _WHOLE:
            rec.memo_ref(size_memo_t[entry_of()[sel]])  # the tensors' own Sizes (few entries memoise theirs)
        else:
            rec.size(table.lengths[rows, :ndim])
        rec.const(_SETITEMS + _BUILD)
        return rec.build(sel.stop - sel.start if isinstance(sel, slice) else len(sel))

    def make(start: int, end: int) -> _Window:
        entry_rows: list[torch.Tensor] = []

        def entry_of() -> torch.Tensor:  # the window's rows' entries, computed once when needed
            if not entry_rows:
                entry_rows.append(window_rows.entry_of_rows(start, end))
            return entry_rows[0]

        codes = window_rows.codes(start, end, storage=False)
        return _Window(start, end, codes, lambda sel, code: build_chunks(start, entry_of, sel, code))

    cursor = _WindowCursor(table.rows, make)
    stream.add(_unicode("state_dict_metadata") + _EMPTY_DICT)
    starts = window_rows.starts
    memo_size = stream.memo_size
    for e, head in enumerate(heads):
        row, end = starts[e], starts[e + 1]
        if size_keys[e] is None:
            stream.add(head)
            continue
        if row == end:
            stream.add(head + _SETITEMS + _BUILD + _SETITEM)
            continue
        stream.add(head + _MARK)
        while row < end:
            window = cursor.window(row)
            stop = min(end, window.end)
            window.emit(stream, row, stop)
            row = stop
        stream.add(_APPENDS + _SETITEMS + _BUILD + _SETITEM)
    if stream.memo_size != memo_size:
        raise AssertionError("chunk records memoised something after the entries' memo indices were assigned")
    stream.add(_SETITEM)
    return fqn_memo


def _write_storage_data(
    stream: _Stream,
    memo: dict[str, bytes],
    shared: _Shared,
    table: ChunkTable,
    window_rows: _WindowRows,
    fqn_memo: list[int],
    file_memo: list[int] | None,
) -> None:
    """The ``storage_data`` key and dict (``None`` when the table has no storage columns).
    ``file_memo``: the memo indices of the file names, None when they are not written yet."""
    storage = table.storage
    if storage is None:
        stream.add(_unicode("storage_data") + _NONE + _SETITEM)
        return
    if file_memo is None:
        files = bytearray(_MARK)
        file_memo = _memoise_files(files, stream, storage.files)
        files += _POP_MARK
        stream.add(bytes(files))
    file_memo_t = torch.tensor(file_memo, dtype=torch.int64)
    fqn_memo_t = torch.tensor(fqn_memo, dtype=torch.int64)
    row_start = table.row_start

    def build_items(start: int, entry_rows: torch.Tensor, sel: slice | torch.Tensor, code: int) -> torch.Tensor:
        base, variant = code >> 2, code & 3
        ndim, has_checksum = (base >> 1) - 1, base & 1
        rows = _rows_of(start, sel)
        entry = entry_rows[sel]
        rec = _Record(shared.size_get)
        rec.const(memo["MetadataIndex"] + _NEW + _EMPTY_DICT + _MARK + memo["fqn"])
        rec.memo_ref(fqn_memo_t[entry])
        rec.const(memo["index"])
        if ndim < 0:
            rec.const(_NONE)
        else:
            row_numbers = (torch.arange(rows.start, rows.stop, dtype=torch.int64) if isinstance(rows, slice)
                           else rows)
            rec.ints(row_numbers - row_start[entry])
            rec.const(memo["offset"])
            if variant & _ZERO:
                rec.const(_get(shared.sizes[(0,) * ndim]))  # memoised in the header
            else:
                rec.size(table.offsets[rows, :ndim])
        rec.const(_SETITEMS + _BUILD)
        rec.const(memo["_StorageInfo"] + _NEW + _EMPTY_DICT + _MARK + memo["relative_path"])
        rec.memo_ref(file_memo_t[storage.file_index[rows].to(torch.int64)])
        rec.const(memo["offset"])
        rec.ints(storage.byte_offset[rows])
        rec.const(memo["length"])
        rec.ints(storage.byte_length[rows])
        if has_checksum:
            rec.const(memo[CHECKSUM_ATTRIBUTE])
            rec.ints(storage.checksums[rows])
        rec.const(_SETITEMS + _BUILD)
        return rec.build(len(entry))

    stream.add(_unicode("storage_data") + _EMPTY_DICT)
    for start in range(0, table.rows, _BLOCK_ROWS):
        end = min(table.rows, start + _BLOCK_ROWS)
        entry_rows = window_rows.entry_of_rows(start, end)
        codes = window_rows.codes(start, end, storage=True)
        window = _Window(start, end, codes, lambda sel, code: build_items(start, entry_rows, sel, code))
        stream.add(_MARK)
        window.emit(stream, start, end)
        stream.add(_SETITEMS)
    stream.add(_SETITEM)
