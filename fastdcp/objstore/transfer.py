"""Moving bytes between host memory and objects: data-file images uploaded as concurrent multipart
uploads, and a load's byte runs fetched as concurrent ranged GETs.

:class:`ObjectReadEngine` offers the read surface of the native engine (``read``, ``read_runs``;
``box_copy`` and ``crc32c`` stay native), so ``load/``'s header pass, piece planning and placement
run unchanged on objects: only the source of the bytes differs. Runs of one object closer than
:data:`COALESCE_GAP` are fetched by one request, requests are cut at ``S3Options.part_bytes``, and
each response is copied straight into its destinations (``_C.scatter``, GIL released)."""

from __future__ import annotations

import os
import re
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

from .._native import _C
from .client import ObjectAccessError, ObjectNotFoundError, ObjectStoreError, S3Options, object_error, require_obstore
from .location import ObjectLocation

__all__ = ["ObjectFile", "ObjectReadEngine", "upload_image", "delete_objects", "COALESCE_GAP", "transfer_pool",
           "wait_all", "range_chunks"]

# Runs of one object at most this far apart are fetched by one request: a request costs a round
# trip (~20 ms across a region), and 256 KiB more of a response costs ~3 ms at 90 MB/s.
COALESCE_GAP = 256 << 10

# Requests of at most this many bytes (blob headers, small tensors) are latency, not bandwidth:
# up to SMALL_REQUEST_FANOUT times ``S3Options.concurrency`` of them are in flight at once (at
# most MAX_SMALL_IN_FLIGHT), so a load's header pass costs one round trip, not several.
SMALL_REQUEST_BYTES = 1 << 20
SMALL_REQUEST_FANOUT = 4
MAX_SMALL_IN_FLIGHT = 64

_ZEROS = bytes(1 << 16)

_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def transfer_pool(concurrency: int) -> ThreadPoolExecutor:
    """The process's pool of ``concurrency`` request threads (the client releases the GIL while a
    request is in flight)."""
    key = (os.getpid(), concurrency)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="fastdcp-s3")
        return pool


def wait_all(futures: list) -> None:
    """Wait for every future, then raise the first error: none of the requests may still write
    into memory the caller frees once this returns."""
    first_error: BaseException | None = None
    for future in futures:
        try:
            future.result()
        except BaseException as error:  # noqa: BLE001 - the first is raised below
            first_error = first_error or error
    if first_error is not None:
        raise first_error


class ObjectFile:
    """One object opened for reading: what ``load/`` handles as a file (``path`` for messages,
    ``direct``, ``close()``). Opening sends no request: every ranged read checks the object's
    length (a short object is named in the error)."""

    direct = False

    def __init__(self, store: Any, location: ObjectLocation, name: str, options: S3Options):
        self.store = store
        self.key = location.key(name)
        self.path = location.url(name)
        self.options = options
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"ObjectFile({self.path!r})"


@dataclass
class _Request:
    file: ObjectFile
    start: int
    end: int
    runs: list[tuple[int, Any, int]]  # (object offset, destination address or buffer, nbytes)


def _destination(dest: Any) -> tuple[int, Any]:
    """An int address for ``dest`` (an address, or a writable buffer kept alive by the caller)."""
    if isinstance(dest, int):
        return dest, None
    import torch

    holder = torch.frombuffer(dest, dtype=torch.uint8)
    return holder.data_ptr(), holder


def plan_requests(runs: list[tuple[ObjectFile, int, Any, int]], request_bytes: int, gap: int = COALESCE_GAP) -> list[_Request]:
    """Requests covering ``runs`` (object, offset, destination, nbytes): runs of one object sorted
    by offset, neighbours at most ``gap`` apart merged while the request stays within
    ``request_bytes``; a run larger than that is cut into pieces of ``request_bytes``."""
    by_file: dict[int, list[tuple[ObjectFile, int, Any, int]]] = defaultdict(list)
    for run in runs:
        if run[3] > 0:
            by_file[id(run[0])].append(run)
    requests: list[_Request] = []
    for file_runs in by_file.values():
        file_runs.sort(key=lambda r: r[1])
        current: _Request | None = None
        for file, offset, dest, nbytes in file_runs:
            pos = 0
            while pos < nbytes:
                start = offset + pos
                room = current.start + request_bytes - start if current is not None else 0
                if current is not None and start - current.end <= gap and room > 0:
                    take = min(nbytes - pos, room)
                    current.runs.append((start, _offset_dest(dest, pos), take))
                    current.end = max(current.end, start + take)
                else:
                    take = min(nbytes - pos, request_bytes)
                    current = _Request(file, start, start + take, [(start, _offset_dest(dest, pos), take)])
                    requests.append(current)
                pos += take
    return requests


def _offset_dest(dest: Any, pos: int) -> Any:
    if isinstance(dest, int):
        return dest + pos
    return memoryview(dest).cast("B")[pos:] if pos else dest


def _range_not_satisfiable(error: BaseException) -> bool:
    """Whether a ranged GET failed because the range starts past the object's end (HTTP 416). Not
    a bare "416" anywhere in the text: the endpoint's port or a request id can hold those digits
    (a missing object behind port 41623 once read as a truncated one)."""
    text = str(error)
    return "InvalidRange" in text or "Range Not Satisfiable" in text or re.search(r"(?<![\w.:])416(?![\w.])", text) is not None


