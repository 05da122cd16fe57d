"""What the format's readers read from (fastdcp/format/sources.py): bytes in memory as a positional
source, short only at the end; anything with ``read_into`` taken as a source; ``read_exactly``
failing through the caller's error when the source ends first."""

from __future__ import annotations

import pytest

from fastdcp.format.sources import BufferSource, as_source, read_exactly


def test_a_buffer_source_reads_at_offsets_and_short_only_at_the_end():
    data = bytes(range(200))
    for given in (data, bytearray(data), memoryview(data)):
        source = as_source(given)
        assert isinstance(source, BufferSource) and source.size() == 200
        buf = bytearray(10)
        assert source.read_into(5, memoryview(buf)) == 10 and bytes(buf) == data[5:15]
        assert source.read_into(195, memoryview(buf)) == 5 and bytes(buf[:5]) == data[195:]
        assert source.read_into(200, memoryview(buf)) == 0 and source.read_into(300, memoryview(buf)) == 0
        source.close()


def test_a_source_is_taken_as_it_is():
    source = BufferSource(b"abc", "named")
    assert as_source(source) is source and source.name == "named"


def test_read_exactly_fails_through_the_callers_error():
    source = BufferSource(b"0123456789")
    assert read_exactly(source, 2, 5, ValueError) == bytearray(b"23456")
    assert read_exactly(source, 10, 0, ValueError) == bytearray()
    with pytest.raises(KeyError, match="needs bytes up to 14, the file ended at 10"):
        read_exactly(source, 8, 6, KeyError)
