"""Save plans as columns and the coordinator's bulk global plan (fastdcp.planners.plan_columns,
global_save_plan): the same plans, hints, dedup and chunk metadata as the item-by-item path
(which matches stock), across simulated rank processes."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from fastdcp.format.chunk_table import table_from_metadata
from fastdcp.planners import items as PI
from fastdcp.planners import plan_cache as PC
from fastdcp.planners import sort_order
from fastdcp.planners.global_save_plan import plan_globally_in_bulk
from fastdcp.planners.plan_columns import ColumnarItems, GlobalItems, encode_columns


def _shard(fqn: str, size: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
           dtype=torch.float32, hint=None, kind=WriteItemType.SHARD) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets), hint),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _row_split(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """torch.chunk-style split of n rows: (offset, length), empty trailing shards at offset n."""
    step = -(-n // ranks)
    start = min(n, step * rank)
    return start, max(0, min(n, start + step) - start)


def _fsdp_plans(ranks: int, rng: random.Random, orders: int | None = None) -> list[list[WriteItem]]:
    """Local plans as FSDP2 + AdamW give them: Shard(0) DTensors (uneven, some empty shards),
    0-d step tensors and objects replicated on every rank, a rank-only tensor. Each rank's items
    in an order of its own, or (``orders``) in one of that many orders, so that ranks share a
    plan structure in runs of consecutive ranks and interleaved."""
    templates: list[list[int]] = []
    shapes = {f"layer{i}.w": (rng.randint(1, 9), rng.randint(1, 12)) for i in range(6)}
    shapes["norm"] = (rng.randint(1, 7),)
    plans = []
    for rank in range(ranks):
        items: list[WriteItem] = []
        for fqn, shape in shapes.items():
            for suffix in ("", ".exp_avg"):
                off, length = _row_split(shape[0], ranks, rank)
                items.append(_shard(fqn + suffix, shape, (off,) + (0,) * (len(shape) - 1),
                                    (length,) + shape[1:]))
            items.append(_shard(fqn + ".step", (), (), (), hint=0, kind=WriteItemType.TENSOR))
        items.append(WriteItem(index=MetadataIndex("param_groups"), type=WriteItemType.BYTE_IO))
        if rank == ranks - 1:
            items.append(_shard(f"only{rank}", (3, 2), (0, 0), (3, 2), dtype=torch.bfloat16, hint=0,
                                kind=WriteItemType.TENSOR))
        if orders and rank != ranks - 1:
            if not templates:
                templates = [rng.sample(range(len(items)), len(items)) for _ in range(orders)]
            items = [items[i] for i in rng.choice(templates)]
        else:
            rng.shuffle(items)
        plans.append(items)
    return plans


def _reference(plans: list[list[WriteItem]], to_lowest: bool):
    deduped = PI._dedup_plans([list(p) for p in plans], to_lowest)
    return PI._global_plans_and_metadata(deduped)


@pytest.fixture
def processes():
    """One planner memory per simulated rank process, plus the coordinator's."""
    states: dict[object, PC.PlanProcessState] = {}

    def get(name: object) -> PC.PlanProcessState:
        return states.setdefault(name, PC.PlanProcessState())

    return get


