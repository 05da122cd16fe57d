"""``TableMetadata`` (a Metadata backed by a chunk table) and the reader reading a checkpoint's
metadata from its chunk index: equal to stock's objects, pickled as stock's, lookups that build
only what is asked for; real checkpoints whose ``.metadata`` was replaced by the emitted one plus
an index load bit-exactly with FastFileSystemReader (from the index, building no per-chunk
object with FastLoadPlanner) and with stock FileSystemReader; an index that is damaged, names a
path outside the checkpoint, or does not match its ``.metadata`` is ignored with a warning."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import random
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

import chunk_table_cases as T
import dcp_cases as C
import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner
from fastdcp.format import table_metadata as TM
from fastdcp.format.index_link import metadata_facts
from fastdcp.format.index_writer import write_chunk_index
from fastdcp.format.chunk_table import ChunkTable, table_from_metadata, table_to_metadata
from fastdcp.format.metadata import CheckpointFormatError, parse_metadata
from fastdcp.format.metadata_emit import write_metadata
from fastdcp.format.table_metadata import TableMetadata, TableStorageData
from fastdcp.io.checkpoint_files import file_extents
from fastdcp.load import metadata_cache as MC

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

INDEX = ".metadata.index"


@pytest.fixture(autouse=True)
def _fresh_cache():
    MC.clear_metadata_cache()
    yield
    MC.clear_metadata_cache()


def _pair(seed: int = 0, **kw) -> tuple[TableMetadata, Metadata, ChunkTable]:
    table = T.random_table(seed, **kw)
    x = T.extras(seed)
    return (TableMetadata(table, x["planner_data"], x["storage_meta"], x["version"]),
            table_to_metadata(table, x["planner_data"], x["storage_meta"], x["version"]), table)


# --------------------------------------------------------------------------- #
# TableMetadata
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("seed", range(3))
def test_equal_to_stock_both_ways(seed):
    tm, stock, _ = _pair(seed)
    assert isinstance(tm, Metadata)
    assert tm == stock and stock == tm and not (tm != stock)
    other = copy.copy(stock)
    other.version = "other"
    assert tm != other and other != tm
    assert tm != "not metadata"


def test_pickles_as_a_stock_metadata():
    tm, stock, _ = _pair(1)
    tm.extra_attribute = 5
    data = pickle.dumps(tm)
    got = pickle.loads(data)
    assert type(got) is Metadata and got.extra_attribute == 5
    del got.extra_attribute
    T.assert_same_objects(got, pickle.loads(pickle.dumps(stock)))
    assert parse_metadata(data, "pickled TableMetadata") == stock


def test_lookups_build_only_what_is_asked_for():
    table = T.sharded_table(ranks=64, entries=30)
    tm = TableMetadata(table, None, None, "1.0.0")
    stock = table_to_metadata(table, None, None, "1.0.0").storage_data
    sd = tm.storage_data
    assert isinstance(sd, TableStorageData) and tm.storage_data is sd and len(sd) == len(stock)
    rng = random.Random(0)
    keys = rng.sample(list(stock), 300)
    for key in keys:
        for probe in (key, MetadataIndex(key.fqn, key.offset), MetadataIndex(key.fqn, key.offset, key.index + 3)):
            assert probe in sd
            T.assert_same_objects(sd[probe], stock[key])
    assert len(sd._built) == 300 and not sd.materialised and not tm.state_dict_metadata_built
    fqn = table.fqns[0]
    for missing in (MetadataIndex("nope", [0, 0]), MetadataIndex(fqn), MetadataIndex(fqn, [1, 0]),
                    MetadataIndex(fqn, [0]), MetadataIndex(fqn, [0, 0, 0])):
        assert missing not in sd and sd.get(missing) is None
        with pytest.raises(KeyError):
            sd[missing]
    assert not sd.materialised


@pytest.mark.parametrize("seed", range(3))
def test_iterating_gives_stock_dict(seed):
    tm, stock, _ = _pair(seed, checksums="rows")
    sd = tm.storage_data
    first = next(iter(stock.storage_data))
    sd[first]  # built before: the dict reuses it
    T.assert_same_objects(dict(sd.items()), stock.storage_data)
    assert sd.materialised and len(sd) == len(stock.storage_data) and sd == stock.storage_data
    assert not tm.state_dict_metadata_built
    T.assert_same_objects(tm.state_dict_metadata, stock.state_dict_metadata)
    for index in (MetadataIndex("x"), first):
        sd[index] = "changed"
        assert sd[index] == "changed"
    del sd[first]
    assert first not in sd and len(sd) == len(stock.storage_data)


def test_assignment_replaces_each_field_on_its_own():
    tm, stock, _ = _pair(2)
    tm.storage_data = {"a": 1}
    assert tm.storage_data == {"a": 1} and not tm.state_dict_metadata_built
    tm.state_dict_metadata = {}
    assert tm.state_dict_metadata == {} and tm.storage_data == {"a": 1}
    assert not tm.table_answers_storage()
    none = TableMetadata(T.random_table(3, storage=False))
    assert none.storage_data is None


def test_copies():
    tm, stock, table = _pair(4)
    tm.storage_data[next(iter(stock.storage_data))]
    shallow = copy.copy(tm)
    assert type(shallow) is TableMetadata and shallow.chunk_table is table and shallow.storage_data is tm.storage_data
    own = tm.copy_containers()
    assert own.chunk_table is table and own.storage_data is not tm.storage_data and own == stock
    own.storage_data[MetadataIndex("new")] = 1  # materialises and changes the copy only
    assert MetadataIndex("new") not in tm.storage_data and not tm.storage_data.materialised
    deep = copy.deepcopy(tm)
    assert deep.chunk_table is not table and deep == stock
    assert deep.chunk_table.offsets.data_ptr() != table.offsets.data_ptr()
    assert "TableMetadata(" in repr(tm) and "entries" in repr(tm)


def test_dataclasses_replace_gives_a_stock_metadata_with_the_same_fields():
    # torch 2.11's FileSystemWriter.finish: dataclasses.replace(metadata, version=...) (2.13 assigns)
    tm, stock, _ = _pair(6, checksums="rows")
    tm.storage_data[next(iter(stock.storage_data))]  # a half-built lookup view: a dict in the copy
    replaced = dataclasses.replace(tm, version="9.9")
    assert type(replaced) is Metadata and replaced.version == "9.9" and tm.version != "9.9"
    assert type(replaced.storage_data) is dict
    T.assert_same_objects(replaced.state_dict_metadata, stock.state_dict_metadata)
    T.assert_same_objects(replaced.storage_data, stock.storage_data)
    assert (replaced.planner_data, replaced.storage_meta) == (stock.planner_data, stock.storage_meta)
    assert type(dataclasses.replace(tm)) is Metadata and dataclasses.replace(tm) == tm


def test_entry_views_build_one_chunk_at_a_time():
    tm, stock, table = _pair(5, max_chunks=12)
    views = tm.entry_views()
    assert list(views) == list(stock.state_dict_metadata) and len(views) == len(stock.state_dict_metadata)
    for fqn, md in stock.state_dict_metadata.items():
        view = views[fqn]
        if isinstance(md, BytesStorageMetadata):
            assert type(view) is BytesStorageMetadata
            continue
        assert (view.properties, view.size, len(view.chunks)) == (md.properties, md.size, len(md.chunks))
        assert list(view.chunks) == md.chunks and view.chunks[-1:] == md.chunks[-1:]
    assert not tm.state_dict_metadata_built
    tm.state_dict_metadata  # once built, the views are the real dict
    assert tm.entry_views() is tm.state_dict_metadata


def test_columnar_file_extents_and_files():
    for seed in range(4):
        tm, stock, table = _pair(seed)
        want = file_extents(stock.storage_data)
        got = TM.table_file_extents(table)
        assert set(got) == set(want)
        for name, (end, key) in want.items():
            assert got[name][0] == end and got[name][1] == key and got[name][1].index == key.index
        used = {info.relative_path for info in stock.storage_data.values()}
        assert TM.referenced_files(table) == [f for f in table.storage.files if f in used]


# --------------------------------------------------------------------------- #
# Real checkpoints: .metadata replaced by the emitted one plus its chunk index
# --------------------------------------------------------------------------- #
def index_checkpoint(path, *, index_name: str = INDEX, table_edit=None) -> ChunkTable:
    """Replace ``path``'s .metadata by write_metadata's and write the chunk index beside it."""
    md = parse_metadata(open(os.path.join(path, ".metadata"), "rb").read(), "saved")
    table = table_from_metadata(md)
    assert table.storage is not None
    if table_edit is not None:
        table_edit(table)
    extras = {"planner_data": md.planner_data, "storage_meta": md.storage_meta, "version": md.version}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        write_metadata(f, table, chunk_index_name=index_name, **extras)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        size, head, tail = metadata_facts(f.read())
    with open(os.path.join(path, index_name), "wb") as f:
        write_chunk_index(f, table, metadata_size=size, metadata_head_crc=head, metadata_tail_crc=tail, **extras)
    return table


def _state() -> dict:
    sd = dict(C.zoo_tensors(3, large=False))
    sd.update(C.many_small_tensors(40, seed=3))
    sd["objects"] = {"step": 7, "name": "é", "blob": b"\x00" * 100}
    return sd


@pytest.fixture
def saved(tmp_path):
    state = _state()
    C.save(state, FastFileSystemWriter(tmp_path / "ckpt", thread_count=3))
    index_checkpoint(tmp_path / "ckpt")
    return state, tmp_path / "ckpt"


def _forbid_building(monkeypatch):
    """Make building stock's per-chunk objects from a table fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("built every chunk's objects")
    monkeypatch.setattr(TM, "build_state_dict_metadata", refuse)
    monkeypatch.setattr(TM, "build_storage_data", refuse)


