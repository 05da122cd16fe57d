"""The GPU save path (``fastdcp.save.device_ring``): file images whose tensor bytes are copied
device-to-host through a pinned ring while earlier slots are written.

Without a GPU the same pipeline runs with CPU tensors standing in for device tensors and a copier
that defers its copies until they are waited for (as a real asynchronous copy would be late), so a
write that does not wait for its copies, or a slot refilled before its write returned, shows up as
wrong bytes in the file. With a GPU, real CUDA tensors are saved and read back by stock DCP.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from stand_in_copier import DeferredCopier, cpu_as_device  # noqa: F401 - a fixture
from fastdcp import FastFileSystemWriter, _C
from fastdcp.io.staging_pipeline import StagingPipeline
from fastdcp.save.device_ring import cut_ranges, interleave, write_device_images
from fastdcp.save.file_sink import ring_shape
from fastdcp.io.engine import DIRECT_ALIGN, IoOptions, get_engine
from fastdcp.io.pinned_pool import pinned_pool_stats, reset_pinned_pool

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _image(size: int, segments: list[tuple], device: list[tuple[int, torch.Tensor]]) -> bytes:
    out = bytearray(size)
    for seg in segments:
        if len(seg) == 2:
            out[seg[0] : seg[0] + len(seg[1])] = bytes(seg[1])
        else:
            raise AssertionError("pointer segments are not used here")
    for offset, t in device:
        out[offset : offset + t.numel()] = bytes(t.numpy().tobytes())
    return bytes(out)


def _random_image(rng: random.Random, size: int):
    """Alternating host byte segments and 4096-aligned device pieces inside [0, size)."""
    segments, device, at = [], [], 0
    while at < size:
        head = rng.randint(1, 300)
        if at + head > size:
            break
        segments.append((at, bytes(rng.getrandbits(8) for _ in range(head))))
        at = -(-(at + head) // DIRECT_ALIGN) * DIRECT_ALIGN
        n = rng.choice([1, 100, DIRECT_ALIGN, 3 * DIRECT_ALIGN + 17, 40_000])
        if at + n > size:
            break
        device.append((at, torch.randint(0, 256, (n,), dtype=torch.uint8)))
        at += n
    return segments, device, max(at, 1)


@pytest.mark.parametrize("seed", range(6))
def test_cut_ranges_partition_the_image(seed):
    rng = random.Random(seed)
    segments, device, size = _random_image(rng, rng.choice([5_000, 70_000, 300_000]))
    slot = DIRECT_ALIGN * rng.choice([1, 2, 5, 16])
    ranges = cut_ranges(0, size, segments, device, slot)
    assert ranges[0].start == 0 and ranges[-1].end == size
    rebuilt = bytearray(size)
    for previous, job in zip([None] + ranges, ranges):
        assert job.start % DIRECT_ALIGN == 0 and 0 < job.end - job.start <= slot
        if previous is not None:
            assert previous.end == job.start
        for seg in job.segments:
            assert job.start <= seg[0] and seg[0] + len(seg[1]) <= job.end
            rebuilt[seg[0] : seg[0] + len(seg[1])] = bytes(seg[1])
        for offset, t in job.device:
            assert job.start <= offset and offset + t.numel() <= job.end
            rebuilt[offset : offset + t.numel()] = t.numpy().tobytes()
    assert bytes(rebuilt) == _image(size, segments, device)


def _ring(slot_bytes: int, slots: int) -> StagingPipeline:
    return StagingPipeline(slot_bytes, slots, torch.empty(slot_bytes * slots, dtype=torch.uint8))


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_ring_writes_the_exact_image(tmp_path, direct, slots):
    rng = random.Random(slots * 10 + direct)
    segments, device, size = _random_image(rng, 400_000)
    ring = _ring(DIRECT_ALIGN * 3, slots)
    copier = DeferredCopier()
    engine = get_engine(IoOptions.resolve(direct_io=direct, default_direct_io=True, io_threads=4, task_bytes=None))
    handle = _C.File(str(tmp_path / "image"), "w", direct)
    try:
        write_device_images(engine, [handle], cut_ranges(0, size, segments, device, ring.slot_bytes), ring, copier)
        handle.truncate(size)
    finally:
        handle.close()
    assert (tmp_path / "image").read_bytes() == _image(size, segments, device)
    assert copier.copies > 0 and not copier.pending


def _write_and_check(tmp_path, handles, images, ring, engine, copier, **kw) -> list:
    """Write the random ``images`` (one per handle) through the ring, truncate, close, and check
    each file's bytes; returns the ranges written."""
    try:
        ranges = [job for i, (segments, device, size) in enumerate(images)
                  for job in cut_ranges(i, size, segments, device, ring.slot_bytes)]
        write_device_images(engine, handles, ranges, ring, copier, **kw)
        for handle, (_, _, size) in zip(handles, images):
            handle.truncate(size)
    finally:
        for handle in handles:
            handle.close()
    for i, (segments, device, size) in enumerate(images):
        assert (tmp_path / f"image{i}").read_bytes() == _image(size, segments, device)
    return ranges


