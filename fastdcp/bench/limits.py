"""Hardware limits measured in the same run as the benchmarks.

* storage: raw sequential write (incl. fsync) and read bandwidth of each target directory,
  with `fio` when installed, else a Python probe: `os.pwritev`/`os.preadv` from a few threads
  (they release the GIL) on page-aligned `mmap` buffers, writes from one buffer of the probe's
  size so that every byte written is read from memory as a save's is (`WriteSource`; the run
  from one cached block per thread is reported in the notes; fio writes from its own buffers).
  Both I/O modes a fastdcp writer or reader can choose are measured (`probe_modes`): O_DIRECT
  (where the filesystem refuses it, EINVAL, those runs are buffered and say so) and buffered +
  fsync; memory filesystems buffered only. For each mode, the configured (block size, threads)
  pairs on ONE file (the threads share it), and for every block size ONE FILE PER THREAD with 2,
  4, 8 files (doubling while it still gains >= 5%), since many filesystems serialise writers of
  one file on its inode lock (tmpfs, buffered ext4/xfs, NFS clients): one file can show half of
  what the storage takes from several. The limit is the best run of any mode, so a fraction of
  it cannot be flattered by probing only the slower mode; which run (mode, files, threads,
  block) is reported (`StorageLimit.method`, `write_best`, `read_best`, `runs`), and the best per
  mode (`write_by_mode`, `read_by_mode`).
  Writes fsync every file inside the timed region; reads are cold where the filesystem allows
  it: O_DIRECT, else posix_fadvise(DONTNEED) of every (clean, fsynced) file first. On tmpfs the
  data lives in the page cache, so its "read" is a copy out of memory.
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
from typing import Any, Callable

import numpy as np
import torch

from .pagecache import COLD_DROP, drop_page_cache, fs_info

GIB = float(1 << 30)
MIB = 1 << 20
PROBE_NAME = ".bench_probe.bin"
MAX_PROBE_FILES = 8       # most files (= threads) of a multi-file probe run
FILE_LADDER = (2, 4, 8)   # files per multi-file run, doubled while a step still gains
LADDER_GAIN = 1.05        # ... at least this factor on write or read over the smaller counts


def _fmt_block(block: int) -> str:
    return f"{block // MIB} MiB" if block >= MIB and block % MIB == 0 else f"{block // 1024} KiB"


@dataclass
class ProbeRun:
    op: str            # "write" | "read" | "page_cache_read"
    block: int
    threads: int
    method: str
    gibps: float
    files: int = 1     # 1: the threads share one file; N (= threads): one file per thread

    @property
    def direct(self) -> bool:
        """Whether the run's I/O was O_DIRECT (the method says what the filesystem granted)."""
        return "O_DIRECT" in self.method or "direct=1" in self.method

    def describe(self) -> str:
        return (f"{self.method} {_fmt_block(self.block)} x{self.threads} thread{'s' * (self.threads > 1)}, "
                f"{self.files} file{'s' * (self.files > 1)}")


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
    write_best: ProbeRun | None = None   # the run that set write_gibps
    read_best: ProbeRun | None = None    # the run that set read_gibps
    write_by_mode: dict[str, float] = field(default_factory=dict)   # best write per mode (O_DIRECT, buffered)
    read_by_mode: dict[str, float] = field(default_factory=dict)    # best cold read per mode


@dataclass
class Limits:
    memcpy_gibps: float
    memcpy_methods: dict[str, float]
    storage: dict[str, StorageLimit]
    h2d_gibps: float | None = None
    d2h_gibps: float | None = None
    d2d_gibps: float | None = None       # device-to-device copy, payload bytes counted once

    def value(self, key: str | None) -> float | None:
        """Resolve a limit key: 'memcpy', 'write:<where>', 'read:<where>', 'h2d', 'd2h', 'd2d',
        or 'min(a,b)'."""
        if not key:
            return None
        if key.startswith("min(") and key.endswith(")"):
            vals = [self.value(k.strip()) for k in key[4:-1].split(",")]
            return min(vals) if vals and all(v for v in vals) else None
        if key == "memcpy":
            return self.memcpy_gibps
        if key in ("h2d", "d2h", "d2d"):
            return getattr(self, f"{key}_gibps")
        op, _, where = key.partition(":")
        s = self.storage.get(where)
        if s is None:
            return None
        return {"write": s.write_gibps, "read": s.read_gibps}.get(op)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- shared by both probes

