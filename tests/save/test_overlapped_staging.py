"""Overlapped async staging: ``FastFileSystemWriter(async_staging=True)``, ``fastdcp.guard`` and
``snapshot_limit_bytes``.

With ``async_staging=True`` the writer's ``stage()`` returns a Future (DCP's protocol), so
``dcp.async_save`` returns ``AsyncSaveResponse(staging_completion, upload_completion)`` before the
state is copied. ``fastdcp.guard(optimizer, *modules)`` makes that safe in a plain training loop:
``optimizer.step()`` waits for the staging in flight, and the modules' buffers (BatchNorm running
stats, changed by the next forward) are staged inside the ``async_save`` call. With
``snapshot_limit_bytes`` at most about that many bytes are copied; the rest is written from the
live tensors, and staging completes only once those are written.

Every checkpoint is loaded back with stock ``FileSystemReader`` and compared bit for bit with a
clone of the state taken right before its ``async_save`` call. Process-mode saves run in a fresh
interpreter (a gloo world of 1, which DCP's process executor needs), once for the whole module.
Peak host memory is measured in a fresh interpreter from the kernel's high-water mark (VmHWM, reset
through /proc/self/clear_refs), durability with strace, crashes with SIGKILL through the crash
tests' zygote (``tests/_crash_worker.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import dcp_cases as C
from _crash_worker import Zygote, classify, make_state

import fastdcp
from fastdcp import FastFileSystemWriter
from fastdcp.save import staging_pool as _pool

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

HERE = Path(__file__).resolve().parent  # this module, imported by name in child interpreters
TESTS_DIR = HERE.parent
REPO_ROOT = TESTS_DIR.parent
MiB = 1 << 20
STEPS = 4  # checkpoints per training run
ENV_ASYNC = "FASTDCP_ASYNC_STAGING"
ENV_BUDGET = "FASTDCP_SNAPSHOT_LIMIT_BYTES"


@pytest.fixture(autouse=True)
def _fresh_pool_and_env(monkeypatch):
    """Every test starts with an empty staging pool at its default cap, and without the
    environment defaults of the feature under test."""
    monkeypatch.delenv(ENV_ASYNC, raising=False)
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    _pool.reset_staging_pool()
    yield
    _pool.reset_staging_pool()


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _load_stock(path, expected: dict, context: str = "") -> None:
    """Stock FileSystemReader loads ``path`` into a sentinel-filled destination: bit-exact ``expected``."""
    try:
        C.load_in_place_and_check(C.make_reader("stock", path), expected, C.destination_for(expected))
    except AssertionError as error:
        raise AssertionError(f"{context}: checkpoint {path} differs from the state at its async_save call: {error}") from None


def _load_fast(path, expected: dict) -> None:
    C.load_in_place_and_check(C.make_reader("fast", path), expected, C.destination_for(expected))


def _save_kwargs(kind: str) -> dict:
    if kind == "process":
        return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}  # a real process group
    return {"async_checkpointer_type": AsyncCheckpointerType.THREAD, "no_dist": True}


def _upload(response):
    return getattr(response, "upload_completion", response)


def _tensor_bytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in C.tensor_leaves(sd).values())


def _make_training(seed: int = 0):
    """A small real model: the first Linear is big enough (2 MiB) that staging it takes a while,
    and BatchNorm's running stats come after it in the state dict."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(STEPS + 2, 32, 512, generator=torch.Generator().manual_seed(seed + 1))
    return model, optimizer, data


