"""Peer replicas of tiered checkpoints, with real processes: gloo ranks grouped into simulated
nodes (``FASTDCP_NODE``), each node with a local tier of its own. A node is lost by removing its
local tier and restarting every process; the shared tier is moved away where a test proves that
the recovery never reads it. Every load is checked bit-exact."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from fastdcp import FastTieredReader, FastTieredWriter, RecoveryWarning
from fastdcp.tiered import local_tier, newest_checkpoint
from fastdcp.tiered.peers import NodeMap

STEPS = (1, 2)


def _state(rank: int, step: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = C.random_float((64, 48), ("sharded", step))
    return {"sharded": distribute_tensor(full, mesh, [Shard(0)]), f"own{rank}": C.random_float((3000,), (rank, step)),
            "replicated": C.random_tensor(torch.bfloat16, (40,), ("replicated", step)), "step": step}


def _node(rank: int, per_node: int) -> str:
    return f"node{rank // per_node}"


def _save_main(rank: int, work: str, world: int, per_node: int, replicas: int, lost_during: str | None = None) -> None:
    """step1 with dcp.save, step2 with dcp.async_save, through one writer. ``lost_during``: the
    node whose processes die during step2's replication (their drains held back, so the shared
    tier never gets step2 either)."""
    import threading

    from fastdcp.tiered import replicas as R

    os.environ["FASTDCP_NODE"] = node = _node(rank, per_node)
    saved = threading.Event()
    if node == lost_during:
        def die_during_step2(job):
            if job.shared_path.endswith("step2"):
                saved.wait()
                os._exit(0)  # the node is gone: no acknowledgement, no further bytes
            return real_exchange(job)

        real_exchange, R._exchange = R._exchange, die_during_step2
    with C.gloo_rank_mesh(rank, f"{work}/pg-save", world) as mesh:
        writer = FastTieredWriter(f"{work}/shared/step1", local_root=f"{work}/{node}", replicas=replicas,
                                  async_staging=True, drain_timeout_s=10)
        dcp.save(_state(rank, 1, mesh), storage_writer=writer)
        writer.replicated.result(120)
        writer.wait_durable(120)
        dist.barrier()
        if lost_during is not None and node == lost_during:
            os.environ.update(FASTDCP_TEST_PAUSE_AT="drain", FASTDCP_TEST_PAUSE_S="600")
        result = dcp.async_save(_state(rank, 2, mesh), storage_writer=writer, checkpoint_id=f"{work}/shared/step2")
        getattr(result, "upload_completion", result).result(120)  # committed locally
        if lost_during is None:
            writer.replicated.result(120)
            writer.wait_durable(120)
            dist.barrier()
            return
        saved.set()
        if node != lost_during:
            with pytest.raises(R.ReplicaError, match="peer"):
                writer.replicated.result(120)
        from fastdcp.bench.process_group import exit_spawned_rank

        exit_spawned_rank()  # the lost node's ranks are gone: no barrier, no orderly teardown


def _load_main(rank: int, work: str, world: int, per_node: int, out: str, step: int = 2) -> None:
    os.environ["FASTDCP_NODE"] = _node(rank, per_node)
    with C.gloo_rank_mesh(rank, f"{work}/pg-load", world) as mesh:
        root = f"{work}/{_node(rank, per_node)}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen = newest_checkpoint(f"{work}/shared", local_root=root, from_peers=True)
            reader = FastTieredReader(f"{work}/shared/step{step}", local_root=root, from_peers=True)
            want = _state(rank, step, mesh)
            dest = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in want.items()}
            dcp.load(dest, storage_reader=reader)
        C.assert_same(dest, want)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"chosen": chosen, "tier": reader.tier, "shared_bytes_read": reader.shared_bytes_read,
                       "warnings": [str(w.message) for w in caught if issubclass(w.category, RecoveryWarning)]}, f)
        dist.barrier()


def _run(main, args: tuple, world: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.spawn(main, args=args, nprocs=world, join=True)


def _outcome(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


def _lose(work: Path, node: str) -> None:
    shutil.rmtree(work / node)  # its local tier (RAM disk or NVMe) went with it


@pytest.fixture
def work(tmp_path):
    yield tmp_path


def test_a_lost_node_is_rebuilt_from_its_peers_without_reading_the_shared_tier(work):
    world, per_node = 4, 2
    _run(_save_main, (str(work), world, per_node, 1), world)
    # each node holds its own ranks' files and the other node's, beside sidecars naming them replicas
    for node in ("node0", "node1"):
        directory = local_tier.local_directory(str(work / node), str(work / "shared" / "step2"))
        names = os.listdir(directory)
        assert len([n for n in names if n.endswith(".distcp") and not n.startswith(".")]) == world, names
        assert len([n for n in names if n.startswith(".replica.__")]) == per_node, names
    _lose(work, "node1")
    os.rename(work / "shared", work / "shared-away")  # any read of the shared tier now fails
    _run(_load_main, (str(work), world, per_node, str(work / "out")), world)
    for rank, got in enumerate(_outcome(work / "out", world)):
        assert got["chosen"] == str(work / "shared" / "step2"), got
        assert got["tier"] == "peers" and got["shared_bytes_read"] == 0 and not got["warnings"], (rank, got)
    # the replacement node holds the files its ranks read, each received whole and marked a replica
    rebuilt = local_tier.local_directory(str(work / "node1"), str(work / "shared" / "step2"))
    for name in os.listdir(rebuilt):
        if name.endswith(".distcp") and not name.startswith("."):
            assert os.path.exists(os.path.join(rebuilt, ".replica." + name)), name


def test_a_damaged_replica_is_never_loaded_and_the_shared_tier_is_used(work):
    world, per_node = 4, 2
    _run(_save_main, (str(work), world, per_node, 1), world)
    _lose(work, "node1")
    survivor = Path(local_tier.local_directory(str(work / "node0"), str(work / "shared" / "step2")))
    (victim,) = [p for p in survivor.iterdir() if p.name.startswith("__2_")]  # node1's rank 2, kept by node0
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x20
    victim.write_bytes(bytes(data))
    _run(_load_main, (str(work), world, per_node, str(work / "out")), world)
    got = _outcome(work / "out", world)
    assert {g["tier"] for g in got} == {"shared"}, got
    assert any(victim.name in w and "damaged" in w for g in got for w in g["warnings"]), got
    assert any("cannot be rebuilt" in w and victim.name in w for g in got for w in g["warnings"]), got
    assert not victim.exists()  # removed, so the next restart does not try it again
    # the step2 chosen is the shared tier's; the load read it from there
    assert all(g["chosen"] == str(work / "shared" / "step2") and g["shared_bytes_read"] > 0 for g in got), got


def test_two_lost_nodes_with_one_replica_fall_back_to_the_shared_tier(work):
    world, per_node = 3, 1
    _run(_save_main, (str(work), world, per_node, 1), world)
    _lose(work, "node1")
    _lose(work, "node2")  # rank 1's files were on node1 and (its replica) on node2
    _run(_load_main, (str(work), world, per_node, str(work / "out")), world)
    got = _outcome(work / "out", world)
    assert {g["tier"] for g in got} == {"shared"} and got[0]["shared_bytes_read"] > 0, got
    assert any("on no surviving node" in w for g in got for w in g["warnings"]), got


def test_a_node_lost_during_replication_leaves_the_previous_checkpoint_recoverable(work):
    world, per_node = 4, 2
    _run(_save_main, (str(work), world, per_node, 1, "node1"), world)
    assert not (work / "shared" / "step2" / ".metadata").exists()  # its drain never finished either
    _lose(work, "node1")
    _run(_load_main, (str(work), world, per_node, str(work / "out"), 1), world)
    for got in _outcome(work / "out", world):  # step2's node1 files are nowhere: step1, from the peers
        assert got["chosen"] == str(work / "shared" / "step1"), got
        assert got["tier"] == "peers" and got["shared_bytes_read"] == 0, got


def _two_nodes_main(rank: int, work: str, told_by: str) -> None:
    if told_by == "torchrun":  # torchrun's environment for 2 nodes of 2 ranks: a node's ranks are consecutive
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    else:
        os.environ["FASTDCP_NODE"] = f"n{rank // 2}"
    with C.gloo_rank_mesh(rank, f"{work}/pg", 4) as mesh:
        writer = FastTieredWriter(f"{work}/shared/step1", local_root=f"{work}/node{rank // 2}")
        dcp.save(_state(rank, 1, mesh), storage_writer=writer)
        writer.wait_durable(120)
        dist.barrier()


@pytest.mark.parametrize("told_by", ["torchrun", "FASTDCP_NODE"])
def test_without_replicas_each_node_commits_its_own_ranks_files_locally(work, told_by):
    _run(_two_nodes_main, (str(work), told_by), 4)
    for node, ranks in (("node0", {0, 1}), ("node1", {2, 3})):
        directory = local_tier.local_directory(str(work / node), str(work / "shared" / "step1"))
        names = [n for n in os.listdir(directory) if n.endswith(".distcp")]
        assert {int(n.split("_")[2]) for n in names} == ranks, names
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(work / "shared" / "step1")).read_metadata()
    assert len(local_tier.files_named(metadata)) == 4  # the shared tier has the whole checkpoint


def test_peers_follow_the_node_map():
    nodes = NodeMap.from_names(["a", "a", "b", "b", "c", "c"])
    assert nodes.nodes == ((0, 1), (2, 3), (4, 5))
    assert nodes.targets(0, 1) == [2] and nodes.targets(5, 1) == [1] and nodes.targets(1, 2) == [3, 5]
    assert nodes.sources(2, 1) == [0] and nodes.sources(1, 2) == [3, 5]
    for rank in range(6):  # no rank keeps its own replica, or two of one source
        for k in (1, 2):
            targets = nodes.targets(rank, k)
            assert len(set(map(nodes.node_of, targets))) == k and nodes.node_of(rank) not in map(nodes.node_of, targets)
    uneven = NodeMap.from_names(["x", "y", "y", "y"])
    assert uneven.targets(3, 1) == [0] and uneven.sources(0, 1) == [1, 2, 3]


def test_a_directory_with_replicas_is_evicted_only_once_the_shared_tier_holds_the_checkpoint(tmp_path):
    directory = tmp_path / "step1-abc"
    directory.mkdir()
    for name in ("__0_aa_0.distcp", "__1_aa_0.distcp", ".drained.rank0"):
        (directory / name).write_bytes(b"x")
    (directory / ".replica.__1_aa_0.distcp").write_text(json.dumps({"size": 1, "crc32c": 0}))
    local_tier.record_shared_location(str(directory), "/shared/step1")
    assert not local_tier.is_durable(str(directory))  # rank 1's copy elsewhere is not seen from here
    assert not local_tier.is_durable(str(directory), lambda location: False)
    assert local_tier.is_durable(str(directory), lambda location: location == "/shared/step1")
    os.unlink(directory / ".drained.rank0")  # its own rank not drained yet: never
    assert not local_tier.is_durable(str(directory), lambda location: True)


def _one_node_main(rank: int, work: str) -> None:
    with C.gloo_rank_mesh(rank, f"{work}/pg", 2):
        os.environ["FASTDCP_NODE"] = "same"
        with pytest.raises(ValueError, match=r"replicas=1.*more than 1 nodes.*FASTDCP_NODE"):
            FastTieredWriter(f"{work}/shared/s", local_root=f"{work}/local", replicas=1)


def test_replicas_without_a_second_node_or_in_another_process_are_refused_clearly(tmp_path):
    _run(_one_node_main, (str(tmp_path),), 2)
    with pytest.raises(ValueError, match="replicas must be an int >= 0"):
        FastTieredWriter(str(tmp_path / "s"), local_root=str(tmp_path / "l"), replicas=-1)
    writer = FastTieredWriter(str(tmp_path / "s"), local_root=str(tmp_path / "l"), replicas=1)
    with pytest.raises(TypeError, match="thread mode"):
        pickle.dumps(writer)
    with pytest.raises(CheckpointException, match="needs torch.distributed initialized"):
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, no_dist=True)


def _wire_main(rank: int, work: str) -> None:
    from fastdcp.tiered.peers import peer_group, recv_file, send_file, wait_all

    with C.gloo_rank_mesh(rank, f"{work}/pg", 2):
        os.environ["FASTDCP_NODE"] = f"n{rank}"
        peers = peer_group()
        if rank == 0:
            works = []
            for name, data in (("a", b"x" * 5000), ("b", bytes(range(256)) * 40)):
                Path(work, name).write_bytes(data)
                works += send_file(peers.group, 1, os.path.join(work, name))[0]
            wait_all(works)
        else:
            with pytest.raises(FileNotFoundError):  # its directory went (evicted) while it arrived
                recv_file(peers.group, 0, os.path.join(work, "gone", "a"))
            assert recv_file(peers.group, 0, os.path.join(work, "b-copy"))[0] == 10240
            assert Path(work, "b-copy").read_bytes() == bytes(range(256)) * 40  # the stream stayed in step
            assert not [n for n in os.listdir(work) if n.endswith(".part")]
        dist.barrier()


def test_a_file_that_cannot_be_written_is_still_read_off_the_wire(tmp_path):
    _run(_wire_main, (str(tmp_path),), 2)
