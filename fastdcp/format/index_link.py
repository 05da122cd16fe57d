"""How a ``.metadata`` and its chunk index are tied together: the ``.metadata`` names the index in
its first bytes (:func:`find_chunk_index_name`; stock readers ignore the attribute), and the index
records the ``.metadata``'s size and the CRC-32C of its first and last bytes
(:func:`metadata_facts`), so a reader uses an index only while both still match.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from .checksums import crc32c
from .index_layout import EDGE_BYTES
from .metadata import CheckpointFormatError
from .metadata_emit import CHUNK_INDEX_ATTRIBUTE
from .sources import as_source, read_exactly

__all__ = ["find_chunk_index_name", "metadata_facts"]

_MD_MODULE = "torch.distributed.checkpoint.metadata"


def metadata_facts(data: Any, edge_bytes: int = EDGE_BYTES, head: bytes = b"") -> tuple[int, int, int]:
    """(size, CRC-32C of the first ``edge_bytes``, CRC-32C of the last ``edge_bytes``) of a
    ``.metadata``: bytes-like, or a :class:`~fastdcp.format.sources.PositionalSource` read by
    positional reads. ``head``: its first bytes when already read (used for as many of the edges
    as they cover, so a small file costs no second read). A source shorter than its size raises
    :class:`CheckpointFormatError`."""
    source = as_source(data)
    fail = lambda problem: CheckpointFormatError(f"'{source.name}': {problem}")  # noqa: E731
    size = source.size()
    first = min(size, edge_bytes)
    head_part = head[:first] if len(head) >= first else bytes(read_exactly(source, 0, first, fail))
    start = max(0, size - edge_bytes)
    tail_part = head[start:size] if len(head) >= size else bytes(read_exactly(source, start, size - start, fail))
    return size, crc32c(head_part), crc32c(tail_part)


def find_chunk_index_name(head: bytes) -> str | None:
    """The chunk index file named by a ``.metadata`` ``write_metadata`` wrote, from its first
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
