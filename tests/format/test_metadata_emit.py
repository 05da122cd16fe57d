"""``write_metadata``: a ``.metadata`` pickle emitted from a ChunkTable that stock ``pickle.load``,
the pure-Python unpickler, ``pickletools`` and fastdcp's restricted ``parse_metadata`` all read as
exactly the objects ``table_to_metadata`` builds (types, attribute order, index hints, checksums),
over many table shapes, with small blocks and frames (records and frames split everywhere), and
written as a stream."""

from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorProperties

import chunk_table_cases as T
from fastdcp.format import metadata_emit as ME
from fastdcp.format.chunk_index import find_chunk_index_name
from fastdcp.format.chunk_table import ChunkTable, StorageColumns, table_to_metadata
from fastdcp.format.metadata import CheckpointFormatError, parse_metadata
from fastdcp.format.metadata_emit import CHUNK_INDEX_ATTRIBUTE, write_metadata


def emit(table: ChunkTable, chunk_index_name: str | None = None, **extras) -> bytes:
    extras = extras or T.extras()
    out = io.BytesIO()
    n = write_metadata(out, table, chunk_index_name=chunk_index_name, **extras)
    data = out.getvalue()
    assert n == len(data)
    return data


def expected(table: ChunkTable, chunk_index_name: str | None = None, **extras) -> Metadata:
    extras = extras or T.extras()
    md = table_to_metadata(table, extras["planner_data"], extras["storage_meta"], extras["version"])
    if chunk_index_name is not None:  # the attribute comes first in the emitted state
        md.__dict__ = {CHUNK_INDEX_ATTRIBUTE: chunk_index_name, **md.__dict__}
    return md


def check_all_readers(data: bytes, want: Metadata) -> None:
    """Stock pickle (C and pure Python), pickletools (memo and stack bookkeeping) and the
    restricted parser read ``data`` as ``want`` (==), object for object what each of them reads
    from stock's own pickle of ``want`` (attribute order included: TensorProperties' comes from
    its ``__setstate__``)."""
    stock = pickle.dumps(want)
    loaders = [pickle.loads, pickle._loads]
    if want.storage_data is not None:
        loaders.append(lambda b: parse_metadata(b, "emitted"))
    else:  # not a loadable checkpoint: both refused alike
        messages = set()
        for b in (data, stock):
            with pytest.raises(CheckpointFormatError) as info:
                parse_metadata(b, "emitted")
            messages.add(str(info.value))
        assert messages == {"emitted: storage_data is a NoneType, not a dict"}
    for load in loaders:
        got = load(data)
        T.assert_same_objects(got, load(stock))
        assert got == want
    pickletools.dis(data, out=io.StringIO())  # raises on a wrong memo index or a stack left over
    opcodes = {op.name for op, _, _ in pickletools.genops(data)}
    assert not opcodes & {"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "GLOBAL", "INST", "OBJ"}


@pytest.mark.parametrize("checksums", ["all", "none", "mixed", "rows"])
@pytest.mark.parametrize("seed", range(4))
def test_the_emitted_pickle_is_the_objects_table_to_metadata_builds(seed, checksums):
    table = T.random_table(seed, checksums=checksums)
    check_all_readers(emit(table), expected(table))


def test_every_record_and_frame_boundary(monkeypatch):
    """Blocks of 3 rows and frames of 64 bytes: entries span blocks, segments change mid-entry
    (checksums present on every other row), every frame boundary falls between opcodes."""
    monkeypatch.setattr(ME, "_BLOCK_ROWS", 3)
    monkeypatch.setattr(ME, "_FRAME_BYTES", 64)
    for seed in range(3):
        table = T.random_table(100 + seed, checksums="rows", max_chunks=12)
        data = emit(table, "idx")
        check_all_readers(data, expected(table, "idx"))
        frames = [arg for op, arg, _ in pickletools.genops(data) if op.name == "FRAME"]
        assert len(frames) > 10


def test_shapes_one_by_one():
    """One entry per case: 0-d, 1..6-D, empty chunk lists, zero sizes, a bytes entry alone, values
    at the int opcodes' edges."""
    edges = [0, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 61) - 1]
    for ndim in range(7):
        for values in (edges, [0], [7]):
            size = torch.Size([(1 << 62) - 1] * ndim)
            rows = len(values)
            offsets = torch.tensor([[v] * ndim for v in values], dtype=torch.int64).view(rows, ndim)
            column = torch.tensor(values, dtype=torch.int64)
            table = ChunkTable(
                ["t"], [TensorProperties(dtype=torch.float16)], [size], torch.tensor([0, rows]),
                offsets if ndim else torch.zeros(rows, 1, dtype=torch.int64),
                torch.zeros_like(offsets) if ndim else torch.zeros(rows, 1, dtype=torch.int64),
                StorageColumns(["f"], torch.zeros(rows, dtype=torch.int32), column, torch.flip(column, [0]) // 2,
                               column.clamp(max=(1 << 32) - 1)),
            )
            check_all_readers(emit(table), expected(table))
    nothing = torch.zeros(0, dtype=torch.int64)
    empty = ChunkTable([], [], [], torch.tensor([0]), torch.zeros(0, 1, dtype=torch.int64),
                       torch.zeros(0, 1, dtype=torch.int64),
                       StorageColumns([], nothing.to(torch.int32), nothing, nothing, nothing))
    check_all_readers(emit(empty), expected(empty))
    no_storage = T.random_table(7, storage=False)
    check_all_readers(emit(no_storage), expected(no_storage))


