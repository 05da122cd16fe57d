"""The shared tier of a tiered checkpoint: where the drainer copies committed files, a
:class:`fastdcp.io.backends.FileStore`: a directory on a shared file system (:class:`DirectoryTier`)
or the store of a registered backend's URL (``s3://``, ``az://``: its ``file_store``).

Each file arrives whole or not at all: a directory tier writes ``name.<random>.part``, fsyncs it and
renames it into place; an object becomes visible only when its upload completes. So "the file
exists in the shared tier" means "the file is there, complete", which is what the coordinator's
commit waits for (:mod:`fastdcp.tiered.drain`)."""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from typing import Any

from .._native import _C
from ..io.engine import DIRECT_ALIGN, IoOptions, get_engine
from ..io.write_mode import record_write, write_mode_for
from ..io.checkpoint_files import fsync_directory
from ..io.backends import FileStore, backend_for
from ..objstore.client import AzureOptions, S3Options

__all__ = ["SharedTier", "DirectoryTier", "put_files", "shared_tier_for", "options_keyword"]


# What the drainer needs of the shared tier: the declared interface of a backend's files.
SharedTier = FileStore


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

    def put_bytes(self, name: str, data: bytes, *, create_only: bool = False) -> None:
        if create_only and os.path.exists(os.path.join(self.path, name)):
            raise FileExistsError(f"{os.path.join(self.path, name)} already exists")
        self._atomic_write(name, lambda f: f.write(data))

    def delete(self, names: Iterable[str]) -> list[str]:
        failed = []
        for name in names:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
            except OSError:
                failed.append(os.path.join(self.path, name))
        return failed

    def size(self, name: str) -> int:
        return os.path.getsize(os.path.join(self.path, name))

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        path = os.path.join(self.path, name)
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"reading {path}: {len(data)} bytes at {offset}, expected {length}")
        return data

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return
        for name in names:
            full = os.path.join(self.path, name)
            if name.startswith(prefix) and os.path.isfile(full):
                yield name, os.path.getsize(full)

    def existing(self, names: set[str]) -> set[str]:
        try:
            return names & set(os.listdir(self.path))
        except FileNotFoundError:
            return set()

    def read_bytes(self, name: str) -> bytes:
        with open(os.path.join(self.path, name), "rb") as f:
            return f.read()


def put_files(tier: SharedTier, files: list[tuple[str, str]]) -> None:
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


def options_keyword(options: Any) -> dict[str, Any]:
    """``options`` as the keyword that passes it on (``s3_options`` / ``azure_options``); {} for None."""
    if isinstance(options, AzureOptions):
        return {"azure_options": options}
    return {"s3_options": options} if isinstance(options, S3Options) else {}


def shared_tier_for(checkpoint_id: str | os.PathLike, s3_options: S3Options | None = None,
                    azure_options: AzureOptions | None = None) -> SharedTier:
    """The shared tier at ``checkpoint_id``: a registered backend's URL (its ``file_store``, given
    the options that were passed) or a directory."""
    backend = backend_for(checkpoint_id)
    if backend is None:
        return DirectoryTier(checkpoint_id)
    options = {k: v for k, v in (("s3_options", s3_options), ("azure_options", azure_options)) if v is not None}
    return backend.load("file_store")(str(checkpoint_id), **options)

