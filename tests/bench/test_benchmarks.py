"""Tests of the benchmark harness (fastdcp/bench/) on tiny sizes.

When fastdcp does not import (e.g. before the extension is built), the harness runs with
FASTDCP_BENCH_STANDIN=1 (stock classes standing in for fastdcp), so that these tests check the
harness itself; test_missing_fastdcp_fails_loudly checks that a default run refuses that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastdcp.bench.config import config_from_args, parse_size
from fastdcp.bench.floor import BASELINE_SYSTEMS, NullStorageReader, NullStorageWriter
from fastdcp.bench.runner import EXIT_NO_FASTDCP, EXIT_VERIFY, main
from fastdcp.bench.state import (VerificationError, build_destination, build_state, clone_state,
                              corrupt_one_byte, fill_box, llm_like_spec, make_tensor, verify_state)
from fastdcp.bench.systems import SYSTEM_NAMES, STANDIN_ENV, FastDCPUnavailable, resolve_systems

REPO = Path(__file__).resolve().parents[2]

# Tiny run: 4 MiB state, 50 small tensors, 32 MiB storage probes, one repeat, cold loads by
# posix_fadvise (a global drop_caches would make every process on the machine re-read its code).
TINY = ["--quick", "--size", "4MiB", "--repeats", "1", "--small-count", "50", "--probe-size", "32MiB",
        "--reshard-size", "2MiB", "--no-shm", "--cold", "fadvise_dontneed"]


def _fastdcp_imports() -> bool:
    try:
        import fastdcp  # noqa: F401

        return hasattr(fastdcp, "FastFileSystemWriter") and hasattr(fastdcp, "FastFileSystemReader")
    except Exception:
        return False


def _fastdcp_has_planners() -> bool:
    try:
        import fastdcp

        return hasattr(fastdcp, "FastSavePlanner") and hasattr(fastdcp, "FastLoadPlanner")
    except Exception:
        return False


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(STANDIN_ENV, None)
    if not _fastdcp_imports():
        env[STANDIN_ENV] = "1"
    return env


@pytest.fixture
def standin_if_needed(monkeypatch):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    if not _fastdcp_imports():
        monkeypatch.setenv(STANDIN_ENV, "1")


def test_harness_runs_and_reports_both_systems_and_limits(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", *TINY, "--scenarios", "save,load,reshard,small",
         "--systems", "stock,fastdcp", "--dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads(out.read_text())

    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["torch"] == torch.__version__
    assert doc["machine"]["targets"]["dir"]["fstype"]
    lim = doc["limits"]
    assert lim["memcpy_gibps"] > 0
    assert lim["storage"]["dir"]["write_gibps"] > 0 and lim["storage"]["dir"]["read_gibps"] > 0
    assert lim["storage"]["dir"]["method"]

    results = doc["results"]
    for scenario in ("save", "load", "reshard", "small"):
        systems = {r["system"] for r in results if r["scenario"] == scenario}
        assert {"stock", "fastdcp"} <= systems, (scenario, systems)
    for r in results:
        assert set(r) >= {"scenario", "system", "config", "where", "bytes", "seconds", "gibps",
                          "ratio_vs_stock", "fraction_of_limit"}
        assert r["bytes"] > 0 and r["seconds"] and all(s > 0 for s in r["seconds"])
        if r["system"] in BASELINE_SYSTEMS:  # DCP's floor: no storage, hence no ratio and no limit
            assert r["scenario"] == "small" and r["ratio_vs_stock"] is None
            continue
        if r["system"] == "raw_io":  # the probe's best configuration inside the save/load loops
            assert r["scenario"] in ("save", "load") and r["gibps"] > 0
            continue
        assert r["system"] in SYSTEM_NAMES
        assert r["gibps"] > 0 and r["ratio_vs_stock"] > 0
        assert r["fraction_of_limit"] is not None and r["fraction_of_limit"] > 0
        if r["system"] == "stock":
            assert r["ratio_vs_stock"] == pytest.approx(1.0)
    layouts = {r["config"].get("layout") for r in results if r["scenario"] == "reshard"}
    assert {"Shard(0)@2->Shard(1)@2", "Shard(0)@2->Shard(0)@4"} <= layouts
    assert "vs stock" in proc.stdout and "of limit" in proc.stdout
    assert not list(tmp_path.glob("fastdcp_bench_*")), "temp checkpoints were not removed"


def test_corrupted_load_fails_loudly(tmp_path, capsys, standin_if_needed):
    rc = main([*TINY, "--scenarios", "load", "--systems", "stock,fastdcp", "--dir", str(tmp_path),
               "--corrupt-after-load", "fastdcp"])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY, err[-3000:]
    assert "NOT bit-exact" in err and "fastdcp" in err
    assert not list(tmp_path.glob("fastdcp_bench_*"))


def test_corrupted_reshard_load_fails_loudly(tmp_path, capsys, standin_if_needed):
    # the byte is flipped inside a rank after its load; the ranks agree and the run fails
    rc = main([*TINY, "--scenarios", "reshard", "--systems", "stock", "--dir", str(tmp_path),
               "--corrupt-after-load", "stock"])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY, err[-3000:]
    assert "NOT bit-exact" in err and "reshard" in err


def test_missing_fastdcp_fails_loudly(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "fastdcp", None)  # makes `import fastdcp` raise ImportError
    with pytest.raises(FastDCPUnavailable):
        resolve_systems(["stock", "fastdcp"])
    assert main([*TINY, "--dir", str(tmp_path)]) == EXIT_NO_FASTDCP
    assert "fastdcp is not importable" in capsys.readouterr().err


def test_verification_catches_one_flipped_byte_and_untouched_destinations():
    spec = llm_like_spec(1 << 20, norms=4)
    src = build_state(spec)
    loaded = clone_state(src)
    verify_state(src, loaded, "identical")
    corrupt_one_byte(loaded)
    with pytest.raises(VerificationError, match="differs"):
        verify_state(src, loaded, "corrupted")
    with pytest.raises(VerificationError):  # a load that wrote nothing
        verify_state(src, build_destination(spec), "untouched")


def test_fill_box_matches_the_full_tensor():
    spec = next(t for t in llm_like_spec(1 << 20).tensors if t.shardable)
    full = make_tensor(spec)
    rows, cols = spec.shape
    col_box = fill_box(torch.empty(rows, cols // 2, dtype=spec.dtype), spec, (0, cols // 2))
    row_box = fill_box(torch.empty(rows // 4, cols, dtype=spec.dtype), spec, (rows // 4, 0))
    assert torch.equal(col_box.view(torch.int16), full[:, cols // 2:].contiguous().view(torch.int16))
    assert torch.equal(row_box.view(torch.int16), full[rows // 4: rows // 2].view(torch.int16))


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1.5K") == 1536
    assert parse_size("4096") == 4096


_FAKE_FIO = r'''#!{python}
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
if args.get("direct") == "1" and os.environ.get("FAKE_FIO_NO_DIRECT"):
    print("fio: O_DIRECT not supported", file=sys.stderr)
    sys.exit(1)
with open(args["filename"], "ab") as f:
    f.truncate(1 << 20)
rw = args["rw"]
bw = (1 << 30) * (3 if rw == "write" else 5) * (2 if args.get("direct") == "1" else 1)
print("note: a line fio prints before its JSON")
print(json.dumps({{"jobs": [{{rw: {{"bw_bytes": bw}}}}]}}))
'''


@pytest.mark.parametrize("no_direct", [False, True])
def test_fio_probe_parses_json_and_falls_back_to_buffered(fake_fio, monkeypatch, no_direct):
    from fastdcp.bench.limits import probe_storage

    data = fake_fio(_FAKE_FIO)
    if no_direct:
        monkeypatch.setenv("FAKE_FIO_NO_DIRECT", "1")
    lim = probe_storage(str(data), 8 << 20, [(1 << 20, 2)], method="auto")
    scale = 1 if no_direct else 2
    assert lim.write_gibps == pytest.approx(3 * scale) and lim.read_gibps == pytest.approx(5 * scale)
    assert ("direct=0" in lim.method) == no_direct and "fio" in lim.method
    assert not list(data.iterdir()), "probe file left behind"


def test_python_probe_and_limit_keys(tmp_path):
    from fastdcp.bench.limits import Limits, probe_storage

    lim = probe_storage(str(tmp_path), 8 << 20, [(1 << 20, 2)], method="python")
    assert lim.write_gibps > 0 and lim.read_gibps > 0 and "python" in lim.method
    limits = Limits(memcpy_gibps=4.0, memcpy_methods={}, storage={"dir": lim})
    assert limits.value("memcpy") == 4.0
    assert limits.value("write:dir") == lim.write_gibps
    assert limits.value("min(memcpy,read:dir)") == min(4.0, lim.read_gibps)
    assert limits.value("h2d") is None and limits.value("read:nowhere") is None


# --------------------------------------------------------------------------- floor, planners, async

def _by(results, scenario, **cfg):
    """{system: result} of the case `scenario` whose config includes `cfg`."""
    return {r["system"]: r for r in results
            if r["scenario"] == scenario and all(r["config"].get(k) == v for k, v in cfg.items())}


def test_small_floor_planners_and_async_rows(tmp_path):
    """Default systems on tiny sizes: DCP's floor next to every small case, the planners system
    present or noted as unavailable, async blocked/durable over reused writers with the bare copy."""
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", *TINY, "--scenarios", "small,async", "--repeats", "2",
         "--dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads(out.read_text())
    results = doc["results"]
    systems = {r["system"] for r in results} - set(BASELINE_SYSTEMS)
    assert {"stock", "stock_best", "fastdcp"} <= systems
    if "fastdcp_planners" not in systems:  # never silently missing
        assert _fastdcp_imports() and not _fastdcp_has_planners()
        assert any("fastdcp_planners not run" in n for n in doc["notes"]), doc["notes"]
        assert "fastdcp_planners not run" in proc.stdout

    # small: the criterion is tiny tensors only; 1st and 2nd+ runs; a floor in every case
    for op in ("save", "load"):
        for run in ("1st", "2nd+"):
            case = _by(results, "small", op=op, run=run)
            assert case, (op, run)
            assert all(r["config"]["tensors"] == "50x1KiB" for r in case.values())
            floor = case["dcp_floor"]
            assert 0 < floor["seconds_median"] < case["stock"]["seconds_median"], (op, run)
            assert floor["limit"] is None and floor["ratio_vs_stock"] is None
            for name, r in case.items():
                if name in BASELINE_SYSTEMS:
                    continue
                want = "dcp_floor_planners" if name == "fastdcp_planners" and "dcp_floor_planners" in case \
                    else "dcp_floor"
                assert r["baseline"] == want
                base = case[want]["seconds_median"]
                assert r["baseline_seconds"] == pytest.approx(base)
                assert r["above_baseline_seconds"] == pytest.approx(r["seconds_median"] - base)
            if "fastdcp_planners" in case:
                assert "dcp_floor_planners" in case or any("dcp_floor_planners" in n for n in doc["notes"])
                # fastdcp's plan caches are cleared before run=1st; run=2nd+ reuses the plans, except a
                # load of fastdcp_planners: each repeat loads the checkpoint it has just saved again,
                # whose chunk index is new, and a read plan from an index serves that index only
                # (the floor replays one captured metadata, so its loads reuse the plan).
                assert case["fastdcp_planners"]["system_config"]["plan_caches"].endswith("before run=1st")
                for name in ("fastdcp_planners", "dcp_floor_planners"):
                    if name in case:
                        fresh_index = op == "load" and name == "fastdcp_planners"
                        want_cache = "miss" if run == "1st" or fresh_index else "hit"
                        assert set(case[name]["extra"]["plan_cache"]) == {want_cache}, (name, op, run)

    # async: thread mode (quick), one writer per system over repeats + 1 = 3 saves
    for run, n in (("1st", 1), ("2nd+", 2)):
        blocked = _by(results, "async", mode="thread", phase="blocked", run=run)
        durable = _by(results, "async", mode="thread", phase="durable", run=run)
        bare = blocked.pop("bare_copy")
        assert len(bare["seconds"]) == n and bare["limit"] == "memcpy" and bare["fraction_of_limit"] > 0
        assert set(blocked) == set(durable) == systems
        for name, r in blocked.items():
            assert len(r["seconds"]) == n
            assert r["baseline"] == "bare_copy"
            assert r["ratio_to_baseline"] == pytest.approx(r["seconds_median"] / bare["seconds_median"])
            assert r["ratio_to_baseline"] > 0
            # each save's durable time includes its blocked time
            assert all(d >= b for d, b in zip(durable[name]["seconds"], r["seconds"]))
            assert durable[name]["baseline"] is None
    for col in ("vs floor/bare", "x bare", "dcp_floor", "DCP floor", "bare copy"):
        assert col in proc.stdout, col


def test_planner_systems_with_standin(tmp_path, capsys, monkeypatch):
    """The planner plumbing (System planner factories -> dcp.save/load, the planners' floor) with
    stock classes and DCP's default planners standing in for fastdcp's."""
    monkeypatch.setenv(STANDIN_ENV, "1")
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "small,async", "--systems", "stock,fastdcp_planners",
               "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    results = json.loads(out.read_text())["results"]
    small = _by(results, "small", op="save", run="1st")
    assert set(small) == {"stock", "fastdcp_planners", "dcp_floor", "dcp_floor_planners"}
    assert small["fastdcp_planners"]["baseline"] == "dcp_floor_planners"
    assert small["stock"]["baseline"] == "dcp_floor"
    assert "STAND-IN" in small["fastdcp_planners"]["system_config"]["planners"]
    assert "bare_copy" in _by(results, "async", phase="blocked")
    assert "STAND-IN" in captured.out


def test_async_process_mode(tmp_path):
    """AsyncCheckpointerType.PROCESS in one process (a 1-rank gloo group, a daemon spawned once)."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", *TINY, "--scenarios", "async", "--systems", "stock,fastdcp",
         "--async-modes", "process", "--async-saves", "2", "--dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads(out.read_text())
    blocked = _by(doc["results"], "async", mode="process", phase="blocked", run="2nd+")
    durable = _by(doc["results"], "async", mode="process", phase="durable", run="2nd+")
    assert {"stock", "bare_copy"} <= set(blocked) and "stock" in durable, doc["notes"]
    if "fastdcp" not in blocked:  # a failure in process mode is reported, not hidden
        assert any("process mode: fastdcp failed" in n for n in doc["notes"]), doc["notes"]
    assert blocked["stock"]["ratio_to_baseline"] > 0


def test_null_storage_floor_does_no_io(tmp_path):
    sd = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 4), "step": 3}
    writer = NullStorageWriter()
    before = set(os.listdir(tmp_path))
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert set(os.listdir(tmp_path)) == before
    md = writer.last_metadata
    assert set(md.state_dict_metadata) == {"a", "b", "step"}
    dest = {"a": torch.zeros(10), "b": torch.zeros(3, 4), "step": 0}
    dcp.load(dest, storage_reader=NullStorageReader(md), no_dist=True)
    assert torch.equal(dest["a"], torch.zeros(10))  # nothing read: the floor loads nothing