def _forward_backward(model: nn.Module, optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()  # train mode: updates BN running_mean/var/num_batches_tracked


def run_training(
    root: Path,
    *,
    kind: str = "thread",
    reuse_writer: bool = False,
    guard: bool = True,
    wait_staging: bool = False,
    save_after_step: bool = False,
    steps: int = STEPS,
    writer_kwargs: dict | None = None,
) -> tuple[list[tuple[Path, dict]], list[bool]]:
    """A real training loop with an ``async_save`` every step.

    ``forward; backward; async_save; optimizer.step()`` (or, with ``save_after_step``,
    ``forward; backward; optimizer.step(); async_save``: the next forward then changes BN's
    running stats right after the call). The loop clones the exact state before each call (the
    expected checkpoint), never waits on staging itself unless ``wait_staging`` (stock's protocol:
    ``staging_completion.result()`` before the step), and waits for the previous upload before the
    next save, as frameworks do. ``reuse_writer``: one writer object, ``checkpoint_id=`` a new
    directory each step; otherwise a new writer per step.

    Returns [(checkpoint directory, expected state)] and, per ``optimizer.step()`` after a save,
    whether that save's ``staging_completion`` was done when the step started changing tensors
    (seen by a step pre-hook registered after the guard's)."""
    writer_kwargs = {"async_staging": True, **(writer_kwargs or {})}
    model, optimizer, data = _make_training()
    _forward_backward(model, optimizer, data[0])
    optimizer.step()  # AdamW's state exists from the first checkpoint on
    handle = fastdcp.guard(optimizer, model) if guard else None
    latest: list = []
    staged_when_step_started: list[bool] = []
    recorder = optimizer.register_step_pre_hook(
        lambda *_: staged_when_step_started.append(latest[-1].staging_completion.done()) if latest else None
    )
    writer = FastFileSystemWriter(root / "ckpt-0", **writer_kwargs) if reuse_writer else None
    saves: list[tuple[Path, dict]] = []
    previous = None
    try:
        for step in range(steps):
            _forward_backward(model, optimizer, data[step + 1])
            if save_after_step:
                optimizer.step()
            if previous is not None:
                _upload(previous).result()
            directory = root / f"ckpt-{step}"
            sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            expected = C.deepcopy_state_dict(sd)
            response = dcp.async_save(
                sd,
                storage_writer=writer if writer is not None else FastFileSystemWriter(directory, **writer_kwargs),
                checkpoint_id=directory if writer is not None else None,
                **_save_kwargs(kind),
            )
            assert isinstance(response, AsyncSaveResponse), (
                f"async_save with async_staging=True returned {type(response).__name__}, not AsyncSaveResponse"
            )
            latest.append(response)
            if wait_staging:
                response.staging_completion.result()
            if not save_after_step:
                optimizer.step()  # changes every parameter and AdamW state tensor in place
            saves.append((directory, expected))
            previous = response
        _upload(previous).result()
    finally:
        recorder.remove()
        if handle is not None:
            handle.remove()
    return saves, staged_when_step_started


def _check_checkpoints(saves, staged_when_step_started, *, waited: bool, context: str) -> None:
    assert len(saves) == STEPS
    for directory, expected in saves:
        _load_stock(directory, expected, context)
        bn = expected["model"]
        assert int(bn["1.num_batches_tracked"]) > 0
    # The checkpoints differ from each other (the loop really trained between them).
    first, last = saves[0][1], saves[-1][1]
    assert not torch.equal(first["model"]["1.running_mean"], last["model"]["1.running_mean"])
    assert not torch.equal(first["optim"]["state"][0]["exp_avg"], last["optim"]["state"][0]["exp_avg"])
    if waited:  # by the guard, or by the loop itself
        assert staged_when_step_started and all(staged_when_step_started), (
            f"{context}: optimizer.step() went ahead while the staging of the async_save before it was "
            f"still in flight (staging_completion done when each step started: {staged_when_step_started})"
        )


# --------------------------------------------------------------------------- #
# process mode: one fresh interpreter for the module
# --------------------------------------------------------------------------- #
PROCESS_CASES = ("guard-new-writer", "guard-reused-writer", "guard-new-writer-save-after-step")
PROCESS_BUDGET = 4 * MiB
PROCESS_BUDGET_SHAPES = [(1024, 1024)] * 4 + [(512, 1024)] * 4  # 4x4 MiB + 4x2 MiB = 24 MiB


class _BigModel(nn.Module):
    """Parameters of given shapes (no compute): for budget tests, updated by a plain SGD step."""

    def __init__(self, shapes, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.params = nn.ParameterList([nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes])
        self.register_buffer("seen", torch.zeros(16))
        for p in self.params:
            p.grad = torch.full_like(p, 0.5)


def _budget_loop(root: Path, model: _BigModel, *, kind: str, budget: int | None, steps: int):
    """Saves of a large state with a staging budget; right after each call the loop changes the
    buffer (as a forward would) and steps (SGD, lr 1: every parameter changes). Guarded."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    saves, reports, staged = [], [], []
    previous = None
    with fastdcp.guard(optimizer, model):
        # Registered after the guard's hook: sees whether staging completed before the step went on.
        recorder = optimizer.register_step_pre_hook(lambda *_: staged.append(previous.staging_completion.done()))
        for step in range(steps):
            if previous is not None:
                _upload(previous).result()
            directory = root / f"budget-{step}"
            writer = FastFileSystemWriter(directory, async_staging=True, snapshot_limit_bytes=budget)
            sd = {"model": model.state_dict()}
            expected = C.deepcopy_state_dict(sd)
            response = dcp.async_save(sd, storage_writer=writer, **_save_kwargs(kind))
            previous = response
            model.seen.add_(1.0)  # a forward-like buffer update right after the call
            optimizer.step()
            saves.append((directory, expected))
            reports.append(writer)
        recorder.remove()
        _upload(previous).result()
    return saves, [w.last_staging_report for w in reports], staged


def _report_dict(report) -> dict:
    out = {name: getattr(report, name) for name in ("state_bytes", "snapshot_bytes", "streamed_bytes", "peak_host_bytes")}
    out["completed_bytes"] = getattr(report, "completed_bytes", 0)  # streamed tensors copied late after all
    return out


def _process_mode_child(root: str) -> None:
    """Runs in a fresh interpreter as a gloo world of 1 (DCP's process executor needs a group)."""
    import datetime

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    root_path = Path(root)
    report: dict = {}
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for case in PROCESS_CASES:
            saves, staged = run_training(
                root_path / case, kind="process", reuse_writer="reused" in case,
                save_after_step=case.endswith("save-after-step"),
            )
            torch.save([(str(d), e) for d, e in saves], root_path / case / "expected.pt")
            report[case] = {"staged_when_step_started": staged}
        # A staging budget in process mode: honoured, or a full snapshot with a warning.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saves, reports, staged = _budget_loop(root_path / "budget", _BigModel(PROCESS_BUDGET_SHAPES),
                                                  kind="process", budget=PROCESS_BUDGET, steps=2)
        torch.save([(str(d), e) for d, e in saves], root_path / "budget" / "expected.pt")
        report["budget"] = {
            "staged_when_step_started": staged,
            "reports": [_report_dict(r) for r in reports],
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        }
        report["ok"] = True
    except BaseException:
        import traceback

        report["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def _run_module_child(function: str, root: Path, timeout: float = 240, extra_env: dict | None = None) -> dict:
    """Run ``function(root)`` of this module in a fresh interpreter; return its report.json."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", **(extra_env or {}))
    env.pop(ENV_ASYNC, None)
    env.pop(ENV_BUDGET, None)
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        sys.path[:0] = [{str(HERE)!r}, {str(TESTS_DIR)!r}, {str(REPO_ROOT)!r}]
        import test_overlapped_staging
        test_overlapped_staging.{function}({str(root)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    report_path = root / "report.json"
    assert report_path.exists(), f"child died: rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    assert "error" not in report, report["error"] + "\n---\n" + proc.stderr[-3000:]
    return report


@pytest.fixture(scope="module")
def process_mode_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("process-mode")
    return root, _run_module_child("_process_mode_child", root, timeout=280)


def _expected_from(path: Path):
    return [(Path(d), e) for d, e in torch.load(path, weights_only=False)]


# --------------------------------------------------------------------------- #
# 1. the guarded training loop, thread and process mode, new or reused writer
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("save_after_step", [False, True], ids=["save-then-step", "step-then-save"])
@pytest.mark.parametrize("reuse_writer", [False, True], ids=["new-writer", "reused-writer"])
def test_guarded_training_loop_thread_mode(tmp_path, reuse_writer, save_after_step):
    """``forward; backward; async_save; step`` every step with the guard and no explicit wait:
    every checkpoint holds exactly the state at its call (parameters, BN running stats, AdamW
    exp_avg/exp_avg_sq/step), and each step returned only after the staging before it completed.
    ``step-then-save``: the next forward updates BN's running stats right after the call (only
    the guard's synchronous buffer staging keeps them exact)."""
    saves, staged = run_training(tmp_path, kind="thread", reuse_writer=reuse_writer, save_after_step=save_after_step)
    _check_checkpoints(saves, staged, waited=True, context=f"thread mode, reuse_writer={reuse_writer}")
    _load_fast(*saves[-1])


@pytest.mark.fastdcp_timeout(300)
@pytest.mark.parametrize("case", PROCESS_CASES)
def test_guarded_training_loop_process_mode(process_mode_run, case):
    """The same loop with ``async_checkpointer_type=PROCESS`` (one background process)."""
    root, report = process_mode_run
    saves = _expected_from(root / case / "expected.pt")
    _check_checkpoints(saves, report[case]["staged_when_step_started"], waited=True, context=f"process mode, {case}")
    _load_fast(*saves[-1])


def test_guard_stages_module_buffers_inside_the_call(tmp_path):
    """64 MiB of tensors come first in the state, so the background copies take a while; the BN
    buffers of the guarded model are overwritten the moment async_save returns (as the next
    forward would): the checkpoint still holds their values at the call."""
    model, optimizer, data = _make_training()
    _forward_backward(model, optimizer, data[0])
    with fastdcp.guard(optimizer, model):
        for step in range(2):
            sd = {"a_big": [torch.randn(2 * MiB) for _ in range(8)], "model": model.state_dict()}
            expected = C.deepcopy_state_dict(sd)
            writer = FastFileSystemWriter(tmp_path / str(step), async_staging=True)
            response = dcp.async_save(sd, storage_writer=writer, no_dist=True)
            for buffer in model.buffers():
                C.fill_storage_with_sentinel(buffer)
            response.staging_completion.result()
            response.upload_completion.result()
            _load_stock(tmp_path / str(step), expected, "BN buffers overwritten right after the call")
            model.load_state_dict(expected["model"])


# --------------------------------------------------------------------------- #
# 2. stock's protocol without the guard
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("reuse_writer", [False, True], ids=["new-writer", "reused-writer"])
def test_unguarded_loop_waiting_for_staging_completion(tmp_path, reuse_writer):
    """No guard: the loop waits ``staging_completion.result()`` before ``optimizer.step()`` (and so
    before the next forward changes BN's stats): bit-exact as well."""
    saves, staged = run_training(tmp_path, reuse_writer=reuse_writer, guard=False, wait_staging=True)
    _check_checkpoints(saves, staged, waited=True, context="no guard, waiting for staging_completion")


def test_guard_handle_removes_its_hook_and_works_as_a_context_manager(tmp_path):
    model, optimizer, data = _make_training()
    hooks_before = len(optimizer._optimizer_step_pre_hooks)
    handle = fastdcp.guard(optimizer, model)
    assert len(optimizer._optimizer_step_pre_hooks) == hooks_before + 1
    handle.remove()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks_before
    with fastdcp.guard(optimizer, model) as g:
        assert g is not None
        assert len(optimizer._optimizer_step_pre_hooks) == hooks_before + 1
        _forward_backward(model, optimizer, data[0])
        sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        expected = C.deepcopy_state_dict(sd)
        response = dcp.async_save(sd, storage_writer=FastFileSystemWriter(tmp_path / "a", async_staging=True), no_dist=True)
        optimizer.step()
        assert response.staging_completion.done()
        response.upload_completion.result()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks_before
    _load_stock(tmp_path / "a", expected)


# --------------------------------------------------------------------------- #
# 3. the API: stage() returns a Future, synchronize_staging(), environment, bad values
# --------------------------------------------------------------------------- #
def _big_state(total_mib: int = 64, pieces: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = total_mib * MiB // 4 // pieces
    return {f"t{i}": torch.randn(n, generator=g) for i in range(pieces)}


def _scribble(sd) -> None:
    for t in C.tensor_leaves(sd).values():
        if t.numel():
            C.fill_storage_with_sentinel(t)


def test_stage_returns_a_future_only_with_async_staging(tmp_path):
    sd = _big_state(8, 4)
    expected = C.deepcopy_state_dict(sd)
    future = FastFileSystemWriter(tmp_path, async_staging=True).stage(sd)
    assert isinstance(future, concurrent.futures.Future), type(future)
    staged = future.result(timeout=60)
    _scribble(sd)
    C.assert_same(staged, expected, check_stride=False)
    for name, t in C.tensor_leaves(staged).items():
        assert t.untyped_storage().data_ptr() != sd[name].untyped_storage().data_ptr(), f"{name} aliases the live tensor"
    assert isinstance(future.report, fastdcp.StagingReport)
    assert future.report.state_bytes == _tensor_bytes(expected)
    assert future.report.snapshot_bytes == _tensor_bytes(expected)  # no budget: everything copied
    assert future.report.streamed_bytes == 0
    del staged, future

    for writer in (FastFileSystemWriter(tmp_path, async_staging=False), FastFileSystemWriter(tmp_path)):
        staged = writer.stage(sd)
        assert isinstance(staged, dict), type(staged)
        C.assert_same(staged, C.deepcopy_state_dict(sd), check_stride=False)
        del staged


def test_synchronize_staging_returns_once_the_latest_stage_is_done(tmp_path):
    writer = FastFileSystemWriter(tmp_path, async_staging=True)
    writer.synchronize_staging()  # nothing staged yet: returns at once
    in_flight_seen = 0
    for seed in range(3):
        sd = _big_state(64, 8, seed)
        future = writer.stage(sd)
        in_flight_seen += not future.done()
        writer.synchronize_staging()
        assert future.done(), "synchronize_staging() returned while the latest stage was still in flight"
        assert future.exception() is None
        assert torch.equal(future.result()["t7"], sd["t7"])
        del future
        gc.collect()
    # Two stages in flight: it waits for the latest.
    first = writer.stage(_big_state(64, 8, 10))
    second = writer.stage(_big_state(64, 8, 11))
    writer.synchronize_staging()
    assert second.done()
    first.result(timeout=60)
    if in_flight_seen == 0:
        pytest.skip("every 64 MiB stage had completed before stage() returned: synchronize_staging() was not exercised")


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("off", False), ("", False)])
def test_environment_turns_async_staging_on(tmp_path, monkeypatch, value, expected):
    monkeypatch.setenv(ENV_ASYNC, value)
    result = FastFileSystemWriter(tmp_path).stage({"a": torch.ones(1000)})
    assert isinstance(result, concurrent.futures.Future) == expected, type(result)
    if expected:
        result.result(timeout=60)
    # The argument wins over the environment.
    monkeypatch.setenv(ENV_ASYNC, "1")
    assert isinstance(FastFileSystemWriter(tmp_path, async_staging=False).stage({"a": torch.ones(3)}), dict)
    monkeypatch.setenv(ENV_ASYNC, "0")
    assert isinstance(FastFileSystemWriter(tmp_path, async_staging=True).stage({"a": torch.ones(3)}),
                      concurrent.futures.Future)


def test_result_of_a_budgeted_stage_is_a_full_snapshot(tmp_path):
    """A consumer that cannot stream (here: the user, calling ``result()`` at once while the
    in-budget copies still run) gets a full snapshot, announced by a warning: no staged tensor
    aliases a live one, and changing the live state afterwards changes nothing staged."""
    sd = {f"s{i}": torch.randn(4 * MiB) for i in range(4)}  # 4 x 16 MiB: within the budget
    sd["tail"] = torch.randn(2 * MiB)  # 8 MiB over the budget: streamed, or copied late
    expected = C.deepcopy_state_dict(sd)
    future = FastFileSystemWriter(tmp_path, async_staging=True, snapshot_limit_bytes=64 * MiB).stage(sd)
    with pytest.warns(UserWarning, match="snapshot limit"):
        staged = future.result(timeout=60)
    aliased = [name for name, t in staged.items() if t.untyped_storage().data_ptr() == sd[name].untyped_storage().data_ptr()]
    assert not aliased, f"staged {aliased} alias the live tensors: result() returned before the late copy was made"
    _scribble(sd)
    C.assert_same(staged, expected, check_stride=False)


def test_environment_sets_the_staging_budget(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_BUDGET, str(MiB))
    sd = {f"t{i}": torch.randn(256, 1024) for i in range(4)}  # 4 x 1 MiB
    expected = C.deepcopy_state_dict(sd)
    writer = FastFileSystemWriter(tmp_path, async_staging=True)
    response = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    response.staging_completion.result()
    response.upload_completion.result()
    report = writer.last_staging_report
    assert report.streamed_bytes > 0 and report.snapshot_bytes <= 2 * MiB, report
    _load_stock(tmp_path, expected)


def _construct_and_stage(tmp_path, **kwargs):
    writer = FastFileSystemWriter(tmp_path, **kwargs)
    result = writer.stage({"a": torch.ones(3)})
    if isinstance(result, concurrent.futures.Future):
        result.result(timeout=60)


@pytest.mark.parametrize(
    "env,value,pattern",
    [
        (ENV_ASYNC, "maybe", ENV_ASYNC),
        (ENV_ASYNC, "2", ENV_ASYNC),
        (ENV_BUDGET, "lots", ENV_BUDGET),
        (ENV_BUDGET, "-5", ENV_BUDGET),
        (ENV_BUDGET, "1.5", ENV_BUDGET),
    ],
)
def test_bad_environment_values_are_named(tmp_path, monkeypatch, env, value, pattern):
    monkeypatch.setenv(env, value)
    kwargs = {"async_staging": True} if env == ENV_BUDGET else {}
    with pytest.raises(ValueError, match=pattern):
        _construct_and_stage(tmp_path, **kwargs)


@pytest.mark.parametrize(
    "kwargs,pattern,errors",
    [
        # A value of the wrong type: TypeError is fine too (the writer's convention for bools).
        ({"async_staging": "yes"}, "async_staging", (ValueError, TypeError)),
        ({"async_staging": 1.0}, "async_staging", (ValueError, TypeError)),
        ({"async_staging": True, "snapshot_limit_bytes": -1}, "snapshot_limit_bytes", ValueError),
        ({"async_staging": True, "snapshot_limit_bytes": 1.5}, "snapshot_limit_bytes", (ValueError, TypeError)),
        ({"async_staging": True, "snapshot_limit_bytes": "16M"}, "snapshot_limit_bytes", (ValueError, TypeError)),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, pattern, errors):
    with pytest.raises(errors, match=pattern):
        _construct_and_stage(tmp_path, **kwargs)


# --------------------------------------------------------------------------- #
# 4. async_save blocks for a fraction of the blocking stage
# --------------------------------------------------------------------------- #
def _blocked_seconds(sd: dict, directory: Path, async_staging: bool) -> float:
    """Best of 3 (after a warm-up) of the time ``dcp.async_save`` blocks the caller."""
    times = []
    for attempt in range(4):
        target = directory / f"{int(async_staging)}-{attempt}"
        writer = FastFileSystemWriter(target, async_staging=async_staging, sync_files=False)
        start = time.perf_counter()
        response = dcp.async_save(sd, storage_writer=writer, no_dist=True)
        elapsed = time.perf_counter() - start
        _upload(response).result()
        if attempt:  # the first one is a warm-up (slab allocation, thread pools)
            times.append(elapsed)
        del writer, response
        shutil.rmtree(target)
    return min(times)


def test_async_save_blocks_for_a_fraction_of_the_blocking_stage(tmp_path):
    """The call with overlapped staging blocks < 50% of the time the blocking stage of the same
    state blocks (measured here, best of 3). Starts at 64 MiB and doubles the state while the
    blocking call takes < 25 ms, up to 1 GiB: the overlapped call's own cost (DCP's call, the
    save thread's start, the background copy competing for the CPUs) is 1-10 ms on the 2-core
    development VM, so a blocking stage of ~10 ms (256 MiB into a reused slab) failed the ratio in
    3 of 5 runs of this file, before and after the slab segments."""
    base = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else tmp_path
    try:
        measured = []
        for total_mib in (64, 128, 256, 512, 1024):
            sd = _big_state(total_mib, 8)
            blocking = _blocked_seconds(sd, base, async_staging=False)
            if blocking < 0.025:
                measured.append((total_mib, blocking))
                del sd
                _pool.reset_staging_pool()
                continue
            overlapped = _blocked_seconds(sd, base, async_staging=True)
            assert overlapped < 0.5 * blocking, (
                f"{total_mib} MiB: async_save with async_staging=True blocked {overlapped * 1e3:.1f} ms, "
                f"the blocking stage {blocking * 1e3:.1f} ms (best of 3 each): not overlapped"
            )
            print(f"{total_mib} MiB: blocking {blocking * 1e3:.1f} ms, overlapped {overlapped * 1e3:.1f} ms")
            return
        pytest.skip(f"the blocking async_save took < 25 ms even at 1 GiB ({measured}): too fast to compare")
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- #
# 5. staging budget: bit-exact, the report, and real peak memory
# --------------------------------------------------------------------------- #
BUDGET = 16 * MiB
BUDGET_SHAPES = [(2048, 1024)] * 6 + [(1024, 1024)] * 4  # 6 x 8 MiB + 4 x 4 MiB = 64 MiB
LARGEST = 8 * MiB


@pytest.mark.parametrize("budget", [BUDGET, None], ids=["budget-16MiB", "full-snapshot"])
def test_budget_thread_mode_is_bit_exact_and_reports_what_it_streamed(tmp_path, budget):
    """A 64 MiB state; right after each guarded call the loop updates a buffer and steps (every
    parameter changes): each checkpoint holds the state at the call. With the 16 MiB budget at
    most budget + largest tensor is copied and the rest streamed."""
    model = _BigModel(BUDGET_SHAPES)
    state_bytes = _tensor_bytes(model.state_dict())
    assert state_bytes == 64 * MiB + 16 * 4
    saves, reports, staged = _budget_loop(tmp_path, model, kind="thread", budget=budget, steps=2)
    for directory, expected in saves:
        _load_stock(directory, expected, f"staging budget {budget}, thread mode")
    assert not torch.equal(saves[0][1]["model"]["params.0"], saves[1][1]["model"]["params.0"])
    assert all(staged), f"optimizer.step() went ahead before staging (streamed writes included) completed: {staged}"
    if budget is None:
        assert all(r.snapshot_bytes == state_bytes and r.streamed_bytes == 0 for r in reports), reports
        return
    for report in reports:
        assert isinstance(report, fastdcp.StagingReport), type(report)
        assert report.state_bytes == state_bytes, report
        assert report.snapshot_bytes <= BUDGET + LARGEST, report
        assert report.streamed_bytes > 0, report
        assert report.snapshot_bytes + report.streamed_bytes == report.state_bytes, report
        assert report.peak_host_bytes <= BUDGET + LARGEST, report


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _rss_growth(action) -> int:
    """Bytes the resident set grew by at its peak while ``action()`` ran (VmHWM after resetting
    the high-water mark to the current RSS by writing 5 to /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    action()
    return (_status_kib("VmHWM") - base) * 1024


def _memory_child(root: str) -> None:
    """Fresh interpreter: RSS growth of an async save of a 64 MiB state with a 16 MiB budget, of the
    same save with a full snapshot, and of the overhead (a tiny state; the same state saved
    synchronously from the live tensors), each with the process warmed up first."""
    warnings.filterwarnings("ignore")
    root_path = Path(root)
    out: dict = {}
    try:
        model = _BigModel(BUDGET_SHAPES)
        sd = {"model": model.state_dict()}
        tiny = {"a": torch.ones(4), "b": torch.zeros(2, dtype=torch.int64)}
        counter = iter(range(1000))

        def async_save(state, budget):
            writer = FastFileSystemWriter(root_path / f"m{next(counter)}", async_staging=True, snapshot_limit_bytes=budget)
            response = dcp.async_save(state, storage_writer=writer, no_dist=True)
            response.upload_completion.result()
            out.setdefault("reports", []).append(_report_dict(writer.last_staging_report))

        def sync_save(state):
            dcp.save(state, storage_writer=FastFileSystemWriter(root_path / f"m{next(counter)}"), no_dist=True)

        # Warm up: imports, the engine's threads and bounce buffers, DCP's executors.
        sync_save(sd)
        async_save(tiny, BUDGET)
        async_save(tiny, None)
        fastdcp.release_staging()
        out["overhead_tiny"] = max(_rss_growth(lambda: async_save(tiny, BUDGET)) for _ in range(2))
        out["overhead_sync"] = max(_rss_growth(lambda: sync_save(sd)) for _ in range(2))
        fastdcp.release_staging()
        out["budget"] = _rss_growth(lambda: async_save(sd, BUDGET))
        out["budget_report"] = out["reports"][-1]
        fastdcp.release_staging()
        out["full"] = _rss_growth(lambda: async_save(sd, None))
        out["full_report"] = out["reports"][-1]
        out["state_bytes"] = _tensor_bytes(sd)
    except BaseException:
        import traceback

        out["error"] = traceback.format_exc()
    with open(root_path / "report.json", "w") as f:
        json.dump(out, f)


MEMORY_MARGIN = 4 * MiB  # allocator and page-table noise on top of the measured overhead


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs /proc/self/clear_refs (Linux)")
def test_budget_bounds_the_real_peak_memory(tmp_path):
    """Measured in a fresh interpreter: with a 16 MiB budget the resident set grows by at most
    budget + largest tensor + the overhead measured there (a tiny async save, and the same state
    saved synchronously from the live tensors) + 4 MiB; with a full snapshot it grows by about the
    state size (so the measurement does see a snapshot)."""
    out = _run_module_child("_memory_child", tmp_path, timeout=240)
    overhead = max(out["overhead_tiny"], out["overhead_sync"])
    allowance = overhead + MEMORY_MARGIN
    summary = (
        f"state {out['state_bytes'] / MiB:.1f} MiB; RSS growth: budget {out['budget'] / MiB:.1f} MiB, "
        f"full snapshot {out['full'] / MiB:.1f} MiB, overhead tiny {out['overhead_tiny'] / MiB:.1f} MiB, "
        f"sync save {out['overhead_sync'] / MiB:.1f} MiB; reports {out['budget_report']} / {out['full_report']}"
    )
    print(summary)
    assert out["full"] >= 0.9 * out["state_bytes"], f"the measurement does not see a full snapshot: {summary}"
    assert out["budget"] <= BUDGET + LARGEST + allowance, f"budget not honoured: {summary}"
    assert out["budget_report"]["streamed_bytes"] > 0 and out["full_report"]["streamed_bytes"] == 0, summary


# --------------------------------------------------------------------------- #
# 6. budget in process mode
# --------------------------------------------------------------------------- #
@pytest.mark.fastdcp_timeout(300)
def test_budget_process_mode_is_bit_exact_or_warns(process_mode_run):
    root, report = process_mode_run
    budget = report["budget"]
    saves = _expected_from(root / "budget" / "expected.pt")
    for directory, expected in saves:
        _load_stock(directory, expected, "staging budget, process mode")
    assert all(budget["staged_when_step_started"]), budget
    state_bytes = _tensor_bytes(saves[0][1])
    for r in budget["reports"]:
        assert r["state_bytes"] == state_bytes, r
        assert r["snapshot_bytes"] + r["streamed_bytes"] == state_bytes, r
        fell_back = r["completed_bytes"] > 0 or r["snapshot_bytes"] > PROCESS_BUDGET + 4 * MiB
        if fell_back:  # not honoured: a full snapshot, which must be announced
            assert any("snapshot limit" in w.lower() for w in budget["warnings"]), (
                f"process mode ignored snapshot_limit_bytes without a warning: {r}, warnings {budget['warnings']}"
            )


# --------------------------------------------------------------------------- #
# 7. durability when upload_completion resolves; failures release the guard
# --------------------------------------------------------------------------- #
def _referenced_files(directory: Path) -> set[str]:
    md = FileSystemReader(directory).read_metadata()
    return {info.relative_path for info in md.storage_data.values()}


def test_upload_completion_means_committed(tmp_path):
    sd = _big_state(8, 4)
    expected = C.deepcopy_state_dict(sd)
    seen: dict = {}
    called = threading.Event()

    def at_resolution(future):  # runs in the thread that resolves the future, right after it did
        try:
            names = set(os.listdir(tmp_path))
            seen["metadata"] = ".metadata" in names
            seen["missing"] = _referenced_files(tmp_path) - names if seen["metadata"] else None
            seen["staging_done"] = response.staging_completion.done()
        except BaseException as error:  # noqa: BLE001
            seen["error"] = repr(error)
        finally:
            called.set()

    response = dcp.async_save(sd, storage_writer=FastFileSystemWriter(tmp_path, async_staging=True), no_dist=True)
    registered_before_done = not response.upload_completion.done()
    response.upload_completion.add_done_callback(at_resolution)
    response.upload_completion.result()
    assert called.wait(30), "the done-callback never ran"
    assert registered_before_done, "the upload was done before async_save returned"
    assert seen == {"metadata": True, "missing": set(), "staging_done": True}, seen
    _load_stock(tmp_path, expected)


_STRACE_CHILD = """
import os, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = {paths!r}
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from fastdcp import FastFileSystemWriter
g = torch.Generator().manual_seed(0)
state = {{"a": torch.randn(1024, 1024, generator=g), "b": torch.randn(512, 1024, generator=g), "n": torch.arange(1000)}}
writer = FastFileSystemWriter({directory!r}, async_staging=True) if {fast!r} else FileSystemWriter({directory!r})
response = dcp.async_save(state, storage_writer=writer, no_dist=True)
upload = getattr(response, "upload_completion", response)
import threading
marked = threading.Event()
before = not upload.done()
def mark(future):
    try:
        os.stat({marker!r})
    except OSError:
        pass
    marked.set()
upload.add_done_callback(mark)
upload.result()
assert marked.wait(30)
print("REGISTERED_BEFORE_DONE" if before else "ALREADY_DONE")
"""


def _strace_calls(trace: str, marker: str) -> list[tuple[str, str]]:
    """(syscall, arguments) of every call that completed with 0 before the marker stat started."""
    done: list[tuple[str, str]] = []
    pending: dict[str, tuple[str, str]] = {}
    for line in trace.splitlines():
        pid, _, rest = line.partition(" ")
        rest = rest.strip()
        if marker in rest:
            break
        if rest.startswith("<..."):  # "<... fsync resumed>) = 0"
            name = rest[5:].split()[0]
            call = pending.pop(pid, None)
            if call and call[0] == name and rest.rstrip().endswith("= 0"):
                done.append(call)
            continue
        name, paren, args = rest.partition("(")
        if not paren:
            continue
        if rest.endswith("<unfinished ...>"):
            pending[pid] = (name, args)
        elif rest.rstrip().endswith("= 0"):
            done.append((name, args))
    return done


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
@pytest.mark.parametrize("writer_kind", ["fast"])
def test_upload_completion_resolves_after_fsyncs_rename_and_directory_fsync(tmp_path, writer_kind):
    """Under strace: before upload_completion resolves (a done-callback stats a marker path), every
    data file named by .metadata was fsynced, the metadata file was fsynced and renamed to
    .metadata, and the directory was fsynced after that rename."""
    directory = Path(os.path.realpath(tmp_path)) / "ckpt"
    marker = str(Path(os.path.realpath(tmp_path)) / "UPLOAD-RESOLVED-MARKER")
    script = _STRACE_CHILD.format(paths=[str(HERE), str(TESTS_DIR), str(REPO_ROOT)], directory=str(directory),
                                  fast=writer_kind == "fast", marker=marker)
    trace_file = tmp_path / "trace"
    proc = subprocess.run(
        ["strace", "-f", "-qq", "-y", "-s", "512", "-o", str(trace_file),
         "-e", "trace=fsync,fdatasync,rename,renameat,renameat2,stat,lstat,newfstatat,statx",
         sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120,
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REGISTERED_BEFORE_DONE" in proc.stdout, "the upload was done before async_save returned: cannot order"
    trace = trace_file.read_text()
    assert marker in trace, "the marker stat is not in the trace"
    calls = _strace_calls(trace, marker)

    def fd_path(args: str) -> str:  # "3</dir/file>) = 0" -> "/dir/file"
        return args.split("<", 1)[-1].split(">", 1)[0]

    syncs = [(i, fd_path(args)) for i, (name, args) in enumerate(calls) if name in ("fsync", "fdatasync")]
    renames = [(i, re.findall(r'"([^"]*)"', args)) for i, (name, args) in enumerate(calls) if name.startswith("rename")]
    data_files = {str(directory / name) for name in _referenced_files(directory)}
    missing = data_files - {path for _, path in syncs}
    assert data_files and not missing, f"data files not fsynced before upload_completion resolved: {sorted(missing)}"
    metadata = str(directory / ".metadata")
    commits = [(i, paths[0]) for i, paths in renames if paths and paths[-1] == metadata]
    assert commits, f"no rename to {metadata} before upload_completion resolved: {renames}"
    rename_index, source = commits[-1]
    assert any(path == source for i, path in syncs if i < rename_index), (
        f"the new metadata file {source} was not fsynced before it was renamed to .metadata: {syncs}"
    )
    assert any(path == str(directory) for i, path in syncs if i > rename_index), (
        f"the directory was not fsynced between the rename of .metadata and upload_completion: {syncs}"
    )


class _Hang(AssertionError):
    pass


def _step_must_return(optimizer, seconds: float = 20.0) -> None:
    """optimizer.step() in a thread, joined with a limit: the guard must not hang it."""
    errors = []

    def run():
        try:
            optimizer.step()
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _Hang(f"optimizer.step() still blocked after {seconds} s: the guard was not released after a failed save")
    if errors:
        raise errors[0]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("failure", ["directory-is-a-file", "unsupported-dtype"])
@pytest.mark.parametrize("budget", [None, 1 * MiB], ids=["snapshot", "budget"])
def test_a_failed_save_raises_and_releases_the_guard(tmp_path, failure, budget):
    """The save fails (its directory cannot be created: a regular file is in the way; or the state
    holds a quint4x2 tensor that nothing can stage or write): upload_completion raises, and the
    guarded optimizer.step() after it returns, then a good save works."""
    model = _BigModel([(512, 1024)] * 4)  # 4 x 2 MiB: more than the budget
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    (tmp_path / "blocker").write_text("a file where the checkpoint directory should go")
    target = tmp_path / "blocker" / "ckpt" if failure == "directory-is-a-file" else tmp_path / "ckpt"
    sd = {"model": model.state_dict()}
    if failure == "unsupported-dtype":
        sd["q"] = C.random_tensor(torch.quint4x2, (8, 8), "q")
    with fastdcp.guard(optimizer, model):
        raised_in_call = None
        try:
            response = dcp.async_save(sd, storage_writer=FastFileSystemWriter(target, async_staging=True,
                                                                             snapshot_limit_bytes=budget), no_dist=True)
        except (Exception, CheckpointException) as error:  # staging may fail inside the call
            raised_in_call, response = error, None
        _step_must_return(optimizer)
        if response is not None:
            with pytest.raises((Exception, CheckpointException)):
                response.upload_completion.result(timeout=60)
            assert response.staging_completion.done()
        else:
            assert raised_in_call is not None
        # The guard still works for the next, good save.
        good = {"model": model.state_dict()}
        expected = C.deepcopy_state_dict(good)
        response = dcp.async_save(good, storage_writer=FastFileSystemWriter(tmp_path / "good", async_staging=True,
                                                                           snapshot_limit_bytes=budget), no_dist=True)
        _step_must_return(optimizer)
        assert response.staging_completion.done()
        response.upload_completion.result(timeout=60)
    _load_stock(tmp_path / "good", expected)


# --------------------------------------------------------------------------- #
# 8. SIGKILL during an overlapped async save leaves the previous checkpoint
# --------------------------------------------------------------------------- #
SEED = 7007
CRASH_SCALE = 16  # ~54 MiB states: staging takes long enough for a kill to land in it
PHASES_COMMITTED = ("cleanup", "cleanup_mid")
ALL_PHASES = ("plan", "open", "write", "sync", "commit", "cleanup", "cleanup_mid")


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    z.prepare(SEED)
    z.prepare(SEED, CRASH_SCALE)
    yield z
    z.close()


def _read_notes(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_for_note(zygote, pid, notes: Path, error_file: Path, wanted, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(wanted(line) for line in _read_notes(notes)):
            return
        if error_file.exists() and error_file.stat().st_size:
            zygote.kill(pid)
            pytest.fail(f"the saving process failed:\n{error_file.read_text()}")
        time.sleep(0.002)
    zygote.kill(pid)
    pytest.fail(f"the saving process never got there (notes: {_read_notes(notes)})")


def _holds(directory: Path, candidates: dict, allowed: set, context: str) -> str:
    results = {reader: classify(str(directory), candidates, reader) for reader in ("fast", "stock")}
    wanted = {f"state {k}" for k in allowed}
    assert results["stock"] in wanted and results["fast"] == results["stock"], (
        f"{context}: readers found {results}, allowed {wanted}; files {sorted(os.listdir(directory))}"
    )
    return results["stock"]


@pytest.mark.parametrize(
    "phase,budget", [("write", None), ("sync", None), ("open", 4 * MiB), ("write", 4 * MiB)],
    ids=["write", "sync", "open-budget", "write-budget"],
)
def test_sigkill_in_a_phase_of_an_overlapped_save(zygote, tmp_path, phase, budget):
    """Killed paused in ``phase`` of an overlapped async save (thread mode): both readers see the
    previous checkpoint, bit-exact. With a budget, the kill at ``open`` lands while staging is
    still incomplete (the streamed tensors are not written yet)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    dcp.save(make_state(SEED, 0, CRASH_SCALE), storage_writer=FastFileSystemWriter(directory), no_dist=True)
    notes, error_file = tmp_path / "notes", tmp_path / "error"
    writer_kwargs = {"async_staging": True}
    if budget is not None:
        writer_kwargs["snapshot_limit_bytes"] = budget
    pid = zygote.fork({
        "dir": str(directory), "seed": SEED, "scale": CRASH_SCALE, "first": 1, "count": 1,
        "async": True, "wait_staging": True, "writer_kwargs": writer_kwargs,
        "notes": str(notes), "error_file": str(error_file),
        "env": {"FASTDCP_TEST_PAUSE_AT": phase, "FASTDCP_TEST_PAUSE_S": "120", "FASTDCP_TEST_PAUSE_NOTIFY": str(notes)},
    })
    _wait_for_note(zygote, pid, notes, error_file, lambda line: line.startswith(f"{phase} "))
    assert zygote.kill(pid)["signal"] == 9
    lines = _read_notes(notes)
    assert "called 1" in lines, lines
    if budget is not None and phase == "open":
        assert "staged 1" not in lines, f"staging_completion resolved before the streamed tensors were written: {lines}"
    candidates = {0: make_state(SEED, 0, CRASH_SCALE), 1: make_state(SEED, 1, CRASH_SCALE)}
    _holds(directory, candidates, {0}, f"killed in {phase!r} (budget {budget})")


N_RANDOM_KILLS = 5


def test_sigkill_at_random_moments_after_async_save_returns(zygote, tmp_path):
    """SIGKILL a seeded random 0-40 ms after an overlapped ``async_save`` returned (the first at
    once): the directory holds the previous checkpoint, or the new one once its .metadata was
    renamed; never a mix."""
    rng = random.Random(SEED)
    landed = collections.Counter()
    candidates = {0: make_state(SEED, 0, CRASH_SCALE), 1: make_state(SEED, 1, CRASH_SCALE)}
    for round_index in range(N_RANDOM_KILLS):
        directory = tmp_path / f"ckpt{round_index}"
        directory.mkdir()
        dcp.save(candidates[0], storage_writer=FastFileSystemWriter(directory), no_dist=True)
        notes, error_file = tmp_path / f"notes{round_index}", tmp_path / f"error{round_index}"
        pid = zygote.fork({
            "dir": str(directory), "seed": SEED, "scale": CRASH_SCALE, "first": 1, "count": 1,
            "async": True, "wait_staging": True, "writer_kwargs": {"async_staging": True},
            "notes": str(notes), "error_file": str(error_file),
            "env": {"FASTDCP_TEST_PAUSE_AT": ",".join(ALL_PHASES), "FASTDCP_TEST_PAUSE_S": "0",
                    "FASTDCP_TEST_PAUSE_NOTIFY": str(notes)},
        })
        _wait_for_note(zygote, pid, notes, error_file, lambda line: line == "called 1")
        delay = 0.0 if round_index == 0 else rng.uniform(0.0, 0.04)
        time.sleep(delay)
        zygote.kill(pid)
        if error_file.exists() and error_file.stat().st_size:
            pytest.fail(f"round {round_index}: the saving process failed:\n{error_file.read_text()}")
        lines = _read_notes(notes)
        phases = [line.split()[0] for line in lines if line.split()[0] in ALL_PHASES]
        if "done 1" in lines or (phases and phases[-1] in PHASES_COMMITTED):
            allowed = {1}
        elif phases and phases[-1] == "commit":
            allowed = {0, 1}  # killed at the rename itself
        else:
            allowed = {0}
        landed["staging" if "staged 1" not in lines else (phases[-1] if phases else "after staging")] += 1
        _holds(directory, candidates, allowed, f"round {round_index}, killed {delay * 1e3:.1f} ms after the call, notes {lines}")
    print(f"random kills landed in: {dict(landed)}")


# --------------------------------------------------------------------------- #
# 9. awkward tensors and values through overlapped staging
# --------------------------------------------------------------------------- #
def _zoo(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    return {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "offset": base[5:],
        "scalar_f32": torch.tensor(3.5 + seed),
        "scalar_i64": torch.tensor(7 + seed, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(5, 0, dtype=torch.bfloat16),
        "bf16": C.random_tensor(torch.bfloat16, (33, 17), (seed, "bf16")),  # random bits: NaN payloads too
        "fp16": C.random_tensor(torch.float16, (129,), (seed, "fp16")),
        "int8": C.random_tensor(torch.int8, (7, 9), (seed, "int8")),
        "bool": C.random_tensor(torch.bool, (50,), (seed, "bool")),
        "complex64": C.random_tensor(torch.complex64, (12, 5), (seed, "c64")),
        "big": torch.randn(1024, 1024, generator=g),  # 4 MiB, page-aligned in staging
        "nested": {"list": [torch.full((3,), seed, dtype=torch.int64), {"deep": torch.ones(2, 2) * seed}, 3, "text"],
                   "opts": {"lr": 0.1 * seed, "name": f"run-{seed}", "none": None, "flag": True}},
        "step": seed,
        "blob": io.BytesIO(b"bytes-%d" % seed),
    }


def test_awkward_state_through_stage_future(tmp_path):
    sd = _zoo(1)
    sd["pair"] = (torch.arange(4, dtype=torch.int16), "x", (torch.tensor(True), 2.5))  # stage only: DCP loads no tuples
    sd["point"] = collections.namedtuple("Point", "x y")(torch.ones(3), "y")
    expected = C.deepcopy_state_dict(sd)
    future = FastFileSystemWriter(tmp_path, async_staging=True).stage(sd)
    staged = future.result(timeout=60)
    _scribble(sd)
    sd["nested"]["opts"]["lr"] = -1.0
    sd["nested"]["list"].append("appended")
    C.assert_same(staged, expected, check_stride=False)
    assert type(staged["point"]).__name__ == "Point"


@pytest.mark.parametrize("budget", [None, 1 * MiB], ids=["snapshot", "budget"])
def test_awkward_state_through_async_save(tmp_path, budget):
    sd = _zoo(2)
    expected = C.deepcopy_state_dict(sd)
    writer = FastFileSystemWriter(tmp_path, async_staging=True, snapshot_limit_bytes=budget)
    response = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    response.staging_completion.result()
    _scribble(sd)  # allowed from here on
    sd["nested"]["opts"]["lr"] = -1.0
    response.upload_completion.result()
    _load_stock(tmp_path, expected)
    _load_fast(tmp_path, expected)
    report = writer.last_staging_report
    assert report.state_bytes == _tensor_bytes(expected), report
    assert report.snapshot_bytes + report.streamed_bytes == report.state_bytes, report
    if budget is not None:
        assert report.streamed_bytes > 0, report
