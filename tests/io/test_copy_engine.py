"""The copy engines (``fastdcp.io.copy_engine``) and the stand-in device: copies on a thread of
their own, tokens that wait for exactly the copies before them, and stand-in device tensors taking
the device paths of a real save (the ring, overlapped staging) with the result readable by stock."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from fastdcp import FastFileSystemWriter
from fastdcp.io import copy_engine
from fastdcp.io.copy_engine import DeviceCopier, StandInCopier, is_device_tensor, to_standin_device
from fastdcp.io.pinned_pool import pinned_pool_stats, reset_pinned_pool

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_standin_tensors_are_device_tensors_while_they_live():
    host = torch.arange(1000, dtype=torch.float32)
    dev = to_standin_device(host)
    assert torch.equal(dev, host) and dev.data_ptr() != host.data_ptr()
    assert is_device_tensor(dev) and is_device_tensor(dev[10:20]) and is_device_tensor(dev.view(10, 100))
    assert not is_device_tensor(host) and not is_device_tensor(dev.clone())
    ptr = dev.data_ptr()
    del dev
    gc.collect()
    assert ptr not in copy_engine._standin_starts


def test_standin_device_refuses_what_is_not_a_dense_cpu_tensor():
    with pytest.raises(ValueError, match="dense CPU tensor"):
        to_standin_device(torch.zeros(3).to_sparse())


def test_standin_copier_runs_copies_on_its_own_thread_in_order():
    copier = StandInCopier()
    src = [torch.full((1 << 16,), float(i)) for i in range(8)]
    dst = torch.empty(1 << 16)  # every copy into the same buffer: the last one wins if in order
    for s in src:
        copier.copy(dst, s)
    copier.wait(copier.record())
    assert torch.equal(dst, src[-1]) and copier.copies == 8
    assert copier._thread is not None and copier._thread is not threading.current_thread()
    copier.close()
    assert copier._thread is None


def test_a_token_waits_for_the_copies_before_it_only():
    copier = StandInCopier()
    gate = threading.Event()
    first_dst = torch.zeros(4)
    copier.copy(first_dst, torch.ones(4))
    early = copier.record()
    # A copy that blocks the copy thread: the later token cannot fire before the gate opens.
    copier._queue.put(_Blocker(gate))
    late = copier.record()
    copier.wait(early)
    assert torch.equal(first_dst, torch.ones(4))
    assert not late.is_set()
    gate.set()
    copier.wait(late)
    copier.close()


class _Blocker(threading.Event):
    """Queued as a token: the copy thread 'sets' it, which here waits for a gate first."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self._gate = gate

    def set(self) -> None:
        self._gate.wait(10)
        super().set()


def test_a_failed_copy_is_raised_by_the_next_wait():
    copier = StandInCopier()
    copier.copy(torch.empty(3), torch.empty(4))  # shapes that do not broadcast
    with pytest.raises(RuntimeError, match="stand-in device copy failed"):
        copier.wait(copier.record())
    copier.close()


def test_device_copier_routes_cpu_sources_to_the_standin():
    copier = DeviceCopier()
    dst = torch.zeros(16)
    copier.copy(dst, to_standin_device(torch.arange(16.0)))
    copier.order_current_streams_after()  # the stand-in waits instead of ordering a stream
    assert torch.equal(dst, torch.arange(16.0))
    copier.wait(copier.record())


def _standin_state(seed: int) -> dict:
    sd = C.zoo_tensors(seed=seed, large=True)
    return {k: (to_standin_device(v) if isinstance(v, torch.Tensor) and v.layout == torch.strided
                and not v.is_conj() and not v.is_neg() else v) for k, v in sd.items()}


@pytest.mark.parametrize("thread_count", [None, 1, 3])
def test_standin_device_state_is_saved_through_the_ring(tmp_path, thread_count):
    reset_pinned_pool()
    sd = _standin_state(5)
    expected = C.deepcopy_state_dict(sd)
    writer = FastFileSystemWriter(tmp_path, thread_count=thread_count, pinned_ring_limit_bytes=1 << 20)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert pinned_pool_stats().buffers_allocated == 1, "the ring leased its memory from the pinned pool"
    assert pinned_pool_stats().bytes_leased == 0, "and gave it back"
    for reader in ("stock", "fast"):
        C.load_in_place_and_check(C.make_reader(reader, tmp_path), expected, C.destination_for(expected))


def test_standin_device_state_async_save_overlapped(tmp_path, monkeypatch):
    copies = []
    real = StandInCopier.copy
    monkeypatch.setattr(StandInCopier, "copy", lambda self, d, s: (copies.append(1), real(self, d, s))[1])
    sd = _standin_state(6)
    expected = C.deepcopy_state_dict(sd)
    writer = FastFileSystemWriter(tmp_path, async_staging=True)
    future = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    getattr(future, "upload_completion", future).result()
    assert copies, "staging took the device branch"
    C.load_in_place_and_check(C.make_reader("stock", tmp_path), expected, C.destination_for(expected))


