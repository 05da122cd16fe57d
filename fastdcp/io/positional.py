"""Reading a file or an object at byte positions: what a checkpoint's ``.metadata`` and chunk index
are read through, so that one reading path (``load/metadata_cache.py``,
``load/sectioned_metadata.py``) serves a local checkpoint (:class:`FileSource`: ``pread`` on a
descriptor held open) and one in object storage (``fastdcp.objstore.indexed_metadata.ObjectSource``:
ranged GETs).

A source answers two questions: its size, and the bytes at an offset (fewer only where it ends).
:func:`source_stream` turns one into a sequential, seekable binary stream for the readers that
read a whole index front to back.
"""

from __future__ import annotations

import io
import os
from typing import Callable, Protocol

__all__ = ["PositionalSource", "FileSource", "source_stream"]

_PREAD_LIMIT = 64 << 20  # bytes one pread asks for at most
_STREAM_BUFFER = 1 << 20  # a stream's buffer: small reads (headers, padding) cost no request of their own


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


class FileSource:
    """A file read with ``pread`` through a descriptor this object owns (so a file renamed over or
    unlinked meanwhile is still the one read).

    Args:
        fd: an open descriptor, owned from now on (closed by :meth:`close`).
        name: the file's path, for messages.
        count: called with the number of bytes of every read (the metadata byte counter).
    """

    def __init__(self, fd: int, name: str, count: Callable[[int], None] | None = None) -> None:
        self.fd: int | None = fd
        self.name = name
        self._count = count

    def size(self) -> int:
        return os.fstat(self._fd()).st_size

    def read_into(self, offset: int, dest: memoryview) -> int:
        fd = self._fd()
        done = 0
        while done < len(dest):
            n = os.preadv(fd, [dest[done:done + _PREAD_LIMIT]], offset + done)
            if not n:
                break
            done += n
        if self._count is not None:
            self._count(done)
        return done

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"'{self.name}' was closed")
        return self.fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileSource({self.name!r})"


class _SourceRaw(io.RawIOBase):
    """A :class:`PositionalSource` as a raw stream (its own position; the source is not closed
    with it)."""

    def __init__(self, source: PositionalSource, start: int = 0) -> None:
        super().__init__()
        self._source = source
        self._pos = start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: object) -> int:
        view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
        n = self._source.read_into(self._pos, view) if len(view) else 0
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._source.size() + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos


def source_stream(source: PositionalSource, start: int = 0) -> io.BufferedReader:
    """``source`` as a buffered binary stream positioned at ``start``: reads of at least the
    buffer's size go straight into the caller's memory, smaller ones are served from one read."""
    return io.BufferedReader(_SourceRaw(source, start), buffer_size=_STREAM_BUFFER)
