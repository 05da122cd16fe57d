"""``fastdcp.warm_up``: after it, the first save of a process finds its pinned ring and its staging
slab in the pools instead of allocating them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
import fastdcp
from fastdcp.io.copy_engine import to_standin_device
from fastdcp.io.pinned_pool import reset_pinned_pool
from fastdcp.save.staging_pool import reset_staging_pool

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_pools():
    reset_pinned_pool()
    reset_staging_pool()
    yield
    reset_pinned_pool()
    reset_staging_pool()


def _state():
    return {"w": to_standin_device(torch.randn(256, 1024)), "b": to_standin_device(torch.arange(77.0)),
            "step": 3, "nested": {"m": to_standin_device(torch.ones(33, 5, dtype=torch.bfloat16))}}


def test_after_warm_up_the_first_save_and_async_save_allocate_nothing(tmp_path):
    sd = _state()
    report = fastdcp.warm_up(sd, ring_bytes=8 * MIB, load_bytes=4 * MIB)
    assert report.pinned_bytes == 12 * MIB and report.staging_bytes > 0 and report.seconds >= 0
    pinned, staging = fastdcp.pinned_pool_stats(), fastdcp.staging_pool_stats()
    assert staging.slabs_allocated == 1 and staging.slabs_idle == 1 and staging.bytes_in_use == 0

    expected = C.deepcopy_state_dict(sd)
    dcp.save(sd, storage_writer=fastdcp.FastFileSystemWriter(tmp_path / "sync", pinned_ring_limit_bytes=8 * MIB),
             no_dist=True)
    future = dcp.async_save(sd, storage_writer=fastdcp.FastFileSystemWriter(tmp_path / "async"), no_dist=True)
    getattr(future, "upload_completion", future).result()
    assert fastdcp.pinned_pool_stats().buffers_allocated == pinned.buffers_allocated, "the ring was pinned again"
    after = fastdcp.staging_pool_stats()
    assert after.slabs_allocated == 1 and after.slabs_reused == 1, "async_save staged into a new slab"
    for name in ("sync", "async"):
        C.load_in_place_and_check(C.make_reader("stock", tmp_path / name), expected, C.destination_for(expected))


def test_warm_up_without_a_state_pins_only_and_twice_is_once():
    fastdcp.warm_up(ring_bytes=2 * MIB, load_bytes=None)
    fastdcp.warm_up(ring_bytes=2 * MIB, load_bytes=None)
    stats = fastdcp.pinned_pool_stats()
    assert stats.buffers_allocated == 1 and stats.bytes_held == 2 * MIB
    assert fastdcp.staging_pool_stats().slabs_allocated == 0


def test_warm_up_refuses_negative_sizes():
    with pytest.raises(ValueError, match="warm_up"):
        fastdcp.warm_up(ring_bytes=-1)
