"""The chunk index file (index_writer, index_reader): round trips of every table shape (from bytes and
from files), columns stored narrow when they fit, and hostile files (truncated anywhere, header
lengths that lie, damaged bytes, and columns or objects that contradict each other with a valid
checksum) refused with a CheckpointFormatError naming the file, before anything large is allocated."""

from __future__ import annotations

import copy
import io
import os
import random
import struct

import pytest
import torch

import chunk_table_cases as T
from fastdcp.format import index_layout as L
from fastdcp.format.checksums import crc32c
from fastdcp.format.index_link import metadata_facts
from fastdcp.format.index_reader import ChunkIndex, read_chunk_index
from fastdcp.format.index_writer import write_chunk_index
from fastdcp.io.positional import ReadAhead, open_source
from fastdcp.format.chunk_table import ChunkTable, StorageColumns
from fastdcp.format.metadata import CheckpointFormatError

WHERE = "checkpoint chunk index '/ckpt/.metadata.index'"
FACTS = {"metadata_size": 123_456_789, "metadata_head_crc": 0xDEADBEEF, "metadata_tail_crc": 7}


def index_bytes(table: ChunkTable, **extras) -> bytes:
    extras = extras or T.extras()
    out = io.BytesIO()
    n = write_chunk_index(out, table, **extras, **FACTS)
    assert n == len(out.getvalue())
    return out.getvalue()


def assert_tables_equal(a: ChunkTable, b: ChunkTable) -> None:
    assert a.fqns == b.fqns and a.sizes == b.sizes and a.properties == b.properties
    for name in ("row_start", "offsets", "lengths"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), name
    assert (a.storage is None) == (b.storage is None)
    if a.storage is not None:
        assert a.storage.files == b.storage.files
        assert b.storage.file_index.dtype == torch.int32
        for name in ("file_index", "byte_offset", "byte_length", "checksums"):
            assert torch.equal(getattr(a.storage, name), getattr(b.storage, name)), name


@pytest.mark.parametrize("checksums", ["all", "none", "mixed", "rows"])
@pytest.mark.parametrize("seed", range(3))
def test_round_trip(seed, checksums, tmp_path):
    table = T.random_table(seed, checksums=checksums)
    data = index_bytes(table)
    path = tmp_path / "index"
    path.write_bytes(data)
    with open_source(path) as source:
        from_file = read_chunk_index(source, WHERE)
        read_ahead = read_chunk_index(ReadAhead(source, window=4096), WHERE)
    for got in (read_chunk_index(data, WHERE), read_chunk_index(bytearray(data), WHERE),
                read_chunk_index(memoryview(data), WHERE), from_file, read_ahead):
        assert isinstance(got, ChunkIndex)
        assert_tables_equal(table, got.table)
        want = T.extras()
        assert (got.planner_data, got.storage_meta, got.version) == (want["planner_data"], want["storage_meta"],
                                                                     want["version"])
        assert (got.metadata_size, got.metadata_head_crc, got.metadata_tail_crc) == tuple(FACTS.values())


def test_tables_without_storage_or_rows():
    nothing = torch.zeros(0, dtype=torch.int64)
    for table in (
        T.random_table(4, storage=False),
        ChunkTable([], [], [], torch.tensor([0]), torch.zeros(0, 1, dtype=torch.int64),
                   torch.zeros(0, 1, dtype=torch.int64)),
        ChunkTable([], [], [], torch.tensor([0]), torch.zeros(0, 1, dtype=torch.int64),
                   torch.zeros(0, 1, dtype=torch.int64),
                   StorageColumns([], nothing.to(torch.int32), nothing, nothing, nothing)),
    ):
        got = read_chunk_index(index_bytes(table, planner_data=None, storage_meta=None, version=None), WHERE)
        assert_tables_equal(table, got.table)
        assert (got.planner_data, got.storage_meta, got.version) == (None, None, None)


def test_columns_are_stored_as_int32_when_they_fit():
    table = T.sharded_table(ranks=16, entries=10, checksums=False)
    rows = table.rows
    narrow = len(index_bytes(table))
    assert narrow < rows * (2 + 2 + 1 + 1 + 1 + 1) * 4 + 4096  # every column at 4 bytes a value
    wide = copy.deepcopy(table)
    wide.storage.byte_offset[-1] = 1 << 40
    assert len(index_bytes(wide)) >= narrow + rows * 4
    assert_tables_equal(wide, read_chunk_index(index_bytes(wide), WHERE).table)


