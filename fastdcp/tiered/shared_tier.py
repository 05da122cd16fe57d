"""The shared tier of a tiered checkpoint: where the drainer copies committed files, one interface
over a directory on a shared file system (:class:`DirectoryTier`) and an ``s3://`` prefix
(:class:`ObjectTier`).

Each file arrives whole or not at all: a directory tier writes ``name.<random>.part``, fsyncs it and
renames it into place; an object becomes visible only when its upload completes. So "the file
exists in the shared tier" means "the file is there, complete", which is what the coordinator's
commit waits for (:mod:`fastdcp.tiered.drain`)."""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any, Protocol

from .._native import _C
from ..io.engine import DIRECT_ALIGN, IoOptions, get_engine
from ..io.write_mode import record_write, write_mode_for
from ..io.checkpoint_files import fsync_directory
from ..objstore.client import S3Options, object_error, require_obstore, store_for
from ..objstore.commit import object_exists, read_object
from ..objstore.location import ObjectLocation, is_object_url
from ..objstore.transfer import upload_image

__all__ = ["SharedTier", "DirectoryTier", "ObjectTier", "shared_tier_for"]


class SharedTier(Protocol):
    """What the drainer needs of the shared tier. Every method raises an ``OSError`` naming the
    file or object on failure."""

    def url(self, name: str | None = None) -> str: ...

    def put_files(self, files: list[tuple[str, str]]) -> None:
        """Copy each ``(local path, name)``, each visible only once complete and durable."""

    def put_images(self, images: list[tuple[str, int, list[tuple]]]) -> None:
        """Write each ``(name, size, segments)`` file image (the writer's sorted ``(offset, bytes)`` /
        ``(offset, address, nbytes)`` segments, zeros in the gaps), each visible only once complete
        and durable. Precondition: the segments' memory stays unchanged until this returns."""

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name`` atomically (replacing any previous one)."""

    def existing(self, names: set[str]) -> set[str]:
        """Which of ``names`` exist (one listing or one request each)."""

    def read_bytes(self, name: str) -> bytes: ...


def _unlink_quietly(path: str) -> None:
    """Remove a part file of a failed write (the write's own error is the one to report)."""
    try:
        os.unlink(path)
    except OSError:
        pass


class DirectoryTier:
    """A directory on a shared file system (NFS, Lustre, a second local disk)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    def url(self, name: str | None = None) -> str:
        return self.path if name is None else os.path.join(self.path, name)

    def _ensure_directory(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    def _atomic_write(self, name: str, write: Any) -> None:
        self._ensure_directory()
        final = os.path.join(self.path, name)
        part = f"{final}.{secrets.token_hex(6)}.part"
        try:
            with open(part, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, final)
        except BaseException:
            _unlink_quietly(part)
            raise
        fsync_directory(self.path)

    def put_files(self, files: list[tuple[str, str]]) -> None:
        _put_files_as_images(self, files)

    def put_images(self, images: list[tuple[str, int, list[tuple]]]) -> None:
        """Through the native engine, as a save writes: O_DIRECT or buffered as this file system's
        learnt write mode says (:mod:`fastdcp.io.write_mode`, shared with direct saves to it), the
        files' tasks in parallel; each written as ``name.<random>.part``, fsynced, renamed into
        place; then one directory fsync."""
        self._ensure_directory()
        options = IoOptions.resolve(direct_io=None, default_direct_io=True, io_threads=None, task_bytes=None)
        engine = get_engine(options)
        total = sum(size for _, size, _ in images)
        mode = write_mode_for(self.path, options, total)
        parts = [(f"{os.path.join(self.path, name)}.{secrets.token_hex(6)}.part", os.path.join(self.path, name))
                 for name, _, _ in images]
        handles = []
        try:
            jobs = []
            for (_, size, segments), (part, _) in zip(images, parts):
                handle = _C.File(part, "w", mode.direct)
                handles.append(handle)
                if size == 0:
                    continue
                if handle.direct:
                    handle.allocate(-(-size // DIRECT_ALIGN) * DIRECT_ALIGN)  # no extending O_DIRECT writes
                jobs.append((handle, 0, size, segments))
            t0 = time.perf_counter()
            engine.write(jobs)
            for handle, (_, size, _) in zip(handles, images):
                handle.truncate(size)
            engine.sync(handles, False)
            record_write(self.path, mode, total, time.perf_counter() - t0, all(h.direct for h in handles))
            for handle in handles:
                handle.close()
            for part, final in parts:
                os.replace(part, final)
        except BaseException:
            for handle in handles:
                if not handle.closed:
                    try:
                        handle.close()
                    except OSError:
                        pass  # the original error is the one to report
            for part, _ in parts:
                _unlink_quietly(part)
            raise
        fsync_directory(self.path)

    def put_bytes(self, name: str, data: bytes) -> None:
        self._atomic_write(name, lambda f: f.write(data))

    def existing(self, names: set[str]) -> set[str]:
        try:
            return names & set(os.listdir(self.path))
        except FileNotFoundError:
            return set()

    def read_bytes(self, name: str) -> bytes:
        with open(os.path.join(self.path, name), "rb") as f:
            return f.read()


class ObjectTier:
    """An ``s3://bucket/prefix`` (through :mod:`fastdcp.objstore`'s client and transfers)."""

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        self.location = ObjectLocation.parse(url)
        self.options = options if options is not None else S3Options()

    def _store(self) -> Any:
        return store_for(self.location, self.options)

    def url(self, name: str | None = None) -> str:
        return self.location.url(name)

    def put_files(self, files: list[tuple[str, str]]) -> None:
        _put_files_as_images(self, files)

    def put_images(self, images: list[tuple[str, int, list[tuple]]]) -> None:
        """One upload per file (multipart, streamed from the image's memory), one after another:
        each already has ``concurrency`` parts in flight."""
        for name, size, segments in images:
            upload_image(self._store(), self.location, name, segments, size, self.options, self.options.concurrency)

    def put_bytes(self, name: str, data: bytes) -> None:
        obstore = require_obstore()
        try:
            obstore.put(self._store(), self.location.key(name), data, use_multipart=False)
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self.location.url(name), "writing", self.options) from error

    def existing(self, names: set[str]) -> set[str]:
        return {name for name in names if object_exists(self._store(), self.location, name, self.options)}

    def read_bytes(self, name: str) -> bytes:
        return read_object(self._store(), self.location, name, self.options)



def _put_files_as_images(tier: SharedTier, files: list[tuple[str, str]]) -> None:
    """``tier.put_images`` of the local files, straight from their pages (mapped read-only, no copy
    in between)."""
    mappings, views, images = [], [], []
    try:
        for local, name in files:
            size = os.path.getsize(local)
            segments: list[tuple] = []
            if size:
                with open(local, "rb") as source:
                    mappings.append(mmap.mmap(source.fileno(), size, access=mmap.ACCESS_READ))
                views.append(memoryview(mappings[-1]))
                segments = [(0, views[-1])]
            images.append((name, size, segments))
        tier.put_images(images)
    finally:
        for view in views:
            view.release()
        for mapping in mappings:
            mapping.close()


def shared_tier_for(checkpoint_id: str | os.PathLike, s3_options: S3Options | None = None) -> SharedTier:
    """The shared tier at ``checkpoint_id``: an ``s3://`` URL or a directory."""
    if is_object_url(checkpoint_id):
        return ObjectTier(str(checkpoint_id), s3_options)
    return DirectoryTier(checkpoint_id)

