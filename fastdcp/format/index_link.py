"""How a ``.metadata`` and its chunk index are tied together: the ``.metadata`` names the index in
its first bytes (:func:`find_chunk_index_name`; stock readers ignore the attribute), and the index
records the ``.metadata``'s size and the CRC-32C of its first and last bytes
(:func:`metadata_facts`), so a reader uses an index only while both still match.
"""

from __future__ import annotations

from typing import Any

from .checksums import crc32c
from .index_layout import EDGE_BYTES
from .metadata import CheckpointFormatError
from .metadata_emit import CHUNK_INDEX_ATTRIBUTE
from .pickles import first_state_item
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
        item = first_state_item(bytes(head[:1 << 16]), _MD_MODULE, "Metadata")
    except Exception:  # noqa: BLE001 - garbage in, None out
        return None
    if item is None:
        return None
    key, value = item
    if key != CHUNK_INDEX_ATTRIBUTE or type(value) is not str or not value:
        return None
    return value
