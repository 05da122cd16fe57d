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
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import chunk_table_cases as T
from fastdcp.format import metadata_emit as ME
from fastdcp.format import metadata_records as MR
from fastdcp.format import pickle_stream as PS
from fastdcp.format.index_link import find_chunk_index_name
from fastdcp.format.chunk_table import NO_CHECKSUM, ChunkTable, StorageColumns, table_to_metadata
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


# --------------------------------------------------------------------------- #
# shared objects: many small tensors
# --------------------------------------------------------------------------- #
SMALL_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]


def small_tensors_table(n: int, *, mixed: bool = False, seed: int = 0) -> ChunkTable:
    """What FastSavePlanner saves for ``n`` small tensors (like ``dcp_cases.many_small_tensors``):
    one whole-tensor chunk each, all in one file, with checksums; ``mixed``: weights (2-D), biases
    (1-D), scalars (0-D) and now and then a bytes entry, in turn. Each entry has its own (equal)
    TensorProperties object, as stock's planner makes them."""
    g = torch.Generator().manual_seed(seed)
    fqns, props, sizes = [], [], []
    for i in range(n):
        kind = i % 4 if mixed else 0
        if kind == 3 and i % 20 == 3:
            fqns.append(f"extra.{i}")
            props.append(None)
            sizes.append(None)
            continue
        fqns.append(f"layer{i:05d}.{'wbs'[min(kind, 2)]}")
        props.append(TensorProperties(dtype=SMALL_DTYPES[i % len(SMALL_DTYPES)]))
        shape = [(1 + i % 5, 3 + i % 7), (3 + i % 7,), (), (2 + i % 3, 5)][kind]
        sizes.append(torch.Size(shape))
    width = 2
    lengths = torch.tensor([list(s) + [0] * (width - len(s)) if s is not None else [0] * width for s in sizes],
                           dtype=torch.int64).view(n, width)
    nbytes = lengths.clamp(min=1).prod(1) * 4 + 64
    return ChunkTable(fqns, props, sizes, torch.arange(n + 1, dtype=torch.int64),
                      torch.zeros(n, width, dtype=torch.int64), lengths,
                      StorageColumns(["__0_0.distcp"], torch.zeros(n, dtype=torch.int32), nbytes.cumsum(0) - nbytes,
                                     nbytes, torch.randint(0, 1 << 32, (n,), generator=g)))


def shared_like_the_planner(md: Metadata) -> Metadata:
    """``md`` with its equal objects shared the way FastSavePlanner's items share them (one
    TensorProperties per distinct value, one Size per shape, one zero-offsets Size per ndim, one
    ChunkStorageMetadata per whole-tensor shape): what stock's pickler memoises in a plan."""
    props: dict = {}
    sizes: dict = {}
    zeros: dict = {}
    whole: dict = {}
    for tsm in md.state_dict_metadata.values():
        if not isinstance(tsm, TensorStorageMetadata):
            continue
        p = tsm.properties
        tsm.properties = props.setdefault((p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory), p)
        tsm.size = sizes.setdefault(tuple(tsm.size), tsm.size)
        for i, chunk in enumerate(tsm.chunks):
            if tuple(chunk.sizes) == tuple(tsm.size) and not any(chunk.offsets):
                zero = zeros.setdefault(len(tsm.size), chunk.offsets)
                tsm.chunks[i] = whole.setdefault(tuple(tsm.size), ChunkStorageMetadata(zero, tsm.size))
    storage = {}
    for index, info in md.storage_data.items():
        offset = index.offset
        if offset is not None and not any(offset):
            offset = zeros.setdefault(len(offset), offset)
        storage[MetadataIndex(index.fqn, offset, index.index)] = info
    md.storage_data = storage
    return md


def planner_extras(table: ChunkTable) -> dict:
    """planner_data as a planner makes it, {fqn: object path}, with the table's fqn objects as
    keys and a path component shared by every path."""
    prefix = "model"
    return {**T.extras(), "planner_data": {fqn: (prefix, fqn) for fqn in table.fqns}}


@pytest.mark.parametrize("n", [200, 3000])
@pytest.mark.parametrize("mixed", [False, True])
def test_many_small_entries_are_smaller_than_stock(n, mixed):
    """Many single-chunk entries: smaller than stock's pickle of the same objects, even when
    those share what a plan shares (stock's pickler then writes each shared object once)."""
    table = small_tensors_table(n, mixed=mixed)
    extras = planner_extras(table)
    data = emit(table, "idx", **extras)
    want = expected(table, "idx", **extras)
    stock = pickle.dumps(want)
    stock_shared = pickle.dumps(shared_like_the_planner(expected(table, "idx", **extras)))
    assert len(stock_shared) < len(stock)
    assert len(data) < 0.85 * len(stock_shared)
    if n == 200:
        check_all_readers(data, want)
    else:
        assert pickle.loads(data) == want


