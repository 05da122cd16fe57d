"""FastLoadPlanner's read plan from a checkpoint's chunk table equals stock's, item for item.

Every test builds stock ``Metadata`` (from stock's own save planning, or directly), attaches its
``ChunkTable`` to a copy whose ``state_dict_metadata`` raises on access, and compares the
``ReadItem`` lists (every field, index hints included, in order) and the errors of
``FastLoadPlanner`` on that copy with stock ``DefaultLoadPlanner``'s on the plain ``Metadata``.

DTensor destinations of rank r of N are planned in this one process with torch's "fake" process
group backend (``FakeStore``): one process group per rank, destroyed before the next.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint import planner_helpers
from torch.testing._internal.distributed.fake_pg import FakeStore

import dcp_cases as C
from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner, FastSavePlanner
from fastdcp.format.chunk_table import table_from_metadata
from fastdcp.planners import read_items as RI


class TableOnlyMetadata(Metadata):
    """A ``Metadata`` whose ``state_dict_metadata`` must not be read: what a reader that builds
    those objects only on demand stands for. Carries ``chunk_table``."""

    def __getattribute__(self, name):
        if name == "state_dict_metadata":
            raise AssertionError("the table path read state_dict_metadata")
        return super().__getattribute__(name)


def table_only(md: Metadata) -> TableOnlyMetadata:
    table = table_from_metadata(md)
    out = TableOnlyMetadata(state_dict_metadata={}, planner_data=md.planner_data)
    out.chunk_table = table
    return out


def item_fields(item) -> tuple:
    """Every field of a ReadItem, with the index hints MetadataIndex equality ignores."""
    return (item.type, item.dest_index.fqn, item.dest_index.offset, item.dest_index.index, item.dest_offsets,
            item.storage_index.fqn, item.storage_index.offset, item.storage_index.index, item.storage_offsets,
            item.lengths)


def stock_outcome(sd, md: Metadata, **kw):
    """Stock DefaultLoadPlanner's plan, or for a flat state dict of custom leaves stock's plan
    function itself (stock's set_up_planner replaces leaves it does not know with None)."""
    try:
        if any(isinstance(v, Boxes) for v in sd.values()):
            plan = create_default_local_load_plan(sd, md, not kw.get("allow_partial_load", False))
        else:
            planner = DefaultLoadPlanner(**kw)
            planner.set_up_planner(sd, md, False)
            plan = planner.create_local_plan()
        return [item_fields(i) for i in plan.items]
    except Exception as e:  # noqa: BLE001 - the error itself is the outcome
        return (type(e), str(e))


def fast_outcome(sd, md: TableOnlyMetadata, **kw):
    planner = FastLoadPlanner(cache_plans=False, **kw)
    planner.set_up_planner(sd, md, False)
    try:
        return [item_fields(i) for i in planner.create_local_plan().items]
    except Exception as e:  # noqa: BLE001
        return (type(e), str(e))


# Stock's order of a tensor's read items: since 2.11 a sweep over the chunks sorted along the longest
# dimension (fastdcp's order); up to 2.9 every (local chunk, stored chunk) pair in index order. The
# items are the same; the order decides nothing in a load. Where stock does not sweep, plans are
# compared as multisets of items.
STOCK_SWEEPS = "sweep" in inspect.getsource(planner_helpers.create_read_items_for_chunk_list)


def assert_plans_equal(got, expected) -> None:
    if STOCK_SWEEPS or not isinstance(expected, list) or not isinstance(got, list):
        assert got == expected
    else:
        assert sorted(got, key=repr) == sorted(expected, key=repr)


def assert_same_plan(sd, md: Metadata, **kw) -> list:
    expected = stock_outcome(sd, md, **kw)
    got = fast_outcome(sd, table_only(md), **kw)
    assert_plans_equal(got, expected)
    return expected


# --------------------------------------------------------------------------- #
# random chunk layouts against stock's sweep (no process group needed)
# --------------------------------------------------------------------------- #
class Boxes:
    """A destination with the chunk list it names (stock asks ``__create_chunk_list__``)."""

    def __init__(self, size, chunks):
        self._size = torch.Size(size)
        self.chunks = chunks

    def size(self):
        return self._size

    def __create_chunk_list__(self):
        return self.chunks


def _split(n: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))  # repeated cuts: empty chunks
    bounds = [0, *cuts, n]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(parts)]


def _tiling(shape, rng: random.Random) -> list[ChunkStorageMetadata]:
    per_dim = [_split(n, rng.randint(1, 4), rng) for n in shape]
    return [ChunkStorageMetadata(torch.Size([p[0] for p in c]), torch.Size([p[1] for p in c]))
            for c in itertools.product(*per_dim)]


