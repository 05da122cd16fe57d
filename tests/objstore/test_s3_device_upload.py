"""Device tensors to S3 through the pinned ring (``fastdcp.objstore.device_upload``), on the CPU:
stand-in device tensors (``fastdcp.io.copy_engine``), and CPU tensors routed through the ring with
a copier whose copies land only when waited for (a part uploaded before its copy landed, or a slot
refilled while the client still sends it, shows up as wrong bytes in the object). Every load is
bit-exact, with stock's fsspec reader and with fastdcp, into stand-in device destinations through
the pinned load pipeline; a failed upload gives every slot and the pinned memory back."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from s3_cases import keys
from stand_in_copier import DeferredCopier, cpu_as_device  # noqa: F401 - a fixture
from fastdcp import FastS3Reader, FastS3Writer, S3Options
from fastdcp.io.copy_engine import is_standin_device_tensor, to_standin_device
from fastdcp.io.pinned_pool import pinned_pool_stats
from fastdcp.objstore.device_upload import UploadRing, ring_slots

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PART = 5 << 20  # S3's smallest part: many parts, many slot reuses
SMALL_PARTS = S3Options(part_bytes=PART, concurrency=4)


def _state(seed: int) -> dict:
    return {
        "big": C.random_float((3 << 20,), (seed, "big")),               # 12 MiB: parts across tensors
        "odd": C.random_float((1_234_567,), (seed, "odd")),             # not a multiple of a block
        "bf16": C.random_float((700, 1001), (seed, "bf16"), torch.bfloat16),
        "small": C.random_float((17,), (seed, "small")),
        "step": 42,                                                     # bytes beside the tensors
    }


def _stock_load(url: str, endpoint: str, expected: dict) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dest = C.destination_for(expected)
    dcp.load(dest, storage_reader=FsspecReader(url, endpoint_url=endpoint), no_dist=True)
    C.assert_same(dest, expected)


def _fast_load(url: str, expected: dict) -> None:
    dest = C.destination_for(expected)
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, expected)


@pytest.mark.parametrize("files", [1, 3])
def test_parts_copied_late_through_two_slots_upload_the_right_bytes(bucket, s3_env, cpu_as_device, files):
    url = f"s3://{bucket}/ring{files}"
    sd = _state(files)
    writer = FastS3Writer(url, thread_count=files, s3_options=SMALL_PARTS, pinned_ring_limit_bytes=2 * PART)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    stored = 4 * ((3 << 20) + 1_234_567) + 2 * 700 * 1001
    assert writer.last_ring_parts >= stored // PART, writer.last_ring_parts
    assert sum(c.copies for c in cpu_as_device) >= 4  # every tensor went through the copier
    assert pinned_pool_stats().bytes_leased == 0
    _stock_load(url, s3_env.endpoint, sd)
    _fast_load(url, sd)


def test_a_standin_device_state_goes_through_the_ring_and_loads_into_device_tensors(bucket, s3_env):
    url = f"s3://{bucket}/standin"
    host = {k: v for k, v in _state(7).items() if isinstance(v, torch.Tensor)}
    sd = {k: to_standin_device(v) for k, v in host.items()}
    assert all(is_standin_device_tensor(v) for v in sd.values())
    writer = FastS3Writer(url, s3_options=SMALL_PARTS)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert writer.last_ring_parts >= 3
    _stock_load(url, s3_env.endpoint, host)
    dest = {k: to_standin_device(torch.full_like(v, 7)) for k, v in host.items()}
    reader = FastS3Reader(url, read_buffer_limit_bytes=4 << 20)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    C.assert_same(dest, host)
    assert reader.last_stats["gpu_pieces"] >= len(host)  # through the pinned load pipeline
    assert reader.last_stats["object_requests"] >= 3


def test_a_failed_device_upload_gives_the_slots_and_the_pinned_memory_back(bucket, s3_env, s3, cpu_as_device):
    url = f"s3://{bucket}/failed"
    s3_env.fault("PUT_PART", count=10_000, status=500)
    impatient = S3Options(part_bytes=PART, concurrency=4, max_retries=1, retry_timeout_s=3, request_timeout_s=10)
    started = time.monotonic()
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/failed/__0_\w+_\d+\.distcp"):
        dcp.save(_state(3), storage_writer=FastS3Writer(url, s3_options=impatient), no_dist=True)
    elapsed = time.monotonic() - started
    s3_env.reset()
    assert elapsed < 30, f"the failed save took {elapsed:.1f} s: a slot was waited for"
    assert pinned_pool_stats().bytes_leased == 0
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert keys(s3, bucket) == set()


def test_ring_slots_cover_the_parts_in_flight_within_the_limit():
    assert ring_slots(1 << 30, 8 << 20, objects=2, parts_in_flight=8) == 18
    assert ring_slots(64 << 20, 8 << 20, objects=2, parts_in_flight=8) == 8
    assert ring_slots(1 << 20, 8 << 20, objects=4, parts_in_flight=8) == 1  # never none


def test_a_slot_is_free_again_only_once_every_view_of_it_is_dropped():
    ring = UploadRing(4096, 1, DeferredCopier())
    index = ring.take()
    part = ring.hand_out(index, 100)
    held = memoryview(part)  # what a client keeps while its request is in flight
    del part
    gc.collect()
    assert ring._free == []
    del held
    assert ring._free == [index]
    ring.close(timeout=1)
    assert pinned_pool_stats().bytes_leased == 0


def test_closing_waits_for_a_slot_the_client_still_holds(caplog):
    before = pinned_pool_stats().bytes_leased
    ring = UploadRing(4096, 2, DeferredCopier())
    held = np.asarray(ring.hand_out(ring.take(), 10))
    ring.close(timeout=0.2)
    assert "still held by the object storage client" in caplog.text
    assert pinned_pool_stats().bytes_leased > before  # kept out of the pool, never reused
    del held
