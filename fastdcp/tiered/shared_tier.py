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
import shutil
from typing import Any, Protocol

from ..io.checkpoint_files import fsync_directory
from ..objstore.client import S3Options, object_error, require_obstore, store_for
from ..objstore.commit import object_exists, read_object
from ..objstore.location import ObjectLocation, is_object_url
from ..objstore.transfer import delete_objects, upload_image

__all__ = ["SharedTier", "DirectoryTier", "ObjectTier", "shared_tier_for"]


class SharedTier(Protocol):
    """What the drainer needs of the shared tier. Every method raises an ``OSError`` naming the
    file or object on failure."""

    def url(self, name: str | None = None) -> str: ...

    def put_file(self, local_path: str, name: str) -> None:
        """Copy the local file to ``name``, visible only once complete and durable."""

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name`` atomically (replacing any previous one)."""

    def exists(self, name: str) -> bool: ...

    def existing(self, names: set[str]) -> set[str]:
        """Which of ``names`` exist (one listing or one request each)."""

    def read_bytes(self, name: str) -> bytes: ...

    def remove(self, names: list[str]) -> None:
        """Delete what exists of ``names`` (best effort: errors are the caller's to ignore)."""


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
            try:
                os.unlink(part)
            except OSError:
                pass
            raise
        fsync_directory(self.path)

    def put_file(self, local_path: str, name: str) -> None:
        def copy(out: Any) -> None:
            with open(local_path, "rb") as src:
                _copy_range(src, out)

        self._atomic_write(name, copy)

    def put_bytes(self, name: str, data: bytes) -> None:
        self._atomic_write(name, lambda f: f.write(data))

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.path, name))

    def existing(self, names: set[str]) -> set[str]:
        try:
            return names & set(os.listdir(self.path))
        except FileNotFoundError:
            return set()

    def read_bytes(self, name: str) -> bytes:
        with open(os.path.join(self.path, name), "rb") as f:
            return f.read()

    def remove(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass


def _copy_range(src: Any, out: Any) -> None:
    """The whole of ``src`` into ``out`` with ``copy_file_range`` (no user-space copy), falling back
    to reads and writes where the kernel refuses it across these file systems."""
    size = os.fstat(src.fileno()).st_size
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src.fileno(), out.fileno(), min(size - done, 1 << 30), done, done)
            if n == 0:
                raise EOFError(f"'{src.name}' ended at {done} bytes while being copied ({size} expected)")
            done += n
    except OSError as error:
        if done or error.errno not in (18, 22, 38, 95, 1):  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP, EPERM
            raise
        src.seek(0)
        out.seek(0)
        shutil.copyfileobj(src, out, 16 << 20)


class ObjectTier:
    """An ``s3://bucket/prefix`` (through :mod:`fastdcp.objstore`'s client and transfers)."""

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        self.location = ObjectLocation.parse(url)
        self.options = options if options is not None else S3Options()

    def _store(self) -> Any:
        return store_for(self.location, self.options)

    def url(self, name: str | None = None) -> str:
        return self.location.url(name)

    def put_file(self, local_path: str, name: str) -> None:
        size = os.path.getsize(local_path)
        with open(local_path, "rb") as f:
            if size == 0:
                upload_image(self._store(), self.location, name, [], 0, self.options, 1)
                return
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    upload_image(self._store(), self.location, name, [(0, view)], size, self.options,
                                 self.options.concurrency)
                finally:
                    view.release()

    def put_bytes(self, name: str, data: bytes) -> None:
        obstore = require_obstore()
        try:
            obstore.put(self._store(), self.location.key(name), data, use_multipart=False)
        except Exception as error:  # noqa: BLE001 - translated, naming the object
            raise object_error(error, self.location.url(name), "writing", self.options) from error

    def exists(self, name: str) -> bool:
        return object_exists(self._store(), self.location, name, self.options)

    def existing(self, names: set[str]) -> set[str]:
        return {name for name in names if self.exists(name)}

    def read_bytes(self, name: str) -> bytes:
        return read_object(self._store(), self.location, name, self.options)

    def remove(self, names: list[str]) -> None:
        delete_objects(self._store(), self.location, names, self.options)


def shared_tier_for(checkpoint_id: str | os.PathLike, s3_options: S3Options | None = None) -> SharedTier:
    """The shared tier at ``checkpoint_id``: an ``s3://`` URL or a directory."""
    if is_object_url(checkpoint_id):
        return ObjectTier(str(checkpoint_id), s3_options)
    return DirectoryTier(checkpoint_id)

