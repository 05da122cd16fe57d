"""Storages the benchmark mounts for its run, beside `--dir` (the disk) and `/dev/shm`.

Each is a real mount, made the way an administrator would make it, used through the ordinary
file API like the other targets, and taken down again on every path out of the run:

* ``xfs``: a sparse image file in the `--dir` parent, formatted by ``mkfs.xfs`` and mounted from a
  loop device in direct-I/O mode (``losetup --direct-io=on``), so that the image's writes reach
  the disk rather than a second page cache in front of the backing file. xfs is the other common
  local filesystem of training clusters, and the one parallel-filesystem servers sit on.
* ``fuse``: ``bindfs``, a FUSE passthrough of a directory in the `--dir` parent: every request
  crosses to a user-space daemon and back, as on the FUSE mounts of network and object stores
  (s3fs, gcsfuse, blobfuse, Lustre/DAOS dfuse). Whether it honours O_DIRECT is up to the mount,
  which is the point: the writer and reader must find out.

A storage that cannot be made here (not root, a tool missing, the kernel refusing) raises
:class:`StorageUnavailable` with the reason; the runner skips it with a note.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

__all__ = ["MOUNTED_STORAGES", "StorageUnavailable", "MountedStorage", "mount_storage", "image_bytes_for"]

# name -> the Debian package (and command) it needs
MOUNTED_STORAGES = {"xfs": ("xfsprogs", "mkfs.xfs"), "fuse": ("bindfs", "bindfs")}

GIB = 1 << 30


class StorageUnavailable(RuntimeError):
    """This machine cannot mount the storage; the message says why."""


@dataclass
class MountedStorage:
    """A storage mounted for the run: `path` is its mount point, `teardown` the commands that take
    it down, in order, and `remove` the paths to delete after them."""

    name: str
    path: str
    description: str
    teardown: list[list[str]] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)

    def close(self) -> list[str]:
        """Unmount and delete; returns the errors met (each teardown step is tried)."""
        errors = []
        for cmd in self.teardown:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                errors.append(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
        self.teardown = []
        for path in self.remove:
            if os.path.isdir(path) and not os.path.ismount(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.isfile(path):
                os.unlink(path)
        self.remove = []
        return errors


def image_bytes_for(state_bytes: int, checkpoints: int, probe_bytes: int) -> int:
    """Size of the xfs image (sparse: only what is written takes disk space): every system's
    checkpoint of the state at once, the storage probe's files, and a quarter to spare."""
    need = checkpoints * state_bytes + 2 * probe_bytes
    return max(4 * GIB, (need + need // 4 + GIB - 1) // GIB * GIB)


def _run(cmd: list[str], what: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StorageUnavailable(f"{what}: {' '.join(cmd)} failed: {e}") from None
    if done.returncode != 0:
        raise StorageUnavailable(f"{what}: {' '.join(cmd)} exited {done.returncode}: "
                                 f"{(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout.strip()


def _require(name: str) -> None:
    package, tool = MOUNTED_STORAGES[name]
    if os.geteuid() != 0:
        raise StorageUnavailable(f"{name}: mounting needs root")
    if shutil.which(tool) is None:
        raise StorageUnavailable(f"{name}: {tool} not installed (Debian package {package})")


def mount_storage(name: str, parent: str, image_bytes: int) -> MountedStorage:
    """Mount storage `name` ("xfs" or "fuse") with its files in a new directory inside `parent`;
    raises StorageUnavailable where this machine cannot, leaving nothing behind."""
    if name not in MOUNTED_STORAGES:
        raise ValueError(f"unknown storage {name!r}; choose from {', '.join(MOUNTED_STORAGES)}")
    _require(name)
    work = tempfile.mkdtemp(prefix=f"fastdcp_bench_{name}_", dir=parent)
    storage = MountedStorage(name, os.path.join(work, "mnt"), "", remove=[work])
    os.mkdir(storage.path)
    try:
        if name == "xfs":
            image = os.path.join(work, "xfs.img")
            with open(image, "wb") as f:
                f.truncate(image_bytes)
            _run(["mkfs.xfs", "-q", "-f", image], "xfs")
            loop = _run(["losetup", "--direct-io=on", "--find", "--show", image], "xfs")
            storage.teardown.append(["losetup", "-d", loop])
            _run(["mount", "-t", "xfs", loop, storage.path], "xfs")
            storage.teardown.insert(0, ["umount", storage.path])
            storage.description = (f"xfs on {loop} (losetup --direct-io=on) over a sparse "
                                   f"{image_bytes / GIB:.0f} GiB image in {parent}")
        else:
            backing = os.path.join(work, "backing")
            os.mkdir(backing)
            _run(["bindfs", "--no-allow-other", backing, storage.path], "fuse")
            unmount = "fusermount3" if shutil.which("fusermount3") else "fusermount"
            storage.teardown.append([unmount, "-u", storage.path] if shutil.which(unmount) else ["umount", storage.path])
            storage.description = f"FUSE passthrough (bindfs) of {backing}"
        if not os.path.ismount(storage.path):
            raise StorageUnavailable(f"{name}: {storage.path} is not a mount point after mounting")
    except BaseException:
        storage.close()
        raise
    return storage