def test_equal_objects_are_shared_and_chunks_of_big_entries_are_not():
    """Equal TensorProperties are one object; a repeated size is one Size; a single whole-tensor
    chunk's sizes are its tensor's Size and its offsets (and its storage key's) the zero Size of
    its ndim; planner_data's keys are the fqn strings of state_dict_metadata. Chunks of an entry
    with many chunks share nothing, and the memo grows per entry, not per chunk."""
    small = small_tensors_table(60, mixed=True)
    sharded = T.sharded_table(ranks=300, entries=4)
    table = ChunkTable(
        small.fqns + sharded.fqns, small.properties + sharded.properties, small.sizes + sharded.sizes,
        torch.cat([small.row_start, sharded.row_start[1:] + small.rows]),
        torch.cat([small.offsets, sharded.offsets]), torch.cat([small.lengths, sharded.lengths]),
        StorageColumns(small.storage.files + sharded.storage.files,
                       torch.cat([small.storage.file_index, sharded.storage.file_index + 1]),
                       *(torch.cat([getattr(small.storage, c), getattr(sharded.storage, c)])
                         for c in ("byte_offset", "byte_length", "checksums"))),
    )
    extras = planner_extras(table)
    data = emit(table, **extras)
    check_all_readers(data, expected(table, **extras))
    got = pickle.loads(data)
    tensors = {fqn: m for fqn, m in got.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    by_props: dict = {}
    by_size: dict = {}
    for m in tensors.values():
        p = m.properties
        by_props.setdefault((p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory), set()).add(id(p))
        by_size.setdefault(tuple(m.size), set()).add(id(m.size))
    assert all(len(ids) == 1 for ids in by_props.values()) and len(by_props) == len(SMALL_DTYPES)
    assert all(len(ids) == 1 for ids in by_size.values())
    zeros: dict = {}
    keys = {(k.fqn, k.index): k for k in got.storage_data}
    for fqn, m in tensors.items():
        if len(m.chunks) == 1:
            (chunk,) = m.chunks
            assert chunk.sizes is m.size
            assert chunk.offsets is zeros.setdefault(len(m.size), chunk.offsets)
            assert keys[(fqn, 0)].offset is chunk.offsets
        else:
            assert len(m.chunks) == 300
            objects = [id(o) for c in m.chunks for o in (c.offsets, c.sizes)] + [id(m.size)]
            assert len(set(objects)) == len(objects)
    assert {len(z) for z in zeros.values()} == {0, 1, 2}
    assert all(key is fqn for key, fqn in zip(got.planner_data, got.state_dict_metadata))
    memoised = sum(op.name == "MEMOIZE" for op, _, _ in pickletools.genops(data))  # fqn, size, planner_data tuple
    assert memoised < 3 * len(table.fqns) + len(table.storage.files) + 100 < table.rows


def shared_parts_table(seed: int, entries: int = 120) -> ChunkTable:
    """Entries of every chunk pattern the sharing rules tell apart: single whole-tensor chunks,
    single chunks with zero offsets but partial sizes, single chunks at an offset, entries split
    in 2..30 chunks (zero offsets first), entries without chunks, 0-D entries, zero-size tensors,
    bytes entries; 0..4 dimensions; TensorProperties equal and not, shared objects and not;
    checksums on some rows; junk in the columns past each entry's ndim (ignored by the format)."""
    rng = random.Random(seed)
    shared_props = [TensorProperties(dtype=d) for d in SMALL_DTYPES]
    fqns, props, sizes, boxes = [], [], [], []
    for i in range(entries):
        fqns.append(f"e{i}")
        pattern = rng.choice(["whole", "whole", "whole", "zero_partial", "at_offset", "split", "none", "bytes"])
        if pattern == "bytes":
            props.append(None)
            sizes.append(None)
            boxes.append([((), ())])
            continue
        ndim = rng.choice([0, 1, 2, 2, 3, 4])
        size = [rng.choice([0, 1, 3, 4, 300]) if rng.random() < 0.2 else rng.randint(1, 6) for _ in range(ndim)]
        sizes.append(torch.Size(size))
        r = rng.random()
        props.append(rng.choice(shared_props) if r < 0.4 else TensorProperties(
            dtype=rng.choice(SMALL_DTYPES), requires_grad=r > 0.8, pin_memory=0.7 < r < 0.9))
        zero = tuple([0] * ndim)
        if pattern == "whole" or ndim == 0:
            boxes.append([(zero, tuple(size))])
        elif pattern == "zero_partial":
            boxes.append([(zero, tuple(max(0, d - 1) for d in size))])
        elif pattern == "at_offset":
            off = tuple(min(1, d) for d in size)
            boxes.append([(off, tuple(d - o for d, o in zip(size, off)))])
        elif pattern == "split":
            k = rng.randint(2, 30)
            boxes.append([((j,) + zero[1:], (1,) + tuple(size[1:])) for j in range(k)])
            sizes[-1] = torch.Size([k] + size[1:])
        else:
            boxes.append([])
    rows = sum(len(b) for b in boxes)
    width = 5
    offsets = torch.randint(-9, 1 << 40, (rows, width), dtype=torch.int64)  # junk past each ndim
    lengths = torch.randint(-9, 1 << 40, (rows, width), dtype=torch.int64)
    r = 0
    row_start = [0]
    for chunks in boxes:
        for off, length in chunks:
            offsets[r, : len(off)] = torch.tensor(off, dtype=torch.int64)
            lengths[r, : len(length)] = torch.tensor(length, dtype=torch.int64)
            r += 1
        row_start.append(r)
    checksums = torch.tensor([rng.getrandbits(32) if rng.random() < 0.7 else NO_CHECKSUM for _ in range(rows)],
                             dtype=torch.int64)
    return ChunkTable(fqns, props, sizes, torch.tensor(row_start, dtype=torch.int64), offsets, lengths,
                      StorageColumns(["a.distcp", "b.distcp"], torch.randint(0, 2, (rows,), dtype=torch.int32),
                                     torch.randint(0, 1 << 33, (rows,)), torch.randint(0, 1 << 20, (rows,)),
                                     checksums))


@pytest.mark.parametrize("few_rows", [1, 4, 16])
@pytest.mark.parametrize("block_rows", [3, 7, 1 << 16])
def test_shared_parts_over_every_window_shape(monkeypatch, few_rows, block_rows):
    """Every chunk pattern, with sharing for entries of up to 1, 4 or 16 chunks, in windows of 3,
    7 or 65536 rows: row shapes change inside windows (groups as spans with holes and as
    gathers), entries straddle windows; the result is stock's objects. The 4-way shards share
    their first chunk's zero offsets when ``few_rows`` >= 4: the other rows' group then spans
    those rows."""
    monkeypatch.setattr(ME, "_FEW_ROWS", few_rows)
    monkeypatch.setattr(ME, "_BLOCK_ROWS", block_rows)
    for table in (shared_parts_table(0), shared_parts_table(1), T.sharded_table(ranks=4, entries=30)):
        extras = planner_extras(table)
        check_all_readers(emit(table, "i", **extras), expected(table, "i", **extras))


def _mark_zero_offsets_whole(codes):
    """Mutation: a chunk with zero offsets is taken for a whole-tensor chunk."""
    def wrong(self, start, end, *, storage):
        c = codes(self, start, end, storage=storage)
        if storage or isinstance(c, int):
            return c
        return torch.where((c & MR.ZERO) != 0, c | MR.WHOLE, c)
    return wrong


def _properties_by_dtype(push):
    """Mutation: TensorProperties told apart by their dtype alone."""
    seen: dict = {}

    def wrong(self, props):
        return push(self, seen.setdefault(props.dtype, props))
    return wrong


def _sizes_by_ndim(push):
    """Mutation: torch.Size values told apart by their length alone."""
    def wrong(self, key, memoise=True):
        first = next((k for k in self.sizes if len(k) == len(key)), key)
        return push(self, first, memoise)
    return wrong


def _memo_one_short(pickled):
    """Mutation: the pickler's memo lags the stream's by one entry."""
    def wrong(self, obj):
        self.memo_objects.append(None)
        try:
            return pickled(self, obj)
        finally:
            self.memo_objects.pop()
    return wrong


@pytest.mark.parametrize("mutation", ["zero_is_whole", "props_by_dtype", "sizes_by_ndim", "memo_one_short"])
def test_wrong_sharing_is_caught(monkeypatch, mutation):
    """The checks above fail on an emitter that shares what is not equal (so the tables do
    exercise each rule, and equality is checked object by object)."""
    target, make = {
        "zero_is_whole": ((MR.WindowRows, "codes"), _mark_zero_offsets_whole),
        "props_by_dtype": ((ME._Shared, "push_properties"), _properties_by_dtype),
        "sizes_by_ndim": ((ME._Shared, "push_size"), _sizes_by_ndim),
        "memo_one_short": ((PS.PickleStream, "pickled"), _memo_one_short),
    }[mutation]
    monkeypatch.setattr(*target, make(getattr(*target)))
    table = shared_parts_table(0)
    extras = planner_extras(table)
    with pytest.raises((AssertionError, pickle.UnpicklingError)):
        check_all_readers(emit(table, **extras), expected(table, **extras))
