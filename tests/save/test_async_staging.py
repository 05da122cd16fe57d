"""``FastFileSystemWriter.stage`` (used by ``dcp.async_save``): a reused host slab from the staging
pool, no aliasing of live tensors, no refill while a save still reads it, process mode, crash safety.
(The pool across writers, its memory cap and fork safety: ``test_staging_pool.py``.)

Every checkpoint is loaded back with stock ``FileSystemReader`` and compared bit-exact with the
values the state had when ``async_save`` was called (the live tensors are overwritten right after).
"""

from __future__ import annotations

import collections
import gc
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from _crash_worker import classify, make_state
from test_crash import SEED, zygote  # noqa: F401 - the crash tests' zygote fixture, shared
from fastdcp import FastFileSystemWriter, set_staging_pool_limit, staging_pool_stats
from fastdcp.save import staging_pool as _pool
from fastdcp.io.host_memory import PAGE, allocate_slab

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

HERE = Path(__file__).resolve().parent  # this test module, imported by name in child processes
TESTS_DIR = HERE.parent  # the shared helpers (dcp_cases, _crash_worker)
REPO_ROOT = TESTS_DIR.parent
Pair = collections.namedtuple("Pair", "left right")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300, 257, generator=g),  # > a page, odd size
        "bf16": torch.randn(1000, 33, generator=g).bfloat16(),
        "small": torch.arange(5, dtype=torch.int16) + seed,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 7),
        "transposed": torch.randn(40, 60, generator=g).t(),  # non-contiguous source
        "nested": {"list": [torch.full((3,), seed, dtype=torch.int64), {"deep": torch.ones(2, 2) * seed}]},
        "step": seed,
        "blob": io.BytesIO(b"bytes-%d" % seed),
        "config": {"lr": 0.1 * seed, "name": f"run-{seed}"},
    }


def _expected(sd: dict) -> dict:
    return C.deepcopy_state_dict(sd)


def _scribble(sd: dict) -> None:
    for t in C.tensor_leaves(sd).values():
        if t.numel():
            C.fill_storage_with_sentinel(t)
    sd["config"]["lr"] = -1.0


def _load_stock(path, expected: dict) -> None:
    C.load_in_place_and_check(C.make_reader("stock", path), expected, C.destination_for(expected))


def _wait(result) -> None:
    getattr(result, "upload_completion", result).result()


def _slab_range(writer: FastFileSystemWriter) -> tuple[int, int]:
    slab = writer._stager._slab
    return slab.ptr, slab.ptr + slab.nbytes


def _done_with(staged) -> types.SimpleNamespace:
    """A stand-in for the planner write_data gets: the writer finds the lease by its state dict."""
    return types.SimpleNamespace(state_dict=staged)


@pytest.fixture(autouse=True)
def _fresh_pool():
    """Every test starts with an empty staging pool at its default cap (the pool is per process)."""
    _pool.reset_staging_pool()
    yield
    _pool.reset_staging_pool()


# --------------------------------------------------------------------------- #
# stage() itself
# --------------------------------------------------------------------------- #
def test_stage_copies_into_one_aligned_slab(tmp_path):
    sd = _state(1)
    sd["nested"]["pair"] = Pair(torch.tensor([1, 1]), "text")  # DCP cannot load into tuples: stage only
    expected = _expected(sd)
    writer = FastFileSystemWriter(tmp_path)
    staged = writer.stage(sd)
    _scribble(sd)  # the live state changes: the staged copy must not
    C.assert_same(C.drop_empty_dicts({k: v for k, v in staged.items() if k != "blob"}),
                  C.drop_empty_dicts({k: v for k, v in expected.items() if k != "blob"}), check_stride=False)
    assert staged["blob"].getvalue() == b"bytes-1"
    assert isinstance(staged["nested"]["pair"], Pair) and staged["nested"]["pair"].right == "text"
    lo, hi = _slab_range(writer)
    for name, t in C.tensor_leaves(staged).items():
        assert t.device.type == "cpu" and t.is_contiguous(), name
        if t.numel():
            assert lo <= t.data_ptr() < hi, f"{name} is not in the staging slab"
        if t.numel() * t.element_size() >= PAGE:
            assert t.data_ptr() % PAGE == 0, f"{name} is not page-aligned in the slab"
    assert writer._stager.slabs_allocated == 1


