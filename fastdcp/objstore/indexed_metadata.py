"""A checkpoint's metadata in object storage, read from the chunk index its ``.metadata`` names by
ranged GETs: the local reading path (:func:`fastdcp.load.metadata_cache.metadata_from_index`,
:class:`~fastdcp.load.sectioned_metadata.SectionedTableMetadata`) over :class:`ObjectSource`
instead of file descriptors.

On several ranks a rank fetches ``.metadata``'s first 4 KiB (the index's name), the index's
header, ``.metadata``'s last 4 KiB (with the first, the CRC-32C the index must record), the
index's shared objects and its own section: tens of KB at thousands of ranks, instead of the whole
``.metadata``. The whole index is read only when the planner needs the whole table. Every object
is pinned to the version its first response came from (``If-Match`` its ETag), so a ``.metadata``
replaced by another save while it is read is an error naming it, never a mix of two saves.

Without a usable index (stock-written metadata; an index missing, damaged or written for another
``.metadata``, logged as on local disk) the ``.metadata`` is parsed whole, its first bytes not
fetched twice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..format.metadata import CheckpointFormatError
from ..load.metadata_cache import metadata_from_index
from ..load.sectioned_metadata import SectionedTableMetadata, count_metadata_read
from .client import ObjectNotFoundError, ObjectStoreError, S3Options, object_error, require_obstore
from .commit import is_object_name, plain_object_name, read_checkpoint_metadata
from .location import ObjectLocation
from .transfer import _range_not_satisfiable, transfer_pool, wait_all

__all__ = ["ObjectFetches", "ObjectChangedError", "ObjectSource", "read_object_metadata", "check_object_names"]

_KEEP_FIRST_BYTES = 64 << 10  # a first response up to this size is kept (the .metadata's head)
_METADATA_READS = 3  # reads of a .metadata that keeps being replaced while it is read


@dataclass
class ObjectFetches:
    """What metadata reads fetched: GET (and HEAD) requests and response bytes, added up.

    Args:
        requests: requests sent.
        bytes: bytes received.
    """

    requests: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        with _fetch_lock:
            self.requests += 1
            self.bytes += nbytes


_fetch_lock = threading.Lock()


class ObjectChangedError(ObjectStoreError):
    """An object read in several requests was replaced between two of them."""


class ObjectSource:
    """One object read at positions by ranged GETs (a
    :class:`~fastdcp.format.sources.PositionalSource`). The first response pins the object's size
    and ETag; later requests carry ``If-Match`` with it, so they read the same version or fail
    with :class:`ObjectChangedError`. A first response from offset 0 (up to 64 KiB) is kept: a
    later read of those bytes (the whole of a small ``.metadata``) costs no request. Reads larger
    than ``S3Options.part_bytes`` go as concurrent requests of that size.

    Args:
        store: the obstore client.
        location: the checkpoint.
        name: the object's name under the checkpoint's prefix.
        options: the client's options (request size, requests in flight).
        fetches: where the requests and bytes are added up (besides the process's metadata
            counter, ``fastdcp.load.sectioned_metadata.metadata_bytes_read``).
    """

    def __init__(self, store: Any, location: ObjectLocation, name: str, options: S3Options,
                 fetches: ObjectFetches | None = None) -> None:
        self.name = location.url(name)
        self._store = store
        self._key = location.key(name)
        self._options = options
        self._fetches = fetches
        self._lock = threading.Lock()
        self._size: int | None = None
        self._etag: str | None = None
        self._first = b""

    def size(self) -> int:
        if self._size is None:
            obstore = require_obstore()
            try:
                meta = obstore.head(self._store, self._key)
            except Exception as error:  # noqa: BLE001 - translated, naming the object
                raise object_error(error, self.name, "reading", self._options) from error
            self._count(0)
            self._pin(meta)
        assert self._size is not None
        return self._size

    def read_into(self, offset: int, dest: memoryview) -> int:
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        n = len(dest)
        done = 0
        first = self._first
        if offset < len(first) and n:
            done = min(n, len(first) - offset)
            dest[:done] = first[offset:offset + done]
        start, rest = offset + done, dest[done:]
        if not len(rest):
            return done
        if self._size is None:
            return done + self._get_into(start, start + len(rest), rest)
        end = min(self._size, start + len(rest))
        if start >= end:
            return done
        step = max(1, self._options.part_bytes)
        pieces = [(a, min(a + step, end)) for a in range(start, end, step)]
        if len(pieces) == 1:
            got = self._get_into(start, end, rest[:end - start])
        else:
            pool = transfer_pool(self._options.concurrency)
            futures = [pool.submit(self._get_into, a, b, rest[a - start:b - start]) for a, b in pieces]
            wait_all(futures)
            got = sum(f.result() for f in futures)
        return done + got

    def _get_into(self, start: int, end: int, dest: memoryview) -> int:
        """One ranged GET of ``[start, end)`` into ``dest``; the bytes received (fewer only where
        the object ends)."""
        obstore = require_obstore()
        options: dict[str, Any] = {"range": (start, end)}
        if self._etag is not None:
            options["if_match"] = self._etag
        first_request = self._size is None
        try:
            result = obstore.get(self._store, self._key, options=options)
            data = result.bytes()
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            from obstore import exceptions as ox

            if isinstance(error, ox.PreconditionError):
                raise ObjectChangedError(
                    f"reading {self.name}: the object was replaced while it was read (a save committed "
                    "meanwhile): load again") from None
            action = "reading" if first_request else f"reading bytes {start}-{end} of"
            translated = object_error(error, self.name, action, self._options)
            if _range_not_satisfiable(error) and not isinstance(translated, ObjectNotFoundError):
                return 0  # the range starts past the object's end
            raise translated from error
        self._pin(result.meta)
        n = len(data)
        if n > len(dest):
            raise ObjectStoreError(f"reading bytes {start}-{end} of {self.name}: the store sent {n} bytes")
        if n:
            dest[:n] = memoryview(data).cast("B")
        self._count(n)
        if start == 0 and not self._first and n <= _KEEP_FIRST_BYTES:
            self._first = bytes(dest[:n])
        return n

    def _pin(self, meta: Any) -> None:
        etag, size = meta.get("e_tag"), int(meta["size"])
        with self._lock:
            if self._size is None:
                self._size, self._etag = size, etag
            elif (self._etag is not None and etag is not None and etag != self._etag) or size != self._size:
                raise ObjectChangedError(f"reading {self.name}: the object was replaced while it was read (a save "
                                         "committed meanwhile): load again")

    def _count(self, nbytes: int) -> None:
        count_metadata_read(nbytes)
        if self._fetches is not None:
            self._fetches.add(nbytes)

    def read_all(self) -> bytes:
        """The whole object (the kept first bytes and one read of the rest)."""
        size = self.size()
        data = bytearray(size)
        got = self.read_into(0, memoryview(data))
        if got != size:
            raise ObjectChangedError(f"reading {self.name}: it ended at byte {got} of {size} (replaced while read)")
        return bytes(data)

    def close(self) -> None:
        """Nothing to release (no connection is held; the kept first bytes are a few KiB): a
        closed source still reads, so a caller can fetch the rest of an object after a reader
        that looked at its first bytes gave up on it."""

    def __repr__(self) -> str:
        return f"ObjectSource({self.name!r})"


def check_object_names(location: ObjectLocation, name: str, names: Any) -> None:
    """Raise ``CheckpointFormatError`` when the metadata object ``name`` names a data object outside
    the checkpoint's prefix (the rule ``read_checkpoint_metadata`` applies: :func:`is_object_name`)."""
    for rel in names:
        if not is_object_name(rel):
            raise CheckpointFormatError(f"{location.url(name)} names a data object {rel!r} outside the checkpoint")


