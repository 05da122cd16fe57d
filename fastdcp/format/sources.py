"""What the format's readers read from: a :class:`PositionalSource` (its size, the bytes at an
offset), so that they parse without touching a file themselves. ``fastdcp.io.positional``
implements it for files (``FileSource``), ``fastdcp.objstore.indexed_metadata`` for objects
(ranged GETs), and :class:`BufferSource` here for bytes in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

__all__ = ["PositionalSource", "BufferSource", "as_source", "read_exactly"]


class PositionalSource(Protocol):
    """Bytes at positions of one file or object.

    Args:
        name: the path or URL, for messages.
    """

    name: str

    def size(self) -> int:
        """The size in bytes."""
        ...

    def read_into(self, offset: int, dest: memoryview) -> int:
        """Fill ``dest`` with the bytes from ``offset``; returns how many were read (fewer than
        ``len(dest)`` only where the source ends). Errors are ``OSError``s naming the source."""
        ...

    def close(self) -> None:
        """Release what the source holds (a descriptor, a cached response)."""
        ...


class BufferSource:
    """A bytes-like object (C-contiguous) as a :class:`PositionalSource`.

    Args:
        data: bytes, bytearray, memoryview, mmap or anything else with the buffer protocol.
        name: for messages.
    """

    def __init__(self, data: Any, name: str = "<bytes>") -> None:
        self.name = name
        self._view = memoryview(data).cast("B")

    def size(self) -> int:
        return len(self._view)

    def read_into(self, offset: int, dest: memoryview) -> int:
        n = max(0, min(len(dest), len(self._view) - offset))
        dest[:n] = self._view[offset:offset + n]
        return n

    def close(self) -> None:
        pass


def as_source(data: Any) -> PositionalSource:
    """``data`` itself when it is a :class:`PositionalSource` (has ``read_into``), else the bytes-like
    ``data`` as a :class:`BufferSource`."""
    return data if hasattr(data, "read_into") else BufferSource(data)


def read_exactly(source: PositionalSource, offset: int, length: int, fail: Callable[[str], Exception]) -> bytearray:
    """``length`` bytes of ``source`` from ``offset`` in a writable buffer; ``fail(problem)`` makes
    the error raised when the source ends first."""
    data = bytearray(length)
    view = memoryview(data)
    done = 0
    while done < length:
        n = source.read_into(offset + done, view[done:])
        if not n:
            raise fail(f"truncated: needs bytes up to {offset + length}, the file ended at {offset + done}")
        done += n
    return data
