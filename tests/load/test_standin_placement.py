"""Loads into stand-in device tensors (``fastdcp.io.copy_engine``) run the GPU load pipeline of
``fastdcp.load.gpu_placement`` on the CPU: pinned slots read ahead by a reader thread, uploads and
the box copy (the kernel's packed descriptors, run by the native CPU box copy) in order on the
stand-in's stream, fallback copies for what the kernel does not take. Every load is bit-exact,
through many slots, resharded, converting dtypes, into strided destinations."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from fastdcp import FastFileSystemReader
from fastdcp.io.copy_engine import is_standin_device_tensor, to_standin_device
from fastdcp.io.phases import recording
from fastdcp.load import gpu_placement as G

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _standin(sizes, dtype, layout):
    """A stand-in device destination of ``layout`` (as ``C.box_destination``), filled with 7s."""
    local = C.box_destination(sizes, dtype, layout)
    base = to_standin_device(torch.empty(local.untyped_storage().nbytes(), dtype=torch.uint8))
    view = base.view(dtype).as_strided(local.shape, local.stride(), local.storage_offset())
    view.copy_(local)
    view._keep_base = base  # the registration lives as long as the base tensor
    assert is_standin_device_tensor(view)
    return view


@pytest.mark.parametrize("writer_kind", ["stock", "fast"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "offset", "convert"])
def test_standin_load_resharded_through_many_slots(tmp_path, writer_kind, layout):
    saved = C.box_state(11)
    C.save(saved, C.make_writer(writer_kind, tmp_path))
    rng = random.Random(f"{writer_kind}-{layout}")

    def destination(sizes, dtype):
        if layout == "convert":
            return _standin(sizes, C.CONVERTED_DTYPE[dtype], "contiguous")
        return _standin(sizes, dtype, layout)

    for _ in range(2):
        slices, dest, expected = C.random_boxes(saved, rng, destination)
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=16 << 10)
        dcp.load(dest, storage_reader=reader, planner=C.SliceLoadPlanner(slices), no_dist=True)
        for name in saved:
            C.assert_tensor_bitexact(C.packed(dest[name]), C.packed(expected[name]), f"{name} {slices[name]}")
        stats = reader.last_stats
        assert stats["gpu_pieces"] >= len(saved) and stats["gpu_kernel_boxes"] > 0
        assert stats["gpu_batches"] >= 2 and stats["gpu_slots"] == min(G.SLOTS, stats["gpu_batches"])
        if layout == "convert":
            assert stats["gpu_fallback_copies"] >= 1  # complex64 -> complex128: not a kernel conversion


def test_standin_load_of_a_whole_state_reports_its_phases(tmp_path):
    saved = {f"w{i}": torch.randn(128, 1024) for i in range(8)}
    C.save(saved, C.make_writer("fast", tmp_path))
    dest = {k: to_standin_device(torch.zeros(128, 1024)) for k in saved}
    with recording() as rec:
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=1 << 20)
        dcp.load(dest, storage_reader=reader, no_dist=True)
    for k, v in saved.items():
        assert torch.equal(dest[k], v)
    stats = reader.last_stats
    assert stats["gpu_batches"] > G.SLOTS, "the load went through several rounds of slots"
    phases = rec.phases()
    assert {"pin", "read_wait", "h2d_issue", "h2d_wait"} <= set(phases)
    assert "read" in phases.get("background", {}), "the reads ran on the reader thread"


def test_a_failing_standin_copy_fails_the_load(tmp_path, monkeypatch):
    saved = {"w": torch.randn(64, 64)}
    C.save(saved, C.make_writer("fast", tmp_path))
    dest = {"w": to_standin_device(torch.zeros(64, 64))}

    def broken(self, table, num_boxes):
        raise ValueError("injected kernel failure")

    monkeypatch.setattr(G._StandInDevice, "launch",
                        lambda self, side, *a: side.enqueue(lambda: broken(self, *a[:2])))
    with pytest.raises(BaseException, match="injected kernel failure"):
        dcp.load(dest, storage_reader=FastFileSystemReader(tmp_path), no_dist=True)