def test_small_and_async_options():
    c = config_from_args(["--small-count", "10000"])
    assert c.small_count == 10000 and c.small_large_count == 0 and c.floor
    assert c.async_modes == ["thread", "process"] and not c.fresh_planners
    q = config_from_args(["--quick"])
    assert "async" in q.scenarios and "small" in q.scenarios and q.async_modes == ["thread"]
    assert (q.small_repeats or q.repeats) >= 2  # 1st and 2nd+ runs
    c = config_from_args(["--small-large-count", "2", "--small-large-size", "1MiB", "--no-floor",
                          "--fresh-planners", "--async-modes", "process", "--async-saves", "4"])
    assert (c.small_large_count, c.small_large_bytes, c.floor) == (2, 1 << 20, False)
    assert c.fresh_planners and c.async_modes == ["process"] and c.async_saves == 4
    with pytest.raises(SystemExit):
        config_from_args(["--async-modes", "fork"])


def test_peer_and_new_writer_options():
    from fastdcp.bench.peers import PEER_NAMES

    q = config_from_args(["--quick"])
    assert "async_new_writer" in q.scenarios and q.peers == list(PEER_NAMES)
    assert config_from_args([]).peers == list(PEER_NAMES)
    assert config_from_args(["--peers", "none"]).peers == []
    c = config_from_args(["--systems", "stock,fastdcp"])  # --systems alone: only the peers it names
    assert c.systems == ["stock", "fastdcp"] and c.peers == []
    c = config_from_args(["--systems", "stock,torch_save", "--peers", "safetensors"])
    assert c.systems == ["stock"] and c.peers == ["torch_save", "safetensors"]
    assert config_from_args(["--systems", "stock,torch_save", "--peers", "none"]).peers == []
    assert config_from_args(["--checkpoint", "/nowhere"]).peers == []
    for bad in (["--peers", "pickle"], ["--systems", "stock,pickle"]):
        with pytest.raises(SystemExit):
            config_from_args(bad)