def _load(path, state, reader, planner):
    dest = C.destination_for(C.deepcopy_state_dict(state))
    C.load(dest, reader, planner=planner)
    C.assert_same(dest, state, check_stride=False)
    return dest


def test_fast_reader_loads_from_the_index_without_building_chunks(saved, monkeypatch, caplog):
    state, path = saved
    _forbid_building(monkeypatch)
    reader = FastFileSystemReader(path)
    with caplog.at_level(logging.WARNING, logger="fastdcp"):
        _load(path, state, reader, FastLoadPlanner())
    md = reader._metadata_read
    assert isinstance(md, TableMetadata) and not md.state_dict_metadata_built
    assert not md.storage_data.materialised and not caplog.records
    assert reader.last_stats["blobs_recognised"] > 0  # KnownBlobs saw the entries through the views


def test_every_reader_and_planner_loads_bit_exactly(saved):
    state, path = saved
    for reader, planner in ((FastFileSystemReader(path), DefaultLoadPlanner()),
                            (FileSystemReader(path), DefaultLoadPlanner()),
                            (FileSystemReader(path), FastLoadPlanner())):
        _load(path, state, reader, planner)
    with fastdcp.open(path) as ckpt:  # the lazy reader parses the (stock-format) .metadata
        C.assert_same(ckpt["uneven"], state["uneven"])