def test_async_saves_reuse_the_slab_and_hold_the_values_at_call_time(tmp_path):
    writer = FastFileSystemWriter(tmp_path / "0")
    sd = _state(2)
    for step in range(3):
        for t in C.tensor_leaves(sd).values():
            if t.numel() and t.dtype.is_floating_point:
                t.add_(1)
        sd["step"] = step
        expected = _expected(sd)
        result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / str(step), no_dist=True)
        _scribble(sd)  # "training" goes on right after the call returns
        _wait(result)
        _load_stock(tmp_path / str(step), expected)
        C.load_in_place_and_check(C.make_reader("fast", tmp_path / str(step)), expected, C.destination_for(expected))
        sd = C.deepcopy_state_dict(expected)
    assert writer._stager.slabs_allocated == 1, "a state of unchanged structure got a new staging slab"


def test_a_reused_slab_is_refilled_exactly_from_unaligned_sources(tmp_path):
    """The second stage of a structure, through a new writer, refills the pool's slab with
    streaming stores (runs of 256 KiB and up): sources at odd addresses and byte counts off the
    64-byte line must land exactly."""
    def state(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (400_004,), dtype=torch.uint8, generator=g)
        return {
            "odd_bytes": raw[1:],  # data at an odd address, 400,003 bytes
            "odd_halves": torch.randn(300_001, generator=g).bfloat16()[1:],  # 2-byte offset, 600,000 bytes
            "line": torch.randn(2**16 + 3, generator=g),  # 262,156 bytes: just over the threshold
            "transposed": torch.randn(300, 400, generator=g).t(),  # copy_, not the box copy
            "small": torch.arange(7, dtype=torch.int64) + seed,
        }

    first = FastFileSystemWriter(tmp_path / "a")
    first.stage(state(1))  # the staged copy is dropped at once: its slab goes back to the pool
    gc.collect()
    sd = state(2)
    expected = _expected(sd)
    writer = FastFileSystemWriter(tmp_path / "b")
    staged = writer.stage(sd)
    assert first._stager.slabs_allocated == 1 and writer._stager.slabs_allocated == 0, (
        "the second stage did not reuse the pool's slab")
    for t in sd.values():
        C.fill_storage_with_sentinel(t)
    C.assert_same(staged, expected, check_stride=False)


@pytest.mark.parametrize("async_staging", [False, True], ids=["blocking", "overlapped"])
def test_a_new_slab_is_prefaulted_and_a_reused_one_gets_streaming_stores(tmp_path, monkeypatch, async_staging):
    """How the engine is asked to fill the slab: a new slab piece by piece after the kernel
    populated each piece (prefault: no trap per page), a reused one, already faulted in, with
    streaming stores; never both (streaming stores into new pages are twice as slow). A mix-up
    copies the same bytes, only slower, so the other tests cannot see it."""
    import fastdcp
    from fastdcp.save import writer as writer_module

    calls = []
    real_get_engine = writer_module.get_engine

    class RecordingEngine:
        def __init__(self, engine):
            self._engine = engine

        def box_copy(self, boxes, streaming=False, prefault=False):
            calls.append((streaming, prefault))
            return self._engine.box_copy(boxes, streaming=streaming, prefault=prefault)

        def __getattr__(self, name):
            return getattr(self._engine, name)

    monkeypatch.setattr(writer_module, "get_engine", lambda options: RecordingEngine(real_get_engine(options)))
    fastdcp.release_staging()

    def state(seed: int) -> dict:  # a layout no other test stages: its first slab is new
        g = torch.Generator().manual_seed(seed)
        return {"weight": torch.randn(513, 129, generator=g), "bias": torch.randn(129, generator=g)}

    for step in range(2):
        sd = state(step)
        expected = _expected(sd)
        writer = FastFileSystemWriter(tmp_path / str(step), async_staging=async_staging)
        staged = writer.stage(sd)
        if async_staging:
            staged = staged.result()
        C.assert_same(staged, expected, check_stride=False)
        del staged
        writer._release_staging()
        gc.collect()
    assert calls == [(False, True), (True, False)], (
        f"box_copy's (streaming, prefault) for a new slab, then a reused one: {calls}")