def _random_box(shape, rng: random.Random) -> ChunkStorageMetadata:
    offsets, sizes = [], []
    for n in shape:
        a = rng.randint(0, n)
        offsets.append(a)
        sizes.append(rng.randint(a, n) - a)
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


_PROPS = TensorProperties(dtype=torch.float32)


def _random_case(seed: int) -> tuple[dict, Metadata]:
    """Saved tensors of 0-3 dimensions tiled into 1-4 chunks per dimension (empty ones included),
    in row-major order, shuffled, or with extra overlapping chunks; destinations asking for random
    boxes (overlapping, empty, several per tensor) or a tiling of their own; objects."""
    rng = random.Random(seed)
    saved: dict = {}
    sd: dict = {}
    for t in range(rng.randint(1, 6)):
        shape = [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
        chunks = _tiling(shape, rng)
        if rng.random() < 0.4:
            rng.shuffle(chunks)
        if rng.random() < 0.2:
            chunks += [_random_box(shape, rng) for _ in range(2)]
        saved[f"t{t}"] = TensorStorageMetadata(_PROPS, torch.Size(shape), chunks)
        local = ([_random_box(shape, rng) for _ in range(rng.randint(0, 3))] if rng.random() < 0.7
                 else _tiling(shape, rng))
        sd[f"t{t}"] = Boxes(shape, local)
    saved["obj"] = BytesStorageMetadata()
    sd["obj"] = ("some", "object")
    keys = list(sd)
    rng.shuffle(keys)
    return {k: sd[k] for k in keys}, Metadata(saved)


@pytest.mark.parametrize("block", range(8))
def test_random_layouts_plan_like_stock(block):
    sorted_entries = unsorted_entries = 0
    for seed in range(block * 50, block * 50 + 50):
        sd, md = _random_case(seed)
        assert_same_plan(sd, md)
        index = RI.read_index(table_from_metadata(md))
        sorted_entries += sum(d >= 0 for d in index.bisect_dim)
        unsorted_entries += sum(d < 0 and bool(n) for d, n in zip(index.bisect_dim, index.max_end))
    assert sorted_entries and unsorted_entries  # both the bisection and the fallback ran


def test_thousands_of_chunks_per_tensor_plan_like_stock():
    """Shard(0)-style saves of many chunks, read whole, as one shard of another split, and as
    boxes cutting across chunks; one entry's chunks reversed (not sorted: the fallback)."""
    rng = random.Random(7)
    saved, sd = {}, {}
    for name, shape, parts in (("a", (1000, 6), 1000), ("b", (3001,), 128), ("c", (64, 64, 3), 64)):
        chunks = []
        step = -(-shape[0] // parts)
        for p in range(parts):
            start = min(p * step, shape[0])
            length = max(0, min(step, shape[0] - start))
            chunks.append(ChunkStorageMetadata(torch.Size([start, *[0] * (len(shape) - 1)]),
                                               torch.Size([length, *shape[1:]])))
        saved[name] = TensorStorageMetadata(_PROPS, torch.Size(shape), chunks)
        saved[name + "_reversed"] = TensorStorageMetadata(_PROPS, torch.Size(shape), chunks[::-1])
        for suffix in ("", "_reversed"):
            sd[name + suffix] = Boxes(shape, [_random_box(shape, rng) for _ in range(3)]
                                      + [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])
    md = Metadata(saved)
    expected = assert_same_plan(sd, md)
    assert len(expected) > 1000
    bisect = RI.read_index(table_from_metadata(md)).bisect_dim
    assert [d >= 0 for d in bisect] == [True, False] * 3


# --------------------------------------------------------------------------- #
# DTensor / ShardedTensor destinations, saved by stock's own planning
# --------------------------------------------------------------------------- #
SHAPES = {"w": (13, 7), "v": (5,), "cube": (3, 4, 6), "wide": (4, 11)}


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _placements(names):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if n == "R" else Shard(int(n[1:])) for n in names]


def dtensor_state_dict(mesh_shape, placement_names, rank: int, *, extras: bool = True) -> dict:
    """This rank's DTensors of SHAPES (placements that name a dimension a tensor lacks shard
    along dim 0 instead), plus a plain tensor, a 0-d tensor and an object."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    sd: dict = {}
    for name, shape in SHAPES.items():
        names = [n if n == "R" or int(n[1:]) < len(shape) else "S0" for n in placement_names]
        placements = _placements(names)
        local_shape, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
        full = torch.empty(shape)
        sd[name] = DTensor.from_local(torch.empty(local_shape), mesh, placements, run_check=False,
                                      shape=full.shape, stride=full.stride())
    if extras:
        sd["plain"] = torch.empty(6, 2)
        sd["scalar"] = torch.empty(())
        sd["meta"] = {"epoch": 3, "tag": "x"}
    return sd


def saved_metadata(mesh_shape, placement_names) -> Metadata:
    """The ``Metadata`` stock's save planning makes for dtensor_state_dict on every rank."""
    world = 1
    for n in mesh_shape:
        world *= n
    plans = []
    for rank in range(world):
        with fake_rank(rank, world):
            planner = DefaultSavePlanner()
            planner.set_up_planner(dtensor_state_dict(mesh_shape, placement_names, rank), is_coordinator=rank == 0)
            plans.append(planner.create_local_plan())
    _, md = DefaultSavePlanner().create_global_plan(plans)
    return md


SAVED_LAYOUTS = {
    "single": ((1,), ["R"]),
    "S0x4": ((4,), ["S0"]),
    "S1x4": ((4,), ["S1"]),
    "S0x8-empty-shards": ((8,), ["S0"]),
    "2d-S0-S1": ((2, 2), ["S0", "S1"]),
    "2d-S1-S0": ((2, 2), ["S1", "S0"]),  # chunks sorted along dim 1 only
    "2d-R-S0": ((2, 3), ["R", "S0"]),
}

LOAD_LAYOUTS = {
    "S0x3": ((3,), ["S0"]),
    "S1x2": ((2,), ["S1"]),
    "Rx2": ((2,), ["R"]),
    "S0x8": ((8,), ["S0"]),
    "2d-S0-S1": ((2, 3), ["S0", "S1"]),
    "2d-S1-R": ((3, 2), ["S1", "R"]),
}


@pytest.fixture(scope="module")
def saved_layouts():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: saved_metadata(*layout) for name, layout in SAVED_LAYOUTS.items()}


