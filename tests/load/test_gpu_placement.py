"""GPU destinations for the reader (fastdcp/load/gpu_placement.py).

Three layers:

* CPU, always run: the kinds/strides of the kernel descriptors checked by running them through the
  CPU box copy (their packed layout: ``tests/io/test_boxes.py``).
* CPU, always run: the whole GPU pipeline (batching, pinned slots, descriptor tables and prefix
  behind the data, fallbacks, stream/event calls) with the CUDA pieces replaced by CPU fakes: the
  fake kernel decodes the uploaded table (``fastdcp.io.boxes.unpack_boxes``) and executes it with
  the CPU box copy.
* GPU, skipped without CUDA: real loads into CUDA tensors, bit-exact against CPU references.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
import fastdcp
import fastdcp.load.gpu_placement as G
import fastdcp.load.reader as reader_module
from fastdcp import FastFileSystemReader, _C
from fastdcp.io.boxes import BOX_BYTES, Box, unpack_boxes
from fastdcp.load.placement_stats import PlacementStats

_skip_without_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fastdcp.build_info().get("cuda")),
    reason="needs a CUDA device and an extension built with CUDA",
)


def needs_cuda(test):
    """A GPU test: marked `cuda` (the acceptance command's `pytest -m cuda`), skipped without one."""
    return pytest.mark.cuda(_skip_without_cuda(test))


def _unpack_at(address: int, num_boxes: int) -> list[Box]:
    """The packed descriptors at ``address`` (what the kernel reads), decoded."""
    return unpack_boxes(ctypes.string_at(address, num_boxes * BOX_BYTES), num_boxes)


# --------------------------------------------------------------------------------------------- #
# kernel descriptors (the layout itself: tests/io/test_boxes.py)
# --------------------------------------------------------------------------------------------- #
_CONVERTIBLE = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _values(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 20).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)  # representable in every kind


@pytest.mark.parametrize("src_dtype", _CONVERTIBLE, ids=str)
def test_kernel_descriptors_convert_like_torch(src_dtype):
    """The descriptors _kernel_box builds (kind numbers, element sizes, strides) executed by the
    CPU box copy give what Tensor.copy_ gives: the ScalarKind table is right for every pair."""
    engine = _C.Engine(2, 1 << 20)
    staging = _values(src_dtype, (6, 10), 3).t()  # a (10, 6) source with strides (1, 10)
    for dst_dtype in _CONVERTIBLE:
        dest = torch.zeros((6, 20), dtype=dst_dtype).t()[::2]  # (10, 6), strides (2, 20)
        piece = types.SimpleNamespace(src_dtype=src_dtype, shape=tuple(staging.shape),
                                      src_stride=tuple(staging.stride()), dest=dest)
        box = G._kernel_box(piece, staging.data_ptr())
        assert box is not None
        if src_dtype == dst_dtype:
            assert box[2:4] == (-1, -1)
        engine.box_copy([box])
        expected = torch.zeros(dest.shape, dtype=dst_dtype).copy_(staging)
        C.assert_tensor_bitexact(C.packed(dest), expected, f"{src_dtype} -> {dst_dtype}")


def test_kernel_box_falls_back_where_the_kernel_cannot():
    def piece(dest, src_dtype=torch.float32):
        return types.SimpleNamespace(src_dtype=src_dtype, shape=tuple(dest.shape),
                                     src_stride=tuple(dest.stride()), dest=dest)

    assert G._kernel_box(piece(torch.zeros(3, dtype=torch.complex128), torch.complex64), 64) is None
    assert G._kernel_box(piece(torch.zeros(3, dtype=torch.complex64)), 64) is None
    assert G._kernel_box(piece(torch.zeros(3, dtype=torch.complex64).conj(), torch.complex64), 64) is None
    assert G._kernel_box(piece(torch.zeros(1, 3).expand(4, 3)), 64) is None
    assert G._kernel_box(piece(torch.zeros([1] * 9)), 64) is None
    # same-dtype copies of kinds the kernel does not know are raw byte copies
    box = G._kernel_box(piece(torch.zeros(3, dtype=torch.uint16), torch.uint16), 64)
    assert box is not None and box[2:6] == (-1, -1, 2, 2)