def test_new_slab_when_the_structure_changes(tmp_path):
    writer = FastFileSystemWriter(tmp_path / "a")
    _wait(dcp.async_save(_state(3), storage_writer=writer, checkpoint_id=tmp_path / "a", no_dist=True))
    grown = _state(3)
    grown["big"] = torch.randn(301, 257)
    expected = _expected(grown)
    _wait(dcp.async_save(grown, storage_writer=writer, checkpoint_id=tmp_path / "b", no_dist=True))
    assert writer._stager.slabs_allocated == 2
    _load_stock(tmp_path / "b", expected)


def test_stage_waits_until_the_previous_save_released_the_slab(tmp_path):
    """A slab still being written is never refilled: with no room in the pool for a second slab,
    the next stage() blocks until the writer releases it (its write_data ended) and then reuses it."""
    writer = FastFileSystemWriter(tmp_path)
    first = writer.stage(_state(4))  # held, as a save in flight would
    set_staging_pool_limit(writer._stager._slab.nbytes)
    first_copy = C.deepcopy_state_dict(first)
    done = threading.Event()
    second = {}

    def stage_again():
        second["sd"] = writer.stage(_state(5))
        done.set()

    thread = threading.Thread(target=stage_again)
    thread.start()
    assert not done.wait(0.5), "stage() refilled a slab that a save still held"
    C.assert_same(first, first_copy)  # untouched while waiting
    writer._release_staging()  # what write_data does when it is done
    assert done.wait(10)
    thread.join()
    assert writer._stager.slabs_allocated == 1
    C.assert_same(second["sd"]["big"], _state(5)["big"])


def test_stage_proceeds_once_the_staged_tensors_are_gone(tmp_path):
    """Process mode never calls the parent writer's write_data: the views going away frees it."""
    writer = FastFileSystemWriter(tmp_path)
    first = writer.stage(_state(6))
    set_staging_pool_limit(writer._stager._slab.nbytes)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (writer.stage(_state(7)), done.set()))
    thread.start()
    assert not done.wait(0.3)
    del first
    gc.collect()
    assert done.wait(10)
    thread.join()
    assert writer._stager.slabs_allocated == 1


def test_an_older_saves_release_does_not_free_a_newer_slab(tmp_path):
    """Saves A (old structure) and B (new structure) in flight through one writer: A's release
    frees A's slab only, so no later stage() refills B's slab while B's save still reads it."""
    set_staging_pool_limit(2 * PAGE)  # A's slab and B's slab (a page each), nothing more
    writer = FastFileSystemWriter(tmp_path)
    held_a = writer.stage({"w": torch.ones(100)})
    held_b = writer.stage({"w": torch.ones(200)})  # new structure: new slab, no waiting
    assert writer._stager.slabs_allocated == 2
    writer._release_staging()  # no planner and two saves in flight: it cannot tell, releases none
    assert staging_pool_stats().slabs_in_use == 2
    writer._release_staging(_done_with(held_a))  # save A is done
    assert staging_pool_stats().slabs_in_use == 1
    c = writer.stage({"w": torch.full((200,), 5.0)})  # A's idle slab is dropped for a new one
    assert c["w"].untyped_storage().data_ptr() != held_b["w"].untyped_storage().data_ptr()
    assert torch.equal(held_b["w"], torch.ones(200))
    done = threading.Event()
    thread = threading.Thread(target=lambda: (writer.stage({"w": torch.full((200,), 7.0)}), done.set()))
    thread.start()
    assert not done.wait(0.5), "a stage refilled a slab that save B or C still reads"
    assert torch.equal(held_b["w"], torch.ones(200)) and torch.equal(c["w"], torch.full((200,), 5.0))
    writer._release_staging(_done_with(held_b))  # save B is done: the waiting stage gets its slab
    assert done.wait(10)
    thread.join()
    assert torch.equal(c["w"], torch.full((200,), 5.0))
    assert torch.equal(held_b["w"], torch.full((200,), 7.0))  # B's slab, refilled after its release
    del held_a


