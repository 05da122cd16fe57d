"""Page-cache control (cold / warm reads) and filesystem facts for benchmark targets."""

from __future__ import annotations

import os
from dataclasses import dataclass

DROP_CACHES = "/proc/sys/vm/drop_caches"
COLD_DROP = "drop_caches"            # global: os.sync() + echo 1 > /proc/sys/vm/drop_caches
COLD_FADVISE = "fadvise_dontneed"    # per file: posix_fadvise(POSIX_FADV_DONTNEED) after os.sync()
_WARM_BLOCK = 8 << 20


def iter_files(root: str):
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            yield os.path.join(dirpath, f)


def dir_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in iter_files(root))


def drop_page_cache() -> bool:
    """Drop the clean page cache of the whole machine. False when not permitted."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:  # PermissionError, read-only /proc (containers)
        return False


def fadvise_dontneed(root: str) -> None:
    """Evict `root`'s files from the page cache (clean pages only, hence the sync)."""
    os.sync()
    for p in iter_files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_files(root: str) -> int:
    """Read every file under `root` once through the page cache; returns bytes read."""
    buf = bytearray(_WARM_BLOCK)
    view = memoryview(buf)
    total = 0
    for p in iter_files(root):
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def choose_cold_method(requested: str = "auto") -> str | None:
    """`auto`: drop_caches when permitted (tried once, now), else fadvise(DONTNEED)."""
    if requested == COLD_DROP:
        return COLD_DROP if drop_page_cache() else None
    if requested == COLD_FADVISE:
        return COLD_FADVISE if hasattr(os, "posix_fadvise") else None
    if requested == "none":
        return None
    if drop_page_cache():
        return COLD_DROP
    return COLD_FADVISE if hasattr(os, "posix_fadvise") else None


def make_cold(method: str | None, root: str) -> None:
    if method == COLD_DROP:
        if not drop_page_cache():
            raise RuntimeError("drop_caches stopped being permitted during the run")
    elif method == COLD_FADVISE:
        fadvise_dontneed(root)
    else:
        raise RuntimeError("no way to make the page cache cold on this machine")


@dataclass
class FsInfo:
    path: str
    fstype: str
    device: str
    mountpoint: str
    is_tmpfs: bool


def fs_info(path: str) -> FsInfo:
    """Filesystem type of `path` from the longest matching mount point in /proc/mounts."""
    real = os.path.realpath(path)
    best = ("?", "?", "/")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                dev, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                    best = (dev, fstype, mnt)
    except OSError:
        pass
    dev, fstype, mnt = best
    return FsInfo(path=real, fstype=fstype, device=dev, mountpoint=mnt,
                  is_tmpfs=fstype in ("tmpfs", "ramfs", "shm"))


def same_device(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False
