"""Tests of the train_loop scenario (fastdcp/bench/training_loop.py) on a tiny model: rows for every
system that can run here (a note for each one that cannot), every checkpoint verified, and a
verification that fails when a checkpoint does not hold the state of its async_save call."""

from __future__ import annotations

import inspect
import io
import json
import os
from pathlib import Path

import pytest
import torch

import fastdcp.bench.training_loop as tl
from fastdcp.bench.config import config_from_args
from fastdcp.bench.report import train_loop_lines, train_loop_rows
from fastdcp.bench.results import Recorder, finalize
from fastdcp.bench.runner import EXIT_VERIFY, main
from fastdcp.bench.scenarios import Context, Progress
from fastdcp.bench.state import VerificationError
from fastdcp.bench.systems import STANDIN_ENV, resolve_systems

# 4 MiB of model + AdamW state, 6 steps with an async_save every 2 (3 checkpoints per loop)
TINY = ["--size", "4MiB", "--train-steps", "6", "--train-every", "2", "--repeats", "1", "--no-shm",
        "--probe-size", "32MiB", "--cold", "fadvise_dontneed", "--train-step-ms", "5"]


def _fastdcp_imports() -> bool:
    try:
        import fastdcp

        return hasattr(fastdcp, "FastFileSystemWriter") and hasattr(fastdcp, "FastFileSystemReader")
    except Exception:
        return False


def _expected_systems() -> set[str]:
    """What train_loop must measure here, decided independently of the module under test."""
    out = {"stock_default"}
    if torch.cuda.is_available():
        out.add("stock_zoc")
    if _fastdcp_imports():
        import fastdcp

        out.add("fastdcp_blocking")
        if hasattr(fastdcp, "guard") and "async_staging" in inspect.signature(fastdcp.FastFileSystemWriter).parameters:
            out.add("fastdcp_overlap")
            if "snapshot_limit_bytes" in inspect.signature(fastdcp.FastFileSystemWriter).parameters:
                out.add("fastdcp_overlap_budget")
    else:
        out.add("fastdcp_blocking")  # the stand-in
    return out


@pytest.fixture
def standin_if_needed(monkeypatch):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    if not _fastdcp_imports():
        monkeypatch.setenv(STANDIN_ENV, "1")


@pytest.fixture
def count_checks(monkeypatch):
    """Counts the bit-exact comparisons train_loop makes (and still makes them)."""
    calls: list[str] = []
    real = tl.check

    def counting(ctx, system, expected, loaded, what):
        calls.append(what)
        real(ctx, system, expected, loaded, what)

    monkeypatch.setattr(tl, "check", counting)
    return calls


def test_train_loop_end_to_end(tmp_path, capsys, standin_if_needed, count_checks):
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "train_loop", "--systems", "stock,fastdcp", "--dir", str(tmp_path),
               "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    doc = json.loads(out.read_text())
    expected = _expected_systems()
    rows = {(r["system"], r["config"]["metric"]): r for r in doc["results"] if r["scenario"] == "train_loop"}
    assert {s for s, _ in rows} == expected | {tl.NO_CKPT}
    base = rows[(tl.NO_CKPT, "loop")]
    assert base["extra"]["checkpoints"] == [0] and base["extra"]["peak_host_bytes"][0] > 0
    for name in expected:
        loop = rows[(name, "loop")]
        assert len(loop["seconds"]) == 1 and loop["seconds"][0] > 0
        assert loop["extra"]["checkpoints"] == [3] and len(loop["extra"]["step_seconds"][0]) == 6
        assert loop["extra"]["peak_host_bytes"][0] >= loop["extra"]["start_host_bytes"][0] > 0
        assert 0 <= loop["extra"]["others_cpu_share"][0] <= 1
        slow = rows[(name, "slowdown")]
        assert slow["seconds"][0] == pytest.approx(loop["seconds"][0] - base["seconds"][0])
        assert slow["extra"]["ratio"][0] == pytest.approx(loop["seconds"][0] / base["seconds"][0])
        blocked = rows[(name, "blocked")]
        assert blocked["extra"]["step"] == [2, 4, 6]
        staged, durable = rows[(name, "staged")]["seconds"], rows[(name, "durable")]["seconds"]
        waited = rows[(name, "waited_prev")]["seconds"]
        assert len(staged) == len(durable) == len(waited) == 3
        assert waited[0] == 0.0  # nothing in flight before the first checkpoint
        for b, call, w, sw, st, du in zip(blocked["seconds"], blocked["extra"]["in_call"],
                                          blocked["extra"]["waited_prev"], blocked["extra"]["step_wait"],
                                          staged, durable):
            assert b == pytest.approx(call + w + sw) and call > 0
            assert 0 < st <= du and call <= du
    # every checkpoint of every system was loaded and compared
    assert len(count_checks) == 3 * len(expected), count_checks
    # systems that cannot run say why
    if "stock_zoc" not in expected:
        assert any("stock_zoc not measured" in n for n in doc["notes"]), doc["notes"]
    if "fastdcp_overlap" not in expected:
        assert any("fastdcp_overlap not measured" in n for n in doc["notes"]), doc["notes"]
    # the compact table: printed and in the JSON
    table = {r["system"]: r for r in doc["train_loop"]}
    assert set(table) == expected | {tl.NO_CKPT}
    worst = max(rows[("stock_default", "blocked")]["seconds"])
    assert table["stock_default"]["blocked_ms_max"] == pytest.approx(1e3 * worst)
    assert "train_loop: 6 steps, an async_save every 2 (3 checkpoints per loop" in captured.out
    assert "slowdown" in captured.out and "peak host GiB" in captured.out
    for name in expected:
        assert any(line.split()[1:2] == [name] for line in captured.out.splitlines()), name
    assert not list(tmp_path.glob("fastdcp_bench_*")), "checkpoints were not removed"