def test_not_available_without_cuda():
    if not torch.cuda.is_available():
        assert not G.gpu_placement_available()
    assert G.gpu_placement_available() == (torch.cuda.is_available() and bool(fastdcp.build_info()["cuda"]))


# --------------------------------------------------------------------------------------------- #
# the pipeline with CPU fakes for the CUDA pieces
# --------------------------------------------------------------------------------------------- #
class _FakeCuda:
    """Records what _place_on_device asks of CUDA and executes the 'kernel' on the CPU."""

    def __init__(self):
        self.engine = _C.Engine(2, 1 << 20)
        self.pinned: list[torch.Tensor] = []
        self.device: list[torch.Tensor] = []
        self.launches = 0
        self.conversion_launches = 0
        self.synchronized = 0
        self.waits: list[tuple[str, str]] = []
        self.ops: list[tuple] = []  # ("launch",), ("record", event id), ("sync", event id), in order
        fake = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name
                self.cuda_stream = 0xC0DE if name == "side" else 0

            def wait_stream(self, other):
                fake.waits.append((self.name, other.name))

            def synchronize(self):
                fake.ops.append(("stream-sync", self.name))

        class Event:
            def record(self, stream=None):
                assert stream is not None and stream.name == "side"
                fake.ops.append(("record", id(self)))

            def synchronize(self):
                fake.synchronized += 1
                fake.ops.append(("sync", id(self)))

        self.Stream, self.Event = Stream, Event
        self.current = Stream(name="current")

    def new_pinned(self, nbytes):
        """A pinned-pool lease (``fastdcp.io.pinned_pool``): its buffer poisoned, its release
        recorded as an op (it must come after the host's last wait)."""
        t = torch.full((nbytes,), 0xEE, dtype=torch.uint8)
        self.pinned.append(t)
        return types.SimpleNamespace(tensor=t, release=lambda: self.ops.append(("release-pinned",)))

    def new_device_buffer(self, nbytes, device):
        t = torch.full((nbytes,), 0xDD, dtype=torch.uint8)
        self.device.append(t)
        return t

    def launch_box_copy(self, d_boxes, d_prefix, num_boxes, total, stream, any_conversion=True):
        assert stream == 0xC0DE
        dev = self.device[-1]
        lo, hi = dev.data_ptr(), dev.data_ptr() + dev.numel()
        assert lo <= d_boxes and d_boxes + num_boxes * BOX_BYTES <= d_prefix and d_prefix + (num_boxes + 1) * 8 <= hi
        assert d_boxes % 8 == 0 and d_prefix % 8 == 0
        tuples = _unpack_at(d_boxes, num_boxes)
        prefix = list((ctypes.c_int64 * (num_boxes + 1)).from_address(d_prefix))
        count = 0
        assert prefix[0] == 0
        for i, box in enumerate(tuples):
            n = 1
            for s in box[6]:
                n *= s
            count += n
            assert prefix[i + 1] == count
            assert lo <= box[0] < hi, "a kernel source must be in device staging"
        # the byte-copy-only kernel leaves converting boxes untouched: the flag must say so
        assert any_conversion == any(box[2] != box[3] for box in tuples), "any_conversion does not match the boxes"
        self.conversion_launches += bool(any_conversion)
        assert count == total
        self.launches += 1
        self.ops.append(("launch",))
        self.engine.box_copy(tuples)

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(G, "_new_pinned", self.new_pinned)
        monkeypatch.setattr(G, "_new_device_buffer", self.new_device_buffer)
        monkeypatch.setattr(G, "_C", types.SimpleNamespace(prepare_boxes=_C.prepare_boxes,
                                                           launch_box_copy=self.launch_box_copy))

        def run_everything_as_gpu(engine, placements, planner, options, direct):
            stats = PlacementStats()

            def read(tables):
                engine.read_runs([(f, t.data_ptr(), t.shape[0]) for f, t in tables], direct)
                for _, t in tables:
                    stats.requests += t.shape[0]
                    stats.bytes_read += int(t[:, 2].sum())

            half = max(64, options.read_buffer_limit_bytes // 2 // 64 * 64)
            pieces = [p for pl in placements for p in pl.pieces]
            if pieces:
                G.place_on_gpu(pieces, half, 4096, stats, read)
            for pl in placements:
                planner.commit_tensor(pl.item, pl.target)
            return stats

        monkeypatch.setattr(reader_module, "run_placements", run_everything_as_gpu)


def _install_fake_cuda(monkeypatch) -> _FakeCuda:
    """The fake, installed for the rest of the test. Tests that save with stock's writer install it
    after the save: where a real GPU is visible, stock's writer streams through CUDA streams (its
    _OverlappingCpuLoader), which the fake does not stand in for."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    return fake


@pytest.fixture
def fake_cuda(monkeypatch):
    return _install_fake_cuda(monkeypatch)


@pytest.mark.parametrize("writer_kind", ["stock", "fast"])
def test_simulated_pipeline_same_layout(tmp_path, monkeypatch, writer_kind):
    saved = C.zoo_tensors(1)
    C.save(saved, C.make_writer(writer_kind, tmp_path))
    fake_cuda = _install_fake_cuda(monkeypatch)
    dest = C.destination_for(saved)
    reader = FastFileSystemReader(tmp_path)
    C.load(dest, reader)
    C.assert_same(dest, saved, check_stride=False)
    stats = reader.last_stats
    assert stats["gpu_kernel_boxes"] > 0 and stats["gpu_fallback_copies"] == 0
    assert fake_cuda.launches == stats["gpu_batches"] >= 1
    # ordering: side waits for current first, current waits for side last
    assert fake_cuda.waits[0] == ("side", "current") and fake_cuda.waits[-1] == ("current", "side")
    _assert_returns_after_the_last_copy(fake_cuda)


def _assert_returns_after_the_last_copy(fake_cuda) -> None:
    """Ready on any stream: the host waited for an event recorded on the side stream after the
    last kernel launch (not only the current stream ordered after it)."""
    last_launch = max(i for i, op in enumerate(fake_cuda.ops) if op[0] == "launch")
    recorded_after = {op[1] for op in fake_cuda.ops[last_launch:] if op[0] == "record"}
    ops = [op for op in fake_cuda.ops if op[0] != "release-pinned"]
    assert ops[-1][0] == "sync" and ops[-1][1] in recorded_after, fake_cuda.ops[last_launch:]
    # The pinned buffer goes back to the pool once per device load, after that last wait.
    releases = [i for i, op in enumerate(fake_cuda.ops) if op[0] == "release-pinned"]
    assert releases and releases[-1] == len(fake_cuda.ops) - 1


def _destination(sizes, dtype, layout, device="cpu"):
    if layout == "convert":
        dtype = C.CONVERTED_DTYPE[dtype]
    return C.box_destination(sizes, dtype, layout, device=device)


@pytest.mark.parametrize("writer_kind", ["stock", "fast"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "offset", "convert"])
def test_simulated_pipeline_resharded_tiny_budget(tmp_path, monkeypatch, writer_kind, layout):
    saved = C.box_state(5)
    C.save(saved, C.make_writer(writer_kind, tmp_path))
    fake_cuda = _install_fake_cuda(monkeypatch)
    rng = random.Random(f"{writer_kind}-{layout}")
    budget = 16 << 10
    for round_ in range(2):
        slices, dest, expected = {}, {}, {}
        for name, tensor in saved.items():
            offsets, sizes = C.random_box(rng, tuple(tensor.shape))
            slices[name] = (offsets, sizes)
            dest[name] = _destination(sizes, tensor.dtype, layout)
            expected[name] = C.box(tensor, offsets, sizes).to(dest[name].dtype)
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=budget)
        dcp.load(dest, storage_reader=reader, planner=C.SliceLoadPlanner(slices), no_dist=True)
        for name in saved:
            C.assert_tensor_bitexact(C.packed(dest[name]), C.packed(expected[name]), f"{name} {slices[name]}")
        stats = reader.last_stats
        assert stats["gpu_staging_bytes"] <= budget
        if layout == "convert":
            assert stats["gpu_fallback_copies"] >= 1  # complex64 -> complex128
    assert all(t.numel() <= budget for t in fake_cuda.pinned)
    # converting batches launch the converting kernel, the others the byte-copy-only one
    assert (fake_cuda.conversion_launches > 0) == (layout == "convert")
    assert fake_cuda.launches > fake_cuda.conversion_launches or layout == "convert"


def test_simulated_pipeline_many_batches_reuse_slots(tmp_path, fake_cuda):
    saved = {f"w{i}": torch.randn(256, 256) for i in range(6)}  # 6 x 256 KiB, larger than windows
    C.save(saved, C.make_writer("fast", tmp_path))
    dest = {k: torch.zeros(256, 256, dtype=torch.bfloat16) for k in saved}
    budget = 200 << 10
    reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=budget)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    for k, v in saved.items():
        C.assert_tensor_bitexact(dest[k], v.bfloat16(), k)
    stats = reader.last_stats
    assert stats["gpu_batches"] > G.SLOTS and stats["gpu_slots"] == G.SLOTS
    # each slot's upload waited for before the slot is refilled, then the last batch before the load returns
    assert fake_cuda.synchronized == stats["gpu_batches"] - G.SLOTS + 1
    _assert_returns_after_the_last_copy(fake_cuda)
    assert len(fake_cuda.pinned) == 1 and fake_cuda.pinned[0].numel() <= budget  # allocated once
    assert len(fake_cuda.device) == 1


def test_simulated_pipeline_a_failed_read_stops_the_load_and_its_reader(tmp_path, fake_cuda, monkeypatch):
    """A read that fails in the reader thread fails the load (no hang, no later batch placed), and
    the reader thread is gone before the pinned buffer goes back to the pool."""
    import threading

    saved = {f"w{i}": torch.randn(256, 256) for i in range(6)}
    C.save(saved, C.make_writer("fast", tmp_path))
    dest = {k: torch.zeros(256, 256) for k in saved}
    real_place = G.place_on_gpu
    reads = []

    def failing_place(pieces, half_budget, request_cost, stats, read):
        def flaky(tables):
            reads.append(len(tables))
            if len(reads) == 3:
                raise OSError(5, "injected read error")
            read(tables)

        return real_place(pieces, half_budget, request_cost, stats, flaky)

    monkeypatch.setattr(G, "place_on_gpu", failing_place)
    with pytest.raises(BaseException, match="injected read error"):
        dcp.load(dest, storage_reader=FastFileSystemReader(tmp_path, read_buffer_limit_bytes=200 << 10), no_dist=True)
    assert len(reads) == 3, "no read after the failed one"
    assert not [t for t in threading.enumerate() if t.name.startswith("fastdcp-gpu-read")]
    assert ("release-pinned",) in fake_cuda.ops


# --------------------------------------------------------------------------------------------- #
# real GPU loads
# --------------------------------------------------------------------------------------------- #
@needs_cuda
def test_gpu_loaded_bytes_are_ready_on_another_stream(tmp_path):
    """Ready on any stream (docs/GUARANTEES.md): once dcp.load returns, a kernel on another stream
    reads the loaded bytes with no wait of its own. The current stream is kept busy before the
    load (torch.cuda._sleep), so copies merely ordered after it would still be pending then."""
    saved = {"w": torch.randn(1024, 1024), "b": torch.arange(4096, dtype=torch.int64)}
    C.save(saved, C.make_writer("fast", tmp_path))
    dest = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in saved.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued on the current stream
    C.load(dest, FastFileSystemReader(tmp_path))
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        seen = {k: v.clone() for k, v in dest.items()}
    other.synchronize()
    for k, v in saved.items():
        C.assert_tensor_bitexact(seen[k].cpu(), v, k)


@needs_cuda
@pytest.mark.parametrize("writer_kind", ["stock", "fast"])
def test_gpu_same_layout(tmp_path, writer_kind):
    saved = C.zoo_tensors(2)
    C.save(saved, C.make_writer(writer_kind, tmp_path))
    dest = {k: torch.full(v.shape, 7, dtype=v.dtype, device="cuda") for k, v in saved.items()}
    reader = FastFileSystemReader(tmp_path)
    C.load(dest, reader)
    torch.cuda.synchronize()
    for k, v in saved.items():
        C.assert_tensor_bitexact(C.packed(dest[k].cpu()), C.packed(v), k)
    assert reader.last_stats["gpu_kernel_boxes"] > 0


@needs_cuda
@pytest.mark.parametrize("writer_kind", ["stock", "fast"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "offset", "convert"])
def test_gpu_resharded_boxes(tmp_path, writer_kind, layout):
    saved = C.box_state(7)
    C.save(saved, C.make_writer(writer_kind, tmp_path))
    rng = random.Random(f"gpu-{writer_kind}-{layout}")
    for budget in (16 << 10, 512 << 20):
        slices, dest, expected = {}, {}, {}
        for name, tensor in saved.items():
            offsets, sizes = C.random_box(rng, tuple(tensor.shape))
            slices[name] = (offsets, sizes)
            dest[name] = _destination(sizes, tensor.dtype, layout, device="cuda")
            expected[name] = C.box(tensor, offsets, sizes).to(dest[name].dtype)  # CPU conversion
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=budget)
        dcp.load(dest, storage_reader=reader, planner=C.SliceLoadPlanner(slices), no_dist=True)
        torch.cuda.synchronize()
        for name in saved:
            C.assert_tensor_bitexact(C.packed(dest[name].cpu()), C.packed(expected[name]), f"{name} {slices[name]}")


@needs_cuda
def test_gpu_shard1_reshard_and_dtype_conversion(tmp_path):
    saved = {"w": torch.randn(512, 1024), "h": torch.randn(300, 257).to(torch.bfloat16)}
    C.save(saved, C.make_writer("fast", tmp_path))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dest = {"w": torch.zeros(512, 256, dtype=dtype, device="cuda"),
                "h": torch.zeros(100, 257, dtype=torch.float32, device="cuda")}
        planner = C.SliceLoadPlanner({"w": ([0, 512], [512, 256]), "h": ([150, 0], [100, 257])})
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=64 << 10)
        dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)
        torch.cuda.synchronize()
        C.assert_tensor_bitexact(dest["w"].cpu(), saved["w"][:, 512:768].to(dtype).contiguous(), f"w as {dtype}")
        C.assert_tensor_bitexact(dest["h"].cpu(), saved["h"][150:250].float(), "h")
        assert reader.last_stats["gpu_batches"] > 2


@needs_cuda
def test_gpu_non_contiguous_destinations_and_fallbacks(tmp_path):
    g = torch.Generator().manual_seed(3)
    saved = {
        "t": torch.randn(300, 200, generator=g),
        "c": torch.randn(50, generator=g).to(torch.complex64),
        "u16": torch.randint(0, 60000, (77,), generator=g).to(torch.uint16),
        "big": torch.randn(1 << 20, generator=g),
    }
    C.save(saved, C.make_writer("fast", tmp_path))
    dest = {
        "t": torch.zeros(200, 300, device="cuda").t(),
        "c": torch.zeros(50, dtype=torch.complex128, device="cuda"),  # unsupported pair: copy_
        "u16": torch.empty(80, dtype=torch.uint16, device="cuda")[3:],  # raw copy at an odd offset
        "big": torch.zeros(2 << 20, device="cuda")[::2],
    }
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a non-default current stream: copies must be ordered on it
        for k in ("t", "c", "big"):
            dest[k].fill_(1)
        reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=1 << 20)
        C.load(dest, reader)
        out = {k: v.cpu() for k, v in dest.items()}  # stream-ordered, no explicit synchronize
    for k, v in saved.items():
        C.assert_tensor_bitexact(C.packed(out[k]), C.packed(v.to(out[k].dtype)), k)
    assert reader.last_stats["gpu_fallback_copies"] >= 1


@needs_cuda
def test_gpu_many_small_tensors_tiny_budget(tmp_path):
    saved = C.many_small_tensors(200, seed=4)
    C.save(saved, C.make_writer("stock", tmp_path))
    dest = {k: torch.zeros_like(v, device="cuda") for k, v in saved.items()}
    reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=8 << 10)
    C.load(dest, reader)
    torch.cuda.synchronize()
    for k, v in saved.items():
        C.assert_tensor_bitexact(dest[k].cpu(), v, k)
    assert reader.last_stats["gpu_batches"] > 2
