"""ShardedTensor states staged for ``dcp.async_save`` on two gloo ranks, with staging memory
unpinned and pinned (fake-pinned mode: ``Tensor.is_pinned()`` true inside the slab, as under CUDA).

A staged ShardedTensor must carry metadata that matches its staged shards: torch checks each local
shard's ``is_pinned()`` and device against it. On a GPU machine the live metadata says unpinned
and ``cuda:N`` while the staged shards are pinned host memory; both must be rewritten. Shards
placed on ``cuda:N`` are played here by CPU tensors whose metadata names ``cuda:{rank}`` (what the
stager reads of a device ShardedTensor). Every checkpoint is read back by stock's reader,
bit-exact, after the live tensors were overwritten.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import dcp_cases as C

ROWS, COLS = 16, 4  # four chunks of 4 rows: two local shards per rank

CASES = [  # (shard placement in the live metadata, staging, executor)
    ("cpu", "blocking", "thread"),
    ("cuda", "blocking", "thread"),
    ("cuda", "blocking", "process"),
    ("cpu", "overlapped", "thread"),
    ("cuda", "overlapped", "thread"),
    ("cuda", "overlapped-budget", "thread"),
]


def _sharded(rank: int, step: int, device: str, fill: float | None = None):
    """A [ROWS, COLS] ShardedTensor, chunks of 4 rows alternating between the ranks (two local
    shards each); with ``device="cuda"`` every placement names ``cuda:{rank}`` while the tensors
    stay on the CPU."""
    import torch.distributed._shard.sharded_tensor as sharded
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:0/cpu", "rank:1/cpu"])
    st = sharded.empty(spec, ROWS, COLS)
    for shard in st.local_shards():
        rows = shard.metadata.shard_offsets[0]
        value = torch.arange(rows * COLS, (rows + 4) * COLS, dtype=torch.float32).reshape(4, COLS) + 1000 * step
        shard.tensor.copy_(value if fill is None else torch.full_like(value, fill))
    if device == "cuda":
        placed = [shard.metadata for shard in st.local_shards()] + list(st.metadata().shards_metadata)
        for shard_metadata in placed:
            shard_metadata.placement._device = torch.device("cuda", shard_metadata.placement.rank())
    return st


def _expected(rank: int, step: int) -> list[torch.Tensor]:
    return [shard.tensor.clone() for shard in _sharded(rank, step, "cpu").local_shards()]


def _check_staged(writer, staged, rank: int, pinned: bool) -> None:
    """The staged ShardedTensor: its shards in the slab, its metadata matching them."""
    st = staged["st"]
    slab = writer._stager._slab
    lo, hi = slab.ptr, slab.ptr + slab.nbytes
    assert slab.pinned is pinned, (slab.pinned, pinned)
    for shard in st.local_shards():
        assert lo <= shard.tensor.data_ptr() < hi
        assert shard.tensor.is_pinned() is pinned
        assert shard.metadata.placement.device() == torch.device("cpu"), shard.metadata
    properties = st.metadata().tensor_properties
    assert properties.pin_memory is pinned, properties
    assert all(m.placement.device() == torch.device("cpu") for m in st.metadata().shards_metadata), st.metadata()
    assert [s.metadata.shard_offsets for s in st.local_shards()] == [[4 * rank, 0], [4 * rank + 8, 0]]


def _rank_main(rank: int, root: str, pinned: bool) -> None:
    if pinned:
        os.environ["FASTDCP_TEST_FAKE_PINNED"] = "1"
    else:  # whatever the suite runs under
        os.environ.pop("FASTDCP_TEST_FAKE_PINNED", None)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from fastdcp import FastFileSystemWriter

    with C.gloo_rank_mesh(rank, os.path.join(root, "store")):
        # Staged directly: the staged ShardedTensor and its metadata.
        writer = FastFileSystemWriter(os.path.join(root, "direct"))
        staged = writer.stage({"st": _sharded(rank, 0, "cuda")})
        _check_staged(writer, staged, rank, pinned)
        del staged
        writer._release_staging()

        shard_bytes = 4 * COLS * 4
        for index, (device, staging, executor) in enumerate(CASES):
            options = {}
            if staging.startswith("overlapped"):
                options["async_staging"] = True
            if staging == "overlapped-budget":
                # room for one of the two local shards: a ShardedTensor is staged or streamed whole
                options["snapshot_limit_bytes"] = shard_bytes + 32
            path = os.path.join(root, f"case{index}")
            writer = FastFileSystemWriter(path, **options)
            st = _sharded(rank, index, device)
            plain = torch.full((8,), float(10 * index + 1))  # replicated: the same on every rank
            kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
            response = dcp.async_save({"st": st, "w": plain}, storage_writer=writer, checkpoint_id=path,
                                      async_checkpointer_type=kind)
            staging_done = getattr(response, "staging_completion", None)
            if staging_done is not None:
                staging_done.result()  # the guard's job in training: live tensors change after it
            if staging == "overlapped-budget":
                report = writer._stager.last_report
                assert report.streamed_bytes == 2 * shard_bytes, report  # both shards, not one
            for shard in st.local_shards():
                shard.tensor.fill_(-1)
            plain.fill_(-1)
            getattr(response, "upload_completion", response).result()
            dist.barrier()
            dest = {"st": _sharded(rank, index, "cpu", fill=0.0), "w": torch.zeros(8)}
            dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
            loaded = [shard.tensor for shard in dest["st"].local_shards()]
            for got, want in zip(loaded, _expected(rank, index)):
                C.assert_tensor_bitexact(got, want, f"case {CASES[index]} rank {rank}")
            assert torch.equal(dest["w"], torch.full((8,), float(10 * index + 1))), CASES[index]


@pytest.mark.fastdcp_timeout(300)
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "fake-pinned"])
def test_async_save_of_a_sharded_tensor_state_on_two_ranks(tmp_path: Path, pinned: bool):
    """Blocking and overlapped staging, thread and process executors, shards placed on the CPU and
    on a device: every checkpoint is the state at the call, read back by stock's reader."""
    mp.start_processes(_rank_main, args=(str(tmp_path), pinned), nprocs=2, join=True, start_method="spawn")