def probe_paths(path: str, files: int) -> list[str]:
    """The file(s) of one probe run: `path` itself for one file, else `<stem>.<i><ext>` beside it
    (the names fio's `filename_format=<stem>.$jobnum<ext>` gives its jobs)."""
    if files <= 1:
        return [path]
    root, ext = os.path.splitext(path)
    return [f"{root}.{i}{ext}" for i in range(files)]


def _remove(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _run_size(nbytes: int, block: int, threads: int) -> int:
    """Bytes of one run: `nbytes` rounded down to whole blocks per thread (at least one each)."""
    return max(1, nbytes // (block * threads)) * block * threads


def file_ladder(nbytes: int, block: int) -> list[int]:
    """File (= thread) counts a multi-file run may use at `block`: each file gets a whole block."""
    return [f for f in FILE_LADDER if f <= MAX_PROBE_FILES and nbytes // (block * f) >= 1]


Pair = Callable[[int, int, int], "tuple[ProbeRun, ProbeRun]"]  # (block, threads, files) -> write, read


def _multi_file_runs(nbytes: int, configs: list[tuple[int, int]], pair: Pair) -> list[ProbeRun]:
    """One file per thread, for every configured block size: 2 and 4 files, then doubling while
    the last step gained >= LADDER_GAIN on write or read over the smaller counts."""
    runs: list[ProbeRun] = []
    for block in sorted({b for b, _ in configs}, reverse=True):
        best_w = best_r = 0.0
        for files in file_ladder(nbytes, block):
            w, r = pair(block, files, files)
            runs += [w, r]
            gained = w.gibps >= best_w * LADDER_GAIN or r.gibps >= best_r * LADDER_GAIN
            best_w, best_r = max(best_w, w.gibps), max(best_r, r.gibps)
            if files >= 4 and not gained:
                break
    return runs


def probe_modes(tmpfs: bool) -> tuple[bool, ...]:
    """The I/O modes a probe measures, O_DIRECT first: both modes a writer or reader may choose
    (fastdcp.io.write_mode), since either can be the faster on a given storage. Memory
    filesystems: buffered only; fastdcp never asks for O_DIRECT there, and tmpfs serves it through
    the same page cache anyway."""
    return (False,) if tmpfs else (True, False)


def best_run(runs: list[ProbeRun], op: str) -> ProbeRun:
    return max((r for r in runs if r.op == op), key=lambda r: r.gibps)


def best_by_mode(runs: list[ProbeRun], op: str) -> dict[str, float]:
    """The best GiB/s of `op` per I/O mode measured: {"O_DIRECT": .., "buffered": ..}."""
    out: dict[str, float] = {}
    for r in runs:
        if r.op == op:
            mode = "O_DIRECT" if r.direct else "buffered"
            out[mode] = max(out.get(mode, 0.0), r.gibps)
    return out


def _describe_best(runs: list[ProbeRun]) -> str:
    parts = [f"{op}: {best_run(runs, op).describe()}" for op in ("write", "read")]
    writes = [r for r in runs if r.op == "write"]
    one = sum(r.files == 1 for r in writes)
    return "; ".join(parts) + f" (best of {len(writes)} configs: {one} one-file, {len(writes) - one} multi-file)"


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


def _open_write(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd, direct = _open(path, flags, direct)
    if direct:  # some filesystems accept O_DIRECT at open and refuse it at the first I/O
        try:
            os.pwritev(fd, [_aligned_buffer(4096)], 0)
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EINVAL:
                raise
            fd, direct = _open(path, flags, False)
    return fd, direct


def _preallocate(fd: int, size: int) -> None:
    """As fastdcp's writer does before O_DIRECT writes (``File.allocate``): allocate the file's
    blocks, or where the filesystem cannot (FUSE: EBADF/EOPNOTSUPP) at least set its size, so that
    no write extends the file (ext4 and xfs serialise O_DIRECT writes that do)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)


def _buffers(block: int, threads: int, fill: bool) -> list[mmap.mmap]:
    return [_aligned_buffer(block) if fill else mmap.mmap(-1, block) for _ in range(threads)]


def _run_threads(fds: list[int], nbytes: int, bufs: list[mmap.mmap], write: bool,
                 fsync: bool = False, source: mmap.mmap | None = None) -> float:
    """Move `nbytes` with one thread per buffer; returns seconds (fsync included when asked).

    One fd: thread i moves the contiguous i-th 1/len(bufs) of [0, nbytes) of the shared file,
    then the file is fsynced once. One fd per thread: thread i moves [0, nbytes/len(bufs)) of
    its own file and fsyncs it, as a writer of one file per thread would. `source` (writes): at
    least `nbytes`; thread i writes its part from the i-th 1/len(bufs) of it, in pieces of its
    buffer's size, instead of writing its one buffer over and over (see `WriteSource`)."""
    threads = len(bufs)
    if len(fds) not in (1, threads):
        raise ValueError(f"{len(fds)} files for {threads} threads")
    shared = len(fds) == 1
    per = nbytes // threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        buf, fd = bufs[i], fds[0 if shared else i]
        block = len(buf)
        view = memoryview(source)[i * per:(i + 1) * per] if source is not None else None
        start.wait()
        try:
            off = i * per if shared else 0
            first, end = off, off + per
            while off < end:
                if view is not None:
                    buf = view[off - first:off - first + block]
                n = os.pwritev(fd, [buf], off) if write else os.preadv(fd, [buf], off)
                if n <= 0:
                    raise OSError(f"short {'write' if write else 'read'} at {off}")
                off += n
            if fsync and not shared:
                os.fsync(fd)
        except BaseException as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    if fsync and shared and not errors:
        os.fsync(fds[0])
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


class WriteSource:
    """The bytes write probes write: one page-aligned buffer of the probe's size, filled once.

    A save writes a state that lives in memory and is far larger than the CPU's caches, so every
    byte it writes is first read from DRAM. A probe that writes one cache-resident block over and
    over skips that read: on a memory filesystem, where a write is a copy into new pages, it
    measured 6.3 GiB/s on a 2-core VM against 5.1 GiB/s for the same write from a 1 GiB
    state, a limit no save can reach. So write probes write distinct bytes from this buffer."""

    def __init__(self) -> None:
        self._buffer: mmap.mmap | None = None

    def get(self, nbytes: int) -> mmap.mmap:
        """A filled buffer of at least `nbytes` (reused while large enough)."""
        if self._buffer is None or len(self._buffer) < nbytes:
            self.close()
            self._buffer = _aligned_buffer(nbytes)
            for index, off in enumerate(range(0, nbytes, MIB)):  # no two MiB alike
                self._buffer[off:off + 8] = index.to_bytes(8, "little")
        return self._buffer

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


def _python_write(paths: list[str], nbytes: int, block: int, threads: int,
                  direct: bool, source: WriteSource | None = None) -> tuple[float, bool]:
    """Write `nbytes` in all to `paths` (one shared file, or one per thread) and fsync each,
    timed together, from `source` (else every thread writes its one block buffer over and over).
    Returns (GiB/s, whether every file was written with O_DIRECT)."""
    fds: list[int] = []
    modes: list[bool] = []
    try:
        for p in paths:
            fd, d = _open_write(p, direct)
            fds.append(fd)
            modes.append(d)
            if d:
                _preallocate(fd, nbytes // len(paths))
        src = source.get(nbytes) if source is not None else None
        dt = _run_threads(fds, nbytes, _buffers(block, threads, fill=src is None), write=True, fsync=True,
                          source=src)
    finally:
        for fd in fds:
            os.close(fd)
    return nbytes / dt / GIB, all(modes)


def _python_read(paths: list[str], nbytes: int, block: int, threads: int,
                 direct: bool, cold: str | None = None) -> tuple[float, bool]:
    """Read back what `_python_write` wrote, cold: O_DIRECT, else after evicting each file from
    the page cache (its pages are clean: the write fsynced them); with `cold` = drop_caches, after
    dropping every cache first (as the cold loads are), which also reaches what a FUSE daemon
    cached of its backing files."""
    fds: list[int] = []
    modes: list[bool] = []
    if cold == COLD_DROP:
        drop_page_cache()
    try:
        for p in paths:
            fd, d = _open(p, os.O_RDONLY, direct)
            fds.append(fd)
            modes.append(d)
            if not d:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # best effort: read the device
        dt = _run_threads(fds, nbytes, _buffers(block, threads, fill=False), write=False)
    finally:
        for fd in fds:
            os.close(fd)
    return nbytes / dt / GIB, all(modes)


def _page_cache_read(path: str, nbytes: int, block: int = 8 << 20) -> float:
    """Buffered 1-thread read of a file that is already in the page cache (read twice)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = _buffers(block, 1, fill=False)
        _run_threads([fd], nbytes, bufs, write=False)  # populate
        return nbytes / _run_threads([fd], nbytes, bufs, write=False) / GIB
    finally:
        os.close(fd)


def _python_pair(path: str, nbytes: int, block: int, threads: int, files: int,
                 direct: bool, source: WriteSource | None = None,
                 cold: str | None = None) -> tuple[ProbeRun, ProbeRun]:
    """Write (from `source`) then read back one configuration; multi-file runs remove their files."""
    size = _run_size(nbytes, block, threads)
    paths = probe_paths(path, files)
    try:
        w, wd = _python_write(paths, size, block, threads, direct, source)
        r, rd = _python_read(paths, size, block, threads, direct, cold)
    finally:
        if files > 1:
            _remove(paths)
    wm = "python O_DIRECT" if wd else "python buffered+fsync"
    rm = "python O_DIRECT" if rd else "python buffered (fadvise DONTNEED first)"
    return ProbeRun("write", block, threads, wm, w, files), ProbeRun("read", block, threads, rm, r, files)


def _probe_python(path: str, nbytes: int, configs: list[tuple[int, int]],
                  tmpfs: bool = False, cold: str | None = None) -> tuple[list[ProbeRun], list[str]]:
    source = WriteSource()  # every write run writes distinct bytes from one state-sized buffer
    try:
        return _probe_python_runs(path, nbytes, configs, tmpfs, source, cold)
    finally:
        source.close()


def _probe_python_runs(path: str, nbytes: int, configs: list[tuple[int, int]], tmpfs: bool,
                       source: WriteSource, cold: str | None = None) -> tuple[list[ProbeRun], list[str]]:
    runs: list[ProbeRun] = []
    for direct in probe_modes(tmpfs):
        mode_runs: list[ProbeRun] = []
        for block, threads in configs:  # one file shared by the threads
            mode_runs += _python_pair(path, nbytes, block, threads, 1, direct=direct, source=source, cold=cold)
        _remove([path])  # keep tmpfs from holding two copies; the last run below leaves it again
        mode_runs += _multi_file_runs(
            nbytes, configs,
            lambda b, t, f: _python_pair(path, nbytes, b, t, f, direct=direct, source=source, cold=cold))
        runs += mode_runs
        if direct and not any(r.direct for r in mode_runs):
            break  # O_DIRECT refused: these runs were buffered already
    # For the record, not the limit: the best write configuration again, each thread writing one
    # cache-resident block over and over (what this probe did before WriteSource).
    best = best_run(runs, "write")
    cached = _python_pair(path, nbytes, best.block, best.threads, best.files, direct=best.direct)[0]
    note = (f"write from one cached {_fmt_block(best.block)} block per thread instead of the "
            f"state-sized source ({best.files} file(s), {best.threads} thread(s)): {cached.gibps:.2f} GiB/s, "
            f"not a limit a save can reach (a save reads every byte it writes from memory)")
    block = max(b for b, _ in configs)
    runs += _python_pair(path, nbytes, block, 1, 1, direct=False, source=source, cold=cold)  # last: leaves `path`
    return runs, [note]


# --------------------------------------------------------------------------- fio probe

def fio_command(path: str, nbytes: int, block: int, threads: int, rw: str, direct: bool,
                files: int = 1) -> list[str]:
    """fio command line of one probe run: `threads` jobs (psync, `block` requests) moving
    `nbytes` in all, reported as one group. files=1: the jobs share `path`, each at its own
    offset; files=threads: each job has its own file (`probe_paths(path, threads)`).
    Writes fsync every file at the end (end_fsync); buffered reads drop the files' pages first
    (invalidate). fallocate=none: the files are written, not preallocated, as a writer would."""
    if files not in (1, threads):
        raise ValueError(f"files must be 1 or threads ({threads}), not {files}")
    per = nbytes // threads // block * block
    if files == 1:
        where = [f"--filename={path}", f"--offset_increment={per}"]
    else:
        root, ext = os.path.splitext(os.path.basename(path))
        where = [f"--directory={os.path.dirname(path) or '.'}", f"--filename_format={root}.$jobnum{ext}",
                 "--nrfiles=1"]
    cmd = ["fio", "--name=probe", *where, f"--rw={rw}", f"--bs={block}", f"--size={per}",
           f"--numjobs={threads}", f"--direct={1 if direct else 0}", "--ioengine=psync",
           # preallocated for O_DIRECT, as fastdcp's writer does; buffered writes are not
           f"--fallocate={'posix' if direct else 'none'}", "--group_reporting", "--output-format=json"]
    cmd.append("--end_fsync=1" if rw == "write" else "--invalidate=1")
    return cmd


def _fio(path: str, nbytes: int, block: int, threads: int, rw: str, direct: bool, files: int = 1,
         cold: str | None = None) -> float:
    cmd = fio_command(path, nbytes, block, threads, rw, direct, files)
    if rw == "read" and cold == COLD_DROP:
        drop_page_cache()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    text = out.stdout[out.stdout.index("{"):]  # fio may print notes before the JSON
    job = json.loads(text)["jobs"][0][rw]  # group_reporting: one entry for all the jobs
    return float(job["bw_bytes"]) / GIB


def _fio_pair(path: str, nbytes: int, block: int, threads: int, files: int,
              direct: bool, cold: str | None = None) -> tuple[ProbeRun, ProbeRun]:
    """One configuration written then read with fio, with O_DIRECT when `direct` and the
    filesystem takes it, else buffered (writes fsynced, reads after dropping the files' pages)."""
    out = []
    for rw in ("write", "read"):
        gibps = None
        if direct:
            try:
                gibps, method = _fio(path, nbytes, block, threads, rw, True, files, cold), "fio direct=1"
            except (subprocess.CalledProcessError, ValueError, KeyError):
                gibps = None  # refused: the buffered run below
        if gibps is None:
            gibps = _fio(path, nbytes, block, threads, rw, False, files, cold)
            method = "fio direct=0 end_fsync=1" if rw == "write" else "fio direct=0"
        out.append(ProbeRun(rw, block, threads, method, gibps, files))
    return out[0], out[1]


def _probe_fio(path: str, nbytes: int, configs: list[tuple[int, int]],
               tmpfs: bool = False, cold: str | None = None) -> tuple[list[ProbeRun], list[str]]:
    runs: list[ProbeRun] = []
    notes: list[str] = []
    for direct in probe_modes(tmpfs):
        mode_runs: list[ProbeRun] = []
        for block, threads in configs:
            mode_runs += _fio_pair(path, nbytes, block, threads, 1, direct, cold)
        try:
            mode_runs += _multi_file_runs(nbytes, configs, lambda b, t, f: _fio_pair(path, nbytes, b, t, f, direct, cold))
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
            notes.append(f"fio multi-file runs failed ({'O_DIRECT' if direct else 'buffered'}, "
                         f"{type(e).__name__}: {e}); limit from one-file runs")
        finally:
            _remove(probe_paths(path, MAX_PROBE_FILES))
        runs += mode_runs
        if direct and not any(r.direct for r in mode_runs):
            break  # O_DIRECT refused: these runs were buffered already
    return runs, notes


# --------------------------------------------------------------------------- public API

def probe_storage(where_dir: str, nbytes: int, configs: list[tuple[int, int]],
                  method: str = "auto", cold_method: str | None = None) -> StorageLimit:
    """Sequential write (with fsync) and cold read bandwidth of the filesystem holding
    `where_dir`: the best of one-file and one-file-per-thread runs in either I/O mode (see the
    module doc). `cold_method`: the run's way of making loads cold (pagecache.py); with
    drop_caches every read run starts after one, as the cold loads do."""
    info = fs_info(where_dir)
    path = os.path.join(where_dir, PROBE_NAME)
    use_fio = method == "fio" or (method == "auto" and shutil.which("fio") is not None)
    notes: list[str] = []
    try:
        if use_fio:
            try:
                runs, notes = _probe_fio(path, nbytes, configs, info.is_tmpfs, cold_method)
            except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
                notes = [f"fio failed ({type(e).__name__}: {e}); used the python probe"]
                runs, more = _probe_python(path, nbytes, configs, info.is_tmpfs, cold_method)
                notes += more
        else:
            runs, notes = _probe_python(path, nbytes, configs, info.is_tmpfs, cold_method)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        pcr = _page_cache_read(path, size) if size else None
    finally:
        _remove(probe_paths(path, 1) + probe_paths(path, MAX_PROBE_FILES))
    if info.is_tmpfs:
        notes.append("tmpfs: 'device' bandwidth is writing new pages of a memory filesystem (page allocation + copy)")
    w, r = best_run(runs, "write"), best_run(runs, "read")
    return StorageLimit(path=info.path, fstype=info.fstype, method=_describe_best(runs), bytes=nbytes,
                        write_gibps=w.gibps, read_gibps=r.gibps, page_cache_read_gibps=pcr, runs=runs,
                        note="; ".join(notes), write_best=w, read_best=r,
                        write_by_mode=best_by_mode(runs, "write"), read_by_mode=best_by_mode(runs, "read"))


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
    src = dst = None  # release (not `del`: the lambdas above close over them)
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
    host = dev = None  # release before empty_cache (the closures above hold them)
    torch.cuda.empty_cache()
    return res


def device_copy_bandwidth(nbytes: int, rounds: int = 5) -> float | None:
    """GiB/s of a device-to-device copy of `nbytes` (counted once, not read + write), or None
    without CUDA: the ceiling for the box-copy kernel, which reads and writes each byte once."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def d2d() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    res = nbytes / _best_time(d2d, rounds) / GIB
    src = dst = None  # release before empty_cache (the closure above holds them)
    torch.cuda.empty_cache()
    return res


def measure_limits(targets: dict[str, str], probe_bytes: int, probe_configs: list[tuple[int, int]],
                   memcpy_bytes: int, probe_method: str = "auto", progress=None,
                   cold_method: str | None = None) -> Limits:
    storage: dict[str, StorageLimit] = {}
    for where, path in targets.items():
        if progress:
            progress(f"limits: storage probe of {where} ({path})")
        storage[where] = probe_storage(path, probe_bytes, probe_configs, probe_method, cold_method)
    if progress:
        progress("limits: memory copy")
    methods = memcpy_bandwidth(memcpy_bytes)
    pinned = pinned_bandwidth(min(memcpy_bytes, 1 << 30)) if torch.cuda.is_available() else None
    d2d = device_copy_bandwidth(min(memcpy_bytes, 1 << 30)) if torch.cuda.is_available() else None
    return Limits(memcpy_gibps=max(methods.values()), memcpy_methods=methods, storage=storage,
                  h2d_gibps=pinned[0] if pinned else None, d2h_gibps=pinned[1] if pinned else None,
                  d2d_gibps=d2d)