def _fetch(request: _Request) -> None:
    obstore = require_obstore()
    file = request.file
    try:
        data = obstore.get_range(file.store, file.key, start=request.start, end=request.end)
    except Exception as error:  # noqa: BLE001 - translated, naming the object
        translated = object_error(error, file.path, f"reading bytes {request.start}-{request.end} of", file.options)
        if not isinstance(translated, (ObjectNotFoundError, ObjectAccessError)) and _range_not_satisfiable(error):
            raise EOFError(
                f"{file.path}: the object ends before byte {request.start}: it is shorter than the checkpoint's "
                "metadata says (truncated or replaced)"
            ) from None
        raise translated from error
    if len(data) != request.end - request.start:
        raise EOFError(
            f"{file.path}: the object ends before byte {request.end} (got {len(data)} of {request.end - request.start} "
            f"bytes from offset {request.start}): it is shorter than the checkpoint's metadata says (truncated or replaced)"
        )
    keep = []
    native_runs = []
    for offset, dest, nbytes in request.runs:
        address, holder = _destination(dest)
        keep.append(holder)
        native_runs.append((offset - request.start, address, nbytes))
    _C.scatter(data, native_runs)


class ObjectReadEngine:
    """The native engine's read surface over objects (see the module docstring); the rest of the
    engine (box copies, checksums) is the native one."""

    def __init__(self, native: "_C.Engine", options: S3Options):
        self.native = native
        self.options = options
        self.requests = 0
        self.bytes_fetched = 0

    def read(self, jobs: list[tuple], direct: bool = False) -> None:
        runs = []
        for file, offset, dest, nbytes in jobs:
            if nbytes is None:
                nbytes = memoryview(dest).nbytes
            runs.append((file, int(offset), dest, int(nbytes)))
        self._run(runs)

    def read_runs(self, tables: list[tuple], direct: bool = False) -> None:
        runs = []
        for file, address, n in tables:
            if n == 0:
                continue
            rows = _table_at(address, n)
            for offset, dest, nbytes in rows.tolist():
                if offset < 0 or nbytes < 0:
                    raise ValueError(f"negative offset or size in a read table for '{file.path}'")
                runs.append((file, offset, dest, nbytes))
        self._run(runs)

    def box_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self.native.box_copy(*args, **kwargs)

    def crc32c(self, *args: Any, **kwargs: Any) -> Any:
        return self.native.crc32c(*args, **kwargs)

    def _run(self, runs: list[tuple[ObjectFile, int, Any, int]]) -> None:
        requests = plan_requests(runs, self.options.part_bytes)
        if not requests:
            return
        self.requests += len(requests)
        self.bytes_fetched += sum(r.end - r.start for r in requests)
        if len(requests) == 1:
            _fetch(requests[0])
            return
        concurrency = self.options.concurrency
        if max(r.end - r.start for r in requests) <= SMALL_REQUEST_BYTES:
            concurrency = max(concurrency, min(MAX_SMALL_IN_FLIGHT, SMALL_REQUEST_FANOUT * concurrency))
        pool = transfer_pool(concurrency)
        wait_all([pool.submit(_fetch, request) for request in requests])


def _table_at(address: int, n: int) -> Any:
    """The int64 [n, 3] run table at ``address`` (built by ``load/pieces``, alive for the call)."""
    import torch

    view = _C.memory_view(address, n * 3 * 8)
    return torch.frombuffer(bytearray(view), dtype=torch.int64).reshape(n, 3)


def range_chunks(segments: list[tuple], start: int, end: int) -> Iterator[memoryview | bytes]:
    """The bytes ``[start, end)`` of a data-file image as buffers in file order: the sorted
    ``(offset, bytes)`` / ``(offset, address, nbytes)`` segments (clipped to the range by the
    caller, or wholly inside it), zeros in the gaps."""
    pos = start
    for segment in segments:
        offset = segment[0]
        while pos < offset:
            gap = min(offset - pos, len(_ZEROS))
            yield memoryview(_ZEROS)[:gap]
            pos += gap
        if len(segment) == 2:
            data = memoryview(segment[1]).cast("B")
        else:
            data = _C.memory_view(segment[1], segment[2])
        if len(data):
            yield data
        pos = offset + len(data)
    while pos < end:
        gap = min(end - pos, len(_ZEROS))
        yield memoryview(_ZEROS)[:gap]
        pos += gap


def upload_image(store: Any, location: ObjectLocation, name: str, segments: list[tuple], size: int,
                 options: S3Options, concurrency: int) -> None:
    """Upload one data-file image as object ``name``: one PUT up to ``part_bytes``, else a multipart
    upload of ``part_bytes`` parts with ``concurrency`` parts in flight, streamed from the segments'
    memory (no local file). Errors name the object."""
    obstore = require_obstore()
    url = location.url(name)
    try:
        if size <= options.part_bytes:
            body = b"".join(range_chunks(segments, 0, size))
            obstore.put(store, location.key(name), body, use_multipart=False)
        else:
            obstore.put(store, location.key(name), range_chunks(segments, 0, size), use_multipart=True,
                        chunk_size=options.part_bytes, max_concurrency=max(1, concurrency))
    except ObjectStoreError:
        raise
    except Exception as error:  # noqa: BLE001 - translated, naming the object
        raise object_error(error, url, "writing", options) from error


def delete_objects(store: Any, location: ObjectLocation, names: list[str], options: S3Options) -> list[str]:
    """Delete ``names`` (a missing one counts as deleted); returns the URLs that could not be."""
    obstore = require_obstore()
    failed: list[str] = []
    for start in range(0, len(names), 1000):  # S3's DeleteObjects takes at most 1,000 keys
        batch = names[start:start + 1000]
        try:
            obstore.delete(store, [location.key(n) for n in batch])
        except Exception:  # noqa: BLE001 - reported to the caller, who logs it
            failed.extend(location.url(n) for n in batch)
    return failed
