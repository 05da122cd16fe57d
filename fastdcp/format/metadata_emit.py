"""Writes a checkpoint's ``.metadata`` straight from a :class:`~fastdcp.format.chunk_table.ChunkTable`,
as a pickle stock DCP reads (``pickle.load``) into the very objects it would have pickled itself,
without building them (:func:`write_metadata`): the per-chunk parts as fixed-size records filled
with tensor operations (:mod:`fastdcp.format.metadata_records`), streamed in frames
(:mod:`fastdcp.format.pickle_stream`); equal objects written once and referenced (see below).

The result unpickles to a ``Metadata`` equal to ``table_to_metadata(table, ...)`` attribute for
attribute, plus ``fastdcp_chunk_index`` (:data:`CHUNK_INDEX_ATTRIBUTE`) when an index is named:
the first key of the Metadata's state, in the file's first bytes
(:func:`fastdcp.format.index_link.find_chunk_index_name`); stock ignores it.
"""

from __future__ import annotations

import pickle
from collections import Counter
from typing import Any, BinaryIO

import torch

from ..compat.torch_internals import tensor_properties_key
from .chunk_table import ChunkTable
from .metadata import CHECKSUM_ATTRIBUTE
from .metadata_records import WHOLE, ZERO, Record, Window, WindowCursor, WindowRows
from .pickle_stream import NEW, PROTOCOL, PickleStream, op_get, op_int, op_str, pickled_fast, tuple_ops

__all__ = ["CHUNK_INDEX_ATTRIBUTE", "write_metadata"]

# The Metadata attribute naming the chunk index file written beside .metadata (stock ignores it).
CHUNK_INDEX_ATTRIBUTE = "fastdcp_chunk_index"

_BLOCK_ROWS = 1 << 16  # rows filled per tensor pass (a window): ~2-6 MB of records
# Entries with at most this many chunks share zero offsets and whole-tensor chunk sizes: single-
# chunk entries (many small tensors). Larger values work too (tests use them), but a shared first
# chunk then splits each entry's records in two runs: measured with 5,000 entries of 2..16 chunks,
# +110-125% write time for 1-5% smaller files.
_FEW_ROWS = 1
_EARLY_FILES = 32  # at most this many file names are memoised before the fqns
_FRAME_BYTES = 4 << 20  # a frame is written once this much is pending
_MD_MODULE = "torch.distributed.checkpoint.metadata"
_FS_MODULE = "torch.distributed.checkpoint.filesystem"

# Opcodes (pickle's own constants, as bytes).
_MARK, _STOP, _POP_MARK = pickle.MARK, pickle.STOP, pickle.POP_MARK
_NONE, _EMPTY_DICT, _EMPTY_LIST = pickle.NONE, pickle.EMPTY_DICT, pickle.EMPTY_LIST
_TUPLE1, _BUILD, _REDUCE = pickle.TUPLE1, pickle.BUILD, pickle.REDUCE
_SETITEM, _SETITEMS, _APPENDS = pickle.SETITEM, pickle.SETITEMS, pickle.APPENDS
_STACK_GLOBAL = pickle.STACK_GLOBAL

# ---------------------------------------------------------------------------------------------
# Objects written once and referenced
# ---------------------------------------------------------------------------------------------
#
# As stock's pickler does with the objects a plan shares, equal objects are written once and
# referenced with BINGET/LONG_BINGET from then on: class globals, field names, fqns and file names;
# one TensorProperties per distinct (dtype, layout, requires_grad, memory_format, pin_memory); one
# torch.Size per repeated tensor size; and, for the chunk of an entry with at most _FEW_ROWS
# chunks (many small tensors), all-zero offsets (one torch.Size per ndim, also the storage key's
# offset) and a chunk size equal to its tensor's size (the tensor's own torch.Size). The chunks of
# entries with more chunks are not memoised (the memo of whoever unpickles the file stays small,
# and their records stay one template per window). planner_data, storage_meta and version are
# pickled by a pickle.Pickler that shares the file's memo (so they reference the fqn strings and
# TensorProperties parts already written) and spliced in.