class _RecordingEngine:
    """An engine that writes through the real one and records each call's (file, start) ranges."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[list[tuple[int, int]]] = []

    def write(self, jobs) -> None:
        self.calls.append([(id(job[0]), job[1]) for job in jobs])
        self.engine.write(jobs)


@pytest.mark.parametrize("files", [1, 3, 5])
@pytest.mark.parametrize("slots,batch,in_flight", [(2, 1, 1), (2, 2, 1), (4, 2, 1), (6, 3, 1), (8, 4, 1),
                                                   (2, 1, 2), (6, 2, 2), (9, 3, 2), (12, 3, 3)])
def test_ring_writes_several_files_per_engine_call(tmp_path, files, slots, batch, in_flight):
    """Ranges of different files go to the engine together (up to ``batch`` per call, up to
    ``in_flight`` calls at once from write lanes), each file's bytes exact: a slot refilled before
    its range was written, or a range written before its copy landed, would show as poisoned bytes
    (the deferred copier)."""
    rng = random.Random(files * 1000 + slots * 100 + batch * 10 + in_flight)
    images = [_random_image(rng, rng.choice([30_000, 120_000, 400_000])) for _ in range(files)]
    ring = _ring(DIRECT_ALIGN * 4, slots)
    copier = DeferredCopier()
    engine = _RecordingEngine(get_engine(IoOptions.resolve(direct_io=False, default_direct_io=False, io_threads=4,
                                                           task_bytes=None)))
    handles = [_C.File(str(tmp_path / f"image{i}"), "w", False) for i in range(files)]
    ranges = _write_and_check(tmp_path, handles, images, ring, engine, copier, batch=batch, writes_in_flight=in_flight)
    assert not copier.pending
    assert max(len(call) for call in engine.calls) == min(batch, len(ranges))
    first = engine.calls[0]
    assert len({f for f, _ in first}) == min(batch, files), "the first call writes a range of each of several files"
    assert sum(len(call) for call in engine.calls) == len(ranges)


def test_interleave_takes_files_round_robin():
    from fastdcp.save.device_ring import RangeJob

    jobs = [RangeJob(f, start, start + 1) for f, n in ((0, 3), (1, 1), (2, 2)) for start in range(n)]
    assert [(j.file_index, j.start) for j in interleave(jobs)] == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]


def test_a_batch_larger_than_the_ring_is_refused():
    with pytest.raises(ValueError, match="batch"):
        write_device_images(None, [], [], _ring(DIRECT_ALIGN, 2), DeferredCopier(), batch=3)
    with pytest.raises(ValueError, match="in flight"):
        write_device_images(None, [], [], _ring(DIRECT_ALIGN, 4), DeferredCopier(), batch=3, writes_in_flight=2)


class _FailingEngine:
    """Writes through the real engine, except the ``fail_at``-th call, which raises after a delay
    (while later writes may be in flight)."""

    def __init__(self, engine, fail_at: int) -> None:
        self.engine, self.fail_at, self.calls, self.active, self.most = engine, fail_at, 0, 0, 0
        import threading

        self.lock = threading.Lock()

    def write(self, jobs) -> None:
        import time

        with self.lock:
            self.calls += 1
            call = self.calls
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            time.sleep(0.01)
            if call == self.fail_at:
                raise OSError(28, "No space left on device (injected)")
            self.engine.write(jobs)
        finally:
            with self.lock:
                self.active -= 1


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_failed_write_is_raised_after_every_lane_stopped(tmp_path, in_flight):
    import threading

    rng = random.Random(7)
    images = [_random_image(rng, 400_000) for _ in range(3)]
    ring = _ring(DIRECT_ALIGN * 4, 3 * (in_flight + 1))
    engine = _FailingEngine(get_engine(IoOptions.resolve(direct_io=False, default_direct_io=False, io_threads=4,
                                                         task_bytes=None)), fail_at=3)
    handles = [_C.File(str(tmp_path / f"image{i}"), "w", False) for i in range(3)]
    copier = DeferredCopier()
    try:
        ranges = [job for i, (segments, device, size) in enumerate(images)
                  for job in cut_ranges(i, size, segments, device, ring.slot_bytes)]
        with pytest.raises(OSError, match="injected"):
            write_device_images(engine, handles, ranges, ring, copier, batch=3, writes_in_flight=in_flight)
    finally:
        for handle in handles:
            handle.close()
    assert engine.active == 0, "a write lane still ran after the error was raised"
    assert copier.tokens > 0 and not copier.pending, "a copy issued ahead may still land in the ring's memory"
    assert engine.most == in_flight
    assert not [t for t in threading.enumerate() if t.name.startswith("fastdcp-ring-write")]


@pytest.mark.parametrize("budget,files,threads", [(256 << 20, 8, 8), (256 << 20, 1, 8), (256 << 20, 16, 4),
                                                  (16 * DIRECT_ALIGN, 8, 8), (32 << 20, 8, 8)])
def test_ring_shape_fits_the_budget(budget, files, threads):
    slot_bytes, slots, batch, in_flight = ring_shape(budget, files, threads)
    assert slot_bytes % DIRECT_ALIGN == 0 and slot_bytes * slots <= max(budget, slots * DIRECT_ALIGN)
    assert 1 <= batch <= min(files, threads) and (in_flight + 1) * batch <= slots and in_flight >= 1
    if budget >= (256 << 20):
        assert batch == min(files, threads), "the default budget writes a file per thread at once"


def _zoo():
    sd = C.zoo_tensors(seed=31, large=True)
    sd["objs"] = C.object_state_dict(seed=31)
    return sd


@pytest.mark.parametrize("budget", [4 * DIRECT_ALIGN, 4 * 64 * 1024, 256 << 20])
@pytest.mark.parametrize("layout", ["one-file", "three-files", "file-per-item"])
def test_save_through_the_ring_is_stock_readable(tmp_path, cpu_as_device, budget, layout):
    sd = _zoo()
    expected = C.deepcopy_state_dict(sd)
    kwargs = {"one-file": {}, "three-files": {"thread_count": 3}, "file-per-item": {"single_file_per_rank": False}}[layout]
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path, pinned_ring_limit_bytes=budget, **kwargs), no_dist=True)
    assert sum(c.copies for c in cpu_as_device) > 0, "the ring was not used"
    for reader in ("stock", "fast"):
        C.load_in_place_and_check(C.make_reader(reader, tmp_path), expected, C.destination_for(expected))


def test_ring_memory_is_reused_by_new_writers(tmp_path, cpu_as_device):
    """The ring's pinned memory comes from the process-wide pool: a new writer object per save (the
    usual training-loop pattern) reuses it instead of pinning again."""
    reset_pinned_pool()
    sd = _zoo()
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path / "a", pinned_ring_limit_bytes=1 << 20), no_dist=True)
    first = pinned_pool_stats()
    assert first.buffers_allocated == 1 and first.bytes_leased == 0 and first.bytes_held > 0
    for name in ("b", "c"):
        dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path / name, pinned_ring_limit_bytes=1 << 20), no_dist=True)
    after = pinned_pool_stats()
    assert after.buffers_allocated == 1 and after.buffers_reused == 2 and after.bytes_held == first.bytes_held


def test_checksums_bypass_the_ring(tmp_path, cpu_as_device):
    sd = _zoo()
    expected = C.deepcopy_state_dict(sd)
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path, checksums=True), no_dist=True)
    assert sum(c.copies for c in cpu_as_device) == 0
    C.load_in_place_and_check(C.make_reader("fast", tmp_path, verify_checksums=True), expected, C.destination_for(expected))


def test_memory_budget_is_validated(tmp_path):
    with pytest.raises(ValueError, match="pinned_ring_limit_bytes"):
        FastFileSystemWriter(tmp_path, pinned_ring_limit_bytes=100)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [4 * DIRECT_ALIGN, 256 << 20])
def test_cuda_tensors_saved_through_the_ring(tmp_path, budget):
    sd = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _zoo().items()}
    expected = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    writer = FastFileSystemWriter(tmp_path, pinned_ring_limit_bytes=budget)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    from fastdcp.io import pinned_pool

    assert pinned_pool_stats().buffers_allocated >= 1
    assert all(slab.pinned for slab in pinned_pool._POOL._idle)
    C.load_in_place_and_check(C.make_reader("stock", tmp_path), expected, C.destination_for(expected))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_async_save_stages_into_pinned_slab(tmp_path):
    sd = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda").bfloat16()}
    expected = {k: v.cpu() for k, v in sd.items()}
    writer = FastFileSystemWriter(tmp_path)
    result = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    for v in sd.values():
        v.fill_(0)
    getattr(result, "upload_completion", result).result()
    assert writer._stager._slab.pinned
    C.load_in_place_and_check(C.make_reader("stock", tmp_path), expected, C.destination_for(expected))


def test_direct_ranges_are_written_from_their_slots_without_bounce_copies(tmp_path):
    """A range with device pieces is written as one aligned segment from its slot (host bytes
    copied in, gaps zeroed, a file's tail up to its next block), so O_DIRECT needs no bounce
    buffer; the file's bytes are exact once truncated to its size."""
    rng = random.Random(3)
    images = [_random_image(rng, 300_000) for _ in range(2)]
    from fastdcp.io.host_memory import allocate_slab

    # page-aligned memory, as the pinned pool's (torch.empty is only 64-byte aligned)
    ring = StagingPipeline(DIRECT_ALIGN * 8, 4, allocate_slab(DIRECT_ALIGN * 32, pin=False).tensor)
    # slots hold stale bytes from an earlier use: gaps must come out zero anyway
    ring.memory.fill_(0xAB)
    engine = _C.Engine(2, DIRECT_ALIGN * 4)
    handles = [_C.File(str(tmp_path / f"image{i}"), "w", True) for i in range(2)]
    if not all(h.direct for h in handles):
        for h in handles:
            h.close()
        pytest.skip(f"{tmp_path} refuses O_DIRECT, so no write there can bounce")
    for h, (_, _, size) in zip(handles, images):
        h.allocate(-(-size // DIRECT_ALIGN) * DIRECT_ALIGN)
    _write_and_check(tmp_path, handles, images, ring, engine, DeferredCopier(), batch=2)
    stats = engine.stats()
    assert stats["bytes_written"] > 0 and stats["bounce_bytes"] == 0