def _ctx(tmp_path: Path, argv: list[str]) -> Context:
    cfg = config_from_args([*TINY, *argv, "--dir", str(tmp_path)])
    systems = resolve_systems(["stock", "fastdcp"], notes=[])
    (tmp_path / "t").mkdir()
    return Context(cfg=cfg, systems=systems, targets={"dir": str(tmp_path / "t")}, recorder=Recorder(),
                   progress=Progress(io.StringIO()), cold_method=None)


def test_corrupted_load_fails_loudly(tmp_path, capsys, standin_if_needed):
    rc = main([*TINY, "--scenarios", "train_loop", "--systems", "stock", "--dir", str(tmp_path),
               "--corrupt-after-load", "stock_default"])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY, err[-3000:]
    assert "NOT bit-exact" in err and "train_loop/dir/cpu/stock_default/rep0/ckpt0@step2" in err


@pytest.mark.parametrize("entry", ["running_mean", "step"])
def test_a_checkpoint_of_another_state_fails(tmp_path, monkeypatch, standin_if_needed, entry):
    """The state changes between the verification copy and the async_save call (a BatchNorm
    running statistic, or AdamW's step count): the checkpoint holds a value the copy does not."""
    real = tl.dcp.async_save

    def changed_then_saved(sd, **kw):
        if entry == "running_mean":
            sd["model"]["3.running_mean"].add_(1.0)
        else:
            next(iter(sd["optim"]["state"].values()))["step"].add_(1.0)
        return real(sd, **kw)

    monkeypatch.setattr(tl.dcp, "async_save", changed_then_saved)
    ctx = _ctx(tmp_path, [])
    with pytest.raises(VerificationError, match=entry):
        tl.run_train_loop(ctx, ["dir"])


def test_state_is_model_and_adamw_of_about_the_size(tmp_path):
    for size in (4 << 20, 64 << 20):
        tr = tl.SyntheticTraining(size)
        tr.calibrate(0.005, batch=4)
        sd = tr.state_dict()
        assert set(sd) == {"model", "optim"}
        assert abs(tr.state_bytes() - size) / size < 0.15
        moments = [s for s in sd["optim"]["state"].values()]
        assert moments and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in moments)
        before = sd["model"]["3.running_mean"].clone()
        batches = int(sd["model"]["3.num_batches_tracked"])
        tr.forward_backward()  # the buffers change in forward
        assert not torch.equal(before, sd["model"]["3.running_mean"])
        assert int(sd["model"]["3.num_batches_tracked"]) == batches + 1


@pytest.mark.parametrize("where", ["shm", "disk"])
def test_snapshot_roundtrip_outside_the_process(tmp_path, monkeypatch, standin_if_needed, where):
    ctx = _ctx(tmp_path, [])
    if where == "disk":  # as when /dev/shm is missing or too small for a loop's copies
        monkeypatch.setattr(tl, "SHM", str(tmp_path / "no_shm"))
    elif not os.path.isdir(tl.SHM):
        pytest.skip("no /dev/shm")
    store = tl.SnapshotStore(ctx, 1 << 20, str(tmp_path))
    tr = tl.SyntheticTraining(1 << 20)
    tr.calibrate(0.005, batch=4)
    sd = tr.state_dict()
    snap = store.take(sd)
    assert snap.file and snap.clones is None and os.path.getsize(snap.file) == tr.state_bytes()
    assert snap.file.startswith(str(tmp_path) if where == "disk" else tl.SHM) and store.fsync == (where == "disk")
    assert (where == "disk") == any("verification copies" in n for n in ctx.notes)
    tr.step()  # the live state moves on; the copy must not
    got = snap.expected()
    want = tl.flat(sd)
    changed = [k for k, v in want.items() if isinstance(v, torch.Tensor) and not torch.equal(v, got[k])]
    assert "model.3.running_mean" in changed
    assert got["optim.param_groups.0.lr"] == sd["optim"]["param_groups"][0]["lr"]
    snap.discard()
    store.close()


