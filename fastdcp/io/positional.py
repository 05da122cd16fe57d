"""Reading a file or an object at byte positions: what a checkpoint's ``.metadata`` and chunk index
are read through (:class:`~fastdcp.format.sources.PositionalSource`), so that one reading path
(``load/metadata_cache.py``, ``load/sectioned_metadata.py``) serves a local checkpoint
(:class:`FileSource`: ``pread`` on a descriptor held open) and one in object storage
(``fastdcp.objstore.indexed_metadata.ObjectSource``: ranged GETs). :class:`ReadAhead` serves the
small reads of a source read front to back (a whole index) from one larger read.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..format.sources import PositionalSource

__all__ = ["FileSource", "ReadAhead", "open_source"]

_PREAD_LIMIT = 64 << 20  # bytes one pread asks for at most
_WINDOW = 1 << 20  # ReadAhead's window: small reads (headers, padding) cost no request of their own


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

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileSource({self.name!r})"


def open_source(path: str, count: Callable[[int], None] | None = None) -> FileSource:
    """The file at ``path`` opened for reading, as a :class:`FileSource` (raises ``OSError``,
    ``FileNotFoundError`` for a missing file, as ``open`` does)."""
    return FileSource(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), os.fspath(path), count)


class ReadAhead:
    """A :class:`~fastdcp.format.sources.PositionalSource` read front to back through a window: a read
    no larger than the window is served from one read of a whole window at its offset (what
    follows is kept for the next reads), a larger one goes straight into the caller's memory. The
    source is not closed with it.

    Args:
        source: the source read.
        window: the window's size in bytes.
    """

    def __init__(self, source: PositionalSource, window: int = _WINDOW) -> None:
        self.source = source
        self.name = source.name
        self._window = bytearray(window)
        self._start = 0  # the source offset of the window's first byte
        self._held = 0  # bytes of the window that hold the source's

    def size(self) -> int:
        return self.source.size()

    def read_into(self, offset: int, dest: memoryview) -> int:
        n = len(dest)
        done = 0
        if self._start <= offset < self._start + self._held:
            done = min(n, self._start + self._held - offset)
            at = offset - self._start
            dest[:done] = self._window[at:at + done]
        if done == n:
            return n
        self._held = 0
        window = memoryview(self._window)
        while done < n:
            rest = n - done
            if rest > len(window):
                got = self.source.read_into(offset + done, dest[done:])
            else:
                self._start = offset + done
                self._held = self.source.read_into(self._start, window)
                got = min(self._held, rest)
                dest[done:done + got] = window[:got]
            if not got:
                break
            done += got
        return done

    def close(self) -> None:
        pass
