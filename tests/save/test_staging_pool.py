"""The process-wide staging pool (``fastdcp.save.staging_pool``): slabs reused across writer objects
(a new ``FastFileSystemWriter`` per checkpoint), released by exactly the save that read them, the
memory cap (eviction, waiting, slabs outside the pool), ``release_staging``, process mode and fork.

Checkpoints are loaded back with stock ``FileSystemReader`` and compared bit-exact with the values
the state had when ``async_save`` was called (the live tensors change right after the call).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from fastdcp import (
    FastFileSystemWriter,
    FastSavePlanner,
    StagingPoolStats,
    release_staging,
    set_staging_pool_limit,
    staging_pool_stats,
)
from fastdcp.io.host_memory import PAGE
from fastdcp.save import staging_pool as _pool

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
REPO_ROOT = TESTS_DIR.parent


@pytest.fixture(autouse=True)
def _fresh_pool():
    """Every test starts with an empty pool at its default cap, so none depends on another."""
    _pool.reset_staging_pool()
    yield
    _pool.reset_staging_pool()


def _state(seed: int, rows: int = 300) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 257, generator=g),  # > a page
        "bf16": torch.randn(50, 33, generator=g).bfloat16(),
        "ids": torch.arange(7, dtype=torch.int64) + seed,
        "nested": {"b": torch.full((5,), float(seed))},
        "step": seed,
    }


def _train_step(sd: dict) -> None:
    """What training does right after async_save returns: change every tensor in place."""
    for t in C.tensor_leaves(sd).values():
        if t.dtype.is_floating_point:
            t.mul_(-1.5).add_(0.25)
        else:
            t.add_(100)
    sd["step"] += 1


def _load_stock(path, expected: dict) -> None:
    C.load_in_place_and_check(C.make_reader("stock", path), expected, C.destination_for(expected))


def _wait(result) -> None:
    getattr(result, "upload_completion", result).result()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _slab_bytes(sd: dict) -> int:
    """The size of the slab a state needs (staged once through a throwaway pool)."""
    writer = FastFileSystemWriter("unused")
    writer.stage(sd)
    size = writer._stager._slab.nbytes
    _pool.reset_staging_pool()
    return size


class _Planner(types.SimpleNamespace):
    """Stands in for the planner write_data gets: the writer finds the lease by its state dict."""


# --------------------------------------------------------------------------- #
# reuse across writers
# --------------------------------------------------------------------------- #
def test_writers_in_a_row_reuse_one_slab(tmp_path):
    sd = _state(1)
    slabs, sizes = set(), set()
    for step in range(4):
        expected = C.deepcopy_state_dict(sd)
        writer = FastFileSystemWriter(tmp_path / str(step))  # a new writer per checkpoint
        result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / str(step), no_dist=True)
        slabs.add(writer._stager._slab.ptr)
        sizes.add(writer._stager._slab.nbytes)
        _train_step(sd)
        _wait(result)
        _load_stock(tmp_path / str(step), expected)
        del writer, result
    stats = staging_pool_stats()
    assert isinstance(stats, StagingPoolStats)
    assert (stats.slabs_allocated, stats.slabs_reused) == (1, 3), stats
    assert len(slabs) == 1
    assert (stats.slabs_in_use, stats.slabs_idle, stats.bytes_in_use) == (0, 1, 0), stats
    assert {stats.bytes_held} == sizes


@pytest.mark.parametrize("planner", ["default", "fast"])
def test_write_data_releases_its_own_slab(tmp_path, planner):
    """The slab is free once the save's write_data is done, even while the staged tensors are
    still alive (here: kept by the writer): the writer finds its lease through the planner."""

    class Keeping(FastFileSystemWriter):
        def stage(self, state_dict):
            self.kept = super().stage(state_dict)
            return self.kept

    sd = _state(2)
    writers = []
    for step in range(3):
        expected = C.deepcopy_state_dict(sd)
        writer = Keeping(tmp_path / str(step))
        writers.append(writer)
        _wait(dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / str(step), no_dist=True,
                             planner=FastSavePlanner() if planner == "fast" else None))
        assert staging_pool_stats().slabs_in_use == 0, "write_data did not release the slab it read"
        _load_stock(tmp_path / str(step), expected)
        _train_step(sd)
    assert all(w.kept is not None for w in writers)
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_reused) == (1, 2), stats


def test_a_release_for_another_writers_state_releases_nothing(tmp_path):
    a, b = FastFileSystemWriter(tmp_path / "a"), FastFileSystemWriter(tmp_path / "b")
    held_a = a.stage(_state(3))
    held_b = b.stage(_state(4))
    b._release_staging(_Planner(state_dict=held_a))  # not b's tensors
    assert staging_pool_stats().slabs_in_use == 2
    a._release_staging(_Planner(state_dict=held_a))
    assert staging_pool_stats().slabs_in_use == 1
    c = FastFileSystemWriter(tmp_path / "c").stage(_state(5))  # a's slab, not b's
    assert _storage(c["w"]) == _storage(held_a["w"]) != _storage(held_b["w"])
    C.assert_same(held_b["w"], _state(4)["w"])


def test_changed_structure_gets_a_new_slab_and_both_are_bit_exact(tmp_path):
    states = {"a": _state(6), "b": _state(7, rows=301), "c": _state(8)}  # b: another shape
    for name, sd in states.items():
        expected = C.deepcopy_state_dict(sd)
        _wait(dcp.async_save(sd, storage_writer=FastFileSystemWriter(tmp_path / name), no_dist=True))
        _train_step(sd)
        _load_stock(tmp_path / name, expected)
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_reused, stats.slabs_idle) == (2, 1, 2), stats


# --------------------------------------------------------------------------- #
# release_staging, close
# --------------------------------------------------------------------------- #
def test_release_staging_frees_idle_slabs_but_never_one_in_use(tmp_path):
    busy_writer = FastFileSystemWriter(tmp_path / "busy")
    busy = busy_writer.stage(_state(9))  # a save still reads it
    busy_copy = C.deepcopy_state_dict(busy)
    idle_writer = FastFileSystemWriter(tmp_path / "idle")
    idle = idle_writer.stage(_state(10, rows=20))
    idle_writer._release_staging(_Planner(state_dict=idle))
    before = staging_pool_stats()
    assert before.slabs_in_use == 1 and before.slabs_idle == 1
    idle_bytes = before.bytes_held - before.bytes_in_use

    assert release_staging() == idle_bytes
    after = staging_pool_stats()
    assert after.slabs_idle == 0 and after.slabs_in_use == 1 and after.bytes_held == before.bytes_in_use
    busy_writer.close()  # drops the writer's hold, not the save's
    again = FastFileSystemWriter(tmp_path / "again").stage(_state(11))  # same layout as busy
    assert _storage(again["w"]) != _storage(busy["w"]), "a slab in use was handed out again"
    C.assert_same(busy, busy_copy)
    assert release_staging() == 0  # both in use: nothing idle to drop now
    del busy, busy_copy
    gc.collect()
    stats = staging_pool_stats()  # busy's slab was marked: dropped once its views went away
    assert stats.slabs_in_use == 1 and stats.slabs_idle == 0, stats
    del again
    gc.collect()
    assert staging_pool_stats().bytes_held == 0


# --------------------------------------------------------------------------- #
# the memory cap
# --------------------------------------------------------------------------- #
def test_cap_evicts_the_least_recently_used_idle_slab(tmp_path):
    shapes = {"A": (64, 128), "B": (128, 64), "C": (32, 256)}  # three layouts, one slab size

    def stage_and_release(name: str, seed: int) -> None:
        writer = FastFileSystemWriter(tmp_path)
        values = {"w": torch.randn(shapes[name], generator=torch.Generator().manual_seed(seed))}
        staged = writer.stage(values)
        C.assert_same(staged, values)
        writer._release_staging(_Planner(state_dict=staged))

    size = 64 * 128 * 4
    set_staging_pool_limit(2 * size)
    stage_and_release("A", 1)
    stage_and_release("B", 2)
    stage_and_release("A", 3)  # reused, now the most recently used
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_reused, stats.bytes_held) == (2, 1, 2 * size), stats
    stage_and_release("C", 4)  # over the cap: B (least recently used) goes
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_dropped, stats.bytes_held) == (3, 1, 2 * size), stats
    stage_and_release("A", 5)  # A is still there
    assert staging_pool_stats().slabs_reused == 2
    stage_and_release("B", 6)  # B was dropped: a new slab (C goes)
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_dropped, stats.bytes_held) == (4, 2, 2 * size), stats


def test_lowering_the_cap_drops_idle_slabs_now(tmp_path):
    writer = FastFileSystemWriter(tmp_path)
    staged = writer.stage(_state(12))
    writer._release_staging(_Planner(state_dict=staged))
    assert staging_pool_stats().bytes_held > 0
    set_staging_pool_limit(0)
    stats = staging_pool_stats()
    assert (stats.bytes_held, stats.slabs_dropped, stats.limit_bytes) == (0, 1, 0)
    set_staging_pool_limit(None)
    assert staging_pool_stats().limit_bytes == _pool.default_limit()
    with pytest.raises(ValueError, match="staging pool limit"):
        set_staging_pool_limit(-1)


def test_a_state_bigger_than_the_cap_gets_an_unpooled_slab_and_one_warning(tmp_path):
    set_staging_pool_limit(PAGE)
    sd = _state(13)
    for step in range(3):
        expected = C.deepcopy_state_dict(sd)
        writer = FastFileSystemWriter(tmp_path / str(step))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / str(step), no_dist=True)
        mine = [str(w.message) for w in caught if "staging pool's limit" in str(w.message)]
        if step == 0:
            assert len(mine) == 1, mine
            assert f"limit of {PAGE} bytes" in mine[0] and "set_staging_pool_limit" in mine[0]
            assert "FASTDCP_STAGING_POOL_LIMIT_BYTES" in mine[0]
        else:
            assert mine == [], "the cap warning is given once per process"
        _train_step(sd)
        _wait(result)
        _load_stock(tmp_path / str(step), expected)
        assert staging_pool_stats().bytes_held == 0  # never pooled
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_unpooled, stats.slabs_reused) == (3, 3, 0), stats


def test_over_the_cap_a_stage_waits_for_a_slab_to_be_released(tmp_path):
    size = _slab_bytes(_state(0))
    set_staging_pool_limit(size)
    first_writer = FastFileSystemWriter(tmp_path / "1")
    first = first_writer.stage(_state(14))
    done = threading.Event()
    second = {}

    def stage_again():
        second["sd"] = FastFileSystemWriter(tmp_path / "2").stage(_state(15))
        done.set()

    thread = threading.Thread(target=stage_again)
    thread.start()
    assert not done.wait(0.5), "a stage over the cap refilled a slab in use (or exceeded the cap)"
    C.assert_same(first["w"], _state(14)["w"])
    first_writer._release_staging(_Planner(state_dict=first))
    assert done.wait(10)
    thread.join()
    assert _storage(second["sd"]["w"]) == _storage(first["w"])  # the same slab, after its release
    C.assert_same(second["sd"]["w"], _state(15)["w"])
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_reused, stats.bytes_held) == (1, 1, size)


# --------------------------------------------------------------------------- #
# two saves in flight (thread mode)
# --------------------------------------------------------------------------- #
class _GatedWriter(FastFileSystemWriter):
    """Its write_data waits for ``gate`` (a save still writing when the next one is staged)."""

    gate: threading.Event | None = None

    def write_data(self, plan, planner):
        if self.gate is not None:
            assert self.gate.wait(120), "test gate never opened"
        return super().write_data(plan, planner)


def test_a_save_staged_while_another_is_in_flight_gets_another_slab(tmp_path):
    sd = _state(16)
    gate = threading.Event()
    expected, results, slabs = [], [], []
    try:
        for step in range(2):
            expected.append(C.deepcopy_state_dict(sd))
            writer = _GatedWriter(tmp_path / str(step))
            writer.gate = gate if step == 0 else None
            results.append(dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / str(step),
                                          no_dist=True))
            slabs.append(writer._stager._slab.ptr)
            _train_step(sd)
        _wait(results[1])  # the second save finishes while the first still waits in write_data
        assert not results[0].done()
        stats = staging_pool_stats()
        assert slabs[0] != slabs[1] and stats.slabs_allocated == 2 and stats.slabs_in_use == 1, stats
        # A third save while the first is still in flight: the second's slab, never the first's.
        expected.append(C.deepcopy_state_dict(sd))
        writer = FastFileSystemWriter(tmp_path / "2")
        results.append(dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / "2", no_dist=True))
        assert writer._stager._slab.ptr == slabs[1]
        _train_step(sd)
    finally:
        gate.set()
    for result in results:
        _wait(result)
    for step, values in enumerate(expected):
        _load_stock(tmp_path / str(step), values)
    stats = staging_pool_stats()
    assert (stats.slabs_allocated, stats.slabs_reused, stats.slabs_in_use) == (2, 1, 0), stats


# --------------------------------------------------------------------------- #
# process mode and fork
# --------------------------------------------------------------------------- #
def _child_main(root: str) -> None:
    """Runs in a fresh interpreter as a gloo world of 1: process-mode saves, a new writer each,
    with slab segments of a page (so that the last tensor, ``w2``, starts a segment of its own) and
    a record of every move of private memory into shared memory that pickling for the checkpoint
    process makes."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from fastdcp.save import staging

    report: dict = {}
    staging.SEGMENT_BYTES = PAGE
    moves: list[int] = []
    share_fd = torch.UntypedStorage._share_fd_cpu_

    def recording_share_fd(storage, *args, **kwargs):
        if not storage.is_shared():
            moves.append(storage.nbytes())
        return share_fd(storage, *args, **kwargs)

    torch.UntypedStorage._share_fd_cpu_ = recording_share_fd
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        sd = {**_state(20), "w2": torch.randn(40, 257)}
        kinds = set()
        for step in range(4):
            expected = C.deepcopy_state_dict(sd)
            path = os.path.join(root, str(step))
            writer = FastFileSystemWriter(path)
            moves.clear()
            result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path,
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            _train_step(sd)
            _wait(result)
            report.setdefault("moves", []).append(list(moves))
            report.setdefault("slab_bytes", []).append(writer._stager._slab.nbytes)
            # The first save moved the (private) slab into shared memory, in place; later ones
            # send it as it is.
            kinds.add(writer._stager._slab.kind)
            report.setdefault("slabs", []).append(writer._stager._slab.ptr)
            writer_slab_pinned = writer._stager._slab.pinned
            dest = C.destination_for(expected)
            dcp.load(dest, storage_reader=C.make_reader("stock", path))
            report[f"same_{step}"] = all(
                torch.equal(C.bit_view(a), C.bit_view(b))
                for a, b in zip(C.tensor_leaves(dest).values(), C.tensor_leaves(expected).values())
            ) and dest["step"] == expected["step"]
            del writer, result
        stats = staging_pool_stats()
        report["pinned"] = writer_slab_pinned
        report["allocated"], report["reused"] = stats.slabs_allocated, stats.slabs_reused
        report["kinds"] = sorted(kinds)
        report["ok"] = True
    except BaseException:
        import traceback

        report["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


@pytest.mark.fastdcp_timeout(600)
def test_process_mode_new_writer_per_save_reuses_one_slab(tmp_path):
    """The writer goes to the background process without its lease: the views going away in this
    process (once the background process answered) free the slab for the next writer. The slab
    goes to the background process as shared memory (moved there by the first save)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        sys.path[:0] = [{str(HERE)!r}, {str(TESTS_DIR)!r}, {str(REPO_ROOT)!r}]
        import test_staging_pool
        test_staging_pool._child_main({str(tmp_path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=500)
    report_path = tmp_path / "report.json"
    assert report_path.exists(), f"child died: rc={proc.returncode}\n{proc.stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    assert "error" not in report, report["error"] + "\n---\n" + proc.stderr[-3000:]
    for step in range(4):
        assert report[f"same_{step}"], (step, report)
    assert (report["allocated"], report["reused"]) == (1, 3), report
    assert len(set(report["slabs"])) == 1 and report["kinds"] == ["shared"], report
    # The first save moved the slab segment by segment (everything before w2, then w2's pages);
    # later saves moved nothing. A pinned slab (under CUDA, or in fake-pinned mode) is shared
    # memory from the start: nothing moves.
    w2_bytes = -(-40 * 257 * 4 // PAGE) * PAGE
    first_moves = [] if report["pinned"] else [report["slab_bytes"][0] - w2_bytes, w2_bytes]
    assert report["moves"][0] == first_moves, report
    assert report["moves"][1:] == [[], [], []], report


def test_a_forked_child_never_reuses_the_parents_slab(tmp_path):
    parent = {"w": torch.arange(1000, dtype=torch.float32), "n": torch.ones(3, dtype=torch.int64)}
    writer = FastFileSystemWriter(tmp_path)
    staged = writer.stage(parent)
    writer._release_staging(_Planner(state_dict=staged))  # idle: reusable in this process
    assert staging_pool_stats().slabs_idle == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: stage the same layout with other values
        code = 1
        try:
            child_writer = FastFileSystemWriter(tmp_path)  # inherited: the writer, its stager, the pool
            mine = child_writer.stage({"w": torch.full((1000,), -7.0), "n": torch.zeros(3, dtype=torch.int64)})
            stats = staging_pool_stats()
            out = {"same_slab": _storage(mine["w"]) == _storage(staged["w"]),
                   "allocated": stats.slabs_allocated, "reused": stats.slabs_reused,
                   "values": bool(torch.equal(mine["w"], torch.full((1000,), -7.0)))}
            writer._release_staging(_Planner(state_dict=staged))  # an inherited lease: harmless
            os.write(write, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        out = json.loads(f.read() or "{}")
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out
    assert out == {"same_slab": False, "allocated": 1, "reused": 0, "values": True}, out
    # The parent's slab (shared memory) was not written by the child.
    assert torch.equal(staged["w"], torch.arange(1000, dtype=torch.float32))
    again = FastFileSystemWriter(tmp_path).stage({"w": torch.ones(1000), "n": torch.ones(3, dtype=torch.int64)})
    assert _storage(again["w"]) == _storage(staged["w"])  # the parent still reuses its own
    assert staging_pool_stats().slabs_reused == 1


def test_a_pool_from_another_pid_is_forgotten(tmp_path, monkeypatch):
    """Forked without the at-fork hook (it resets the pool too): the pid check alone."""
    writer = FastFileSystemWriter(tmp_path)
    staged = writer.stage(_state(21))
    writer._release_staging(_Planner(state_dict=staged))
    monkeypatch.setattr(_pool.staging_pool(), "_pid", -1)
    again = FastFileSystemWriter(tmp_path).stage(_state(22))
    assert _storage(again["w"]) != _storage(staged["w"])
    assert staging_pool_stats().slabs_allocated == 1  # counted afresh


# --------------------------------------------------------------------------- #
# the default cap
# --------------------------------------------------------------------------- #
def test_default_cap(monkeypatch):
    monkeypatch.delenv(_pool.LIMIT_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert _pool.default_limit() == physical // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _pool.default_limit() == physical // 32
    assert staging_pool_stats().limit_bytes == physical // 32
    monkeypatch.setenv(_pool.LIMIT_ENV, str(3 << 20))
    assert staging_pool_stats().limit_bytes == 3 << 20
    monkeypatch.setenv(_pool.LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="FASTDCP_STAGING_POOL_LIMIT_BYTES"):
        _pool.default_limit()