def test_train_loop_table_from_rows():
    rec = Recorder()
    for rep, (base, loop) in enumerate(((1.0, 1.5), (1.2, 1.5))):
        rec.add("train_loop", "dir", "no_ckpt", {"device": "cpu", "metric": "loop"}, 1 << 30, base, None,
                peak_host_bytes=2 << 30, start_host_bytes=2 << 30, peak_above_start_bytes=0, checkpoints=0,
                steps=12, every=3, batch=8, calibrated_step_seconds=0.1, drain_seconds=0.0)
        rec.add("train_loop", "dir", "fastdcp_blocking", {"device": "cpu", "metric": "loop"}, 1 << 30, loop, None,
                peak_host_bytes=3 << 30, start_host_bytes=2 << 30, peak_above_start_bytes=1 << 30, checkpoints=4,
                steps=12, every=3, batch=8, calibrated_step_seconds=0.1, drain_seconds=0.2)
        rec.add("train_loop", "dir", "fastdcp_blocking", {"device": "cpu", "metric": "slowdown"}, 1 << 30,
                loop - base, None, ratio=loop / base)
    for b in (0.1, 0.3):
        rec.add("train_loop", "dir", "fastdcp_blocking", {"device": "cpu", "metric": "blocked"}, 1 << 30, b, None,
                in_call=b / 2, waited_prev=b / 2, step_wait=0.0)
    rows = {r.system: r for r in train_loop_rows(finalize(rec.results, None))}
    r = rows["fastdcp_blocking"]
    assert r.loop_s == pytest.approx(1.5) and r.slowdown_s == pytest.approx(0.4)
    assert r.slowdown_pct == pytest.approx(100 * ((1.5 + 1.25) / 2 - 1))
    assert r.slowdown_best_pct == pytest.approx(50.0)  # 1.5 / 1.0 - 1
    assert (r.blocked_ms_mean, r.blocked_ms_max, r.in_call_ms_max) == pytest.approx((200, 300, 150))
    assert r.peak_host_gib == pytest.approx(3) and r.peak_above_start_gib == pytest.approx(1)
    assert rows["no_ckpt"].slowdown_pct is None
    text = "\n".join(train_loop_lines(finalize(rec.results, None)))
    assert "+37.5% (+0.400 s)" in text and "200.0 / 300.0" in text and "3.00 (+1.00)" in text


def test_train_loop_options():
    q = config_from_args(["--quick"])
    assert (q.train_steps, q.train_every) == (12, 3)
    assert "train_loop" not in q.scenarios  # it does not fit the quick run's ~2 minutes
    assert config_from_args(["--quick", "--scenarios", "train_loop"]).scenarios == ["train_loop"]
    c = config_from_args(["--scenarios", "train_loop", "--train-steps", "6", "--train-every", "2",
                          "--train-batch", "16"])
    assert c.scenarios == ["train_loop"] and (c.train_steps, c.train_every, c.train_batch) == (6, 2, 16)
    assert "train_loop" in config_from_args([]).scenarios
    for bad in (["--train-every", "0"], ["--train-batch", "1"], ["--train-steps", "0"]):
        with pytest.raises(SystemExit):
            config_from_args(bad)


def test_other_processes_cpu_is_measured():
    """A busy child process during the region shows up as other processes' CPU time."""
    import subprocess
    import sys

    meter = tl.OthersCPU()
    meter.start()
    # user-space spinning (perf_counter is a vDSO call, not a system call) for 0.5 s
    subprocess.run([sys.executable, "-c", "import time\nt = time.perf_counter()\n"
                    "while time.perf_counter() - t < 0.5: pass"], check=True)
    others, share = meter.stop()
    assert others >= 0.3 and 0 < share <= 1


def test_a_fast_device_reaches_the_step_time_with_micro_batches(monkeypatch):
    """When the largest batch still makes a short step (a fast GPU), calibration makes each step
    accumulate several micro-batches, so the loop's step is the asked-for time and a checkpoint's
    slowdown is measured against real work."""
    from fastdcp.bench import training_loop as T

    trainer = T.SyntheticTraining(1 << 20)
    monkeypatch.setattr(T, "MAX_BATCH", 32)
    passes = []
    real = trainer.forward_backward
    monkeypatch.setattr(trainer, "forward_backward", lambda: (passes.append(1), real())[1])
    # The asked-for step is 8 largest batches long on this machine, however busy it is.
    trainer.set_batch(32)
    target = max(0.2, 8 * min(trainer.timed_steps(3)))
    step = trainer.calibrate(target_s=target)
    assert trainer.batch == 32 and trainer.micro_steps > 1
    assert step >= target / 4, f"{step * 1e3:.1f} ms: the micro-batches did not lengthen the step"
    passes.clear()
    trainer.step()
    assert len(passes) == trainer.micro_steps