@pytest.mark.parametrize("load_layout", list(LOAD_LAYOUTS))
def test_dtensor_destinations_plan_like_stock(load_layout, saved_layouts):
    mesh_shape, placement_names = LOAD_LAYOUTS[load_layout]
    world = 1
    for n in mesh_shape:
        world *= n
    for rank in range(world):
        with fake_rank(rank, world):
            sd = dtensor_state_dict(mesh_shape, placement_names, rank)
            for saved_name, md in saved_layouts.items():
                expected = assert_same_plan(sd, md)
                assert isinstance(expected, list) and expected, (saved_name, rank)


def test_equal_shapes_with_other_placements_plan_like_stock():
    """DTensors of one shape on one mesh with different placements: each gets its own chunks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = torch.Size([12, 12])
    md = Metadata({name: TensorStorageMetadata(_PROPS, shape, [ChunkStorageMetadata(torch.Size([r * 3, 0]),
                                                                                     torch.Size([3, 12]))
                                                               for r in range(4)])
                   for name in ("a", "b", "c", "d")})
    for rank in range(4):
        with fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2))
            sd = {}
            for name, placement_names in (("a", ["S0", "S1"]), ("b", ["S1", "S0"]), ("c", ["R", "S1"]),
                                          ("d", ["S0", "S1"])):
                placements = _placements(placement_names)
                local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
                sd[name] = DTensor.from_local(torch.empty(local_shape), mesh, placements, run_check=False,
                                              shape=shape, stride=(12, 1))
            assert_same_plan(sd, md)


def test_rank_outside_a_submesh_plans_nothing_for_it(saved_layouts):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    with fake_rank(3, 4):
        submesh = DeviceMesh("cpu", [0, 1])  # rank 3 is not in it
        full = torch.empty(SHAPES["w"])
        sd = {"w": DTensor.from_local(torch.empty(0, 7), submesh, [Shard(0)], run_check=False,
                                      shape=full.shape, stride=full.stride()),
              "plain": torch.empty(6, 2)}
        expected = assert_same_plan(sd, saved_layouts["S0x4"])
        assert [fields[1] for fields in expected] == ["plain"]


def test_sharded_tensor_with_several_local_shards_plans_like_stock(saved_layouts):
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    with fake_rank(0, 1), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # local shards out of row order: stock sorts them by the sweep dimension
        shards = [STShard.from_tensor_and_offsets(torch.empty(3, 7), [0, 0], 0),
                  STShard.from_tensor_and_offsets(torch.empty(4, 7), [9, 0], 0),
                  STShard.from_tensor_and_offsets(torch.empty(6, 7), [3, 0], 0)]
        sd = {"w": init_from_local_shards(shards, 13, 7), "v": torch.empty(5)}
        for md in saved_layouts.values():
            expected = assert_same_plan(sd, md)
            assert {fields[3] for fields in expected if fields[1] == "w"} == {0, 1, 2}


@pytest.mark.filterwarnings("ignore::UserWarning")  # stock: _get_pg_default_device is deprecated
def test_meta_destination_takes_stock_set_up_and_plans_from_the_table(saved_layouts):
    """Meta tensors: stock's set_up_planner materialises them, the plan still comes from the table."""
    md = saved_layouts["S0x4"]

    def destination():
        return {"w": torch.empty(13, 7, device="meta"), "v": torch.empty(5, device="meta")}

    with fake_rank(0, 1):
        expected = stock_outcome(destination(), md)
        got = fast_outcome(destination(), table_only(md))
    assert_plans_equal(got, expected)
    assert [fields[1] for fields in expected] == ["w"] * 4 + ["v"] * 3


