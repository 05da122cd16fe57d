"""Pickle opcodes written directly: the opcodes of single values (strings, ints, memo references,
tuples; ints in the narrowest fixed-width opcode of a range), whole small objects spliced into
another stream, and :class:`PickleStream`, which writes opcodes in frames and keeps the memo's
bookkeeping (so a :class:`pickle.Pickler` can continue in it). What
:mod:`fastdcp.format.metadata_emit` writes ``.metadata`` with.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
from typing import Any, BinaryIO

import torch

__all__ = ["PROTOCOL", "NEW", "PickleStream", "op_str", "op_int", "op_get", "tuple_ops", "int_format", "get_format",
           "strip_pickle", "pickled_fast", "tensor_view"]

PROTOCOL = 4  # the pickle protocol written

# Opcodes (pickle's own constants, as bytes).
_MARK, _STOP, _TUPLE = pickle.MARK, pickle.STOP, pickle.TUPLE
_TUPLES = (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_MEMOIZE, _BINGET, _LONG_BINGET = pickle.MEMOIZE, pickle.BINGET, pickle.LONG_BINGET
_BININT1, _BININT2, _BININT, _LONG1, _LONG4 = pickle.BININT1, pickle.BININT2, pickle.BININT, pickle.LONG1, pickle.LONG4
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.BINUNICODE8
_FRAME = pickle.FRAME
NEW = pickle.EMPTY_TUPLE + pickle.NEWOBJ  # cls () NEWOBJ: what copyreg.__newobj__ pickles to

# ---------------------------------------------------------------------------------------------
# Opcode helpers for single values
# ---------------------------------------------------------------------------------------------


def op_str(text: str) -> bytes:
    """A str as pickle writes it (UTF-8 with lone surrogates passed through, like pickle)."""
    data = text.encode("utf-8", "surrogatepass")
    n = len(data)
    if n < 256:
        return _SHORT_BINUNICODE + bytes((n,)) + data
    if n < 1 << 32:
        return _BINUNICODE + struct.pack("<I", n) + data
    return _BINUNICODE8 + struct.pack("<Q", n) + data


def op_int(value: int) -> bytes:
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


def op_get(index: int) -> bytes:
    return _BINGET + bytes((index,)) if index < 256 else _LONG_BINGET + struct.pack("<I", index)


def tuple_ops(n: int) -> tuple[bytes, bytes]:
    """(opcodes before the n items, opcodes after them) of an n-tuple."""
    return (b"", _TUPLES[n]) if n <= 3 else (_MARK, _TUPLE)


def int_format(lo: int, hi: int) -> tuple[bytes, int]:
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


def get_format(hi: int) -> tuple[bytes, int]:
    return (_BINGET, 1) if hi < 256 else (_LONG_BINGET, 4)


def strip_pickle(data: bytes) -> bytes:
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


def pickled_fast(obj: Any) -> bytes:
    """``obj`` pickled without memo (no MEMOIZE, no BINGET): the bytes can be spliced anywhere,
    any number of times. For small acyclic objects only."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=PROTOCOL)
    pickler.fast = True
    pickler.dump(obj)
    return strip_pickle(buf.getvalue())


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy (the caller keeps ``t`` alive)."""
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


# ---------------------------------------------------------------------------------------------
# The output stream: frames of whole opcodes, memo bookkeeping
# ---------------------------------------------------------------------------------------------


class PickleStream:
    """Buffers opcodes into frames of about ``frame_bytes`` and writes them to ``out``.

    Every piece added is made of whole opcodes, so no opcode straddles a frame boundary (the
    pure-Python unpickler requires that). Large pieces are memoryviews of record tensors and are
    written without copying; ``owners`` keeps those tensors alive until their frame is written.

    The memo: ``memo_objects[i]`` stands for what the unpickler's memo will hold at index ``i``:
    the very object when it is one of the caller's ``str`` (an fqn, a file name), else None (a
    placeholder). :meth:`pickled` hands these to its pickler, so it numbers its own MEMOIZEs
    right and references those strings instead of writing them again."""

    def __init__(self, out: BinaryIO, frame_bytes: int) -> None:
        self.out = out
        self.frame_bytes = frame_bytes  # a frame is written once this much is pending
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
        if self.pending >= self.frame_bytes:
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
        if self.pending >= self.frame_bytes:
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
            self._pickler = pickle.Pickler(self._pickler_out, protocol=PROTOCOL)
            if self.memo_objects:
                self._pickler.memo = {i: (i, object() if o is None else o) for i, o in enumerate(self.memo_objects)}
        out = self._pickler_out
        out.seek(0)
        out.truncate()
        self._pickler.dump(obj)
        body = strip_pickle(out.getvalue())
        size = len(self._pickler.memo.copy())
        if size < self.memo_size:
            raise AssertionError("the pickler's memo lost track of the stream's")
        self.memo_objects.extend([None] * (size - self.memo_size))
        self._pickler_memo_size = size
        return body