def _send(processes, plans: list[list[WriteItem]]) -> list[bytes]:
    sent = []
    for rank, items in enumerate(plans):
        with PC.simulated_process(processes(rank)):
            sent.append(pickle.dumps(SavePlan(PC._PackedItems(items))))
    return sent


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("to_lowest", [False, True])
@pytest.mark.parametrize("orders", [None, 2])
@pytest.mark.parametrize("radix", [False, True], ids=["torch-sort", "radix-sort"])
def test_bulk_global_plan_equals_item_by_item(processes, seed, to_lowest, orders, radix, monkeypatch):
    if radix:  # the extension's radix sort for every sort, as at thousands of ranks
        monkeypatch.setattr(sort_order, "RADIX_MIN_KEYS", 0)
    rng = random.Random(seed)
    ranks = rng.choice([1, 2, 3, 5, 8]) if orders is None else rng.choice([4, 7, 13])
    plans = _fsdp_plans(ranks, rng, orders)
    expected_items, expected_md = _reference(plans, to_lowest)

    sent = _send(processes, plans)
    with PC.simulated_process(processes("coordinator")):
        received = [pickle.loads(blob) for blob in sent]
        assert all(isinstance(p.items, ColumnarItems) for p in received)
        assert [list(p.items) for p in received] == plans  # the columns rebuild every item
        bulk = plan_globally_in_bulk([(p.items.columns, p.items.structure) for p in received], to_lowest)
        scattered = [pickle.dumps(items) for items in bulk.global_items]

    assert _tables_equal(table_from_metadata(Metadata(expected_md)), bulk.table)
    for rank, blob in enumerate(scattered):
        with PC.simulated_process(processes(rank)):
            items = pickle.loads(blob)
        assert list(items) == expected_items[rank]
        # index hints too (MetadataIndex equality ignores them)
        assert [i.index.index for i in items] == [i.index.index for i in expected_items[rank]]
        rows = torch.frombuffer(bytearray(items.table_rows), dtype=torch.int64).tolist() if items else []
        assert rows == bulk.table_rows[bulk.kept_start[rank]: bulk.kept_start[rank + 1]].tolist()
        entry_of_row = bulk.table.entry_of_rows()
        for item, row in zip(items, rows):  # each item's row holds its key
            assert bulk.table.fqns[int(entry_of_row[row])] == item.index.fqn

    # Each rank's rows for the chunk index sections: the rows of every item it planned (a
    # replicated item's is the row of the copy kept), ascending.
    table = bulk.table
    entry_of_row = table.entry_of_rows().tolist()
    row_of_key = {}
    for row, e in enumerate(entry_of_row):
        ndim = len(table.sizes[e]) if table.sizes[e] is not None else 0
        row_of_key[(table.fqns[e], tuple(table.offsets[row, :ndim].tolist()))] = row
    start = table.rank_rows.start.tolist() if ranks > 1 else None
    for rank, local in enumerate(plans):
        if start is None:
            break
        expected = sorted(row_of_key[(i.index.fqn, tuple(i.index.offset or ()))] for i in local)
        assert table.rank_rows.rows[start[rank]:start[rank + 1]].tolist() == expected


@pytest.mark.parametrize("rows", [90_000, 3 << 31])
def test_numbers_travel_in_the_narrowest_width_and_plan_alike(processes, rows):
    """Each rank sends its numbers in the narrowest integer width that holds them: ranks of one
    structure may differ (here the first ranks' offsets fit int16, the last's not), and the global
    plan is the item-by-item one."""
    ranks = 3
    plans = []
    for rank in range(ranks):
        off, length = _row_split(rows, ranks, rank)
        plans.append([_shard("w", (rows, 1), (off, 0), (length, 1)),
                      _shard("step", (), (), (), hint=0, kind=WriteItemType.TENSOR)])
    expected_items, expected_md = _reference(plans, False)
    sent = _send(processes, plans)
    with PC.simulated_process(processes("coordinator")):
        received = [pickle.loads(blob) for blob in sent]
        widths = [p.items.columns.itemsize for p in received]
        bulk = plan_globally_in_bulk([(p.items.columns, p.items.structure) for p in received], False)
        scattered = [pickle.dumps(items) for items in bulk.global_items]
    assert widths == ([2, 2, 4] if rows == 90_000 else [8, 8, 8])
    assert _tables_equal(table_from_metadata(Metadata(expected_md)), bulk.table)
    for rank, blob in enumerate(scattered):
        with PC.simulated_process(processes(rank)):
            assert list(pickle.loads(blob)) == expected_items[rank]


def _tables_equal(a, b) -> bool:
    return (a.fqns == b.fqns and a.properties == b.properties and a.sizes == b.sizes
            and torch.equal(a.row_start, b.row_start)
            and torch.equal(a.offsets[:, : b.offsets.shape[1]], b.offsets[:, : a.offsets.shape[1]])
            and torch.equal(a.lengths[:, : b.lengths.shape[1]], b.lengths[:, : a.lengths.shape[1]]))


