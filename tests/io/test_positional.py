"""Positional sources (fastdcp/io/positional.py): a file read with pread through a descriptor the
source owns, counted; a source as a buffered stream that a whole chunk index is read from; the
chunk index readers taking a source where they took a descriptor."""

from __future__ import annotations

import io
import os

import pytest

from fastdcp.format import chunk_index as CI
from fastdcp.io.positional import FileSource, source_stream


def _source(path, data: bytes, counted: list[int] | None = None) -> FileSource:
    path.write_bytes(data)
    return FileSource(os.open(path, os.O_RDONLY), str(path), None if counted is None else counted.append)


def test_a_file_source_reads_at_offsets_short_only_at_the_end_and_counts(tmp_path):
    data = bytes(range(256)) * 40
    counted: list[int] = []
    source = _source(tmp_path / "f", data, counted)
    buf = bytearray(100)
    assert source.read_into(5000, memoryview(buf)) == 100 and bytes(buf) == data[5000:5100]
    assert source.read_into(len(data) - 30, memoryview(buf)) == 30 and bytes(buf[:30]) == data[-30:]
    assert source.read_into(len(data), memoryview(buf)) == 0
    assert source.size() == len(data) and counted == [100, 30, 0]
    source.close()
    with pytest.raises(ValueError, match="was closed"):
        source.size()


def test_a_file_source_keeps_reading_the_file_it_opened(tmp_path):
    path = tmp_path / "f"
    source = _source(path, b"old" * 10)
    path.unlink()
    path.write_bytes(b"new" * 20)  # replaced: the descriptor still reads the old file
    assert CI.pread_exactly(source, 0, 30, ValueError) == b"old" * 10
    with pytest.raises(ValueError, match="truncated"):
        CI.pread_exactly(source, 20, 20, lambda problem: ValueError(problem))
    source.close()


def test_a_source_stream_reads_seeks_and_serves_small_reads_from_one_read(tmp_path):
    data = os.urandom(3 << 20)
    counted: list[int] = []
    source = _source(tmp_path / "f", data, counted)
    with source_stream(source, start=10) as f:
        assert f.tell() == 10 and f.read(5) == data[10:15] and f.read(7) == data[15:22]
        assert len(counted) == 1  # both from the stream's buffer
        big = bytearray(2 << 20)
        assert f.readinto(big) == len(big) and bytes(big) == data[22:22 + len(big)]
        assert f.seek(0, io.SEEK_END) == len(data) and f.read(1) == b""
        f.seek(len(data) - 3)
        assert f.read() == data[-3:]
    assert source.size() == len(data)  # the stream does not close its source
    source.close()


def test_the_chunk_index_reads_the_same_through_a_source_as_from_bytes(tmp_path):
    import chunk_table_cases as T

    table = T.random_table(5, entries=12, max_chunks=4, big=False)
    table.storage.byte_length.clamp_(max=(1 << 31) - 1)
    out = io.BytesIO()
    CI.write_chunk_index(out, table, **T.extras(), metadata_size=5, metadata_head_crc=6, metadata_tail_crc=7)
    source = _source(tmp_path / "index", out.getvalue())
    header = CI.read_index_header(source, "test")
    assert header.metadata_size == 5
    with source_stream(source) as f:
        streamed = CI.read_chunk_index(f, "test")
    whole = CI.read_chunk_index(out.getvalue(), "test")
    assert streamed.table.fqns == whole.table.fqns
    assert bool((streamed.table.offsets == whole.table.offsets).all())
    assert bool((streamed.table.storage.byte_offset == whole.table.storage.byte_offset).all())
    source.close()


def test_metadata_facts_through_a_source_reuse_the_first_bytes(tmp_path):
    data = os.urandom(10_000)
    counted: list[int] = []
    source = _source(tmp_path / "md", data, counted)
    expected = CI.metadata_facts(io.BytesIO(data), 4096)
    assert CI.source_metadata_facts(source, 4096, data[:4096]) == expected
    assert counted == [4096]  # the tail only: the head edge came from the bytes given
    small = _source(tmp_path / "small", data[:3000], counted)
    counted.clear()
    assert CI.source_metadata_facts(small, 4096, data[:3000]) == CI.metadata_facts(io.BytesIO(data[:3000]), 4096)
    assert counted == []  # a file the first read held whole: no read at all
    source.close()
    small.close()
