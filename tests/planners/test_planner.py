"""FastSavePlanner / FastLoadPlanner: stock-equivalent plans, plan caching, multi-rank saves; and
the reader's per-item shortcuts (the parsed-metadata cache, blobs recognised by their layout).

Every checkpoint here is written to real files and read back by stock DCP as well
(``FileSystemReader`` + ``DefaultLoadPlanner``), bit-exact. Multi-rank tests spawn gloo process
groups of 2 and 3 ranks (one group each, every scenario in one spawn, since starting a rank costs
a torch import).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import pickletools
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType

import dcp_cases as C
from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner, FastSavePlanner
from fastdcp.load import header_pass as H
from fastdcp.bench.process_group import exit_spawned_rank
from fastdcp.load import metadata_cache as MC
from fastdcp.planners import items as PI
from fastdcp.planners import plan_cache as PC

SAVE_PLANNERS = {"stock": DefaultSavePlanner, "fast": FastSavePlanner}
LOAD_PLANNERS = {"stock": DefaultLoadPlanner, "fast": FastLoadPlanner}


def mixed_state_dict(seed: int = 0) -> dict:
    """Tensors of every shape class, nested containers, objects and a ShardedTensor-free optimizer-like
    tree: what a single process checkpoints."""
    return {
        **C.zoo_tensors(seed, large=False),
        **C.many_small_tensors(n=30, seed=seed),
        "obj": C.object_state_dict(seed),
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": C.random_float((5,), (seed, "m"))}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "list_of_tensors": [C.random_float((2,), (seed, "l0")), C.random_float((3,), (seed, "l1"))],
        "tuple_leaf": (1, "two"),
        "int_keys": {1: torch.zeros(3), 2: torch.ones(1)},
        "empty": {},
    }


def save(sd, path, *, writer="fast", planner=None, **kw):
    return C.save(sd, C.make_writer(writer, path), planner=planner, **kw)


def stock_load_check(path, expected) -> None:
    """The strict check: stock reader and stock planner, bit-exact, in place."""
    C.load_in_place_and_check(FileSystemReader(path), expected, C.destination_for(expected),
                              planner=DefaultLoadPlanner())


def files_of(path) -> set[str]:
    return {n for n in os.listdir(path) if n.endswith(".distcp")}


# --------------------------------------------------------------------------- #
# equivalence with stock planning
# --------------------------------------------------------------------------- #
def _local_save_plan(planner, sd):
    planner.set_up_planner(sd, None, True)
    return planner.create_local_plan(), planner


def _items_with_hints(items):
    return [(i, i.index.index) for i in items]


STATE_DICTS = {
    "mixed": lambda: mixed_state_dict(1),
    "flat_small": lambda: C.many_small_tensors(50, seed=2),
    "requires_grad": lambda: {"w": torch.randn(3, requires_grad=True), "b": torch.randn(2),
                              "p": torch.nn.Parameter(torch.randn(2, 2))},
    "nested_lists": lambda: {"a": [[torch.ones(1), 5], {"k": [torch.zeros(2)]}], "b": [1, [2, "x"]]},
    "mapping_in_list": lambda: {"a": [{"x": 1}, torch.ones(2)], "c": [[], torch.ones(1)]},
    "bytesio": lambda: {"buf": io.BytesIO(b"abc"), "t": torch.ones(0, 3)},
}


@pytest.mark.parametrize("name", list(STATE_DICTS))
def test_local_save_plan_equals_stock(name):
    sd = STATE_DICTS[name]()
    stock_plan, stock = _local_save_plan(DefaultSavePlanner(), sd)
    fast_plan, fast = _local_save_plan(FastSavePlanner(), sd)
    assert fast_plan.items == stock_plan.items  # MetadataIndex equality ignores index hints
    assert fast_plan.planner_data == stock_plan.planner_data
    assert list(fast.state_dict) == list(stock.state_dict)
    assert all(fast.state_dict[k] is stock.state_dict[k] for k in stock.state_dict)
    # The global plans and metadata agree too, index hints included.
    stock_global, stock_md = stock.create_global_plan([stock_plan])
    fast_global, fast_md = fast.create_global_plan([fast_plan])
    assert _items_with_hints(fast_global[0].items) == _items_with_hints(stock_global[0].items)
    assert fast_md.state_dict_metadata == stock_md.state_dict_metadata
    assert fast_md.planner_data == stock_md.planner_data


@pytest.mark.parametrize("name", list(STATE_DICTS))
def test_local_load_plan_equals_stock(name, tmp_path):
    sd = STATE_DICTS[name]()
    md = save(sd, tmp_path, writer="stock")
    plans = {}
    for kind, cls in LOAD_PLANNERS.items():
        planner = cls()
        dest = C.destination_for(sd)
        planner.set_up_planner(dest, FileSystemReader(tmp_path).read_metadata(), True)
        plans[kind] = planner.create_local_plan()
        assert list(planner.state_dict) == list(md.planner_data)
    hints = lambda plan: [(i, i.dest_index.index, i.storage_index.index) for i in plan.items]  # noqa: E731
    assert hints(plans["fast"]) == hints(plans["stock"])


def test_flatten_errors_like_stock():
    sd = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    for cls in SAVE_PLANNERS.values():
        with pytest.raises(ValueError, match="duplicated flatten key a.b"):
            cls().set_up_planner(sd, None, True)


# --------------------------------------------------------------------------- #
# round trips: every combination of planner x storage class, both directions
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("writer_kind", C.KINDS)
@pytest.mark.parametrize("save_planner", list(SAVE_PLANNERS))
def test_round_trip_all_combinations(save_planner, writer_kind, tmp_path):
    sd = mixed_state_dict(3)
    expected = C.deepcopy_state_dict(sd)
    md = save(sd, tmp_path, writer=writer_kind, planner=SAVE_PLANNERS[save_planner]())
    for reader_kind in C.KINDS:
        for cls in LOAD_PLANNERS.values():
            C.load_in_place_and_check(C.make_reader(reader_kind, tmp_path), expected, C.destination_for(expected),
                                      planner=cls())
    # what the fast planner wrote is what stock planning describes
    _assert_metadata_as_stock_plans(md, sd)


def _assert_metadata_as_stock_plans(md, sd) -> None:
    """``md`` describes ``sd`` exactly as stock ``DefaultSavePlanner`` would."""
    reference = DefaultSavePlanner()
    plan, _ = _local_save_plan(reference, sd)
    _, ref_md = reference.create_global_plan([plan])
    assert md.state_dict_metadata == ref_md.state_dict_metadata
    assert md.planner_data == ref_md.planner_data


def test_metadata_has_only_stock_classes(tmp_path):
    save(mixed_state_dict(4), tmp_path, planner=FastSavePlanner())
    with open(tmp_path / ".metadata", "rb") as f:
        data = f.read()
    # No fastdcp class (the file may carry the fastdcp_chunk_index attribute: a plain string).
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    assert not [s for s in strings if s.startswith("fastdcp.")]
    md = pickle.loads(data)
    assert type(md) is dcp.Metadata and type(md.state_dict_metadata) is dict and type(md.planner_data) is dict


def test_model_and_optimizer_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = C.deepcopy_state_dict(sd)
    for i in range(2):  # the second save and load run from the caches
        save(sd, tmp_path / str(i), planner=FastSavePlanner())
        stock_load_check(tmp_path / str(i), expected)
        dest = C.destination_for(expected)
        C.load(dest, FastFileSystemReader(tmp_path / str(i)), planner=FastLoadPlanner())
        C.assert_same(dest, expected, check_stride=False)


def test_async_save_thread(tmp_path):
    sd = mixed_state_dict(5)
    expected = C.deepcopy_state_dict(sd)
    for i in range(2):
        res = dcp.async_save(sd, storage_writer=FastFileSystemWriter(tmp_path / str(i)), planner=FastSavePlanner(),
                             no_dist=True)
        (res.upload_completion if hasattr(res, "upload_completion") else res).result()
        stock_load_check(tmp_path / str(i), expected)


def _async_process_child(root: str) -> None:
    """In a fresh interpreter (gloo world of 1): two async_save(PROCESS) calls with FastSavePlanner
    (the planner is pickled into DCP's daemon process); results to root/results.json."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    result = "ok"
    try:
        planner = FastSavePlanner()
        for i in range(2):
            res = dcp.async_save(_structured(i), storage_writer=FastFileSystemWriter(os.path.join(root, str(i))),
                                 planner=planner, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            (res.upload_completion if hasattr(res, "upload_completion") else res).result()
    except BaseException:
        result = traceback.format_exc()
    finally:
        with open(os.path.join(root, "results.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


@pytest.mark.fastdcp_timeout(600)
def test_async_save_process(tmp_path):
    import subprocess
    import sys
    import textwrap

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if not hasattr(AsyncCheckpointerType, "PROCESS"):
        pytest.skip("this torch has no AsyncCheckpointerType.PROCESS")
    tests_dir = Path(__file__).resolve().parent
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tests_dir)!r}, {str(tests_dir.parent)!r}, {str(tests_dir.parents[1])!r}]
        import test_planner
        test_planner._async_process_child({str(tmp_path)!r})
    """)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")  # DCP's daemon TCPStore
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=500)
    results = tmp_path / "results.json"
    assert results.exists(), f"rc={proc.returncode}\n{proc.stderr[-6000:]}"
    assert json.loads(results.read_text()) == "ok"
    for i in range(2):
        stock_load_check(tmp_path / str(i), _structured(i))


def test_planner_pickles_without_state(tmp_path):
    planner = FastSavePlanner()
    sd = {"big": torch.zeros(1 << 16)}
    save(sd, tmp_path, planner=planner)
    assert len(pickle.dumps(planner)) < 4096  # no tensors, no plans
    again = pickle.loads(pickle.dumps(planner))
    save(sd, tmp_path / "again", planner=again)
    stock_load_check(tmp_path / "again", sd)


# --------------------------------------------------------------------------- #
# save plan caching
# --------------------------------------------------------------------------- #
def _structured(seed: int, **changes) -> dict:
    sd = {"a": C.random_float((4, 3), (seed, "a")), "b": C.random_float((7,), (seed, "b")),
          "nested": {"c": C.random_float((2, 2), (seed, "c"), torch.bfloat16), "step": seed}}
    sd.update(changes)
    return sd


def test_second_save_hits_and_writes_new_values(tmp_path):
    planner = FastSavePlanner()
    save(_structured(0), tmp_path, planner=planner)
    assert (planner.local_plan_misses, planner.global_plan_misses) == (1, 1)
    first_files = files_of(tmp_path)
    sd = _structured(1)  # same structure, new values
    md = save(sd, tmp_path, planner=planner)
    assert (planner.local_plan_hits, planner.global_plan_hits) == (1, 1)
    stock_load_check(tmp_path, sd)
    # storage_data is this save's: FastFileSystemWriter named the files with a new token
    assert files_of(tmp_path).isdisjoint(first_files)
    assert {info.relative_path for info in md.storage_data.values()} == files_of(tmp_path)


def test_fresh_planner_instances_share_the_cache(tmp_path):
    save(_structured(0), tmp_path / "a", planner=FastSavePlanner())
    planner = FastSavePlanner()
    save(_structured(1), tmp_path / "b", planner=planner)
    assert (planner.local_plan_hits, planner.global_plan_hits) == (1, 1)
    stock_load_check(tmp_path / "b", _structured(1))


@pytest.mark.parametrize("writer_kind", C.KINDS)
def test_cache_hits_with_either_writer(writer_kind, tmp_path):
    planner = FastSavePlanner()
    for seed in range(3):
        sd = _structured(seed)
        save(sd, tmp_path, writer=writer_kind, planner=planner)
        stock_load_check(tmp_path, sd)
    assert (planner.local_plan_hits, planner.global_plan_hits) == (2, 2)


CHANGES = {
    "shape": {"a": torch.ones(5, 3)},
    "dtype": {"b": torch.ones(7, dtype=torch.float64)},
    "requires_grad": {"b": torch.ones(7, requires_grad=True)},
    "added_key": {"new": torch.ones(2)},
    "nested_shape": {"nested": {"c": torch.ones(3, 2, dtype=torch.bfloat16), "step": 0}},
    "tensor_became_object": {"b": [1, 2, 3]},
    "object_became_tensor": {"nested": {"c": torch.ones(2, 2, dtype=torch.bfloat16), "step": torch.tensor(5)}},
    "same_fqn_other_path": {"nested": {"c": torch.ones(2, 2, dtype=torch.bfloat16)}, "nested.step": 0},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_structure_change_replans(change, tmp_path):
    planner = FastSavePlanner()
    save(_structured(0), tmp_path, planner=planner)
    save(_structured(1), tmp_path, planner=planner)
    assert planner.global_plan_hits == 1
    sd = _structured(2, **CHANGES[change])
    md = save(sd, tmp_path, planner=planner)
    assert (planner.local_plan_misses, planner.global_plan_misses) == (2, 2)
    stock_load_check(tmp_path, sd)
    _assert_metadata_as_stock_plans(md, sd)


def test_removed_key_replans(tmp_path):
    planner = FastSavePlanner()
    save(_structured(0), tmp_path, planner=planner)
    sd = _structured(1)
    del sd["b"]
    md = save(sd, tmp_path, planner=planner)
    assert planner.global_plan_misses == 2 and "b" not in md.state_dict_metadata
    stock_load_check(tmp_path, sd)


def test_returned_metadata_is_not_the_cached_one(tmp_path):
    planner = FastSavePlanner()
    md1 = save(_structured(0), tmp_path / "a", planner=planner)
    md1.state_dict_metadata.clear()
    md1.planner_data.clear()
    md2 = save(_structured(1), tmp_path / "b", planner=planner)
    assert planner.global_plan_hits == 1
    assert set(md2.state_dict_metadata) == {"a", "b", "nested.c", "nested.step"}
    assert md1.storage_data is not md2.storage_data
    stock_load_check(tmp_path / "b", _structured(1))


def test_cache_plans_false_never_hits(tmp_path):
    planner = FastSavePlanner(cache_plans=False)
    for seed in range(2):
        save(_structured(seed), tmp_path, planner=planner)
    assert planner.local_plan_hits == planner.global_plan_hits == 0
    stock_load_check(tmp_path, _structured(1))


def test_alternating_structures_both_stay_cached(tmp_path):
    planner = FastSavePlanner()
    for i in range(4):
        sd = _structured(i) if i % 2 == 0 else C.many_small_tensors(10, seed=i)
        save(sd, tmp_path / str(i), planner=planner)
        stock_load_check(tmp_path / str(i), sd)
    assert (planner.global_plan_misses, planner.global_plan_hits) == (2, 2)


def test_rank_local_save_keeps_fresh_prefixes(tmp_path):
    if not C._has_param(dcp.save, "use_collectives"):
        pytest.skip("this torch's dcp.save has no use_collectives")
    planner = FastSavePlanner()
    names = []
    for seed in range(2):
        sd = _structured(seed)
        md = save(sd, tmp_path, planner=planner, use_collectives=False)
        names.append({info.relative_path for info in md.storage_data.values()})
        assert names[-1] == files_of(tmp_path)
    assert planner.global_plan_hits == 1 and names[0].isdisjoint(names[1])
    dest = C.destination_for(_structured(1))
    C.load(dest, FileSystemReader(tmp_path))
    C.assert_same(dest, _structured(1), check_stride=False)


# --------------------------------------------------------------------------- #
# load plan caching and the metadata cache
# --------------------------------------------------------------------------- #
def _load(path, expected, planner, reader="fast"):
    dest = C.destination_for(expected)
    C.load_in_place_and_check(C.make_reader(reader, path), expected, dest, planner=planner)


@pytest.mark.parametrize("reader_kind", C.KINDS)
def test_load_plan_cache_hits_for_same_structure(reader_kind, tmp_path):
    planner = FastLoadPlanner()
    sd = mixed_state_dict(6)
    save(sd, tmp_path / "a")
    _load(tmp_path / "a", sd, planner, reader_kind)
    _load(tmp_path / "a", sd, planner, reader_kind)
    sd2 = mixed_state_dict(7)  # another checkpoint of the same structure: same plan
    save(sd2, tmp_path / "b")
    _load(tmp_path / "b", sd2, planner, reader_kind)
    assert (planner.local_plan_misses, planner.local_plan_hits) == (1, 2)


def test_load_plan_cache_invalidated_when_checkpoint_changes(tmp_path):
    planner = FastLoadPlanner(allow_partial_load=True)
    save({"x": torch.arange(4.0)}, tmp_path)
    _load(tmp_path, {"x": torch.arange(4.0)}, planner)
    # Same destination, checkpoint with another entry: the metadata changed, so the plan must.
    save({"x": torch.arange(4.0) + 1, "y": torch.ones(3)}, tmp_path)
    _load(tmp_path, {"x": torch.arange(4.0) + 1}, planner)
    # The tensor became an object in the checkpoint: a byte read instead of a tensor read.
    save({"x": [1, 2]}, tmp_path)
    dest = {"x": torch.zeros(4)}
    C.load(dest, FastFileSystemReader(tmp_path), planner=planner)
    assert dest == {"x": [1, 2]}
    assert (planner.local_plan_misses, planner.local_plan_hits) == (3, 0)


def test_load_plan_cache_invalidated_when_destination_changes(tmp_path):
    planner = FastLoadPlanner()
    save({"x": torch.arange(6.0)}, tmp_path)
    _load(tmp_path, {"x": torch.arange(6.0)}, planner)
    with pytest.raises(BaseException, match="Size mismatch"):
        C.load({"x": torch.zeros(5)}, FastFileSystemReader(tmp_path), planner=planner)
    _load(tmp_path, {"x": torch.arange(6.0)}, planner)
    assert planner.local_plan_hits == 1


def test_load_errors_like_stock(tmp_path):
    save({"x": torch.ones(3)}, tmp_path)
    for cls in LOAD_PLANNERS.values():
        with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: y"):
            C.load({"x": torch.ones(3), "y": torch.ones(1)}, FastFileSystemReader(tmp_path), planner=cls())
        dest = {"x": torch.zeros(3), "y": torch.zeros(1)}
        C.load(dest, FastFileSystemReader(tmp_path), planner=cls(allow_partial_load=True))
        assert torch.equal(dest["x"], torch.ones(3)) and torch.equal(dest["y"], torch.zeros(1))


def test_partial_destination_uses_cache(tmp_path):
    sd = {"model": {"w": torch.ones(3)}, "optim": {"m": torch.zeros(3)}}
    save(sd, tmp_path)
    planner = FastLoadPlanner()
    for _ in range(2):
        dest = {"model": {"w": torch.zeros(3)}}
        C.load(dest, FastFileSystemReader(tmp_path), planner=planner)
        assert torch.equal(dest["model"]["w"], torch.ones(3))
    assert planner.local_plan_hits == 1


def test_meta_destination_takes_stock_path(tmp_path):
    save({"x": torch.arange(3.0)}, tmp_path)
    outcomes = []
    for cls in LOAD_PLANNERS.values():
        dest = {"x": torch.empty(3, device="meta")}
        try:
            C.load(dest, FastFileSystemReader(tmp_path), planner=cls())
            outcomes.append(("ok", dest["x"].device.type, dest["x"].tolist()))
        except BaseException as e:  # without a process group stock cannot pick a device
            outcomes.append(("raised", type(e).__name__))
    assert outcomes[0] == outcomes[1]


def test_metadata_cache_follows_the_file(tmp_path):
    save({"x": torch.ones(2)}, tmp_path)
    reader = FastFileSystemReader(tmp_path)
    first, second = reader.read_metadata(), reader.read_metadata()
    assert first is not second and first.state_dict_metadata is not second.state_dict_metadata
    assert first.state_dict_metadata == second.state_dict_metadata
    assert first.storage_meta is not second.storage_meta
    second.state_dict_metadata.clear()  # a caller's change does not reach the cache
    assert FastFileSystemReader(tmp_path).read_metadata().state_dict_metadata == first.state_dict_metadata
    save({"x": torch.ones(5), "y": torch.ones(1)}, tmp_path)  # rewritten: a new .metadata file
    md = FastFileSystemReader(tmp_path).read_metadata()
    assert set(md.state_dict_metadata) == {"x", "y"}
    assert md.state_dict_metadata["x"].size == torch.Size([5])


def test_metadata_cache_skips_parsing_until_the_file_changes(tmp_path, monkeypatch):
    parses = []
    real = MC.load_metadata
    monkeypatch.setattr(MC, "load_metadata", lambda *a, **k: parses.append(a) or real(*a, **k))
    sd = C.many_small_tensors(10, seed=12)
    save(sd, tmp_path)
    for _ in range(3):
        C.load_in_place_and_check(FastFileSystemReader(tmp_path), sd, C.destination_for(sd))
    assert len(parses) == 1
    sd2 = C.many_small_tensors(10, seed=13)
    save(sd2, tmp_path)
    C.load_in_place_and_check(FastFileSystemReader(tmp_path), sd2, C.destination_for(sd2))
    assert len(parses) == 2


def test_metadata_cache_is_per_unpickling_mode(tmp_path):
    save({"x": torch.ones(2)}, tmp_path)
    FastFileSystemReader(tmp_path, allow_unsafe_metadata=True).read_metadata()
    assert len(MC.metadata_cache._entries) == 1
    FastFileSystemReader(tmp_path).read_metadata()
    assert len(MC.metadata_cache._entries) == 2


# --------------------------------------------------------------------------- #
# reader: blobs fastdcp wrote are recognised by their layout, anything else is parsed
# --------------------------------------------------------------------------- #
def _known_blob_sd() -> dict:
    sd = {f"{C.dtype_name(dt)}_{i}": C.random_tensor(dt, shape, ("known", str(dt), i))
          for dt in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64)
          for i, shape in enumerate([(), (0,), (3,), (4, 5), (2, 3, 4)])}
    sd["large"] = C.random_tensor(torch.float32, (70_000,), ("known", "large"))  # page-aligned data
    sd["transposed"] = C.random_tensor(torch.float32, (6, 4), ("known", "t")).t()
    return sd


def _stored_blobs(path):
    md = FileSystemReader(path).read_metadata()
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            continue
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            yield md, index, info, f.read(info.length)


@pytest.mark.parametrize("writer_kind", C.KINDS)
def test_known_blob_layouts_agree_with_the_parser(writer_kind, tmp_path):
    from fastdcp.format.blob_parse import parse_tensor_blob
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    save(_known_blob_sd(), tmp_path, writer=writer_kind)
    recognised = 0
    for md, index, info, blob in _stored_blobs(tmp_path):
        known = H.KnownBlobs(md.state_dict_metadata)
        window = H.Window(info.offset, memoryview(bytearray(blob)), torch.empty(0, dtype=torch.uint8))
        item = ReadItem(LoadItemType.TENSOR, index, torch.Size(), index, torch.Size(), torch.Size())
        match = known.match(item, info, [window])
        parsed = parse_tensor_blob(blob, blob, len(blob), lambda off, n: blob[off:off + n], "blob")
        assert match is None or match == parsed, (index.fqn, match, parsed)
        recognised += match is not None
    if writer_kind == "stock":
        assert recognised == 0  # torch.save blobs are always parsed
    else:
        assert recognised == len(_known_blob_sd())  # fastdcp's own blobs never need parsing


def test_blob_differing_from_the_layout_is_parsed(tmp_path):
    sd = C.many_small_tensors(20, seed=11)
    save(sd, tmp_path)
    reader = FastFileSystemReader(tmp_path)
    C.load_in_place_and_check(reader, sd, C.destination_for(sd))
    assert reader.last_stats["blobs_recognised"] == 20
    # A serialization id that is not 40 digits still loads (torch ignores it) but is not trusted.
    md, index, info, blob = next(_stored_blobs(tmp_path))
    tmd = md.state_dict_metadata[index.fqn]
    layout = next(lay for align in H._WRITER_DATA_ALIGNS
                  if (lay := H._known_layout(tmd.properties.dtype, tuple(tmd.chunks[0].sizes),
                                             info.offset % align, align)) and lay.length == info.length)
    at = info.offset + len(layout.head) + layout.data_nbytes + len(layout.tail_before_id)
    with open(os.path.join(tmp_path, info.relative_path), "r+b") as f:
        f.seek(at)
        f.write(b"x")
    reader = FastFileSystemReader(tmp_path)
    C.load_in_place_and_check(reader, sd, C.destination_for(sd))
    assert reader.last_stats["blobs_recognised"] == 19
    stock_load_check(tmp_path, sd)


def test_gc_pause_restores_the_collector():
    import gc

    from fastdcp.io.gc import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's choice is left alone
    finally:
        gc.enable()


# --------------------------------------------------------------------------- #
# building blocks
# --------------------------------------------------------------------------- #
def test_packed_items_pickle_once_and_unpickle_once():
    # Read items (write items travel as columns: tests/planners/test_bulk_save_plan.py).
    items = PC._PackedItems([
        ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(f"k{i}"), dest_offsets=torch.Size([0]),
                 storage_index=MetadataIndex(f"k{i}"), storage_offsets=torch.Size([0]), lengths=torch.Size([1]))
        for i in range(100)
    ])
    blob1 = pickle.dumps(items)
    blob2 = pickle.dumps(items)
    assert blob1 == blob2 and items._blob is not None
    back1, back2 = pickle.loads(blob1), pickle.loads(blob2)
    assert back1 == items and type(back1) is PC._PackedItems
    assert back1.same_items(items) and back1.same_items(back2) and back1 is not back2
    assert all(a is b for a, b in zip(back1, back2))  # the second unpickle reused the first one's items
    back1.append(items[0])  # in-place changes drop the blob
    assert back1._blob is None and not back1.same_items(items)
    assert pickle.loads(pickle.dumps(back1)) == list(items) + [items[0]]


def _item(fqn: str, nbytes: int, kind=WriteItemType.TENSOR) -> WriteItem:
    if kind == WriteItemType.BYTE_IO:
        return WriteItem(index=MetadataIndex(fqn), type=kind)
    t = torch.empty(nbytes, dtype=torch.uint8)
    return PI._local_write_items({fqn: t})[0]


def test_dedup_writes_each_item_once_and_balances_by_size():
    replicated = [_item(f"r{i}", size) for i, size in enumerate([10, 70, 20, 60, 30, 50, 40])]
    obj = _item("obj", 0, WriteItemType.BYTE_IO)
    plans = [[_item("own0", 100)] + replicated + [obj], [_item("own1", 5)] + replicated + [obj],
             replicated + [obj]]
    deduped = PI._dedup_plans(plans, to_lowest_rank=False)
    seen = [i.index.fqn for items in deduped for i in items]
    assert sorted(seen) == sorted({i.index.fqn for items in plans for i in items})  # all, each once
    loads = [sum(PI._item_bytes(i) for i in items) for items in deduped]
    assert max(loads) - min(loads) <= 70  # within the largest replicated item
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    stock = dedup_save_plans([dcp.SavePlan(items) for items in plans])
    stock_loads = [sum(PI._item_bytes(i) for i in p.items) for p in stock]
    assert max(loads) <= max(stock_loads)
    lowest = PI._dedup_plans(plans, to_lowest_rank=True)
    assert {i.index.fqn for i in lowest[0]} >= {f"r{i}" for i in range(7)} | {"obj"}


def test_metadata_pickles_smaller_than_stock(tmp_path):
    sd = C.many_small_tensors(200, seed=9)
    save(sd, tmp_path / "stock", planner=DefaultSavePlanner())
    save(sd, tmp_path / "fast", planner=FastSavePlanner())
    stock_size = (tmp_path / "stock" / ".metadata").stat().st_size
    fast_size = (tmp_path / "fast" / ".metadata").stat().st_size
    assert fast_size < stock_size


# --------------------------------------------------------------------------- #
# multi-rank (gloo): DTensor, ShardedTensor, replicated tensors and objects
# --------------------------------------------------------------------------- #
REPLICATED_SIZES = [4096, 3000, 2500, 2048, 1500, 1024, 700, 512, 300, 100]
MP_TIMEOUT_S = float(os.environ.get("FASTDCP_MP_TIMEOUT", "300"))


def _full(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    return C.random_tensor(dtype, shape, ("planner-mp", name))


def _mp_state_dict(mesh, rank: int, ws: int, step: int, grow: bool = False) -> dict:
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd: dict = {"step": step, "meta": {"name": "run", "lr": [0.1, 0.01]}}
    full_w = _full("w", (12, 10)) + step
    sd["w"] = DTensor.from_local(torch.chunk(full_w, ws, 0)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                 shape=full_w.shape, stride=full_w.stride())
    full_d = _full("dtensor_rep", (6, 5)) + step
    sd["dtensor_rep"] = DTensor.from_local(full_d.clone(), mesh, [Replicate()], run_check=False)
    full_st = _full("st", (9, 4)) + step
    chunks = torch.chunk(full_st, ws, 0)
    offset = sum(c.shape[0] for c in chunks[:rank])
    sd["st"] = init_from_local_shards([STShard.from_tensor_and_offsets(chunks[rank].clone(), [offset, 0], rank)], 9, 4)
    sd["rep"] = {f"t{i}": _full(f"rep{i}", (n,), torch.uint8) + step for i, n in enumerate(REPLICATED_SIZES)}
    own_shape = (3 + rank + (4 if grow else 0), 2)
    sd[f"own{rank}"] = _full(f"own{rank}", own_shape) + step
    return sd


def _expected_full(ws: int, step: int, grow_rank: int | None = None) -> dict:
    """What a single process loads from a checkpoint of ``_mp_state_dict`` (plain tensors)."""
    exp: dict = {"step": step, "meta": {"name": "run", "lr": [0.1, 0.01]},
                 "w": _full("w", (12, 10)) + step, "dtensor_rep": _full("dtensor_rep", (6, 5)) + step,
                 "st": _full("st", (9, 4)) + step,
                 "rep": {f"t{i}": _full(f"rep{i}", (n,), torch.uint8) + step for i, n in enumerate(REPLICATED_SIZES)}}
    for r in range(ws):
        exp[f"own{r}"] = _full(f"own{r}", (3 + r + (4 if r == grow_rank else 0), 2)) + step
    return exp


def _final_items(planner) -> list[str]:
    return sorted(f"{i.index.fqn}@{tuple(i.index.offset or ())}" for i in planner.plan.items)


def _mp_worker(rank: int, spec: dict) -> None:
    """One rank: three saves with FastSavePlanner (miss, hit, one rank's structure changed), each
    also loaded back with stock DCP here (DTensor/ShardedTensor destinations); then two loads with
    FastLoadPlanner. Writes one JSON record per rank."""
    torch.set_num_threads(1)
    ws, root = spec["ws"], Path(spec["root"])
    record: dict = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=120))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        mesh = init_device_mesh("cpu", (ws,))
        planner = FastSavePlanner()
        saves = []
        grow_rank = 1
        for step, grow in ((0, False), (1, False), (2, True)):
            sd = _mp_state_dict(mesh, rank, ws, step, grow=grow and rank == grow_rank)
            path = root / f"save{step}"
            dcp.save(sd, storage_writer=FastFileSystemWriter(path), planner=planner)
            saves.append({"items": _final_items(planner), "local_hits": planner.local_plan_hits,
                          "global_hits": planner.global_plan_hits, "global_misses": planner.global_plan_misses})
            # stock DCP loads it back into the same kind of (sharded) state dict, bit-exact
            dest = _mp_state_dict(mesh, rank, ws, step + 100, grow=grow and rank == grow_rank)
            dcp.load(dest, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner())
            expected = _mp_state_dict(mesh, rank, ws, step, grow=grow and rank == grow_rank)
            for key in ("w", "dtensor_rep"):
                C.assert_tensor_bitexact(dest[key].to_local(), expected[key].to_local(), key, check_stride=False)
            C.assert_tensor_bitexact(dest["st"].local_shards()[0].tensor, expected["st"].local_shards()[0].tensor, "st")
            C.assert_same({k: v for k, v in dest.items() if k not in ("w", "dtensor_rep", "st")},
                          {k: v for k, v in expected.items() if k not in ("w", "dtensor_rep", "st")},
                          "plain", check_stride=False)
        record["saves"] = saves
        # FastLoadPlanner, twice: resharded DTensor reads, the second from the plan cache
        load_planner = FastLoadPlanner()
        for _ in range(2):
            dest = _mp_state_dict(mesh, rank, ws, 100)
            dcp.load(dest, storage_reader=FastFileSystemReader(root / "save1"), planner=load_planner)
            expected = _mp_state_dict(mesh, rank, ws, 1)
            assert isinstance(dest["w"], DTensor)
            C.assert_tensor_bitexact(dest["w"].to_local(), expected["w"].to_local(), "w", check_stride=False)
            C.assert_tensor_bitexact(dest["rep"]["t0"], expected["rep"]["t0"], "rep.t0")
        record["load_hits"] = load_planner.local_plan_hits
        dist.barrier()
        record["ok"] = True
    except BaseException:  # CheckpointException is a BaseException
        record["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(spec["results"], f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
    exit_spawned_rank()  # the record carries the verdict


def _run_world(tmp_path: Path, ws: int) -> list[dict]:
    root = tmp_path / f"ws{ws}"
    results = root / "results"
    results.mkdir(parents=True)
    spec = {"ws": ws, "root": str(root), "results": str(results), "store": str(root / "store")}
    ctx = mp.start_processes(_mp_worker, args=(spec,), nprocs=ws, join=False, start_method="spawn")
    deadline = time.time() + MP_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.time() > deadline:
                raise TimeoutError(f"{ws}-rank planner test did not finish in {MP_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    records = [json.loads((results / f"rank{r}.json").read_text()) for r in range(ws)]
    for rec in records:
        assert rec["ok"], f"rank {rec['rank']} failed:\n{rec.get('error')}"
    return records


def _check_world(tmp_path: Path, ws: int, records: list[dict]) -> None:
    root = tmp_path / f"ws{ws}"
    for step, save_info in enumerate(zip(*[rec["saves"] for rec in records])):
        # every item (replicated tensors and objects included) is written by exactly one rank
        written = [item for info in save_info for item in info["items"]]
        assert len(written) == len(set(written)), f"save {step}: an item was written twice"
        md = FileSystemReader(root / f"save{step}").read_metadata()
        expected_keys = {f"{k}@{tuple(idx.offset or ())}" for idx in md.storage_data for k in [idx.fqn]}
        assert set(written) == expected_keys
        # replicated bytes are spread by size: no rank holds more than the largest one above another
        rep_bytes = [sum(REPLICATED_SIZES[int(i.split("@")[0][len("rep.t"):])] for i in info["items"]
                         if i.startswith("rep.")) for info in save_info]
        own = [sum(1 for i in info["items"] if i.startswith("rep.")) for info in save_info]
        assert all(n > 0 for n in own), f"save {step}: some rank writes no replicated tensor ({rep_bytes})"
        assert max(rep_bytes) - min(rep_bytes) <= max(REPLICATED_SIZES) + 200, rep_bytes
        # stock DCP in one process reads the whole checkpoint into plain tensors
        grow = 1 if step == 2 else None
        expected = _expected_full(ws, step, grow)
        dest = C.destination_for(expected)
        dcp.load(dest, storage_reader=FileSystemReader(root / f"save{step}"), planner=DefaultLoadPlanner(),
                 no_dist=True)
        C.assert_same(dest, expected, check_stride=False)
    # save 0 planned, save 1 came from the caches on every rank, save 2 (rank 1 grew a tensor)
    # made every rank replan globally while the others' local plans still hit
    coordinator = records[0]["saves"]
    assert [s["global_misses"] for s in coordinator] == [1, 1, 2]
    assert [s["global_hits"] for s in coordinator] == [0, 1, 1]
    for rec in records:
        local_hits = [s["local_hits"] for s in rec["saves"]]
        assert local_hits == ([0, 1, 1] if rec["rank"] == 1 else [0, 1, 2]), (rec["rank"], local_hits)
        assert rec["load_hits"] == 1


@pytest.mark.fastdcp_timeout(0)
@pytest.mark.parametrize("ws", [2, 3])
def test_multi_rank_saves(ws, tmp_path):
    records = _run_world(tmp_path, ws)
    _check_world(tmp_path, ws, records)
