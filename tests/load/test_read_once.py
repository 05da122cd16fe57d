"""Read-once loads (``FastFileSystemReader(read_once=True)``, ``fastdcp.load.read_once``): four
gloo ranks on an HSDP-like mesh (2 replicas x 2 shards) load a checkpoint with each stored byte
read once (every rank's read bytes counted by the reader), bit-exact, in the saved layout (with
DCP's and with fastdcp's load planner, in many rounds, through host buffers) and resharded; pure sharding reads as without the mode; a rank whose reads fail fails the load on
every rank, its replica naming it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import dcp_cases as C
from fastdcp.load.read_once import ReplicaKey, deal_items, plan_digest, replica_groups

ROWS, COLS = 256, 96


def _full() -> dict[str, torch.Tensor]:
    return {"w": C.random_tensor(torch.float32, (ROWS, COLS), ("read-once", "w")),
            "v": C.random_tensor(torch.bfloat16, (ROWS, 40), ("read-once", "v")),
            "b": C.random_tensor(torch.float32, (ROWS,), ("read-once", "b"))}


CASES = ("same", "resharded", "planner", "rounds", "host_staged", "sharded", "failing")


def _rank_main(rank: int, store: str, path: str, out: str) -> None:
    """One process group for every case (one spawn: each costs seconds): the checkpoint saved once,
    then one load per case, each rank's result per case written to ``out``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fastdcp.load.read_once as read_once
    from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner
    from fastdcp.bench.process_group import exit_spawned_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    full = _full()
    flat = init_device_mesh("cpu", (4,))
    saved = {k: distribute_tensor(v, flat, [Shard(0)]) for k, v in full.items()}
    saved["step"] = 3
    dcp.save(saved, storage_writer=FastFileSystemWriter(path))

    class FailingReader(FastFileSystemReader):
        def _read_native(self, per_file, planner):
            raise OSError(f"the disk under rank {rank} went away")

    default_budget = read_once.DEFAULT_EXCHANGE_BYTES
    default_p2p = read_once.ReadOnceShare._device_p2p
    for case in CASES:
        if case == "sharded":  # every rank its own rows: nothing to share
            dest = {k: distribute_tensor(torch.zeros_like(v), flat, [Shard(0)]) for k, v in full.items()}
        else:  # the saved rows as 2 shards x 2 replicas; "resharded": columns
            dim = 1 if case == "resharded" else 0
            dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate(), Shard(min(dim, v.dim() - 1))])
                    for k, v in full.items()}
        dest["step"] = 0
        # "rounds": exchange rounds of 8 KiB, many rounds, each read while the one before is sent.
        read_once.DEFAULT_EXCHANGE_BYTES = 8 << 10 if case == "rounds" else default_budget
        # "host_staged": every item sent and received through host buffers, as a CUDA destination is
        # when the default group has no NCCL.
        read_once.ReadOnceShare._device_p2p = (lambda self, t: False) if case == "host_staged" else default_p2p
        reader_class = FailingReader if case == "failing" and rank == 2 else FastFileSystemReader
        reader = reader_class(path, read_once=True)
        planner = FastLoadPlanner() if case == "planner" else None
        result: dict = {"rank": rank}
        try:
            dcp.load(dest, storage_reader=reader, planner=planner)
            for k, v in full.items():
                C.assert_same(dest[k].full_tensor(), v, f"rank {rank} {k}")
            assert dest["step"] == 3
            result["stats"] = {k: v for k, v in reader.last_stats.items() if isinstance(v, (int, float))}
            result["local_bytes"] = sum(t.to_local().numel() * t.element_size() for k, t in dest.items()
                                        if k != "step")
        except CheckpointException as error:
            result["error"] = str(error)
        with open(os.path.join(out, f"{case}-{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    exit_spawned_rank()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case's per-rank results, from one four-rank run."""
    tmp = tmp_path_factory.mktemp("read_once")
    out = tmp / "out"
    out.mkdir()
    mp.spawn(_rank_main, args=(str(tmp / "pg"), str(tmp / "ckpt"), str(out)), nprocs=4, join=True)
    return {case: [json.loads((out / f"{case}-{r}.json").read_text()) for r in range(4)] for case in CASES}


@pytest.mark.parametrize("case", ["same", "resharded", "planner", "rounds", "host_staged"])
def test_replicas_read_each_stored_byte_once_and_load_bit_exact(results, case):
    results = results[case]
    assert all("error" not in r for r in results), results
    for r in results:
        stats = r["stats"]
        assert stats["read_once_replicas"] == 2, stats
        # What a rank holds = what it read + what its replica sent it.
        assert stats["read_once_read_bytes"] + stats["read_once_received_bytes"] == r["local_bytes"], stats
        assert stats["read_once_read_bytes"] < r["local_bytes"], stats
        assert (stats["read_once_rounds"] > 1) == (case == "rounds"), stats  # one item a chunk: 2-3 rounds
    needed_once = sum(v.numel() * v.element_size() for v in _full().values())
    read_tensor_bytes = sum(r["stats"]["read_once_read_bytes"] for r in results)
    assert read_tensor_bytes == needed_once  # each stored tensor byte read once by the job
    # And the bytes the read path fetched (tensor bytes plus blob headers, a resharded row's gaps).
    fetched = sum(r["stats"]["bytes_read"] for r in results)
    assert fetched <= 1.05 * needed_once + 64 * 1024, (fetched, needed_once)


def test_pure_sharding_reads_as_without_the_mode(results):
    results = results["sharded"]
    assert all("error" not in r for r in results), results
    assert all("read_once_replicas" not in r["stats"] for r in results), results


def test_a_rank_whose_reads_fail_fails_the_load_on_every_rank_naming_it(results):
    results = results["failing"]
    assert all("error" in r for r in results), results
    assert "the disk under rank 2 went away" in results[2]["error"]
    # Rank 0 is rank 2's replica: it names rank 2 and its error rather than waiting for its bytes.
    assert "rank 2 of this rank's replica group [0, 2] failed its reads" in results[0]["error"]
    assert "the disk under rank 2 went away" in results[0]["error"]


def test_groups_are_ranks_with_equal_plans_and_members_read_runs_of_equal_bytes():
    a, b = b"a" * 16, b"b" * 16
    groups = replica_groups([ReplicaKey(a, 0), ReplicaKey(b, 1), ReplicaKey(a, 2), ReplicaKey(b, 3), None,
                             ReplicaKey(b"c" * 16, 5)])
    assert groups[0].members == (0, 2) and groups[2] is groups[0]
    assert groups[1].members == (1, 3) and groups[1].token != groups[0].token
    assert groups[4] is None and groups[5] is None  # no key, or alone with its plan
    assert deal_items([5, 9, 1, 9, 4], 2) == [0, 0, 1, 1, 1]  # 14 | 14
    assert deal_items([1] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert deal_items([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert deal_items([1, 1], 4) == [0, 2]  # fewer items than members: some read nothing
    assert deal_items([], 3) == []


def test_the_digest_changes_with_any_region_of_any_item():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    def item(offset: int) -> ReadItem:
        return ReadItem(LoadItemType.TENSOR, MetadataIndex("w", torch.Size([offset, 0])), torch.Size([0, 0]),
                        MetadataIndex("w", torch.Size([0, 0]), 0), torch.Size([offset, 0]), torch.Size([4, 4]))

    assert plan_digest([item(0)]) == plan_digest([item(0)])
    assert plan_digest([item(0)]) != plan_digest([item(4)])
    assert plan_digest([item(0), item(4)]) != plan_digest([item(4), item(0)])