def test_the_cache_hands_out_copies_of_the_table_metadata(saved):
    _, path = saved
    first = FastFileSystemReader(path).read_metadata()
    second = FastFileSystemReader(path).read_metadata()
    assert isinstance(first, TableMetadata) and first is not second
    assert first.chunk_table is second.chunk_table and first.storage_meta is not second.storage_meta
    first.storage_data[MetadataIndex("x")] = 1  # a caller's change stays in its copy
    assert not second.storage_data.materialised and MetadataIndex("x") not in second.storage_data
    (cached,) = MC.metadata_cache._entries.values()
    assert not cached.state_dict_metadata_built and not cached.storage_data.materialised
    assert MC._held_items(cached) < len(cached.chunk_table.fqns) + cached.chunk_table.rows


def test_unsafe_mode_reads_the_index_too(saved):
    state, path = saved
    reader = FastFileSystemReader(path, allow_unsafe_metadata=True)
    _load(path, state, reader, FastLoadPlanner())
    assert isinstance(reader._metadata_read, TableMetadata)


def _falls_back(path, state, caplog, *words):
    reader = FastFileSystemReader(path)
    with caplog.at_level(logging.DEBUG, logger="fastdcp"):
        _load(path, state, reader, FastLoadPlanner())
    assert type(reader._metadata_read) is Metadata
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for word in words:
        assert any(word in m for m in warned), warned
    return warned