def read_object_metadata(store: Any, location: ObjectLocation, name: str, options: S3Options, allow_unsafe: bool,
                         *, sectioned: bool = False, fetches: ObjectFetches | None = None) -> Metadata:
    """The metadata object ``name`` of the checkpoint at ``location``: from the chunk index it names
    (a ``TableMetadata``; with ``sectioned``, a ``SectionedTableMetadata`` that reads a rank's
    section when asked), else parsed whole (see the module docstring). A missing one is a
    ``CheckpointNotFoundError`` naming it.

    Args:
        allow_unsafe: unpickle with plain pickle (the index's small objects, or ``.metadata``).
        sectioned: a load on several ranks.
        fetches: where the requests and bytes fetched are added up.
    """
    def open_index(index_name: str) -> ObjectSource:
        if not plain_object_name(index_name):
            raise CheckpointFormatError(f"'{index_name}' is not an object directly under {location.url()}")
        return ObjectSource(store, location, index_name, options, fetches)

    for attempt in range(_METADATA_READS):
        source = ObjectSource(store, location, name, options, fetches)
        try:
            metadata = metadata_from_index(source, open_index, allow_unsafe, sectioned)
            if metadata is None:
                return read_checkpoint_metadata(store, location, name, options, allow_unsafe,
                                                data=source.read_all())  # (its first bytes are not fetched again)
        except ObjectChangedError:
            if attempt == _METADATA_READS - 1:
                raise
            continue  # a save committed while it was read: read the one now there
        except ObjectNotFoundError:
            # read_checkpoint_metadata says what is missing (the object, or the bucket)
            return read_checkpoint_metadata(store, location, name, options, allow_unsafe)
        if not isinstance(metadata, SectionedTableMetadata):
            check_object_names(location, name, metadata.chunk_table.storage.files)  # type: ignore[union-attr]
        return metadata
    raise AssertionError("unreachable")