def test_baselines_in_finalize():
    from fastdcp.bench.results import Recorder, finalize

    rec = Recorder()
    case = {"op": "save", "run": "2nd+"}
    for system, secs in (("stock", 3.0), ("fastdcp", 1.5), ("fastdcp_planners", 1.0),
                         ("dcp_floor", 0.8), ("dcp_floor_planners", 0.4)):
        rec.add("small", "dir", system, case, 1 << 20, secs, None)
    rec.add("async", "dir", "stock", {"phase": "blocked"}, 1 << 30, 0.5, "memcpy")
    rec.add("async", "dir", "bare_copy", {"phase": "blocked"}, 1 << 30, 0.1, "memcpy")
    rs = {(r.scenario, r.system): r for r in finalize(rec.results, None)}
    assert rs[("small", "stock")].above_baseline_seconds == pytest.approx(2.2)
    assert rs[("small", "fastdcp")].above_baseline_seconds == pytest.approx(0.7)
    assert rs[("small", "fastdcp_planners")].baseline == "dcp_floor_planners"
    assert rs[("small", "fastdcp_planners")].above_baseline_seconds == pytest.approx(0.6)
    assert rs[("small", "dcp_floor")].ratio_vs_stock is None
    assert rs[("async", "stock")].ratio_to_baseline == pytest.approx(5.0)