def test_a_rank_gets_back_its_own_list_and_others_get_columns(processes):
    items = PC._PackedItems(_fsdp_plans(2, random.Random(0))[0])
    with PC.simulated_process(processes(0)):
        blob = pickle.dumps(items)
        assert pickle.dumps(items) == blob  # encoded once
        assert pickle.loads(blob) is items
    with PC.simulated_process(processes(1)):
        other = pickle.loads(blob)
        assert isinstance(other, ColumnarItems) and pickle.dumps(other) == blob
        again = pickle.loads(blob)
        assert again.structure is other.structure  # the structure blob is decoded once


def test_items_that_do_not_fit_columns_travel_whole(processes):
    odd = WriteItem(  # index offset other than the chunk's offsets
        index=MetadataIndex("x", torch.Size([1])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([2])), TensorProperties(),
                                    torch.Size([4])),
    )
    assert encode_columns([odd]) is None
    with PC.simulated_process(processes(0)):
        blob = pickle.dumps(PC._PackedItems([odd]))
    with PC.simulated_process(processes(1)):
        back = pickle.loads(blob)
    assert type(back) is PC._PackedItems and list(back) == [odd]


def test_a_global_plan_for_an_unknown_local_plan_is_a_clear_error(processes):
    plans = _fsdp_plans(2, random.Random(1))
    sent = _send(processes, plans)
    with PC.simulated_process(processes("coordinator")):
        received = [pickle.loads(blob) for blob in sent]
        bulk = plan_globally_in_bulk([(p.items.columns, p.items.structure) for p in received], False)
        blob = pickle.dumps(bulk.global_items[0])
    with PC.simulated_process(processes("stranger")), pytest.raises(RuntimeError, match="does not know"):
        pickle.loads(blob)


def test_duplicate_non_shard_key_asserts_like_stock(processes):
    twice = [_shard("t", (2,), (0,), (2,), kind=WriteItemType.TENSOR),
             _shard("t", (2,), (0,), (2,), kind=WriteItemType.TENSOR)]
    with pytest.raises(AssertionError):
        _reference([twice], False)
    with PC.simulated_process(processes(0)):
        columns = PC._PackedItems(twice).columns()
        with pytest.raises(AssertionError):
            plan_globally_in_bulk([columns], False)


def test_the_flatten_mapping_travels_compressed_and_is_decoded_once(processes):
    """A local plan's planner_data (FSDP ranks send the same flatten mapping) crosses the gather
    as one compressed blob: small, equal to the mapping, and one shared object on the
    coordinator however many ranks send it."""
    mapping = {f"model.layers.{i}.mlp.down_proj.weight.exp_avg": ("optim", "state", f"model.layers.{i}", "exp_avg")
               for i in range(300)}
    sent = []
    for rank in range(3):
        with PC.simulated_process(processes(rank)):
            sent.append(pickle.dumps(SavePlan([], planner_data=PC._PackedMapping(mapping))))
    raw = len(pickle.dumps(mapping, protocol=pickle.HIGHEST_PROTOCOL))
    assert all(len(blob) < raw / 4 for blob in sent), (raw, [len(b) for b in sent])
    with PC.simulated_process(processes("coordinator")):
        received = [pickle.loads(blob) for blob in sent]
        again = pickle.dumps(received[0])  # the scatter sends it back the same way
    assert all(plan.planner_data == mapping for plan in received)
    assert all(plan.planner_data is received[0].planner_data for plan in received)
    assert len(again) < raw / 4


def test_global_items_pickle_small(processes):
    plans = _fsdp_plans(4, random.Random(3))
    sent = _send(processes, plans)
    with PC.simulated_process(processes("coordinator")):
        received = [pickle.loads(blob) for blob in sent]
        bulk = plan_globally_in_bulk([(p.items.columns, p.items.structure) for p in received], False)
        for items, plan in zip(bulk.global_items, plans):
            assert isinstance(items, GlobalItems)
            assert len(pickle.dumps(items)) < 60 + 17 * len(plan) + 16