def test_all_dtypes_and_property_variants():
    table = T.random_table(11, entries=3 * len(T.ALL_DTYPES), max_chunks=2)
    dtypes = {p.dtype for p in table.properties if p is not None}
    assert len(dtypes) > len(T.ALL_DTYPES) * 3 // 4
    check_all_readers(emit(table), expected(table))


def test_planner_data_storage_meta_and_version_of_any_form():
    table = T.random_table(3, entries=6)
    cyclic: list = ["x"]
    cyclic.append(cyclic)
    for extras in (
        {"planner_data": None, "storage_meta": None, "version": None},
        {"planner_data": cyclic, "storage_meta": StorageMeta(checkpoint_id=pathlib.PurePosixPath("/a/b")),
         "version": "2.0"},
    ):
        data = emit(table, **extras)
        got = pickle.loads(data)
        if extras["planner_data"] is cyclic:
            assert got.planner_data[1] is got.planner_data  # shared references survive
            extras = {**extras, "planner_data": None}
            got.planner_data = None
            T.assert_same_objects(got, pickle.loads(pickle.dumps(expected(table, **extras))))
            assert parse_metadata(data, "x").storage_meta == extras["storage_meta"]
        else:
            check_all_readers(data, expected(table, **extras))


def test_the_chunk_index_name_comes_first():
    table = T.random_table(5)
    for name in ("chunks.index", "索引_é.idx", "n" * 400):
        data = emit(table, name)
        got = pickle.loads(data)
        assert list(vars(got))[0] == CHUNK_INDEX_ATTRIBUTE and got.fastdcp_chunk_index == name
        assert got == expected(table)  # stock's == ignores the extra attribute
        assert find_chunk_index_name(data[:4096]) == name
        assert parse_metadata(data, "x").fastdcp_chunk_index == name
    plain = pickle.loads(emit(table))
    assert list(vars(plain)) == ["state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"]
    with pytest.raises(ValueError):
        emit(table, "")


def test_find_chunk_index_name_never_raises():
    table = T.random_table(6, entries=4)
    data = emit(table, "the.index")
    assert find_chunk_index_name(pickle.dumps(expected(table))) is None  # stock-written
    assert find_chunk_index_name(emit(table)) is None
    for cut in range(len(data[:200])):
        assert find_chunk_index_name(data[:cut]) in (None, "the.index")
    rng = random.Random(0)
    for _ in range(2000):
        head = bytearray(data[:200])
        for _ in range(rng.randint(1, 4)):
            head[rng.randrange(len(head))] = rng.randrange(256)
        name = find_chunk_index_name(bytes(head))
        assert name is None or isinstance(name, str)
    for junk in (b"", b"\x80", b"\x80\x04\x95", bytes(range(256)), b"\x80\x04" + b"\x8c\xff" * 3):
        assert find_chunk_index_name(junk) is None


class _CountingSink:
    def __init__(self) -> None:
        self.total = 0
        self.largest = 0
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        self.total += n
        self.largest = max(self.largest, n)
        self.parts.append(bytes(data))
        return n


def test_streams_in_bounded_writes(monkeypatch):
    """No write is larger than a frame's pending bytes plus one block of records (the output is
    never assembled in memory); the stream is written through ``write`` alone."""
    monkeypatch.setattr(ME, "_BLOCK_ROWS", 1024)
    monkeypatch.setattr(ME, "_FRAME_BYTES", 64 << 10)
    table = T.sharded_table(ranks=64, entries=200)
    sink = _CountingSink()
    n = write_metadata(sink, table, chunk_index_name="i", **T.extras())
    assert n == sink.total > 1 << 20
    assert sink.largest < (64 << 10) + 1024 * 200
    data = b"".join(sink.parts)
    check_all_readers(data, expected(table, "i"))


def test_smaller_than_stock_for_the_sharded_shape():
    table = T.sharded_table(ranks=128, entries=40)
    data = emit(table)
    stock = pickle.dumps(expected(table))
    assert len(data) < len(stock)
    check_all_readers(data, expected(table))
