"""Hardware limits measured in the same run as the benchmarks.

* storage: raw sequential write (incl. fsync) and read bandwidth of each target directory,
  with `fio` when installed, else a Python probe: O_DIRECT `os.pwritev`/`os.preadv` from a few
  threads (they release the GIL) on page-aligned `mmap` buffers; where O_DIRECT is refused
  (EINVAL, e.g. some tmpfs) buffered I/O + fsync instead. The method used is reported.
  Several (block size, threads) configurations are tried; the limit is the best of them.
* memory copy: torch `copy_`, numpy `copyto` and `ctypes.memmove` from 1 and N threads on
  large buffers; the limit is the best method (GiB/s of bytes copied).
* GPU (when available): pinned host <-> device copy bandwidth.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .pagecache import fs_info

GIB = float(1 << 30)


@dataclass
class ProbeRun:
    op: str            # "write" | "read" | "page_cache_read"
    block: int
    threads: int
    method: str
    gibps: float


@dataclass
class StorageLimit:
    path: str
    fstype: str
    method: str                 # e.g. "python O_DIRECT", "python buffered+fsync", "fio direct=1"
    bytes: int
    write_gibps: float
    read_gibps: float
    page_cache_read_gibps: float | None
    runs: list[ProbeRun] = field(default_factory=list)
    note: str = ""


@dataclass
class Limits:
    memcpy_gibps: float
    memcpy_methods: dict[str, float]
    storage: dict[str, StorageLimit]
    h2d_gibps: float | None = None
    d2h_gibps: float | None = None

    def value(self, key: str | None) -> float | None:
        """Resolve a limit key: 'memcpy', 'write:<where>', 'read:<where>', 'h2d', 'd2h',
        or 'min(a,b)'."""
        if not key:
            return None
        if key.startswith("min(") and key.endswith(")"):
            vals = [self.value(k.strip()) for k in key[4:-1].split(",")]
            return min(vals) if vals and all(v for v in vals) else None
        if key == "memcpy":
            return self.memcpy_gibps
        if key in ("h2d", "d2h"):
            return getattr(self, f"{key}_gibps")
        op, _, where = key.partition(":")
        s = self.storage.get(where)
        if s is None:
            return None
        return {"write": s.write_gibps, "read": s.read_gibps}.get(op)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- python probe

def _aligned_buffer(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size)  # anonymous mmap: page aligned
    chunk = os.urandom(min(size, 1 << 20))
    for off in range(0, size, len(chunk)):
        buf[off:off + len(chunk)] = chunk[: size - off]
    return buf


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
    return os.open(path, flags, 0o644), False


def _buffers(block: int, threads: int, fill: bool) -> list[mmap.mmap]:
    return [_aligned_buffer(block) if fill else mmap.mmap(-1, block) for _ in range(threads)]


def _run_threads(fd: int, nbytes: int, bufs: list[mmap.mmap], write: bool) -> float:
    """Each thread moves its contiguous 1/len(bufs) of [0, nbytes) with its buffer; returns seconds."""
    threads = len(bufs)
    per = nbytes // threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        buf = bufs[i]
        start.wait()
        try:
            off, end = i * per, (i + 1) * per
            while off < end:
                n = os.pwritev(fd, [buf], off) if write else os.preadv(fd, [buf], off)
                if n <= 0:
                    raise OSError(f"short {'write' if write else 'read'} at {off}")
                off += n
        except BaseException as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def _python_write(path: str, nbytes: int, block: int, threads: int, direct: bool) -> tuple[float, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd, direct = _open(path, flags, direct)
    try:
        if direct:  # some filesystems accept O_DIRECT at open and refuse it at the first I/O
            try:
                os.pwritev(fd, [_aligned_buffer(4096)], 0)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(fd)
                fd, direct = _open(path, flags, False)
        bufs = _buffers(block, threads, fill=True)
        dt = _run_threads(fd, nbytes, bufs, write=True)
        t0 = time.perf_counter()
        os.fsync(fd)
        dt += time.perf_counter() - t0
    finally:
        os.close(fd)
    return nbytes / dt / GIB, direct


def _python_read(path: str, nbytes: int, block: int, threads: int, direct: bool) -> tuple[float, bool]:
    fd, direct = _open(path, os.O_RDONLY, direct)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # best effort: read the device
        dt = _run_threads(fd, nbytes, _buffers(block, threads, fill=False), write=False)
    finally:
        os.close(fd)
    return nbytes / dt / GIB, direct


def _page_cache_read(path: str, nbytes: int, block: int = 8 << 20) -> float:
    """Buffered 1-thread read of a file that is already in the page cache (read twice)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = _buffers(block, 1, fill=False)
        _run_threads(fd, nbytes, bufs, write=False)  # populate
        return nbytes / _run_threads(fd, nbytes, bufs, write=False) / GIB
    finally:
        os.close(fd)


