"""Resharding reads on the CPU: random boxes of 1-4-D stored tensors (stock- and fastdcp-written)
placed into destinations of every layout and dtype, under a tiny staging budget; and the bytes the
reader reads against the bytes it needs."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from fastdcp import FastFileSystemReader

STORED = {
    "v1": ((1000,), torch.float32),
    "m2": ((63, 47), torch.float32),
    "b3": ((7, 13, 11), torch.bfloat16),
    "i4": ((3, 5, 7, 9), torch.int16),
    "wide": ((96, 384), torch.float32),  # 1.5 KiB rows: runs long enough to read in place
    "h2": ((40, 33), torch.float16),
}


def _stored_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in STORED.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-30000, 30000, shape, generator=g).to(dtype)
    # a tensor stored with non-contiguous strides (stock keeps x.t()'s strides in its blob)
    out["t2"] = torch.randn(29, 31, generator=g).t()
    return out


def _destination(sizes: list[int], dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "convert":
        dtype = torch.float64 if dtype.is_floating_point else torch.int64
    return C.box_destination(sizes, dtype, layout)


@pytest.mark.parametrize("writer_kind", ["stock", "fast"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "offset", "convert"])
def test_random_boxes_into_every_layout(tmp_path, writer_kind, layout):
    saved = _stored_state(11)
    C.save(saved, C.make_writer(writer_kind, tmp_path))
    rng = random.Random(f"{writer_kind}-{layout}")
    for round_ in range(3):
        slices, dest, expected = {}, {}, {}
        for name, tensor in saved.items():
            offsets, sizes = C.random_box(rng, tuple(tensor.shape))
            slices[name] = (offsets, sizes)
            dest[name] = _destination(sizes, tensor.dtype, layout)
            expected[name] = C.box(tensor, offsets, sizes).to(dest[name].dtype)
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=16 << 10)
        dcp.load(dest, storage_reader=reader, planner=C.SliceLoadPlanner(slices), no_dist=True)
        for name in saved:
            C.assert_tensor_bitexact(C.packed(dest[name]), C.packed(expected[name]), f"{name} round {round_} {slices[name]}")
        stats = reader.last_stats
        assert stats["max_staging_bytes"] <= 16 << 10
        assert stats["bytes_read"] >= stats["bytes_needed"] or stats["window_pieces"] > 0


def test_long_runs_are_read_without_amplification(tmp_path):
    # 64 rows of 128 KiB; a Shard(1)-like box takes half of every row: runs of 64 KiB with 64 KiB gaps.
    saved = {"w": torch.randn(64, 65536).to(torch.bfloat16)}
    C.save(saved, C.make_writer("fast", tmp_path))
    for dtype in (torch.bfloat16, torch.float32):  # in place (runs) and staged (conversion)
        dest = {"w": torch.zeros(64, 32768, dtype=dtype)}
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=1 << 20)
        dcp.load(dest, storage_reader=reader, planner=C.SliceLoadPlanner({"w": ([0, 32768], [64, 32768])}), no_dist=True)
        C.assert_tensor_bitexact(dest["w"], C.packed(saved["w"][:, 32768:].to(dtype)), f"w as {dtype}")
        stats = reader.last_stats
        assert stats["bytes_needed"] == 64 * 32768 * 2
        assert stats["bytes_read"] <= 1.05 * stats["bytes_needed"], stats
        assert stats["requests"] >= 64  # one per run: the 64 KiB gaps were not read


def test_row_shards_read_only_their_rows(tmp_path):
    # Shard(0) at world size 2 -> 4: each new shard is a quarter of the rows, read in one request.
    saved = {"w": torch.randn(256, 1024)}
    C.save(saved, C.make_writer("fast", tmp_path))
    for quarter in range(4):
        dest = {"w": torch.zeros(64, 1024)}
        reader = FastFileSystemReader(tmp_path)
        box = ([64 * quarter, 0], [64, 1024])
        dcp.load(dest, storage_reader=reader, planner=C.SliceLoadPlanner({"w": box}), no_dist=True)
        C.assert_tensor_bitexact(dest["w"], saved["w"][64 * quarter : 64 * (quarter + 1)], f"quarter {quarter}")
        assert reader.last_stats["bytes_read"] == 64 * 1024 * 4
        assert reader.last_stats["requests"] == 1 and reader.last_stats["staged_pieces"] == 0


def test_checkpoint_larger_than_budget(tmp_path):
    saved = {f"w{i}": torch.randn(256, 256) for i in range(6)}  # 6 x 256 KiB
    C.save(saved, C.make_writer("stock", tmp_path))
    dest = {k: torch.zeros(256, 256, dtype=torch.float64) for k in saved}  # staged: dtype conversion
    budget = 200 << 10
    reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=budget)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    for k, v in saved.items():
        C.assert_tensor_bitexact(dest[k], v.double(), k)
    assert reader.last_stats["staging_batches"] > 1
    assert reader.last_stats["max_staging_bytes"] <= budget


def test_last_stats_carry_every_placement_counter(tmp_path):
    """``last_stats`` is the run's ``PlacementStats`` as a dict (plus the reader's own counters)."""
    import dataclasses

    from fastdcp.load.placement_stats import PlacementStats

    saved = {"w": torch.randn(64, 64)}
    C.save(saved, C.make_writer("fast", tmp_path))
    reader = FastFileSystemReader(tmp_path)
    dcp.load({"w": torch.zeros(64, 64, dtype=torch.float64)}, storage_reader=reader, no_dist=True)
    for field in dataclasses.fields(PlacementStats):
        assert isinstance(reader.last_stats[field.name], int if field.type == "int" else float), field.name
    assert reader.last_stats["bytes_needed"] == 64 * 64 * 4 and reader.last_stats["gpu_batches"] == 0
    assert {"plan_seconds", "blobs_recognised"} <= set(reader.last_stats)
