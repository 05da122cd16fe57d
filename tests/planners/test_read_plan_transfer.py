"""Read plans cross the load's coordinator undecoded (plan_cache.UndecodedReadItems).

A rank's ``FastLoadPlanner`` plan is pickled as DCP's gather pickles it, in one simulated process
(``simulated_process``); unpickled in another (the coordinator) it stays a blob through stock's
identity global plan and the reader's ``prepare_global_plan``, pickles back as the same blob, and
the rank gets its own item objects back. Real multi-rank loads through this path run in
test_planner.py::test_multi_rank_saves (gloo, 2 and 3 ranks).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.planner import LoadPlan

import dcp_cases as C
from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner, FastSavePlanner
from fastdcp.planners import plan_cache as PC
from fastdcp.planners.process_state import PlanProcessState, simulated_process


def _state(seed: int) -> dict:
    return {"model": {f"layer{i}.weight": C.random_float((16, 8), ("transfer", seed, i)) for i in range(40)},
            "step": torch.tensor(seed), "extra": {"name": "run"}}


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    C.save(_state(1), FastFileSystemWriter(path), planner=FastSavePlanner())
    return path


def _expected(keep_layers: int = 40) -> dict:
    state = _state(1)
    state["model"] = {k: v for i, (k, v) in enumerate(state["model"].items()) if i < keep_layers}
    return state


def _local_plan(path, rank_state: PlanProcessState, keep_layers: int = 40
                ) -> tuple[FastLoadPlanner, FastFileSystemReader, LoadPlan, dict]:
    with simulated_process(rank_state):
        dest = C.destination_for(_expected(keep_layers))
        reader = FastFileSystemReader(path)
        planner = FastLoadPlanner()
        planner.set_up_planner(dest, reader.read_metadata(), False)
        reader.set_up_storage_reader(reader.read_metadata(), False)
        plan = reader.prepare_local_plan(planner.create_local_plan())
    return planner, reader, plan, dest


def test_the_coordinator_passes_a_read_plan_on_undecoded(checkpoint):
    rank, coordinator = PlanProcessState(), PlanProcessState()
    planner, _, plan, _ = _local_plan(checkpoint, rank)
    items = list(plan.items)
    assert len(items) > 40
    with simulated_process(rank):
        sent = pickle.dumps(plan)

    with simulated_process(coordinator):
        received = pickle.loads(sent)
        assert type(received.items) is PC.UndecodedReadItems
        coordinator_planner = FastLoadPlanner()
        coordinator_reader = FastFileSystemReader(checkpoint)
        coordinator_reader.read_metadata()
        global_plans = coordinator_reader.prepare_global_plan(coordinator_planner.create_global_plan([received]))
        assert global_plans[0].items is received.items
        assert not received.items.decoded, "the coordinator decoded a read plan it only passes on"
        scattered = pickle.dumps(global_plans[0])
    assert len(scattered) < len(sent) + 200  # the same blob, not a re-encoding

    with simulated_process(rank):
        central = planner.finish_plan(pickle.loads(scattered))
    assert type(central.items) is PC._PackedItems
    assert all(a is b for a, b in zip(central.items, items)), "the rank decoded its own plan again"
    assert list(central.items) == items
    assert central.storage_data == plan.storage_data


def test_a_rank_that_forgot_its_plan_decodes_it(checkpoint):
    rank, coordinator = PlanProcessState(), PlanProcessState()
    planner, _, plan, _ = _local_plan(checkpoint, rank)
    items = list(plan.items)
    with simulated_process(rank):
        sent = pickle.dumps(plan)
    with simulated_process(coordinator):
        scattered = pickle.dumps(pickle.loads(sent))
    rank.clear()  # what eviction from the blob memory leaves
    with simulated_process(rank):
        returned = pickle.loads(scattered)
        assert type(returned.items) is PC.UndecodedReadItems
        central = planner.finish_plan(returned)
    assert type(central.items) is PC._PackedItems
    assert central.items == items
    with simulated_process(coordinator):  # and it still pickles as the same blob
        assert len(pickle.dumps(central)) < len(sent) + 200


def test_undecoded_items_read_as_a_sequence(checkpoint):
    rank = PlanProcessState()
    _, _, plan, _ = _local_plan(checkpoint, rank)
    items = list(plan.items)
    with simulated_process(rank):
        blob = pickle.dumps(plan.items)
    with simulated_process(PlanProcessState()):
        undecoded = pickle.loads(blob)
    assert type(undecoded) is PC.UndecodedReadItems and not undecoded.decoded
    assert "not decoded" in repr(undecoded)
    assert len(undecoded) == len(items) and undecoded.decoded
    assert undecoded[0] == items[0] and undecoded[-3:] == tuple(items[-3:])
    assert list(undecoded) == items and undecoded == items and undecoded == tuple(items)
    assert undecoded != items[:-1]
    assert undecoded + [1] == items + [1] and [1] + undecoded == [1] + items
    assert items[5] in undecoded
    with pytest.raises(AttributeError):
        undecoded.append(items[0])  # read-only: a change in place fails loudly
    with pytest.raises(TypeError):
        hash(undecoded)


def test_write_plans_that_are_not_columns_still_decode_at_once():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    # a BYTE_IO item with an index hint does not fit the save columns
    items = PC._PackedItems([WriteItem(index=MetadataIndex("obj", index=3), type=WriteItemType.BYTE_IO)])
    with simulated_process(PlanProcessState()):
        blob = pickle.dumps(items)
    with simulated_process(PlanProcessState()):
        received = pickle.loads(blob)
    assert type(received) is PC._PackedItems and received == list(items)


def test_a_load_through_the_pass_through_is_bit_exact(checkpoint):
    """The whole protocol by hand, as dcp.load runs it with two ranks: local plans pickled,
    the coordinator's global step on undecoded plans, the plans scattered back, each rank's
    read_data."""
    states = [PlanProcessState(), PlanProcessState()]
    layers = [40, 25]  # rank 1 loads a part of the model: the two plans differ
    ranks = [_local_plan(checkpoint, state, n) for state, n in zip(states, layers)]
    sent = []
    for state, (_, _, plan, _) in zip(states, ranks):
        with simulated_process(state):
            sent.append(pickle.dumps(plan))
    with simulated_process(states[0]):  # rank 0 is the coordinator
        gathered = [pickle.loads(b) for b in sent]
        assert type(gathered[0].items) is PC._PackedItems  # its own plan: remembered
        assert type(gathered[1].items) is PC.UndecodedReadItems
        coordinator_planner, coordinator_reader = ranks[0][0], ranks[0][1]
        global_plans = coordinator_reader.prepare_global_plan(coordinator_planner.create_global_plan(gathered))
        assert not gathered[1].items.decoded
        scattered = [pickle.dumps(p) for p in global_plans]
    for state, (planner, reader, _, dest), blob, n in zip(states, ranks, scattered, layers):
        with simulated_process(state):
            central = planner.finish_plan(pickle.loads(blob))
            reader.read_data(central, planner).wait()
        C.assert_same(dest, _expected(n))