def _probe_python(path: str, nbytes: int, configs: list[tuple[int, int]]) -> tuple[list[ProbeRun], str]:
    runs: list[ProbeRun] = []
    for block, threads in configs:
        size = nbytes // (block * threads) * block * threads
        w, wd = _python_write(path, size, block, threads, direct=True)
        r, rd = _python_read(path, size, block, threads, direct=True)
        wm = "python O_DIRECT" if wd else "python buffered+fsync"
        rm = "python O_DIRECT" if rd else "python buffered"
        runs += [ProbeRun("write", block, threads, wm, w), ProbeRun("read", block, threads, rm, r)]
    # Buffered I/O can beat O_DIRECT at low queue depth (kernel writeback / readahead): the
    # limit is the best way the device can be driven, so try it too (write+fsync; cold read).
    block = max(b for b, _ in configs)
    size = nbytes // block * block
    w, _ = _python_write(path, size, block, 1, direct=False)
    r, _ = _python_read(path, size, block, 1, direct=False)
    runs += [ProbeRun("write", block, 1, "python buffered+fsync", w),
             ProbeRun("read", block, 1, "python buffered (fadvise DONTNEED first)", r)]
    return runs, _describe_best(runs)


def _describe_best(runs: list[ProbeRun]) -> str:
    parts = []
    for op in ("write", "read"):
        b = max((x for x in runs if x.op == op), key=lambda x: x.gibps)
        parts.append(f"{op}: {b.method} {b.block >> 20} MiB x{b.threads}")
    return "; ".join(parts) + f" (best of {len(runs) // 2} configs)"


# --------------------------------------------------------------------------- fio probe

