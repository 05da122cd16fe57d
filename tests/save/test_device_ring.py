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
import fastdcp.save.writer as writer_module
from stand_in_copier import DeferredCopier
from fastdcp import FastFileSystemWriter, _C
from fastdcp.save.device_ring import DeviceRing, cut_ranges, write_device_images
from fastdcp.io.engine import DIRECT_ALIGN, IoOptions, get_engine

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def cpu_as_device(monkeypatch):
    """Route every CPU tensor of a FastFileSystemWriter save through the ring."""
    copiers: list[DeferredCopier] = []

    def make():
        copiers.append(DeferredCopier())
        return copiers[-1]

    monkeypatch.setattr(writer_module, "_stays_on_device", lambda t: True)
    monkeypatch.setattr(writer_module, "_make_copier", make)
    return copiers


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


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_ring_writes_the_exact_image(tmp_path, direct, slots):
    rng = random.Random(slots * 10 + direct)
    segments, device, size = _random_image(rng, 400_000)
    ring = DeviceRing(DIRECT_ALIGN * 3, slots)
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
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path, memory_budget_bytes=budget, **kwargs), no_dist=True)
    assert sum(c.copies for c in cpu_as_device) > 0, "the ring was not used"
    for reader in ("stock", "fast"):
        C.load_in_place_and_check(C.make_reader(reader, tmp_path), expected, C.destination_for(expected))


def test_ring_is_reused_across_saves(tmp_path, cpu_as_device):
    writer = FastFileSystemWriter(tmp_path / "a", memory_budget_bytes=1 << 20)
    sd = _zoo()
    dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "a", no_dist=True)
    slab = writer._ring._slab
    dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "b", no_dist=True)
    assert writer._ring._slab is slab


def test_checksums_bypass_the_ring(tmp_path, cpu_as_device):
    sd = _zoo()
    expected = C.deepcopy_state_dict(sd)
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path, checksums=True), no_dist=True)
    assert sum(c.copies for c in cpu_as_device) == 0
    C.load_in_place_and_check(C.make_reader("fast", tmp_path, verify_checksums=True), expected, C.destination_for(expected))


def test_memory_budget_is_validated(tmp_path):
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        FastFileSystemWriter(tmp_path, memory_budget_bytes=100)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [4 * DIRECT_ALIGN, 256 << 20])
def test_cuda_tensors_saved_through_the_ring(tmp_path, budget):
    sd = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _zoo().items()}
    expected = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    writer = FastFileSystemWriter(tmp_path, memory_budget_bytes=budget)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert writer._ring is not None and writer._ring._slab.pinned
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