# --------------------------------------------------------------------------- peers, async_new_writer

def _peer_importable(name: str) -> bool:
    from fastdcp.bench.peers import PeerUnavailable, resolve_peers

    try:
        resolve_peers([name])
        return True
    except PeerUnavailable:
        return False


def _flip_payload_byte(root: Path, sd: dict) -> str:
    """Flip one byte of the largest tensor's payload inside whichever file under `root` holds it
    (found by its bytes: every peer stores tensor bytes uncompressed). Returns the file's name."""
    name, t = max(((k, v) for k, v in sd.items() if isinstance(v, torch.Tensor)), key=lambda kv: kv[1].nbytes)
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    pattern = raw[len(raw) // 2: len(raw) // 2 + 64]
    for f in sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size):
        data = bytearray(f.read_bytes())
        at = data.find(pattern)
        if at >= 0:
            data[at + 7] ^= 0xFF
            f.write_bytes(bytes(data))
            return f.name
    raise AssertionError(f"the bytes of {name!r} are in no file under {root}")


@pytest.mark.parametrize("name", ["torch_save", "safetensors", "torchsnapshot", "nvrx_async"])
def test_peer_save_verifies_and_a_corrupted_file_fails(tmp_path, name):
    """Each installed peer: a real durable save of a small LLM-like state, loaded back bit-exact;
    one flipped payload byte in its file makes the verification raise."""
    from fastdcp.bench.peers import resolve_peers

    if not _peer_importable(name):
        pytest.skip(f"{name} is not installed")
    peer = resolve_peers([name])[0]
    spec = llm_like_spec(1 << 20, norms=4)
    src, dest = build_state(spec), build_destination(spec)
    path = tmp_path / name
    peer.save(src, str(path))
    assert peer.exists(str(path)) and any(p.is_file() for p in path.rglob("*"))
    peer.verify(src, dest, str(path), "roundtrip")
    assert dest["step"] == src["step"] and dest["run_info"] == src["run_info"]
    _flip_payload_byte(path, src)
    with pytest.raises(VerificationError, match="differs"):
        peer.verify(src, dest, str(path), "corrupted")