def test_a_slab_held_too_long_is_replaced_not_overwritten(tmp_path, monkeypatch):
    monkeypatch.setattr(_pool, "_WAIT_BEFORE_NEW_SLAB_S", 0.2)
    writer = FastFileSystemWriter(tmp_path)
    first = writer.stage(_state(8))
    set_staging_pool_limit(writer._stager._slab.nbytes)  # no room for a second slab: it waits
    first_copy = C.deepcopy_state_dict(first)
    with pytest.warns(UserWarning, match="still holds its staging memory"):
        second = writer.stage(_state(9))
    assert writer._stager.slabs_allocated == 2
    assert staging_pool_stats().slabs_unpooled == 1  # outside the cap, dropped after its save
    C.assert_same(first, first_copy)
    C.assert_same(second["big"], _state(9)["big"])


def test_failed_stage_releases_the_slab(tmp_path):
    writer = FastFileSystemWriter(tmp_path)

    class Unpicklable:
        def __deepcopy__(self, memo):
            raise RuntimeError("cannot copy me")

    with pytest.raises(RuntimeError, match="cannot copy me"):
        writer.stage({"t": torch.ones(3), "bad": Unpicklable()})
    start = time.monotonic()
    writer.stage({"t": torch.ones(3)})
    assert time.monotonic() - start < 5
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_reused) == (1, 1)


def test_writer_pickles_without_its_slab(tmp_path):
    writer = FastFileSystemWriter(tmp_path)
    writer.stage(_state(10))
    clone = pickle.loads(pickle.dumps(writer))
    assert clone._stager is None and writer._stager is not None
    writer.close()
    assert writer._stager is None


def test_slab_kinds_are_page_aligned():
    for shared in (True, False):
        slab = allocate_slab(10_000, prefer_shared=shared, pin=False)
        assert slab.ptr % PAGE == 0 and slab.nbytes >= 10_000
        slab.tensor.fill_(3)
        assert int(slab.tensor.sum()) == 3 * slab.nbytes
    assert allocate_slab(1, prefer_shared=True, pin=False).kind == "shared"
    assert allocate_slab(1, prefer_shared=False, pin=False).kind == "private"
    assert allocate_slab(1, pin=False).kind == "private"  # unpinned: anonymous unless asked