class _Shared:
    """The objects written once for the whole file and referenced from then on: ``torch.Size``
    values (keyed by their ints) and ``TensorProperties`` (keyed by their type and fields).
    Each takes one memo slot. Lives for one :func:`write_metadata` call (the identity cache of
    properties relies on the table keeping its objects alive meanwhile)."""

    def __init__(self, stream: PickleStream, size_get: bytes) -> None:
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
        before, after = tuple_ops(len(key))
        body = self.size_get + before + b"".join([op_int(v) for v in key]) + after + _TUPLE1 + _REDUCE
        if not memoise:
            return body
        op, index = self.stream.memoize()
        self.sizes[key] = index
        self._size_gets[key] = op_get(index)
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
            return pickled_fast(props)
        get = self._properties.get(key)
        if get is not None:
            self._properties_by_id[id(props)] = get
            return get
        # Pickled without a memo of its own and memoised whole: one memo slot per distinct
        # properties (its dozen inner objects would take a dozen, see push_size).
        op, index = self.stream.memoize()
        self._properties[key] = self._properties_by_id[id(props)] = op_get(index)
        return pickled_fast(props) + op


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
    stream = PickleStream(out, _FRAME_BYTES)
    stream.raw(pickle.PROTO + bytes((PROTOCOL,)))
    memo: dict[str, bytes] = {}  # name -> the BINGET of what was memoised under it

    def memoised_global(module_push: bytes, name: str) -> bytes:
        """Push class ``name`` of the module ``module_push`` pushes, memoising the class."""
        push = module_push + op_str(name) + stream.memoize()[0] + _STACK_GLOBAL
        op, index = stream.memoize()
        memo[name] = op_get(index)
        return push + op

    def memoised_module(module: str) -> bytes:
        """Push a module name, memoised (its first STACK_GLOBAL consumes it)."""
        op, index = stream.memoize()
        memo[module] = op_get(index)
        return op_str(module) + op

    # The Metadata object; the chunk index name first, where a reader finds it in the first bytes.
    head = bytearray(memoised_global(memoised_module(_MD_MODULE), "Metadata"))
    head += NEW + _EMPTY_DICT
    if chunk_index_name is not None:
        head += op_str(CHUNK_INDEX_ATTRIBUTE) + op_str(chunk_index_name) + _SETITEM

    # Classes and field names, memoised once (pushed after a MARK and dropped with POP_MARK:
    # the memo keeps them, the object stays untouched).
    head += _MARK
    for name in ("TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex"):
        head += memoised_global(memo[_MD_MODULE], name)
    head += memoised_global(memoised_module("torch"), "Size")
    head += memoised_global(memoised_module(_FS_MODULE), "_StorageInfo")
    for field in ("properties", "size", "chunks", "offsets", "sizes", "fqn", "index", "offset", "relative_path",
                  "length", CHECKSUM_ATTRIBUTE):
        head += op_str(field)
        op, index = stream.memoize()
        head += op
        memo[field] = op_get(index)
    # A few file names take memo slots below 256 here, before the fqns: every storage_data item
    # references one (BINGET, 2 bytes, instead of LONG_BINGET, 5). Many files (one per rank) come
    # after the fqns, which keep those slots.
    file_memo = None
    if table.storage is not None and len(table.storage.files) <= _EARLY_FILES:
        file_memo = _memoise_files(head, stream, table.storage.files)
    # The all-zero offsets of each ndim the chunks of few-chunk entries may have (a chunk record
    # references them: they must be memoised before the entries, see _write_state_dict_metadata).
    shared = _Shared(stream, memo["Size"])
    rows = WindowRows(table, [(-1 if size is None else len(size)) for size in table.sizes], _FEW_ROWS)
    for ndim in sorted(set(rows.kinds[rows.few].tolist())):
        head += shared.push_size((0,) * ndim)
    head += _POP_MARK
    stream.add(bytes(head))

    fqn_memo = _write_state_dict_metadata(stream, memo, shared, table, rows)
    stream.add(op_str("planner_data") + stream.pickled(planner_data) + _SETITEM)
    _write_storage_data(stream, memo, shared, table, rows, fqn_memo, file_memo)
    stream.add(op_str("storage_meta") + stream.pickled(storage_meta) + _SETITEM)
    stream.add(op_str("version") + stream.pickled(version) + _SETITEM)
    stream.add(_BUILD + _STOP)
    stream.flush()
    return stream.written


def _memoise_files(out: bytearray, stream: PickleStream, files: list[str]) -> list[int]:
    """Append the file names, each memoised, to ``out`` (inside a MARK the caller drops with
    POP_MARK); returns their memo indices."""
    file_memo = []
    for name in files:
        op, index = stream.memoize(name)
        out += op_str(name) + op
        file_memo.append(index)
    return file_memo


def _rows_of(start: int, sel: slice | torch.Tensor) -> slice | torch.Tensor:
    """The table rows of window positions ``sel`` (a window starting at row ``start``)."""
    return slice(start + sel.start, start + sel.stop) if isinstance(sel, slice) else sel + start