def test_chunk_index_follows_the_committed_metadata(tmp_path):
    """A save planned in bulk commits .metadata with its chunk index; the next save's cleanup
    removes the old index (and a dead save's), the reader uses the current one, stock ignores it."""
    import os

    import torch.distributed.checkpoint as dcp

    from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastSavePlanner
    from fastdcp.format.table_metadata import TableMetadata
    from fastdcp.load.metadata_cache import clear_metadata_cache

    state = {"w": torch.arange(12.0).reshape(3, 4), "o": {"lr": 0.5}}
    (tmp_path / ".metadata.deadbeef.index").write_bytes(b"left by a save that died")
    for step in range(2):
        state["w"] += step
        dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), planner=FastSavePlanner(), no_dist=True)
        indexes = sorted(n for n in os.listdir(tmp_path) if n.endswith(".index"))
        with open(tmp_path / ".metadata", "rb") as f:
            stock_md = pickle.load(f)
        assert indexes == [stock_md.fastdcp_chunk_index]
        clear_metadata_cache()
        assert isinstance(FastFileSystemReader(tmp_path).read_metadata(), TableMetadata)
        dest = {"w": torch.zeros(3, 4), "o": {"lr": 0.0}}
        dcp.load(dest, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
        assert torch.equal(dest["w"], state["w"]) and dest["o"]["lr"] == 0.5


def test_the_returned_metadata_travels_as_a_reference_to_the_committed_index(tmp_path):
    """dcp.save's metadata (broadcast by DCP to every rank) pickles as the committed chunk index's
    name and facts; unpickled, it reads the index on first use and equals what stock reads."""
    import torch.distributed.checkpoint as dcp

    from fastdcp import FastFileSystemWriter, FastSavePlanner
    from fastdcp.format.metadata import CheckpointFormatError
    from fastdcp.io.committed_metadata import CommittedTableMetadata

    state = {"w": torch.arange(24.0).reshape(6, 4), "b": torch.ones(3), "o": {"lr": 0.5}}
    returned = dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), planner=FastSavePlanner(),
                        no_dist=True)
    blob = pickle.dumps(returned)
    assert len(blob) < 400 and b"ChunkStorageMetadata" not in blob
    received = pickle.loads(blob)
    assert type(received) is CommittedTableMetadata
    with open(tmp_path / ".metadata", "rb") as f:
        on_disk = pickle.load(f)
    assert received == on_disk and received.state_dict_metadata == on_disk.state_dict_metadata
    assert type(pickle.loads(pickle.dumps(received))) is Metadata  # once read: a stock Metadata again
    # Overwritten since: a clear error on first use, not another save's metadata.
    stale = pickle.loads(blob)
    dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), planner=FastSavePlanner(), no_dist=True)
    with pytest.raises(CheckpointFormatError, match="no longer"):
        stale.state_dict_metadata


@pytest.mark.parametrize("edit", ["drop", "add"])
def test_a_local_plan_edited_after_it_was_sent_is_a_clear_error(processes, edit):
    """A rank whose local plan's item list changed in place after the gather cannot apply its
    global plan: the error gives both counts, the keys only the local plan has, the cause and
    the remedy (clear_plan_caches)."""
    plans = _fsdp_plans(2, random.Random(4))
    items = [PC._PackedItems(plan) for plan in plans]
    sent = []
    for rank, local in enumerate(items):
        with PC.simulated_process(processes(rank)):
            sent.append(pickle.dumps(SavePlan(local)))
    with PC.simulated_process(processes("coordinator")):
        received = [pickle.loads(blob) for blob in sent]
        bulk = plan_globally_in_bulk([(p.items.columns, p.items.structure) for p in received], False)
        blob = pickle.dumps(bulk.global_items[0])
    planned = len(bulk.global_items[0])
    extra = _shard("added.after.the.gather", (4,), (0,), (4,), kind=WriteItemType.TENSOR)
    if edit == "drop":
        items[0].pop()
    else:
        items[0].append(extra)
    with PC.simulated_process(processes(0)), pytest.raises(RuntimeError) as info:
        pickle.loads(blob)
    message = str(info.value)
    assert f"planned {planned} items" in message, message
    assert f"local plan has {len(items[0])} items" in message, message
    if edit == "add":
        assert "'added.after.the.gather'" in message, message
    else:
        assert "the local plan has 1 fewer item than" in message, message
    assert "in place" in message and "fastdcp.planners.clear_plan_caches()" in message, message
