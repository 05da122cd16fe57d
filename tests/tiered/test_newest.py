"""Resuming a tiered run: ``newest_checkpoint`` picks the newest checkpoint every rank can load,
from its local tier or the shared one (one process; two gloo ranks as two nodes; an S3 parent)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import dcp_cases as C
from fastdcp import FastTieredWriter
from fastdcp.tiered import newest_checkpoint


@pytest.fixture
def local_root():
    root = Path("/dev/shm") / f"fastdcp-test-{uuid.uuid4().hex[:10]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _save(shared: str, local_root, seed: int) -> FastTieredWriter:
    writer = FastTieredWriter(shared, local_root=local_root)
    dcp.save({"w": torch.full((64,), float(seed)), "step": seed}, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    return writer


def test_the_newest_is_local_when_only_the_local_tier_holds_it(tmp_path, local_root):
    parent = tmp_path / "run"
    for step in (9, 10):
        _save(str(parent / f"step{step}"), local_root, step)
    assert newest_checkpoint(parent, local_root=local_root) == str(parent / "step10")  # 10 after 9, not as text
    # step11 committed locally, its drain not finished (no .metadata in the shared tier yet)
    writer = _save(str(parent / "step11"), local_root, 11)
    (parent / "step11" / ".metadata").unlink()
    assert newest_checkpoint(parent, local_root=local_root) == str(parent / "step11")
    # ... and its local copy gone: the newest durable one
    shutil.rmtree(writer.local_path)
    assert newest_checkpoint(parent, local_root=local_root) == str(parent / "step10")
    assert newest_checkpoint(tmp_path / "nothing", local_root=local_root) is None


def _rank_main(rank: int, store: str, parent: str, roots: list[str]) -> None:
    with C.gloo_rank_mesh(rank, store, 2):
        got = newest_checkpoint(parent, local_root=roots[rank])
        assert got == os.path.join(parent, "step2"), (rank, got)


def test_two_nodes_agree_on_the_newest_checkpoint_both_can_load(tmp_path, local_root):
    parent = tmp_path / "run"
    for step in (1, 2, 3):
        _save(str(parent / f"step{step}"), local_root, step)
    (parent / "step3" / ".metadata").unlink()  # step3: only in the first node's local tier
    other_node = tmp_path / "other-node-local"   # the second rank's node holds no local copy
    mp.spawn(_rank_main, args=(str(tmp_path / "pg"), str(parent), [str(local_root), str(other_node)]),
             nprocs=2, join=True)


def test_an_s3_parent(bucket, s3_env, local_root):
    parent = f"s3://{bucket}/run"
    for step in (1, 2):
        _save(f"{parent}/step{step}", local_root, step)
    shutil.rmtree(local_root)
    assert newest_checkpoint(parent, local_root=local_root) == f"{parent}/step2"