def test_missing_peers_are_notes_not_errors(tmp_path, capsys, monkeypatch, standin_if_needed):
    from fastdcp.bench.peers import PeerUnavailable, resolve_peers

    for top in ("safetensors", "torchsnapshot", "nvidia_resiliency_ext"):
        for mod in [top, *(m for m in sys.modules if m.startswith(top + "."))]:
            monkeypatch.setitem(sys.modules, mod, None)  # `import mod` raises ImportError
    notes: list[str] = []
    peers = resolve_peers(["torch_save", "safetensors", "torchsnapshot", "nvrx_async"], notes=notes)
    assert [p.name for p in peers] == ["torch_save"]
    assert len(notes) == 3
    for name, hint in (("safetensors", "pip install safetensors"), ("torchsnapshot", "pip install torchsnapshot"),
                       ("nvrx_async", "pip install nvidia-resiliency-ext")):
        assert any(n.startswith(f"{name} not run") and hint in n for n in notes), (name, notes)
    with pytest.raises(PeerUnavailable):
        resolve_peers(["safetensors"])

    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "save", "--systems", "stock,torch_save,safetensors",
               "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    assert "NOTE: safetensors not run" in captured.out and "pip install safetensors" in captured.out
    doc = json.loads(out.read_text())
    assert any(n.startswith("safetensors not run") for n in doc["notes"])
    # raw_io: the storage probe's best configuration inside the save loop (no system, no peer)
    assert {r["system"] for r in doc["results"]} == {"stock", "torch_save", "raw_io"}
    assert doc["run"]["peers"] == ["torch_save"]


