"""The native engine on real files: round trips, O_DIRECT fallback, short transfers, errors."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from fastdcp import _C

ALIGN = 4096


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _write_image(engine, path, segments, size, direct):
    f = _C.File(str(path), "w", direct)
    engine.write([(f, 0, size, segments)])
    f.truncate(size)
    f.sync()
    used_direct = f.direct
    f.close()
    return used_direct


def _expected_image(size, placed):
    image = bytearray(size)
    for offset, data in placed:
        image[offset : offset + len(data)] = data
    return bytes(image)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("task_bytes", [ALIGN, 64 << 10, 8 << 20])
def test_write_image_round_trip(tmp_path, direct, task_bytes):
    engine = _C.Engine(3, task_bytes)
    big = _pattern(300_001, 1)
    small = b"header-bytes" * 7
    tail = b"T" * 5
    # segments with gaps (zeros), an unaligned tail, data at an aligned offset, an int address
    segments = [(0, small), (ALIGN, big.data_ptr(), big.numel()), (ALIGN + big.numel() + 17, tail)]
    size = ALIGN + big.numel() + 17 + len(tail)
    used_direct = _write_image(engine, tmp_path / "img", segments, size, direct)
    assert os.path.getsize(tmp_path / "img") == size
    expected = _expected_image(size, [(0, small), (ALIGN, bytes(big.tolist())), (ALIGN + big.numel() + 17, tail)])
    assert (tmp_path / "img").read_bytes() == expected
    if direct and not _C.on_memory_filesystem(str(tmp_path)):
        assert used_direct  # a disk filesystem takes O_DIRECT
    # read back through the engine: unaligned offsets, into a tensor and into a bytearray
    rf = _C.File(str(tmp_path / "img"), "r", direct)
    out = torch.empty(big.numel(), dtype=torch.uint8)
    buf = bytearray(len(tail) + 3)
    engine.read([(rf, ALIGN, out.data_ptr(), out.numel()), (rf, size - len(tail) - 3, buf)], direct)
    assert torch.equal(out, big)
    assert bytes(buf) == b"\0\0\0" + tail
    rf.close()


def test_direct_fallback_at_open(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDCP_TEST_DIRECT_EINVAL", "open")
    engine = _C.Engine(2, 64 << 10)
    data = _pattern(100_000, 2)
    assert not _write_image(engine, tmp_path / "a", [(0, data.data_ptr(), data.numel())], data.numel(), True)
    assert (tmp_path / "a").read_bytes() == bytes(data.tolist())


def test_direct_fallback_at_first_io(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDCP_TEST_DIRECT_EINVAL", "io")
    engine = _C.Engine(2, 64 << 10)
    data = _pattern(200_000, 3)
    f = _C.File(str(tmp_path / "b"), "w", True)
    assert f.direct  # the open succeeded...
    engine.write([(f, 0, data.numel(), [(0, data.data_ptr(), data.numel())])])
    assert not f.direct  # ...the first I/O was refused, the file went buffered
    f.truncate(data.numel())
    f.close()
    assert (tmp_path / "b").read_bytes() == bytes(data.tolist())
    # reads fall back the same way
    rf = _C.File(str(tmp_path / "b"), "r", True)
    out = torch.empty_like(data)
    engine.read([(rf, 0, out.data_ptr(), out.numel())], True)
    assert not rf.direct
    assert torch.equal(out, data)
    rf.close()


@pytest.mark.parametrize("direct,cap", [(False, 1000), (True, ALIGN)])
def test_short_transfers_are_finished(tmp_path, monkeypatch, direct, cap):
    monkeypatch.setenv("FASTDCP_TEST_MAX_IO_BYTES", str(cap))
    engine = _C.Engine(2, 1 << 20)
    data = _pattern(3 * (1 << 20) + 123, 4)
    _write_image(engine, tmp_path / "c", [(0, data.data_ptr(), data.numel())], data.numel(), direct)
    assert (tmp_path / "c").read_bytes() == bytes(data.tolist())
    rf = _C.File(str(tmp_path / "c"), "r", direct)
    out = torch.empty_like(data)
    engine.read([(rf, 0, out.data_ptr(), out.numel())], direct)
    rf.close()
    assert torch.equal(out, data)


def test_open_error_names_path_and_errno(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "f"
    with pytest.raises(FileNotFoundError) as info:
        _C.File(str(missing), "w", True)
    assert info.value.errno == errno.ENOENT
    assert str(missing) in str(info.value)


def test_write_error_names_path_offset_and_strerror(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available to produce ENOSPC")
    engine = _C.Engine(2, 64 << 10)
    f = _C.File("/dev/full", "w", False)
    data = _pattern(200_000, 5)
    with pytest.raises(OSError) as info:
        engine.write([(f, 0, data.numel(), [(0, data.data_ptr(), data.numel())])])
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert "/dev/full" in message and "offset" in message and os.strerror(errno.ENOSPC) in message
    f.close()
    # the engine survives a failed batch
    ok = _C.File(str(tmp_path / "after"), "w", False)
    engine.write([(ok, 0, 10, [(0, b"0123456789")])])
    ok.close()
    assert (tmp_path / "after").read_bytes() == b"0123456789"


@pytest.mark.parametrize("direct", [False, True])
def test_read_past_end_of_file_is_a_clear_error(tmp_path, direct):
    (tmp_path / "short").write_bytes(b"x" * 5000)
    engine = _C.Engine(2, 64 << 10)
    rf = _C.File(str(tmp_path / "short"), "r", direct)
    out = bytearray(2000)
    with pytest.raises(EOFError) as info:
        engine.read([(rf, 4000, out)], direct)
    assert str(tmp_path / "short") in str(info.value)
    assert "4000" in str(info.value) and "truncated" in str(info.value)
    rf.close()


def test_bad_requests_are_rejected_before_io(tmp_path):
    engine = _C.Engine(1, 1 << 20)
    f = _C.File(str(tmp_path / "d"), "w", False)
    with pytest.raises(ValueError, match="sorted"):
        engine.write([(f, 0, 100, [(50, b"abc"), (10, b"def")])])
    with pytest.raises(ValueError, match="inside"):
        engine.write([(f, 0, 10, [(8, b"abcdef")])])
    with pytest.raises(ValueError, match="aligned"):
        engine.write([(f, 100, 200, [(100, b"abc")])])
    with pytest.raises(ValueError, match="mode"):
        _C.File(str(tmp_path / "e"), "x", False)
    f.close()


def test_no_descriptor_leak_on_errors(tmp_path):
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    engine = _C.Engine(2, 64 << 10)
    before = open_fds()
    for _ in range(20):
        with pytest.raises(FileNotFoundError):
            _C.File(str(tmp_path / "missing" / "x"), "r", True)
        f = _C.File(str(tmp_path / "short"), "w", True)
        f.close()
        rf = _C.File(str(tmp_path / "short"), "r", True)
        with pytest.raises(EOFError):
            engine.read([(rf, 0, bytearray(10))], True)
        del rf  # destructor closes
    assert open_fds() == before


def _mount_type(path: str) -> str:
    """The filesystem type of the longest /proc/mounts mount point containing ``path``."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def test_memory_filesystem_detection(tmp_path):
    assert _C.on_memory_filesystem(str(tmp_path)) == (_mount_type(str(tmp_path)) in ("tmpfs", "ramfs"))
    if os.path.isdir("/dev/shm") and _mount_type("/dev/shm") == "tmpfs":
        assert _C.on_memory_filesystem("/dev/shm")
    assert not _C.on_memory_filesystem("/proc/definitely/missing")
