"""Objects as the streams stock DCP's code reads and writes: the ``fs`` of a fastdcp object
storage writer or reader, so the items fastdcp hands to stock code (stream transforms, blobs that
are not one plain tensor, other serialization formats) are read and written by stock's own code.

Reads are ranged GETs of at least :data:`READ_AHEAD` bytes (``torch.load`` reads in small steps);
writes are buffered in memory and PUT when the stream closes."""

from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Any, Iterator

from .client import S3Options, object_error, require_obstore, store_for
from .commit import object_exists
from .location import ObjectLocation

__all__ = ["ObjectStreams", "READ_AHEAD"]

READ_AHEAD = 8 << 20


class _ObjectReader(io.RawIOBase):
    def __init__(self, store: Any, key: str, url: str, options: S3Options):
        self._store, self._key, self._url, self._options = store, key, url, options
        obstore = require_obstore()
        try:
            self._size = int(obstore.head(store, key)["size"])
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, url, "reading", options) from error
        self._pos = 0
        self._cache_start, self._cache = 0, memoryview(b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._size - self._pos)
        if wanted <= 0:
            return 0
        end = self._cache_start + len(self._cache)
        if not (self._cache_start <= self._pos and self._pos + wanted <= end):
            obstore = require_obstore()
            fetch_end = min(self._size, self._pos + max(wanted, READ_AHEAD))
            try:
                self._cache = memoryview(obstore.get_range(self._store, self._key, start=self._pos, end=fetch_end))
            except Exception as error:  # noqa: BLE001 - translated, naming the object
                raise object_error(error, self._url, f"reading bytes {self._pos}-{fetch_end} of", self._options) from error
            self._cache_start = self._pos
            if len(self._cache) < wanted:
                raise EOFError(f"{self._url}: the object ended early (truncated while being read?)")
        start = self._pos - self._cache_start
        view[:wanted] = self._cache[start:start + wanted]
        self._pos += wanted
        return wanted


class _ObjectWriter(io.BytesIO):
    def __init__(self, store: Any, key: str, url: str, options: S3Options):
        super().__init__()
        self._store, self._key, self._url, self._options = store, key, url, options
        self._written = b""

    def fileno(self) -> int:
        # Stock fsyncs a stream it can; without a descriptor it would os.sync() the whole host.
        # An object is durable once its PUT returns: nothing to sync.
        raise io.UnsupportedOperation("an object has no file descriptor")

    def close(self) -> None:
        # Stock's stream transforms close the stream they write into: keep what was written for
        # the PUT, which happens only when the writing code finished without an error.
        if not self.closed:
            self._written = bytes(self.getbuffer())
        super().close()

    def commit(self) -> None:
        obstore = require_obstore()
        body = self._written if self.closed else bytes(self.getbuffer())
        try:
            obstore.put(self._store, self._key, body, use_multipart=False)
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self._url, "writing", self._options) from error


class ObjectStreams:
    """The ``fs`` stock's reader and writer code calls (``concat_path``, ``create_stream``,
    ``exists``), over the objects of one checkpoint location."""

    def __init__(self, location: ObjectLocation, options: S3Options):
        # Plain data only: a writer travels to process-mode async_save's checkpoint process pickled.
        self._location = location
        self._options = options

    def _store_of(self) -> tuple[Any, ObjectLocation]:
        return store_for(self._location, self._options), self._location

    def init_path(self, path: Any) -> str:
        return str(path)

    def concat_path(self, path: Any, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def _name(self, path: Any) -> tuple[Any, str]:
        """(store, the object's name under the checkpoint's prefix) of a URL stock code built."""
        store, location = self._store_of()
        url = str(path)
        base = location.url().rstrip("/") + "/"
        if not url.startswith(base):
            raise ValueError(f"{url} is not inside the checkpoint {location.url()}")
        return store, url[len(base):]

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        store, name = self._name(path)
        key, url = self._location.key(name), self._location.url(name)
        if "r" in mode:
            reader = io.BufferedReader(_ObjectReader(store, key, url, self._options), buffer_size=1 << 20)
            try:
                yield reader
            finally:
                reader.close()
        else:
            writer = _ObjectWriter(store, key, url, self._options)
            try:
                yield writer
                writer.commit()
            finally:
                writer.close()

    def exists(self, path: Any) -> bool:
        store, name = self._name(path)
        return object_exists(store, self._location, name, self._options)
