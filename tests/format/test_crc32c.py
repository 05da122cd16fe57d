"""The native CRC-32C function ``_C.crc32c`` and ``fastdcp.format.checksums.crc32c`` over it: the
standard check value, continuation from a seed, and every C-contiguous buffer (bytes, bytearray,
memoryview, mmap, numpy) accepted; a strided buffer refused rather than checksummed wrongly."""

from __future__ import annotations

import mmap
import random
import threading

import pytest

from fastdcp._native import _C
from fastdcp.format.checksums import crc32c

CHECK = 0xE3069283  # CRC-32C of b"123456789"


@pytest.mark.parametrize("function", [_C.crc32c, crc32c], ids=["native", "checksums"])
def test_the_check_value_and_the_continuation(function):
    assert function(b"123456789") == CHECK
    assert function(b"") == 0 and function(b"", 1234) == 1234
    data = random.Random(7).randbytes(100_003)
    whole = function(data)
    for cut in (0, 1, 7, 4096, 65_537, len(data)):
        assert function(data[cut:], function(data[:cut])) == whole, cut
    assert function(data, seed=0) == whole


def test_every_contiguous_buffer_gives_the_same_crc(tmp_path):
    data = random.Random(3).randbytes(1 << 20) + b"123456789"
    expected = crc32c(data)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert crc32c(mapped) == expected
        assert crc32c(memoryview(mapped)[-9:]) == CHECK
    assert crc32c(bytearray(data)) == expected
    assert crc32c(memoryview(data)) == expected
    assert crc32c(memoryview(data)[len(data) - 9:]) == CHECK
    assert crc32c(memoryview(data[: 1 << 20]).cast("I")) == crc32c(data[: 1 << 20])  # bytes, not items
    np = pytest.importorskip("numpy")
    array = np.frombuffer(data[: len(data) // 8 * 8], dtype=np.int64)
    assert crc32c(array) == crc32c(data[: len(data) // 8 * 8])


def test_a_strided_buffer_is_refused():
    with pytest.raises((BufferError, ValueError, TypeError)):
        crc32c(memoryview(b"abcdefgh")[::2])
    with pytest.raises(TypeError):
        crc32c("not bytes")
    with pytest.raises(TypeError):
        crc32c(b"x", -1)


def test_threads_compute_it_at_once():
    # The GIL is released while it runs: threads over one large buffer all get the same answer.
    data = random.Random(5).randbytes(8 << 20)
    expected = crc32c(data)
    results = []
    threads = [threading.Thread(target=lambda: results.append(crc32c(data))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4