def test_standin_copies_batch_between_tokens_but_keep_their_order_where_they_overlap():
    """Copies between two tokens go to the native engine together (one batch) unless a copy writes
    or reads bytes an earlier pending copy writes: then the earlier ones run first."""
    copier = StandInCopier()
    slab = torch.zeros(4 * 1024, dtype=torch.uint8)
    sources = [torch.full((1024,), i + 1, dtype=torch.uint8) for i in range(4)]
    for i, source in enumerate(sources):  # four disjoint views of one buffer
        copier.copy(slab[i * 1024:(i + 1) * 1024], source)
    copier.wait(copier.record())
    assert copier.batches == 1
    assert [int(slab[i * 1024]) for i in range(4)] == [1, 2, 3, 4]
    # overlapping: a write, a second write of the same bytes, a read of them into another place
    out = torch.zeros(1024, dtype=torch.uint8)
    copier.copy(slab[:1024], torch.full((1024,), 7, dtype=torch.uint8))
    copier.copy(slab[512:1536], torch.full((1024,), 9, dtype=torch.uint8))
    copier.copy(out, slab[:1024])
    copier.wait(copier.record())
    assert int(slab[0]) == 7 and int(slab[600]) == 9 and int(out[0]) == 7 and int(out[600]) == 9
    # a strided destination (every other byte) and a dtype change take copy_
    strided = torch.zeros(2048, dtype=torch.uint8)
    copier.copy(strided[::2], torch.ones(1024, dtype=torch.uint8))
    wide = torch.zeros(16, dtype=torch.float64)
    copier.copy(wide, torch.arange(16, dtype=torch.float32))
    copier.wait(copier.record())
    assert int(strided[::2].sum()) == 1024 and int(strided[1::2].sum()) == 0
    assert torch.equal(wide, torch.arange(16, dtype=torch.float64))
    copier.close()


def test_batch_jobs_take_plain_byte_copies_only():
    from fastdcp.io.copy_engine import batch_jobs

    a, b = torch.randn(4, 5), torch.empty(4, 5)
    strided = torch.randn(5, 4).t()
    pairs = [(b, a), (torch.empty(4, 5), strided), (torch.empty(4, 5, dtype=torch.float64), a),
             (torch.empty(0), torch.empty(0)), (torch.empty(3, dtype=torch.complex64),
                                                torch.randn(3, dtype=torch.complex64).conj())]
    jobs, rest = batch_jobs(pairs)
    assert jobs == [(b.data_ptr(), a.data_ptr(), 80)]
    assert [r[1] is strided for r in rest][:1] == [True] and len(rest) == 3


def test_cuda_copier_enqueues_plain_copies_in_one_native_call(monkeypatch):
    """The batch path of CudaCopier.copy_many, with the CUDA pieces replaced by CPU ones: one native
    call per device gets the job table (dst, src, bytes); the rest goes through copy_ on the same
    side stream."""
    import contextlib
    import ctypes
    import types

    calls = []

    def native(table, count, stream):
        jobs = (ctypes.c_int64 * (3 * count)).from_address(table)
        calls.append((count, stream))
        for i in range(count):
            ctypes.memmove(jobs[3 * i], jobs[3 * i + 1], jobs[3 * i + 2])

    class Stream:
        cuda_stream = 0x5EED

        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(copy_engine, "_native_batch", lambda: native)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    sources = [torch.randn(100, 7), torch.arange(12, dtype=torch.int16), torch.randn(6, 4).t()]
    dests = [torch.zeros(100, 7), torch.zeros(12, dtype=torch.int16), torch.zeros(4, 6)]
    copier = copy_engine.CudaCopier()
    copier.copy_many(list(zip(dests, sources)))
    assert calls == [(2, 0x5EED)] and copier.batched == 2
    for d, s in zip(dests, sources):
        assert torch.equal(d, s)
    del types


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_many_lands_every_byte_in_pinned_memory():
    sources = [torch.randn(1 << 16, device="cuda"), torch.randn(33, 77, device="cuda").bfloat16(),
               torch.randn(64, 32, device="cuda").t()]
    dests = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in sources]
    copier = copy_engine.CudaCopier()
    copier.copy_many(list(zip(dests, sources)))
    copier.wait(copier.record())
    assert copier.batched == (2 if copy_engine._native_batch() is not None else 0)
    for d, s in zip(dests, sources):
        assert torch.equal(d, s.cpu())