def test_peer_that_cannot_run_is_left_out_with_a_note_and_a_mismatch_fails(tmp_path):
    from fastdcp.bench.peers import Peer, prepare_peers, resolve_peers

    def broken_save(sd, path):
        raise OSError("no space left on device (test)")

    broken = Peer("torch_save", broken_save, lambda d, p: None, "model.pt")
    notes: list[str] = []
    good = resolve_peers(["torch_save"])[0]
    assert prepare_peers([broken, good], str(tmp_path), notes.append) == [good]
    assert len(notes) == 1 and "torch_save not run" in notes[0] and "no space left" in notes[0]

    def lying_load(dest, path):  # a load that "succeeds" with wrong bytes
        good.load(dest, path)
        corrupt_one_byte(dest)

    liar = Peer("torch_save", good.save, lying_load, "model.pt")
    with pytest.raises(VerificationError):
        prepare_peers([liar], str(tmp_path), notes.append)


def test_peer_with_corrupt_output_fails_the_run(tmp_path, capsys, monkeypatch, standin_if_needed):
    """A peer whose saved file does not hold what was saved: a save-only run (verified after the
    save loop) stops with exit status 3; so does a peer's load in the load scenario that does
    not return what was saved (the test hook flips a byte after it)."""
    import fastdcp.bench.peers as peers_mod

    real = peers_mod._BUILDERS["torch_save"]
    calls = {"saves": 0}

    def corrupting():
        peer = real()
        save = peer.save

        def save_then_corrupt(sd, path):
            save(sd, path)
            calls["saves"] += 1
            if calls["saves"] > 1:  # the warm-up save stays intact
                _flip_payload_byte(Path(path), sd)

        peer.save = save_then_corrupt
        return peer

    monkeypatch.setitem(peers_mod._BUILDERS, "torch_save", corrupting)
    rc = main([*TINY, "--scenarios", "save", "--systems", "stock,torch_save", "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY, err[-3000:]
    assert "NOT bit-exact" in err and "save/dir [torch_save]" in err, err[-3000:]
    monkeypatch.setitem(peers_mod._BUILDERS, "torch_save", real)
    rc = main([*TINY, "--scenarios", "save,load", "--systems", "stock,torch_save", "--dir", str(tmp_path),
               "--corrupt-after-load", "torch_save"])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY and "load/dir" in err and "torch_save" in err, err[-3000:]


def test_vs_best_peer_in_results_and_summary():
    from fastdcp.bench.report import peer_lines
    from fastdcp.bench.results import Recorder, finalize

    rec = Recorder()
    for system, secs in (("stock", 4.0), ("stock_best", 2.0), ("fastdcp", 1.0), ("torch_save", 1.6),
                         ("safetensors", 2.5)):
        rec.add("save", "dir", system, {"fsync": True}, 1 << 30, secs, None)
    for system, secs in (("stock", 2.0), ("stock_best", 1.0), ("fastdcp", 0.5)):  # no external peer
        rec.add("load", "shm", system, {"cache": "warm", "ckpt_writer": system}, 1 << 30, secs, None)
    rs = {(r.scenario, r.system): r for r in finalize(rec.results, None)}
    fast = rs[("save", "fastdcp")]
    assert fast.best_peer == "torch_save" and fast.ratio_vs_best_peer == pytest.approx(1.6)
    assert rs[("save", "stock")].ratio_vs_best_peer == pytest.approx(0.4)
    assert rs[("save", "torch_save")].best_peer is None  # peers are not compared with themselves
    assert rs[("load", "fastdcp")].best_peer == "stock_best"  # stock_best counts as a peer
    assert rs[("load", "fastdcp")].ratio_vs_best_peer == pytest.approx(2.0)
    lines = peer_lines(list(rs.values()))
    assert lines[0].startswith("fastdcp vs best peer")
    save_line = next(line for line in lines if line.strip().startswith("save"))
    assert "fastdcp 1.00 GiB/s = 1.60x best peer torch_save (0.62 GiB/s), 4.00x stock" in save_line
    assert "peers: torch_save 0.62, stock_best 0.50, safetensors 0.40" in save_line
    assert any("load cache=warm shm: fastdcp" in line and "best peer stock_best" in line for line in lines)


def test_peers_in_save_and_load_report_vs_best_peer(tmp_path, capsys, standin_if_needed):
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "save,load", "--systems", "stock,stock_best,fastdcp,torch_save",
               "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    results = json.loads(out.read_text())["results"]
    save = _by(results, "save")
    # raw_io (the probe's best run in the same loop) is a limit, never the best peer: the next lines
    assert set(save) == {"stock", "stock_best", "fastdcp", "torch_save", "raw_io"}
    assert save["torch_save"]["extra"]["file_bytes"][0] >= save["torch_save"]["bytes"]
    f = save["fastdcp"]
    best = max(("stock_best", "torch_save"), key=lambda n: save[n]["gibps"])
    assert f["best_peer"] == best and f["ratio_vs_best_peer"] == pytest.approx(f["gibps"] / save[best]["gibps"])
    for cache in ("cold", "warm"):
        load = _by(results, "load", cache=cache)
        assert load["torch_save"]["config"]["ckpt_writer"] == "torch_save", cache
        assert load["fastdcp"]["best_peer"] in ("stock_best", "torch_save")
    assert "fastdcp vs best peer" in captured.out
    assert "save fsync=True dir: fastdcp" in captured.out and "x best peer" in captured.out


def test_async_new_writer_makes_a_writer_per_save(tmp_path, capsys, monkeypatch, standin_if_needed):
    """async_new_writer: a new writer object per save (async reuses one per system), 1st and 2nd+
    saves reported apart in both phases, every checkpoint verified (canary)."""
    from fastdcp.bench.systems import System

    made: list[str] = []
    real = System.async_writer

    def counting(self, path):
        made.append(path)
        return real(self, path)

    monkeypatch.setattr(System, "async_writer", counting)
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "async,async_new_writer", "--systems", "stock,fastdcp",
               "--async-saves", "2", "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    new = [p for p in made if "/async/async_new_writer/" in p]
    reused = [p for p in made if "/async/async/" in p]
    assert len(new) == 2 * 2 and len(set(new)) == 4  # one per save and system, each for its own path
    assert len(reused) == 2                           # `async`: one per system
    results = json.loads(out.read_text())["results"]
    for run, n in (("1st", 1), ("2nd+", 1)):
        blocked = _by(results, "async_new_writer", mode="thread", phase="blocked", run=run)
        durable = _by(results, "async_new_writer", mode="thread", phase="durable", run=run)
        assert set(blocked) == {"stock", "fastdcp", "bare_copy"} and set(durable) == {"stock", "fastdcp"}
        for name in ("stock", "fastdcp"):
            assert len(blocked[name]["seconds"]) == n and blocked[name]["baseline"] == "bare_copy"
            assert all(d >= b for d, b in zip(durable[name]["seconds"], blocked[name]["seconds"]))
    assert "async_new_writer mode=thread,run=1st,phase=blocked dir: bare copy" in captured.out


def test_async_new_writer_checks_the_canary(tmp_path, capsys, standin_if_needed):
    rc = main([*TINY, "--scenarios", "async_new_writer", "--systems", "stock", "--async-saves", "2",
               "--dir", str(tmp_path), "--corrupt-after-load", "stock"])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY and "async_new_writer/dir/thread/save0" in err, err[-3000:]


def test_async_first_times_each_systems_first_save_in_a_fresh_process(tmp_path, capsys, standin_if_needed):
    """async_first: per repeat, mode and system one save (in a child process of its own, verified
    there), blocked and durable recorded as run=1st, every pair in the table."""
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "async_first", "--systems", "stock,fastdcp", "--repeats", "2",
               "--async-modes", "thread,process", "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    results = json.loads(out.read_text())["results"]
    for mode in ("thread", "process"):
        blocked = _by(results, "async_first", mode=mode, phase="blocked", run="1st")
        durable = _by(results, "async_first", mode=mode, phase="durable", run="1st")
        assert set(blocked) == set(durable) == {"stock", "fastdcp"}, mode
        for name in ("stock", "fastdcp"):
            assert len(blocked[name]["seconds"]) == 2, (mode, name)
            assert all(0 < b <= d for b, d in zip(blocked[name]["seconds"], durable[name]["seconds"]))
    table = [line.split() for line in captured.out.splitlines() if line.startswith("async_first")]
    assert {(row[1].split(",")[0], row[3]) for row in table} == {
        (f"mode={mode}", name) for mode in ("thread", "process") for name in ("stock", "fastdcp")}, table


def test_async_first_fails_when_a_childs_checkpoint_does_not_verify(tmp_path, capsys, standin_if_needed):
    rc = main([*TINY, "--scenarios", "async_first", "--systems", "stock,fastdcp", "--dir", str(tmp_path),
               "--corrupt-after-load", "fastdcp"])
    err = capsys.readouterr().err
    assert rc == EXIT_VERIFY and "async_first/thread [fastdcp]" in err, err[-3000:]


def test_safetensors_peer_handles_shared_views_and_objects(tmp_path):
    """What safetensors refuses (tied weights, views into a larger storage, non-contiguous
    tensors) is saved as a user would (own copies); JSON-able objects go in the metadata, others
    are skipped with a note and left out of the verification."""
    from fastdcp.bench.peers import resolve_peers

    if not _peer_importable("safetensors"):
        pytest.skip("safetensors is not installed")
    peer = resolve_peers(["safetensors"])[0]
    base = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    src = {"embed": base, "lm_head": base, "half": base[:32], "t": base.t(),
           "step": 12, "cfg": {"lr": 0.5, "name": "x"}, "opaque": object()}
    path = str(tmp_path / "st")
    peer.save(src, path)
    assert peer.skipped == {"opaque"} and any("'opaque'" in n for n in peer.notes)
    dest = {k: (torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else None)
            for k, v in src.items()}
    peer.verify(src, dest, path, "shared")
    assert dest["cfg"] == {"lr": 0.5, "name": "x"} and dest["step"] == 12 and dest["opaque"] is None
    assert torch.equal(dest["t"], base.t()) and base.is_contiguous()  # the source is left as it was