def _fio(path: str, nbytes: int, block: int, threads: int, rw: str, direct: bool) -> float:
    per = nbytes // threads // block * block
    cmd = ["fio", "--name=probe", f"--filename={path}", f"--rw={rw}", f"--bs={block}",
           f"--size={per}", f"--numjobs={threads}", f"--offset_increment={per}",
           f"--direct={1 if direct else 0}", "--ioengine=psync", "--group_reporting",
           "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    else:
        cmd.append("--invalidate=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    text = out.stdout[out.stdout.index("{"):]  # fio may print notes before the JSON
    job = json.loads(text)["jobs"][0][rw]
    return float(job["bw_bytes"]) / GIB


def _probe_fio(path: str, nbytes: int, configs: list[tuple[int, int]]) -> tuple[list[ProbeRun], str]:
    runs: list[ProbeRun] = []
    for block, threads in configs:
        for rw in ("write", "read"):
            try:
                g, m = _fio(path, nbytes, block, threads, rw, True), "fio direct=1"
            except (subprocess.CalledProcessError, ValueError, KeyError):
                g, m = _fio(path, nbytes, block, threads, rw, False), \
                    ("fio direct=0 end_fsync=1" if rw == "write" else "fio direct=0")
            runs.append(ProbeRun(rw, block, threads, m, g))
    return runs, _describe_best(runs)


# --------------------------------------------------------------------------- public API

def probe_storage(where_dir: str, nbytes: int, configs: list[tuple[int, int]],
                  method: str = "auto") -> StorageLimit:
    """Sequential write (with fsync) and read bandwidth of the filesystem holding `where_dir`."""
    info = fs_info(where_dir)
    path = os.path.join(where_dir, ".bench_probe.bin")
    use_fio = method == "fio" or (method == "auto" and shutil.which("fio") is not None)
    note = ""
    try:
        if use_fio:
            try:
                runs, how = _probe_fio(path, nbytes, configs)
            except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
                note = f"fio failed ({type(e).__name__}: {e}); used the python probe"
                runs, how = _probe_python(path, nbytes, configs)
        else:
            runs, how = _probe_python(path, nbytes, configs)
        size = os.path.getsize(path)
        pcr = _page_cache_read(path, size) if size else None
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if info.is_tmpfs:
        note = (note + "; " if note else "") + (
            "tmpfs: 'device' bandwidth is writing new pages of a memory filesystem (page allocation + copy)")
    best = lambda op: max(r.gibps for r in runs if r.op == op)  # noqa: E731
    return StorageLimit(path=info.path, fstype=info.fstype, method=how, bytes=nbytes,
                        write_gibps=best("write"), read_gibps=best("read"),
                        page_cache_read_gibps=pcr, runs=runs, note=note)


def _best_time(fn, rounds: int) -> float:
    fn()  # warm-up (first touch, thread pools)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_bandwidth(nbytes: int, rounds: int = 3) -> dict[str, float]:
    """GiB/s (bytes copied per second) of several in-RAM copy methods on `nbytes` buffers."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    s_np, d_np = src.numpy(), dst.numpy()
    s_ptr, d_ptr = src.data_ptr(), dst.data_ptr()
    ncpu = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    def memmove_threads(n: int) -> None:
        per = nbytes // n
        ts = [threading.Thread(target=ctypes.memmove,  # ctypes drops the GIL
                               args=(d_ptr + i * per, s_ptr + i * per, per if i < n - 1 else nbytes - i * per))
              for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    out = {
        f"torch copy_ ({torch.get_num_threads()} threads)": _best_time(lambda: dst.copy_(src), rounds),
        "numpy copyto (1 thread)": _best_time(lambda: np.copyto(d_np, s_np), rounds),
        "memmove (1 thread)": _best_time(lambda: ctypes.memmove(d_ptr, s_ptr, nbytes), rounds),
    }
    if ncpu > 1:
        out[f"memmove ({ncpu} threads)"] = _best_time(lambda: memmove_threads(ncpu), rounds)
    del src, dst
    return {k: nbytes / v / GIB for k, v in out.items()}


def pinned_bandwidth(nbytes: int, rounds: int = 3) -> tuple[float, float] | None:
    """(host->device, device->host) GiB/s with pinned host memory, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    res = (nbytes / _best_time(h2d, rounds) / GIB, nbytes / _best_time(d2h, rounds) / GIB)
    del host, dev
    torch.cuda.empty_cache()
    return res


def measure_limits(targets: dict[str, str], probe_bytes: int, probe_configs: list[tuple[int, int]],
                   memcpy_bytes: int, probe_method: str = "auto", progress=None) -> Limits:
    storage: dict[str, StorageLimit] = {}
    for where, path in targets.items():
        if progress:
            progress(f"limits: storage probe of {where} ({path})")
        storage[where] = probe_storage(path, probe_bytes, probe_configs, probe_method)
    if progress:
        progress("limits: memory copy")
    methods = memcpy_bandwidth(memcpy_bytes)
    pinned = pinned_bandwidth(min(memcpy_bytes, 1 << 30)) if torch.cuda.is_available() else None
    return Limits(memcpy_gibps=max(methods.values()), memcpy_methods=methods, storage=storage,
                  h2d_gibps=pinned[0] if pinned else None, d2h_gibps=pinned[1] if pinned else None)
