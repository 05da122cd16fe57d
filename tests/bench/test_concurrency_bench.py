"""Tests of the concurrency scenario (fastdcp/bench/concurrency.py) in the benchmark runner: one round
per system and case end to end (JSON rows and the printed table agree with each other), the
table from hand-made rows, and its place among the options (not in --quick)."""

from __future__ import annotations

import json

import pytest

from fastdcp.bench.concurrency import CASES, SAVES_PER_WRITER, SCENARIO
from fastdcp.bench.config import config_from_args
from fastdcp.bench.report import concurrency_lines, concurrency_rows
from fastdcp.bench.results import Recorder, finalize
from fastdcp.bench.runner import main
from fastdcp.bench.systems import STANDIN_ENV

# the scenario's own sizes are fixed; these only keep the runner's storage probes small
TINY = ["--size", "16MiB", "--repeats", "1", "--no-shm", "--probe-size", "32MiB", "--cold", "fadvise_dontneed"]


def _fastdcp_imports() -> bool:
    try:
        import fastdcp

        return hasattr(fastdcp, "FastFileSystemWriter") and hasattr(fastdcp, "FastFileSystemReader")
    except Exception:
        return False


@pytest.mark.fastdcp_timeout(240)
def test_concurrency_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "concurrency", "--systems", "stock,fastdcp", "--dir", str(tmp_path),
               "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    doc = json.loads(out.read_text())
    systems = {"stock", "fastdcp"} if _fastdcp_imports() else {"stock"}
    rows = {(r["system"], r["config"]["writers"], r["config"]["loader"]): r
            for r in doc["results"] if r["scenario"] == SCENARIO}
    assert set(rows) == {(s, c.writers, c.loader) for s in systems for c in CASES}
    for (system, writers, loader), r in rows.items():
        ex = r["extra"]
        assert len(r["seconds"]) == 1 and r["seconds"][0] > 0
        # every save of every writer is accounted for, as ok or failed
        assert ex["saves_ok"][0] + ex["saves_failed"][0] == writers * SAVES_PER_WRITER, (system, ex)
        assert sum(ex["save_errors"][0].values()) == ex["saves_failed"][0]
        loads = ex["loads_ok"][0] + ex["loads_mix"][0] + ex["loads_failed"][0]
        if loader:
            assert loads >= 1 and ex["loads_during_saves"][0] <= loads, (system, ex)
            assert sum(ex["load_errors"][0].values()) == ex["loads_failed"][0]
        else:
            assert loads == 0
        assert isinstance(ex["final_one_committed_state"][0], bool) and ex["final"][0].count("state") >= 0
    # the table: in the JSON (one row per system and case, the same counts) and printed
    table = {(t["system"], t["writers"], t["loader"]): t for t in doc["concurrency"]}
    assert set(table) == set(rows)
    for key, t in table.items():
        ex = rows[key]["extra"]
        assert (t["rounds"], t["saves_ok"], t["saves_failed"], t["loads_ok"], t["loads_mix"], t["loads_failed"]) == (
            1, ex["saves_ok"][0], ex["saves_failed"][0], ex["loads_ok"][0], ex["loads_mix"][0], ex["loads_failed"][0])
        assert t["final_one_state"] == int(ex["final_one_committed_state"][0])
    assert "concurrency: writer processes saving into ONE directory" in captured.out
    assert "loads ok / mix / failed" in captured.out and "ends as one committed state" in captured.out
    printed = [line.split() for line in captured.out.splitlines()]
    for system, writers, loader in table:
        assert any(p[:2] == [system, str(writers)] and (("+" in p) == loader) for p in printed), (system, writers)
    assert not list(tmp_path.glob("fastdcp_bench_*")), "checkpoints were not removed"


def test_concurrency_table_from_rows():
    rec = Recorder()
    rounds = [
        dict(saves_ok=10, saves_failed=6, save_errors={"FileNotFoundError: x": 5, "RuntimeError: y": 1},
             loads_ok=3, loads_mix=2, loads_failed=9, load_errors={"EOFError: z": 9}, loads_during_saves=14,
             final_one_committed_state=False, final="stock: none; fastdcp: none", leftover_files=2),
        dict(saves_ok=12, saves_failed=4, save_errors={"FileNotFoundError: x": 4},
             loads_ok=5, loads_mix=0, loads_failed=1, load_errors={"EOFError: z": 1}, loads_during_saves=6,
             final_one_committed_state=True, final="stock: ok state 1007; fastdcp: ok state 1007", leftover_files=0),
    ]
    for seconds, extra in zip((1.0, 3.0), rounds):
        rec.add(SCENARIO, "dir", "stock", {"writers": 3, "loader": True}, 1 << 20, seconds, None, **extra)
    rec.add(SCENARIO, "dir", "fastdcp", {"writers": 3, "loader": True}, 1 << 20, 1.0, None,
            **dict(rounds[1], saves_failed=0, save_errors={}, loads_failed=0, load_errors={}))
    results = finalize(rec.results, None)
    rows = {r.system: r for r in concurrency_rows(results)}
    s = rows["stock"]
    assert (s.rounds, s.saves_ok, s.saves_failed, s.loads_ok, s.loads_mix, s.loads_failed) == (2, 22, 10, 8, 2, 10)
    assert s.top_save_error == "9x FileNotFoundError: x" and s.top_load_error == "10x EOFError: z"
    assert (s.final_one_state, s.final_other, s.leftover_files_max, s.seconds_median) == (
        1, ["stock: none; fastdcp: none"], 2, 2.0)
    assert rows["fastdcp"].top_save_error is None
    text = "\n".join(concurrency_lines(results))
    assert "8 / 2 / 10" in text and "22 / 10" in text and "1 of 2" in text and "9x FileNotFoundError: x" in text
    assert "a round ended as: stock: none; fastdcp: none" in text
    assert concurrency_lines(finalize(Recorder().results, None)) == []


def test_concurrency_options():
    assert SCENARIO not in config_from_args(["--quick"]).scenarios  # rounds of real processes: not quick
    assert SCENARIO in config_from_args([]).scenarios
    assert config_from_args(["--scenarios", SCENARIO]).scenarios == [SCENARIO]