def _write_state_dict_metadata(
    stream: PickleStream, memo: dict[str, bytes], shared: _Shared, table: ChunkTable, window_rows: WindowRows
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
    bytes_entry = memo["BytesStorageMetadata"] + NEW + _SETITEM
    tensor_entry = memo["TensorStorageMetadata"] + NEW + _EMPTY_DICT + _MARK + memo["properties"]
    size_field, chunks_field = memo["size"], memo["chunks"] + _EMPTY_LIST
    push_properties, push_size, size_index = shared.push_properties, shared.push_size, shared.sizes.get
    for e, fqn in enumerate(table.fqns):
        # In memo order: the fqn, then what the properties and the size memoise.
        op, index = stream.memoize(fqn)
        fqn_memo.append(index)
        key = size_keys[e]
        if key is None:
            heads.append(op_str(fqn) + op + bytes_entry)
            size_memo.append(-1)
            continue
        props = push_properties(table.properties[e])
        size = push_size(key, few[e] or key in repeated)
        heads.append(b"".join((op_str(fqn), op, tensor_entry, props, size_field, size, chunks_field)))
        size_memo.append(size_index(key, -1))
    size_memo_t = torch.tensor(size_memo, dtype=torch.int64)

    def build_chunks(start: int, entry_of: Any, sel: slice | torch.Tensor, code: int) -> torch.Tensor | None:
        ndim, variant = (code >> 2) - 1, code & 3
        if ndim < 0:
            return None  # bytes rows: no chunk
        rows = _rows_of(start, sel)
        rec = Record(shared.size_get)
        rec.const(memo["ChunkStorageMetadata"] + NEW + _EMPTY_DICT + _MARK + memo["offsets"])
        if variant & ZERO:
            rec.const(op_get(shared.sizes[(0,) * ndim]))  # memoised in the header
        else:
            rec.size(table.offsets[rows, :ndim])
        rec.const(memo["sizes"])
        if variant & WHOLE:
            rec.memo_ref(size_memo_t[entry_of()[sel]])  # the tensors' own Sizes (few entries memoise theirs)
        else:
            rec.size(table.lengths[rows, :ndim])
        rec.const(_SETITEMS + _BUILD)
        return rec.build(sel.stop - sel.start if isinstance(sel, slice) else len(sel))

    def make(start: int, end: int) -> Window:
        entry_rows: list[torch.Tensor] = []

        def entry_of() -> torch.Tensor:  # the window's rows' entries, computed once when needed
            if not entry_rows:
                entry_rows.append(window_rows.entry_of_rows(start, end))
            return entry_rows[0]

        codes = window_rows.codes(start, end, storage=False)
        return Window(start, end, codes, lambda sel, code: build_chunks(start, entry_of, sel, code))

    cursor = WindowCursor(table.rows, make, _BLOCK_ROWS)
    stream.add(op_str("state_dict_metadata") + _EMPTY_DICT)
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
    stream: PickleStream,
    memo: dict[str, bytes],
    shared: _Shared,
    table: ChunkTable,
    window_rows: WindowRows,
    fqn_memo: list[int],
    file_memo: list[int] | None,
) -> None:
    """The ``storage_data`` key and dict (``None`` when the table has no storage columns).
    ``file_memo``: the memo indices of the file names, None when they are not written yet."""
    storage = table.storage
    if storage is None:
        stream.add(op_str("storage_data") + _NONE + _SETITEM)
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
        rec = Record(shared.size_get)
        rec.const(memo["MetadataIndex"] + NEW + _EMPTY_DICT + _MARK + memo["fqn"])
        rec.memo_ref(fqn_memo_t[entry])
        rec.const(memo["index"])
        if ndim < 0:
            rec.const(_NONE)
        else:
            row_numbers = (torch.arange(rows.start, rows.stop, dtype=torch.int64) if isinstance(rows, slice)
                           else rows)
            rec.ints(row_numbers - row_start[entry])
            rec.const(memo["offset"])
            if variant & ZERO:
                rec.const(op_get(shared.sizes[(0,) * ndim]))  # memoised in the header
            else:
                rec.size(table.offsets[rows, :ndim])
        rec.const(_SETITEMS + _BUILD)
        rec.const(memo["_StorageInfo"] + NEW + _EMPTY_DICT + _MARK + memo["relative_path"])
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

    stream.add(op_str("storage_data") + _EMPTY_DICT)
    for start in range(0, table.rows, _BLOCK_ROWS):
        end = min(table.rows, start + _BLOCK_ROWS)
        entry_rows = window_rows.entry_of_rows(start, end)
        codes = window_rows.codes(start, end, storage=True)
        window = Window(start, end, codes, lambda sel, code: build_items(start, entry_rows, sel, code))
        stream.add(_MARK)
        window.emit(stream, start, end)
        stream.add(_SETITEMS)
    stream.add(_SETITEM)
