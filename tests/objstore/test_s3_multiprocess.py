"""Two ranks (torch.multiprocessing + gloo) save DTensors to S3 (moto's server on 127.0.0.1) with
fastdcp and load them resharded with fastdcp; stock's FsspecReader loads the same checkpoint in
one process, and fastdcp loads a checkpoint two ranks saved with stock's FsspecWriter."""

from __future__ import annotations


import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import dcp_cases as C

ROWS, COLS = 64, 48


def _full() -> dict[str, torch.Tensor]:
    return {"w": C.random_tensor(torch.float32, (ROWS, COLS), ("s3mp", "w")),
            "b": C.random_tensor(torch.bfloat16, (ROWS,), ("s3mp", "b"))}


def _rank_main(rank: int, store: str, url: str, writer_kind: str, endpoint: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fastdcp import FastS3Reader, FastS3Writer

    with C.gloo_rank_mesh(rank, store, 2) as mesh:
        full = _full()
        state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": distribute_tensor(full["b"], mesh, [Replicate()]),
                 "step": 11}
        if writer_kind == "fast":
            writer = FastS3Writer(url)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(url, endpoint_url=endpoint, sync_files=False)
        dcp.save(state, storage_writer=writer)
        # Resharded: rows -> columns, and the replicated vector sharded.
        dest = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
                "b": distribute_tensor(torch.zeros(ROWS, dtype=torch.bfloat16), mesh, [Shard(0)]), "step": 0}
        reader = FastS3Reader(url)
        dcp.load(dest, storage_reader=reader)
        C.assert_same({"w": dest["w"].full_tensor(), "b": dest["b"].full_tensor()}, full, f"rank {rank}")
        assert dest["step"] == 11
        # A rank fetched its half of the columns' rows: at most the bytes it needs plus the runs'
        # coalescing gaps (a column half of a row is 96 bytes apart from the next row's), and
        # never the other checkpoint file whole.
        if writer_kind == "fast":
            assert reader.last_stats["object_bytes"] <= ROWS * COLS * 4 + ROWS * 2 + (64 << 10), reader.last_stats


def _run(tmp_path, url: str, writer_kind: str, endpoint: str) -> None:
    store = str(tmp_path / f"pg-{writer_kind}")
    mp.spawn(_rank_main, args=(store, url, writer_kind, endpoint), nprocs=2, join=True)


def test_two_ranks_save_to_s3_and_load_resharded(tmp_path, bucket, s3_env):
    url = f"s3://{bucket}/mp-fast"
    _run(tmp_path, url, "fast", s3_env.endpoint)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dest = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS, dtype=torch.bfloat16), "step": 0}
    dcp.load(dest, storage_reader=FsspecReader(url, endpoint_url=s3_env.endpoint), no_dist=True)
    C.assert_same({k: dest[k] for k in ("w", "b")}, _full())
    assert dest["step"] == 11


def test_fastdcp_loads_two_ranks_stock_fsspec_checkpoint_resharded(tmp_path, bucket, s3_env):
    _run(tmp_path, f"s3://{bucket}/mp-stock", "stock", s3_env.endpoint)