def test_metadata_facts(tmp_path):
    rng = random.Random(1)
    for size in (0, 10, L.EDGE_BYTES, L.EDGE_BYTES + 1, 3 * L.EDGE_BYTES + 5):
        data = bytes(rng.getrandbits(8) for _ in range(size))
        path = tmp_path / f"m{size}"
        path.write_bytes(data)
        with open_source(path) as source:
            got = metadata_facts(source)
        assert got == (size, crc32c(data[: L.EDGE_BYTES]), crc32c(data[-L.EDGE_BYTES:] if data else b""))
        assert metadata_facts(data) == got
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


# --------------------------------------------------------------------------- #
# hostile files
# --------------------------------------------------------------------------- #
def refused(data, *words: str) -> str:
    with pytest.raises(CheckpointFormatError) as info:
        read_chunk_index(data, WHERE)
    message = str(info.value)
    assert message.startswith(WHERE), message
    for word in words:
        assert word in message, message
    return message


def with_crc(data: bytes | bytearray) -> bytes:
    """``data`` with its trailer's CRC recomputed (what a deliberate forger would do)."""
    body = bytes(data[:-8])
    return body + L.TRAILER.pack(L.TRAILER_MAGIC, crc32c(body))


def test_truncated_anywhere(tmp_path):
    data = index_bytes(T.random_table(5))
    path = tmp_path / "index"
    cuts = sorted(set(range(0, len(data), max(1, len(data) // 60))) | {len(data) - 1, len(data) - 8, 127, 128})
    for cut in cuts:
        refused(data[:cut])
        path.write_bytes(data[:cut])
        with open_source(path) as source:
            refused(source)


def _patched(data: bytes, field: str, value) -> bytes:
    names = ["magic", "version", "header_size", "flags", "width", "entries", "rows", "metadata_size", "head_crc",
             "tail_crc", "element_sizes", "objects_offset", "objects_length"]
    fields = list(L.HEADER.unpack_from(data))
    fields[names.index(field)] = value
    return L.HEADER.pack(*fields) + data[L.HEADER.size:]


@pytest.mark.parametrize("field,value,words", [
    ("magic", b"NOTINDEX", ["not a fastdcp chunk index"]),
    ("version", 3, ["version 3"]),
    ("header_size", 64, ["unexpected header"]),
    ("flags", 6, ["unexpected header"]),
    ("width", 5000, ["width 5000"]),
    ("entries", 1 << 60, ["lie"]),
    ("rows", (1 << 64) - 1, ["lie"]),
    ("rows", 1, ["lie"]),
    ("objects_length", 1 << 40, ["lie"]),
    ("objects_offset", 0, ["lie"]),
    ("element_sizes", b"\x08\x08\x08\x08\x08\x08\x00\x00", ["element sizes"]),
    ("element_sizes", b"\x03\x08\x04\x08\x08\x08\x00\x00", ["element sizes"]),
])
def test_header_lengths_that_lie(field, value, words):
    data = index_bytes(T.random_table(6))
    refused(_patched(data, field, value), *words)  # damaged on disk: the header is checked first...
    refused(with_crc(_patched(data, field, value)), *words)  # ...as when forged with a valid CRC


def test_damaged_bytes_fail_the_checksum():
    data = index_bytes(T.random_table(7))
    rng = random.Random(2)
    for _ in range(50):
        damaged = bytearray(data)
        damaged[rng.randrange(L.HEADER_SIZE, len(data) - 8)] ^= 1 << rng.randrange(8)
        refused(bytes(damaged), "checksum mismatch")


def test_the_checksum_covers_the_header():
    data = index_bytes(T.random_table(7))
    refused(_patched(data, "metadata_size", 5), "checksum mismatch")
    refused(_patched(data, "head_crc", 5), "checksum mismatch")


def _forged(mutate) -> bytes:
    """An index of a table made inconsistent by ``mutate`` (write_chunk_index does not check)."""
    table = copy.deepcopy(T.random_table(8, entries=30, max_chunks=6, big=False))
    extras = T.extras()
    mutate(table, extras)
    return index_bytes(table, **extras)


def _tensor_entry(table: ChunkTable, min_ndim: int = 1) -> tuple[int, int]:
    for e, size in enumerate(table.sizes):
        first, end = int(table.row_start[e]), int(table.row_start[e + 1])
        if size is not None and len(size) >= min_ndim and end > first and min(size) > 0:
            return e, first
    raise AssertionError("no such entry")


def _bytes_entry(table: ChunkTable) -> int:
    return next(e for e, s in enumerate(table.sizes) if s is None)


def _set(table, name, row, value):
    getattr(table.storage, name)[row] = value


MUTATIONS = {
    "row_start not from 0": (lambda t, x: t.row_start.__setitem__(0, 1), ["row_start runs from 1"]),
    "row_start short of rows": (lambda t, x: t.row_start.__setitem__(-1, t.rows - 1), ["not from 0 to"]),
    "row_start decreasing": (lambda t, x: t.row_start.__setitem__(5, int(t.row_start[6]) + 1), ["decreases"]),
    "bytes entry with two rows": (
        lambda t, x: t.row_start.__setitem__(_bytes_entry(t) + 1, int(t.row_start[_bytes_entry(t) + 1]) + 1),
        ["must be 1"]),
    "file index too large": (lambda t, x: _set(t, "file_index", 3, len(t.storage.files)), ["file number"]),
    "file index negative": (lambda t, x: _set(t, "file_index", 3, -1), ["file number -1"]),
    "negative byte offset": (lambda t, x: _set(t, "byte_offset", 2, -5), ["invalid byte range"]),
    "negative byte length": (lambda t, x: _set(t, "byte_length", 2, -1), ["invalid byte range"]),
    "byte range past 2^62": (
        lambda t, x: (_set(t, "byte_offset", 2, 1 << 61), _set(t, "byte_length", 2, (1 << 61) + 1)),
        ["invalid byte range"]),
    "checksum of 33 bits": (lambda t, x: _set(t, "checksums", 4, 1 << 32), ["invalid checksum"]),
    "negative checksum": (lambda t, x: _set(t, "checksums", 4, -2), ["invalid checksum"]),
    "negative chunk offset": (lambda t, x: t.offsets.__setitem__(_tensor_entry(t)[1], -1), ["outside the tensor"]),
    "chunk past its tensor": (
        lambda t, x: t.lengths.__setitem__((_tensor_entry(t)[1], 0), t.sizes[_tensor_entry(t)[0]][0] + 1),
        ["outside the tensor"]),
    "a bytes row with a box": (lambda t, x: t.offsets.__setitem__((int(t.row_start[_bytes_entry(t)]), 0), 1),
                               ["outside the tensor"]),
    "values past ndim": (lambda t, x: t.lengths.__setitem__((_tensor_entry(t)[1], t.offsets.shape[1] - 1), 1)
                         if len(t.sizes[_tensor_entry(t)[0]]) < t.offsets.shape[1] else None, ["outside the tensor"]),
    "duplicate fqn": (lambda t, x: t.fqns.__setitem__(1, t.fqns[0]), ["listed twice"]),
    "fqn not a string": (lambda t, x: t.fqns.__setitem__(1, 5), ["not a string"]),
    "size without properties": (lambda t, x: t.properties.__setitem__(_tensor_entry(t)[0], None), ["properties"]),
    "negative size": (lambda t, x: t.sizes.__setitem__(_tensor_entry(t)[0], torch.Size([-1])), ["invalid size"]),
    "more dims than width": (lambda t, x: t.sizes.__setitem__(_tensor_entry(t)[0], torch.Size([9] * 7)),
                             ["dimensions, more than"]),
    "disallowed global": (lambda t, x: x.__setitem__("planner_data", os.getcwd), ["refusing to load disallowed"]),
    "storage_meta of another type": (lambda t, x: x.__setitem__("storage_meta", {"a": 1}), ["not StorageMeta"]),
    "version of another type": (lambda t, x: x.__setitem__("version", 3), ["not a string"]),
    "file name not a string": (lambda t, x: t.storage.files.__setitem__(0, b"f"), ["not a non-empty string"]),
}


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_inconsistent_contents_with_a_valid_checksum(case):
    mutate, words = MUTATIONS[case]
    refused(_forged(mutate), *words)


def test_the_forger_is_honest_without_a_mutation():
    data = _forged(lambda t, x: None)
    read_chunk_index(data, WHERE)  # the cases above fail because of their mutation only


def test_objects_pickle_is_checked():
    data = bytearray(index_bytes(T.random_table(9, entries=3)))
    (offset, length) = struct.unpack_from("<QQ", data, L.HEADER.size - 16)
    evil = b"\x80\x04cos\nsystem\n\x8c\x04echo\x85R."  # GLOBAL os.system, called
    data[offset : offset + length] = evil.ljust(length, b".")
    refused(with_crc(data), "refusing to load disallowed global os.system")
    data[offset : offset + length] = b"\x80\x04K\x05.".ljust(length, b".")  # an int, not the dict
    refused(with_crc(data), "objects section")


def test_allow_unsafe_reads_custom_planner_data():
    table = T.random_table(10, entries=4)
    data = index_bytes(table, planner_data=os.getcwd, storage_meta=None, version=None)
    refused(data, "disallowed global")
    assert read_chunk_index(data, WHERE, allow_unsafe=True).planner_data is os.getcwd