def test_a_segmented_slab_gives_each_segment_its_own_storage_and_views_never_span_two():
    slab = allocate_slab(5 * PAGE, pin=False, segment_starts=[2 * PAGE, 3 * PAGE])
    assert slab.segment_starts == (0, 2 * PAGE, 3 * PAGE) and slab.nbytes == 5 * PAGE
    storages = {segment.untyped_storage().data_ptr() for segment in slab.segments}
    assert len(storages) == 3 and slab.ptr % PAGE == 0
    first = slab.view(0, 2 * PAGE, torch.float32, torch.Size([2, PAGE // 4]))
    last = slab.view(3 * PAGE + 8, 16, torch.int64, torch.Size([2]))
    assert first.data_ptr() == slab.ptr and last.data_ptr() == slab.ptr + 3 * PAGE + 8
    assert slab.holds_storage_of(last) and not slab.holds_storage_of(torch.zeros(2))
    assert last.untyped_storage().data_ptr() == slab.segments[2].untyped_storage().data_ptr()
    last.copy_(torch.tensor([7, -7]))  # writes land in the slab's memory
    assert slab.segments[2][8:24].view(torch.int64).tolist() == [7, -7]
    with pytest.raises(ValueError, match="inside segment 1"):
        slab.view(2 * PAGE, PAGE + 4, torch.uint8, torch.Size([PAGE + 4]))
    with pytest.raises(ValueError, match="no single tensor"):
        slab.tensor
    with pytest.raises(ValueError, match="page multiples"):
        allocate_slab(5 * PAGE, pin=False, segment_starts=[100])
    shared = allocate_slab(5 * PAGE, prefer_shared=True, pin=False, segment_starts=[2 * PAGE])
    assert shared.segment_starts == (0,) and shared.kind == "shared"  # shared memory is never moved


def test_segments_are_cut_before_the_page_aligned_tensor_that_would_overflow_one():
    from fastdcp.save.staging import StagingLayout

    sizes = [4 * PAGE - 64, 100, PAGE, 5 * PAGE]
    layout = StagingLayout.for_tensors([torch.empty(n, dtype=torch.uint8) for n in sizes])
    assert layout.offsets == (0, 4 * PAGE - 64, 5 * PAGE, 6 * PAGE)
    # 4 pages a segment: the small tensor takes the first past 4 pages, but it is not on a page
    # boundary, so no cut before it; the next starts a segment; the 5-page one is one of its own.
    assert layout.segment_starts(4 * PAGE) == (0, 5 * PAGE, 6 * PAGE)
    assert layout.segment_starts(100 * PAGE) == (0,)


def test_cached_staging_flag_is_accepted(tmp_path):
    """Stock's cache_staged_state_dict=True needs pinned memory (an accelerator); ours always
    reuses its slab and works everywhere."""
    writer = FastFileSystemWriter(tmp_path / "a", cache_staged_state_dict=True)
    for name in ("a", "b"):
        sd = _state(11 if name == "a" else 12)
        expected = _expected(sd)
        _wait(dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / name, no_dist=True))
        _load_stock(tmp_path / name, expected)
    assert writer._stager.slabs_allocated == 1


# --------------------------------------------------------------------------- #
# DTensor / ShardedTensor and process mode: fresh interpreters (process groups)
# --------------------------------------------------------------------------- #
def _child_main(root: str, mode: str) -> None:
    """Runs in a fresh interpreter as a gloo world of 1 (see the tests below)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    import torch.distributed._shard.sharded_tensor as sharded
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    report: dict = {}
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (1,))
        writer = FastFileSystemWriter(os.path.join(root, "0"))
        kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        base = _state(20)
        full = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
        for step in range(3):
            st = sharded.empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 10, 4)
            st.local_shards()[0].tensor.copy_(torch.arange(40.0).reshape(10, 4) + step)
            sd = {**C.deepcopy_state_dict(base), "step": step,
                  "dt": distribute_tensor(full + step, mesh, [Shard(0)]), "st": st}
            staged = writer.stage(sd) if step == 0 and mode == "thread" else None
            if staged is not None:
                report["dtensor_staged"] = isinstance(staged["dt"], DTensor) and staged["dt"].placements == (Shard(0),)
                report["sharded_staged"] = isinstance(staged["st"], ShardedTensor)
                lo, hi = _slab_range(writer)
                report["in_slab"] = all(lo <= t.data_ptr() < hi for t in
                                        (staged["dt"]._local_tensor, staged["st"].local_shards()[0].tensor))
                del staged
                writer._release_staging()
            result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=os.path.join(root, str(step)),
                                    async_checkpointer_type=kind)
            sd["dt"]._local_tensor.fill_(-1)
            sd["st"].local_shards()[0].tensor.fill_(-1)
            _wait(result)
            dest = {"dt": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)]),
                    "st": sharded.zeros(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 10, 4)}
            dcp.load(dest, storage_reader=C.make_reader("stock", os.path.join(root, str(step))))
            report[f"dt_{step}"] = torch.equal(dest["dt"].full_tensor(), full + step)
            report[f"st_{step}"] = torch.equal(dest["st"].local_shards()[0].tensor,
                                               torch.arange(40.0).reshape(10, 4) + step)
        report["slabs"] = writer._stager.slabs_allocated
        report["slab_kind"] = writer._stager._slab.kind
        report["slab_pinned"] = writer._stager._slab.pinned
        report["ok"] = True
    except BaseException:
        import traceback

        report["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def _run_child(root: Path, mode: str) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        sys.path[:0] = [{str(HERE)!r}, {str(TESTS_DIR)!r}, {str(REPO_ROOT)!r}]
        import test_async_staging
        test_async_staging._child_main({str(root)!r}, {mode!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    report_path = root / "report.json"
    assert report_path.exists(), f"child died: rc={proc.returncode}\n{proc.stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    assert "error" not in report, report["error"] + "\n---\n" + proc.stderr[-3000:]
    return report


@pytest.mark.fastdcp_timeout(600)
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_save_dtensor_shardedtensor_and_process_mode(tmp_path, mode):
    """Three async saves of DTensor + ShardedTensor state through one writer in THREAD or PROCESS
    mode: one slab for all of them (anonymous memory; process mode moves it into shared memory once,
    in place, and later saves send it without a copy), each checkpoint holds the values at call
    time, stock reads them."""
    report = _run_child(tmp_path, mode)
    if mode == "thread":
        assert report["dtensor_staged"] and report["sharded_staged"] and report["in_slab"], report
    for step in range(3):
        assert report[f"dt_{step}"] and report[f"st_{step}"], report
    assert report["slabs"] == 1, report
    # A pinned slab is shared memory from the start (host_memory's docstring): with a GPU visible
    # thread mode's slab is shared too.
    assert report["slab_kind"] == ("shared" if mode == "process" or report["slab_pinned"] else "private"), report


# --------------------------------------------------------------------------- #
# a crash between stage() and the commit leaves the previous checkpoint
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("phase", ["plan", "write", "sync", "commit", "cleanup"])
def test_sigkill_during_async_save(zygote, tmp_path, phase):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    dcp.save(make_state(SEED, 0), storage_writer=FastFileSystemWriter(directory), no_dist=True)
    notes, error_file = tmp_path / "notes", tmp_path / "error"
    pid = zygote.fork({
        "dir": str(directory), "seed": SEED, "first": 1, "count": 1, "async": True,
        "notes": str(notes), "error_file": str(error_file),
        "env": {"FASTDCP_TEST_PAUSE_AT": phase, "FASTDCP_TEST_PAUSE_S": "120",
                "FASTDCP_TEST_PAUSE_NOTIFY": str(notes)},
    })
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = notes.read_text() if notes.exists() else ""
        if f"{phase} " in text and "staged 1" in text:
            break
        if error_file.exists() and error_file.stat().st_size:
            zygote.kill(pid)
            pytest.fail(error_file.read_text())
        time.sleep(0.005)
    else:
        zygote.kill(pid)
        pytest.fail(f"never reached {phase}: {notes.read_text() if notes.exists() else ''}")
    assert zygote.kill(pid)["signal"] == 9
    expected = "state 1" if phase == "cleanup" else "state 0"
    candidates = {0: make_state(SEED, 0), 1: make_state(SEED, 1)}
    for reader in ("fast", "stock"):
        assert classify(str(directory), candidates, reader) == expected, (phase, reader, os.listdir(directory))


def test_a_tensor_that_cannot_be_staged_is_named(tmp_path):
    writer = FastFileSystemWriter(tmp_path)
    with pytest.raises(RuntimeError, match=r"cannot stage 'model\.layers\[1\]\.w' \(torch\.float32, shape \(2, 3\), on meta\)"):
        writer.stage({"model": {"layers": [{"w": torch.ones(2)}, {"w": torch.empty(2, 3, device="meta")}]}})
    writer.stage({"t": torch.ones(3)})  # the failed stage released the slab


def test_the_save_thread_yields_the_gil_once_to_the_caller(tmp_path, monkeypatch):
    """After stage() on the caller's thread, the save thread's first call (reset) gives up the GIL
    once, so the caller of async_save does not wait for the interpreter's switch interval."""
    from fastdcp.save import writer as W

    yields: list[tuple[float, str]] = []
    real_sleep = W.time.sleep

    def spy(seconds):
        yields.append((seconds, threading.current_thread().name))
        real_sleep(seconds)

    monkeypatch.setattr(W.time, "sleep", spy)
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    writer = FastFileSystemWriter(tmp_path / "a")
    for i in range(2):
        path = tmp_path / f"save{i}"
        future = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
        getattr(future, "upload_completion", future).result()
        C.load_in_place_and_check(dcp.FileSystemReader(path), state, {"w": torch.zeros(1000), "step": None})
        assert len(yields) == i + 1, yields  # once per save
        seconds, thread = yields[-1]
        assert seconds == 0 and thread != threading.current_thread().name
    # a blocking save on the thread that staged (or a writer that never staged) does not yield
    dcp.save(state, checkpoint_id=tmp_path / "sync", storage_writer=writer, no_dist=True)
    dcp.save(state, checkpoint_id=tmp_path / "sync2", storage_writer=FastFileSystemWriter(tmp_path / "b"),
             no_dist=True)
    assert len(yields) == 2