def test_an_index_for_another_metadata_is_ignored(saved, caplog):
    state, path = saved
    with open(path / ".metadata", "ab") as f:
        f.write(b"\0")  # pickle ignores bytes after STOP; the size no longer matches
    _falls_back(path, state, caplog, "written for another .metadata")


def test_a_damaged_index_is_ignored(saved, caplog):
    state, path = saved
    data = bytearray((path / INDEX).read_bytes())
    data[len(data) // 2] ^= 0x40
    (path / INDEX).write_bytes(bytes(data))
    _falls_back(path, state, caplog, "damaged chunk index", "checksum mismatch")
    (path / INDEX).write_bytes(bytes(data[:1000]))
    MC.clear_metadata_cache()
    _falls_back(path, state, caplog, "damaged chunk index")


def test_a_missing_or_strange_index_is_ignored_quietly(saved, caplog):
    state, path = saved
    os.unlink(path / INDEX)
    assert _falls_back(path, state, caplog) == []
    os.mkfifo(path / INDEX)  # must not block
    MC.clear_metadata_cache()
    assert _falls_back(path, state, caplog) == []


def test_an_index_outside_the_checkpoint_is_ignored(tmp_path, caplog):
    state = _state()
    path = tmp_path / "ckpt"
    C.save(state, FastFileSystemWriter(path))
    index_checkpoint(path, index_name="../outside.index")
    assert (tmp_path / "outside.index").exists()
    _falls_back(path, state, caplog, "outside.index", "'..' component")


def test_a_stock_checkpoint_is_parsed(tmp_path, caplog):
    state = _state()
    C.save(state, dcp.FileSystemWriter(tmp_path))
    assert _falls_back(tmp_path, state, caplog) == []


def test_data_paths_and_extents_are_checked_from_the_columns(tmp_path):
    state = _state()
    path = tmp_path / "ckpt"
    C.save(state, FastFileSystemWriter(path))
    name = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]

    def escape(table):
        table.storage.files[0] = "../" + name
    shutil.copy(path / ".metadata", tmp_path / "saved.metadata")
    index_checkpoint(path, table_edit=escape)
    with pytest.raises(CheckpointFormatError, match=r"'\.\.' component"):
        FastFileSystemReader(path).read_metadata()
    shutil.copy(tmp_path / "saved.metadata", path / ".metadata")
    MC.clear_metadata_cache()
    index_checkpoint(path)
    size = os.path.getsize(path / name)
    with open(path / name, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(CheckpointException, match="is truncated"):
        _load(path, state, FastFileSystemReader(path), FastLoadPlanner())


# --------------------------------------------------------------------------- #
# Chunked tensors (2 gloo ranks, Shard(0) and Shard(1)) loaded whole from the index
# --------------------------------------------------------------------------- #
SHAPE = (37, 130)


def _full(name: str) -> torch.Tensor:
    return C.random_tensor(torch.bfloat16 if name == "s1" else torch.float32, SHAPE, ("table-md", name))


def _dtensor_worker(rank: int, store: str, root: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    with C.gloo_rank_mesh(rank, store) as mesh:
        state = {"s0": distribute_tensor(_full("s0"), mesh, [Shard(0)]),
                 "s1": distribute_tensor(_full("s1"), mesh, [Shard(1)]),
                 "plain": _full("plain")}
        dcp.save(state, storage_writer=FastFileSystemWriter(os.path.join(root, "ckpt")))


@pytest.mark.fastdcp_timeout(180)
def test_sharded_chunks_load_from_the_index(tmp_path, monkeypatch):
    mp.start_processes(_dtensor_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    path = tmp_path / "ckpt"
    table = index_checkpoint(path)
    assert table.rows >= 5 and len(table.storage.files) == 2
    state = {name: _full(name) for name in ("s0", "s1", "plain")}
    for reader, planner in ((FileSystemReader(path), DefaultLoadPlanner()),
                            (FastFileSystemReader(path), DefaultLoadPlanner())):
        _load(path, state, reader, planner)
    MC.clear_metadata_cache()
    _forbid_building(monkeypatch)
    reader = FastFileSystemReader(path)
    _load(path, state, reader, FastLoadPlanner())
    assert isinstance(reader._metadata_read, TableMetadata)
    assert len(reader._metadata_read.storage_data._built) == table.rows  # each stored chunk once
