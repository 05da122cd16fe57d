"""Tests of the storage-limit probes (fastdcp/bench/limits.py): one-file and one-file-per-thread
runs on real files in tmp_path at small sizes, the choice of the limit, and fio command lines
(with a fake fio; a real one only when installed)."""

from __future__ import annotations

import os
import shutil

import pytest

from fastdcp.bench import limits as L
from fastdcp.bench.limits import (Limits, ProbeRun, fio_command, file_ladder, probe_paths,
                               probe_storage)

MiB = 1 << 20


def _fileid(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _pathid(p) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_dev, st.st_ino


# --------------------------------------------------------------------------- python probe, real files

@pytest.mark.parametrize("files", [2, 4])
def test_multi_file_write_makes_n_files_of_the_right_total_size(tmp_path, files):
    paths = probe_paths(str(tmp_path / L.PROBE_NAME), files)
    assert len(set(paths)) == files and all(os.path.dirname(p) == str(tmp_path) for p in paths)
    size = 8 * MiB
    gibps, _ = L._python_write(paths, size, 1 * MiB, files, direct=True)
    assert gibps > 0
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths)
    assert [os.path.getsize(p) for p in paths] == [size // files] * files
    for p in paths:  # written, not a hole
        with open(p, "rb") as f:
            assert f.read(4096) != bytes(4096)


@pytest.mark.parametrize("files", [1, 3])
def test_write_from_a_source_writes_its_bytes_once_in_order(tmp_path, files):
    """With a WriteSource, thread i writes the i-th part of one state-sized buffer (every byte
    distinct, so the probe reads it from memory as a save does), not one block over and over:
    the files, in thread order, hold the source's bytes."""
    paths = probe_paths(str(tmp_path / L.PROBE_NAME), files)
    block, threads, size = 1 * MiB, 3, 6 * MiB
    source = L.WriteSource()
    try:
        L._python_write(paths, size, block, threads, direct=True, source=source)
        expected = bytes(source.get(size)[:size])
    finally:
        source.close()
    written = b"".join(open(p, "rb").read() for p in paths)
    assert written == expected
    assert expected[:block] != expected[block:2 * block], "the source repeats a block"


def test_multi_file_pair_writes_n_files_then_removes_them(tmp_path, monkeypatch):
    seen = []
    real_read = L._python_read

    def spy(paths, nbytes, block, threads, direct, cold=None):
        seen.append((list(paths), nbytes, threads, {p: os.path.getsize(p) for p in paths}))
        return real_read(paths, nbytes, block, threads, direct, cold)

    monkeypatch.setattr(L, "_python_read", spy)
    path = str(tmp_path / L.PROBE_NAME)
    w, r = L._python_pair(path, 12 * MiB, 1 * MiB, 4, 4, direct=True)
    (paths, nbytes, threads, sizes), = seen
    assert len(paths) == 4 and threads == 4 and nbytes == 12 * MiB
    assert sum(sizes.values()) == 12 * MiB and set(sizes.values()) == {3 * MiB}
    assert (w.op, w.files, w.threads, w.block) == ("write", 4, 4, 1 * MiB)
    assert (r.op, r.files, r.threads) == ("read", 4, 4)
    assert w.gibps > 0 and r.gibps > 0 and "python" in w.method
    assert not list(tmp_path.iterdir()), "multi-file probe files left behind"


@pytest.mark.parametrize("files", [1, 3])
@pytest.mark.parametrize("direct", [True, False])
def test_read_probe_reads_every_written_byte_once(tmp_path, monkeypatch, files, direct):
    """Whatever the layout (3 threads on one file, or one file each), the read probe reads each
    file's whole extent exactly once and gets the bytes the write probe put there; buffered
    reads evict every file from the page cache first (cold)."""
    paths = probe_paths(str(tmp_path / L.PROBE_NAME), files)
    block, threads, size = 1 * MiB, 3, 6 * MiB
    L._python_write(paths, size, block, threads, direct=direct)
    contents = {_pathid(p): open(p, "rb").read() for p in paths}
    assert sum(len(c) for c in contents.values()) == size

    reads, advised = [], []
    real_preadv, real_fadvise = os.preadv, os.posix_fadvise

    def preadv(fd, bufs, off):
        n = real_preadv(fd, bufs, off)
        reads.append((_fileid(fd), off, bytes(bufs[0][:n])))
        return n

    def fadvise(fd, off, length, advice):
        advised.append((_fileid(fd), off, length, advice))
        return real_fadvise(fd, off, length, advice)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    gibps, was_direct = L._python_read(paths, size, block, threads, direct=direct)
    assert gibps > 0
    for fid, data in contents.items():
        mine = sorted((off, got) for f, off, got in reads if f == fid)
        assert [off for off, _ in mine] == list(range(0, len(data), block)), "each block read exactly once"
        assert b"".join(got for _, got in mine) == data
    assert len(reads) == size // block
    if not was_direct:
        assert {f for f, _, _, adv in advised if adv == os.POSIX_FADV_DONTNEED} == set(contents)


@pytest.fixture(params=["tmp_path", "shm"])
def probe_dir(request, tmp_path):
    if request.param == "tmp_path":
        yield tmp_path
        return
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no writable /dev/shm")
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="fastdcp_limits_test_", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_python_probe_tries_one_and_several_files_and_cleans_up(probe_dir):
    tmp_path = probe_dir
    lim = probe_storage(str(tmp_path), 8 * MiB, [(1 * MiB, 2)], method="python")
    assert not list(tmp_path.iterdir()), "probe files left behind"
    if lim.fstype == "tmpfs" and "O_DIRECT" in lim.runs[0].method:
        # tmpfs does O_DIRECT through its page cache (the buffered path): no buffered multi-file rerun
        assert not [r for r in lim.runs if r.files > 1 and "buffered" in r.method]
    files = {r.files for r in lim.runs}
    assert 1 in files and {2, 4} <= files
    assert all(r.files in (1, r.threads) for r in lim.runs)
    for op in ("write", "read"):
        ops = [r for r in lim.runs if r.op == op]
        best = max(ops, key=lambda r: r.gibps)
        assert getattr(lim, f"{op}_gibps") == best.gibps and getattr(lim, f"{op}_best") == best
        assert f"{op}: {best.describe()}" in lim.method
    # every configuration has a write and a read run (the read reads that write's files)
    key = lambda r: (r.block, r.threads, r.files, "O_DIRECT" in r.method)  # noqa: E731
    assert sorted(key(r) for r in lim.runs if r.op == "write") == sorted(key(r) for r in lim.runs if r.op == "read")
    doc = Limits(memcpy_gibps=1.0, memcpy_methods={}, storage={"dir": lim}).to_json()
    s = doc["storage"]["dir"]
    assert s["write_best"]["files"] == lim.write_best.files and all("files" in r for r in s["runs"])
    assert s["write_gibps"] == lim.write_gibps and s["read_gibps"] == lim.read_gibps


# --------------------------------------------------------------------------- choice of the limit

def _fake_pair(table, calls):
    """A probe pair returning bandwidths from `table[(block, files, direct)]` (default 1.0)."""

    def pair(path, nbytes, block, threads, files, direct, source=None, cold=None):
        if source is None:  # the cached-block run, recorded in the notes only
            calls.append(("cached", block, threads, files, direct))
            w, r = 99.0, 99.0
        else:
            calls.append((block, threads, files, direct))
            w, r = table.get((block, files, direct), (1.0, 1.0))
        tag = "python O_DIRECT" if direct else "python buffered"
        return (ProbeRun("write", block, threads, tag, w, files), ProbeRun("read", block, threads, tag, r, files))

    return pair


def test_limit_is_the_best_run_and_names_its_configuration(tmp_path, monkeypatch):
    table = {(8 * MiB, 4, True): (4.8, 2.0),   # several files win the write
             (1 * MiB, 1, True): (2.4, 6.0),   # one file wins the read
             (8 * MiB, 2, True): (4.0, 1.0)}
    calls = []
    monkeypatch.setattr(L, "_python_pair", _fake_pair(table, calls))
    lim = probe_storage(str(tmp_path), 64 * MiB, [(1 * MiB, 4), (8 * MiB, 1)], method="python")
    assert lim.write_gibps == 4.8 and lim.read_gibps == 6.0
    assert (lim.write_best.files, lim.write_best.threads, lim.write_best.block) == (4, 4, 8 * MiB)
    assert (lim.read_best.files, lim.read_best.threads, lim.read_best.block) == (1, 4, 1 * MiB)
    assert "write: python O_DIRECT 8 MiB x4 threads, 4 files" in lim.method
    assert "read: python O_DIRECT 1 MiB x4 threads, 1 file" in lim.method
    assert lim.write_gibps == max(r.gibps for r in lim.runs if r.op == "write")
    assert lim.read_gibps == max(r.gibps for r in lim.runs if r.op == "read")
    limits = Limits(memcpy_gibps=9.0, memcpy_methods={}, storage={"shm": lim})
    assert limits.value("write:shm") == 4.8 and limits.value("min(memcpy,read:shm)") == 6.0
    # 8 MiB: 2 -> 4 files gained >= 5%, so 8 was tried; 1 MiB: 4 did not gain over 2, so not
    multi = [(b, f) for b, _, f, d in (c for c in calls if c[0] != "cached") if f > 1 and d]
    assert multi == [(8 * MiB, 2), (8 * MiB, 4), (8 * MiB, 8), (1 * MiB, 2), (1 * MiB, 4)]
    # buffered + fsync: the same sweep (every configuration, one file and the file ladder), then
    # the cached-block run, then one file (last, it leaves the file for the page-cache read)
    buffered = [c[:3] for c in calls[:-2] if c[0] != "cached" and not c[3]]
    # (all 1.0 in buffered mode: 4 files gain nothing over 2, so the ladder stops at 4)
    assert buffered == [(1 * MiB, 4, 1), (8 * MiB, 1, 1), (8 * MiB, 2, 2), (8 * MiB, 4, 4),
                        (1 * MiB, 2, 2), (1 * MiB, 4, 4)]
    assert calls[-2:] == [("cached", 8 * MiB, 4, 4, True), (8 * MiB, 1, 1, False)]
    assert lim.write_by_mode == {"O_DIRECT": 4.8, "buffered": 1.0} and lim.read_by_mode["O_DIRECT"] == 6.0
    # the run from one cached block per thread is in the note, never the limit
    assert "99.00 GiB/s" in lim.note and all(r.gibps != 99.0 for r in lim.runs)


def test_a_faster_buffered_mode_sets_the_limit(tmp_path, monkeypatch):
    """The limit is the best of both modes a writer can choose: where buffered + fsync beats
    O_DIRECT (a virtio disk, some network filesystems) a probe of O_DIRECT alone would flatter
    every fraction of the limit."""
    table = {(8 * MiB, 1, True): (1.0, 1.0), (8 * MiB, 2, False): (1.6, 0.9), (8 * MiB, 1, False): (1.2, 1.4)}
    calls = []
    monkeypatch.setattr(L, "_python_pair", _fake_pair(table, calls))
    lim = probe_storage(str(tmp_path), 64 * MiB, [(8 * MiB, 1)], method="python")
    assert (lim.write_gibps, lim.read_gibps) == (1.6, 1.4)
    assert not lim.write_best.direct and lim.write_best.files == 2
    assert lim.write_by_mode == {"O_DIRECT": 1.0, "buffered": 1.6}
    assert lim.read_by_mode == {"O_DIRECT": 1.0, "buffered": 1.4}
    assert "write: python buffered 8 MiB x2 threads, 2 files" in lim.method


def test_memory_filesystems_are_probed_buffered_only():
    assert L.probe_modes(tmpfs=True) == (False,) and L.probe_modes(tmpfs=False) == (True, False)


def test_file_ladder_is_capped():
    assert file_ladder(64 * MiB, 8 * MiB) == [2, 4, 8]
    assert file_ladder(16 * MiB, 8 * MiB) == [2]
    assert file_ladder(4 * MiB, 8 * MiB) == []
    assert max(file_ladder(1 << 40, 4096)) == L.MAX_PROBE_FILES


# --------------------------------------------------------------------------- fio

def _args(cmd):
    return dict(a[2:].split("=", 1) for a in cmd[1:] if a.startswith("--") and "=" in a)


def test_fio_command_one_file():
    cmd = fio_command("/d/.bench_probe.bin", 64 * MiB, 1 * MiB, 4, "write", True)
    a = _args(cmd)
    assert cmd[0] == "fio" and "--group_reporting" in cmd
    assert a["filename"] == "/d/.bench_probe.bin" and a["numjobs"] == "4"
    assert a["size"] == a["offset_increment"] == str(16 * MiB)
    assert a["direct"] == "1" and a["end_fsync"] == "1" and a["rw"] == "write" and a["bs"] == str(MiB)
    assert "directory" not in a and "filename_format" not in a


@pytest.mark.parametrize("rw", ["write", "read"])
def test_fio_command_one_file_per_job(rw):
    path = "/d/.bench_probe.bin"
    cmd = fio_command(path, 64 * MiB, 8 * MiB, 4, rw, False, files=4)
    a = _args(cmd)
    assert "filename" not in a and "offset_increment" not in a  # separate files, not one shared
    assert a["directory"] == "/d" and a["numjobs"] == "4" and a["size"] == str(16 * MiB)
    assert a["nrfiles"] == "1" and a["direct"] == "0" and "--group_reporting" in cmd
    assert a["fallocate"] == "none"  # buffered; O_DIRECT runs preallocate (posix), as fastdcp's writer does
    names = [os.path.join(a["directory"], a["filename_format"].replace("$jobnum", str(j))) for j in range(4)]
    assert names == probe_paths(path, 4)  # the files probe_storage removes
    assert (a.get("end_fsync"), a.get("invalidate")) == (("1", None) if rw == "write" else (None, "1"))
    with pytest.raises(ValueError):
        fio_command(path, 64 * MiB, 8 * MiB, 4, rw, False, files=2)


_FAKE_FIO = r'''#!{python}
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
n, size = int(args["numjobs"]), int(args["size"])
if "filename" in args:
    names = [args["filename"]]
    total = n * size
else:
    if os.environ.get("FAKE_FIO_NO_MULTI"):
        sys.exit("fio: no multi-file today")
    names = [os.path.join(args["directory"], args["filename_format"].replace("$jobnum", str(j)))
             for j in range(n)]
    total = size
if args["rw"] == "write":
    for p in names:
        with open(p, "ab") as f:
            f.truncate(total)
else:
    assert all(os.path.getsize(p) == total for p in names), "read before write"
bw = (1 << 30) * (1 if args["rw"] == "write" else 3) * (2 if "filename_format" in args else 1)
print(json.dumps({{"jobs": [{{args["rw"]: {{"bw_bytes": bw * n}}}}]}}))
'''


@pytest.mark.parametrize("multi_fails", [False, True])
def test_fio_probe_with_separate_files_per_job(fake_fio, monkeypatch, multi_fails):
    data = fake_fio(_FAKE_FIO)
    if multi_fails:
        monkeypatch.setenv("FAKE_FIO_NO_MULTI", "1")
    lim = probe_storage(str(data), 64 * MiB, [(8 * MiB, 1)], method="auto")
    assert not list(data.iterdir()), "probe files left behind"
    assert all(r.method.startswith("fio") for r in lim.runs)
    if multi_fails:
        assert {r.files for r in lim.runs} == {1}
        assert (lim.write_gibps, lim.read_gibps) == (1.0, 3.0)
        assert "fio multi-file runs failed" in lim.note
    else:
        # fake bandwidth grows with the job count: 2, 4, 8 files, each step gaining
        assert sorted({r.files for r in lim.runs}) == [1, 2, 4, 8]
        assert (lim.write_gibps, lim.read_gibps) == (16.0, 48.0)
        assert (lim.write_best.files, lim.write_best.threads) == (8, 8)
        assert "8 MiB x8 threads, 8 files" in lim.method and "fio direct=1" in lim.method


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_real_fio_multi_file(tmp_path):
    lim = probe_storage(str(tmp_path), 16 * MiB, [(1 * MiB, 2)], method="fio")
    assert not list(tmp_path.iterdir())
    assert "fio multi-file runs failed" not in lim.note and {r.files for r in lim.runs} >= {1, 2, 4}
    assert lim.write_gibps > 0 and lim.read_gibps > 0


def test_cold_reads_follow_the_runs_cold_method(tmp_path, monkeypatch):
    """With drop_caches (the cold loads' method when permitted) every read run starts after one,
    so that the read limit is as cold as the loads it is compared with (a FUSE daemon's cache of
    its backing files included); without it, no global drop."""
    drops = []
    monkeypatch.setattr(L, "drop_page_cache", lambda: drops.append(1) or True)
    path = str(tmp_path / L.PROBE_NAME)
    L._python_pair(path, 8 * MiB, 1 * MiB, 2, 2, direct=False, cold=L.COLD_DROP)
    assert drops == [1]
    L._python_pair(path, 8 * MiB, 1 * MiB, 2, 2, direct=False)
    assert drops == [1] and not list(tmp_path.iterdir())
