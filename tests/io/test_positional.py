"""Positional sources (fastdcp/io/positional.py): a file read with pread through a descriptor the
source owns, counted; a source read ahead in windows, which a whole chunk index is read through;
the chunk index readers taking a source."""

from __future__ import annotations

import io
import os

import pytest

from fastdcp.format.index_link import metadata_facts
from fastdcp.format.index_reader import read_chunk_index
from fastdcp.format.index_sections import read_index_header
from fastdcp.format.index_writer import write_chunk_index
from fastdcp.format.sources import read_exactly
from fastdcp.io.positional import FileSource, ReadAhead, open_source


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
    assert read_exactly(source, 0, 30, ValueError) == b"old" * 10
    with pytest.raises(ValueError, match="truncated"):
        read_exactly(source, 20, 20, lambda problem: ValueError(problem))
    source.close()


def test_open_source_opens_a_path_and_closes_with_the_block(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    with open_source(path) as source:
        assert source.size() == 3 and source.name == str(path)
    assert source.fd is None
    with pytest.raises(FileNotFoundError):
        open_source(tmp_path / "missing")


def test_read_ahead_serves_small_reads_from_one_read_and_large_ones_directly(tmp_path):
    data = os.urandom(3 << 20)
    counted: list[int] = []
    source = _source(tmp_path / "f", data, counted)
    ahead = ReadAhead(source)
    buf = bytearray(7)
    assert ahead.read_into(10, memoryview(buf)[:5]) == 5 and bytes(buf[:5]) == data[10:15]
    assert ahead.read_into(15, memoryview(buf)) == 7 and bytes(buf) == data[15:22]
    assert counted == [1 << 20]  # both from one window
    big = bytearray(2 << 20)
    assert ahead.read_into(22, memoryview(big)) == len(big) and bytes(big) == data[22:22 + len(big)]
    assert counted == [1 << 20, len(big) - ((1 << 20) - 12)]  # the window's rest (it starts at 10), then straight in
    assert ahead.read_into(len(data) - 3, memoryview(buf)) == 3 and bytes(buf[:3]) == data[-3:]
    assert ahead.read_into(len(data), memoryview(buf)) == 0
    assert ahead.size() == len(data) and ahead.name == source.name
    ahead.close()
    assert source.size() == len(data)  # the source is not closed with it
    source.close()


def test_the_chunk_index_reads_the_same_through_a_source_as_from_bytes(tmp_path):
    import chunk_table_cases as T

    table = T.random_table(5, entries=12, max_chunks=4, big=False)
    table.storage.byte_length.clamp_(max=(1 << 31) - 1)
    out = io.BytesIO()
    write_chunk_index(out, table, **T.extras(), metadata_size=5, metadata_head_crc=6, metadata_tail_crc=7)
    source = _source(tmp_path / "index", out.getvalue())
    header = read_index_header(source, "test")
    assert header.metadata_size == 5
    streamed = read_chunk_index(ReadAhead(source), "test")
    whole = read_chunk_index(out.getvalue(), "test")
    assert streamed.table.fqns == whole.table.fqns
    assert bool((streamed.table.offsets == whole.table.offsets).all())
    assert bool((streamed.table.storage.byte_offset == whole.table.storage.byte_offset).all())
    source.close()


def test_metadata_facts_through_a_source_reuse_the_first_bytes(tmp_path):
    data = os.urandom(10_000)
    counted: list[int] = []
    source = _source(tmp_path / "md", data, counted)
    expected = metadata_facts(data, 4096)
    assert metadata_facts(source, 4096, data[:4096]) == expected
    assert counted == [4096]  # the tail only: the head edge came from the bytes given
    small = _source(tmp_path / "small", data[:3000], counted)
    counted.clear()
    assert metadata_facts(small, 4096, data[:3000]) == metadata_facts(data[:3000], 4096)
    assert counted == []  # a file the first read held whole: no read at all
    source.close()
    small.close()
