"""The benchmark's `s3` scenario end to end, small: it starts its own S3 endpoint (SeaweedFS behind
the counting proxy), runs every system of the scenario in both latency settings, checks every load,
records requests per S3 operation, and gives each system's save and load as a fraction of the
server's own speed measured in the same loop (`s3_limit`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_s3_scenario_compares_stock_fastdcp_and_the_server_limit(tmp_path):
    out = tmp_path / "s3.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", "--scenarios", "s3", "--size", "16MiB", "--repeats", "1",
         "--s3-delay-ms", "5", "--dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [r for r in json.loads(out.read_text())["results"] if r["scenario"] == "s3"]
    cases = {(r["where"], r["config"]["op"], r["system"]) for r in results}
    for where in ("s3", "s3+10ms"):
        for system in ("stock", "stock_t4", "stock_t16", "stock_best", "fastdcp", "s3_limit"):
            assert (where, "save", system) in cases, (where, system, sorted(cases))
        for system in ("stock", "fastdcp", "s3_limit"):
            assert (where, "load", system) in cases
        for system in ("stock", "fastdcp"):
            assert (where, "reshard", system) in cases
    by_case = {(r["where"], r["config"]["op"], r["system"]): r for r in results}
    for (where, op, system), r in by_case.items():
        if op in ("save", "load") and system in ("stock", "fastdcp"):
            limit = by_case[(where, op, "s3_limit")]["gibps"]
            assert r["limit"] == "case:s3_limit" and r["limit_gibps"] == limit, r
            assert abs(r["fraction_of_limit"] - r["gibps"] / limit) < 1e-9, r
    saves = {(r["where"], r["system"]): r["extra"]["requests"][0] for r in results if r["config"]["op"] == "save"}
    fast = saves[("s3", "fastdcp")]
    assert fast.get("LIST", 0) == 0 and fast.get("COPY", 0) == 0 and fast["PUT"] >= 1, fast
    assert saves[("s3", "stock")].get("COPY", 0) >= 1  # stock's .metadata "rename"