# --------------------------------------------------------------------------- #
# errors and partial loads
# --------------------------------------------------------------------------- #
def test_missing_keys_like_stock(saved_layouts):
    md = saved_layouts["S0x4"]
    sd = {"plain": torch.empty(6, 2), "not_saved": torch.empty(3), "v": torch.empty(5)}
    strict = assert_same_plan(sd, md)
    assert strict == (RuntimeError, "Missing key in checkpoint state_dict: not_saved.")
    partial = assert_same_plan(sd, md, allow_partial_load=True)
    assert [fields[1] for fields in partial] == ["plain", "v", "v", "v"]


def test_size_mismatch_like_stock(saved_layouts):
    md = saved_layouts["S1x4"]
    outcome = assert_same_plan({"plain": torch.empty(6, 2), "w": torch.empty(13, 8)}, md)
    assert outcome[0] is ValueError and "Size mismatch between saved" in outcome[1]


def test_object_where_a_tensor_was_saved_like_stock(saved_layouts):
    outcome = assert_same_plan({"w": "not a tensor"}, saved_layouts["single"])
    assert outcome[0] is ValueError and outcome[1].startswith("Invalid checkpoint metadata for w")


def test_tensor_where_an_object_was_saved_reads_bytes_like_stock(saved_layouts):
    expected = assert_same_plan({"meta": {"tag": torch.empty(3)}}, saved_layouts["single"])
    assert len(expected) == 1 and expected[0][0].name == "BYTE_IO"


def test_empty_and_scalar_tensors_like_stock():
    md = Metadata({
        "empty": TensorStorageMetadata(_PROPS, torch.Size([0, 4]), [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                                          torch.Size([0, 4]))]),
        "no_chunks": TensorStorageMetadata(_PROPS, torch.Size([3]), []),
        "scalar": TensorStorageMetadata(_PROPS, torch.Size([]), [ChunkStorageMetadata(torch.Size([]),
                                                                                       torch.Size([]))]),
    })
    expected = assert_same_plan({"empty": torch.empty(0, 4), "no_chunks": torch.empty(3),
                                 "scalar": torch.empty(())}, md)
    assert [fields[1] for fields in expected] == ["scalar"]


# --------------------------------------------------------------------------- #
# the planner around it: cache, real files
# --------------------------------------------------------------------------- #
def test_plan_cache_is_keyed_on_the_table(saved_layouts):
    md = saved_layouts["S0x4"]
    sd = {"w": torch.empty(13, 7), "v": torch.empty(5)}
    first = table_only(md)
    planner = FastLoadPlanner()
    for metadata in (first, first, table_only(md)):
        planner.set_up_planner(sd, metadata, False)
        plan = planner.create_local_plan()
        assert_plans_equal([item_fields(i) for i in plan.items], stock_outcome(sd, md))
    # the same table again hits; a new table object (another read of the file) replans
    assert (planner.local_plan_hits, planner.local_plan_misses) == (1, 2)


def test_table_path_loads_real_files_bit_exact(tmp_path):
    """A checkpoint fastdcp wrote (with its chunk index): the reader's metadata is table-backed,
    the plan comes from the table, stock's per-chunk objects are never built, and the load is
    bit-exact; loading again hits the plan cache (the metadata cache shares the table)."""
    sd = {**C.zoo_tensors(1, large=False), "obj": C.object_state_dict(1), "step": torch.tensor(5)}
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path), planner=FastSavePlanner(), no_dist=True)
    planner = FastLoadPlanner()
    for _ in range(2):
        dest = C.destination_for(sd)
        dcp.load(dest, storage_reader=FastFileSystemReader(tmp_path), planner=planner, no_dist=True)
        C.assert_same(dest, sd, check_stride=False)
        assert RI.chunk_table_of(planner.metadata) is not None
        assert planner.metadata.state_dict_metadata_built is False
    assert (planner.local_plan_misses, planner.local_plan_hits) == (1, 1)
