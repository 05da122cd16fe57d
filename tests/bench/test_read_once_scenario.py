"""The benchmark's `read_once` scenario end to end, small: replicas load one checkpoint through a
bandwidth-limited S3 endpoint with stock, fastdcp and fastdcp's read-once mode; every load is
checked on every rank, and each row records the bytes the storage served and the bytes needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_read_once_scenario_reads_replicated_state_once(tmp_path):
    out = tmp_path / "read_once.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", "--scenarios", "read_once", "--read-once-size", "8MiB",
         "--read-once-replicas", "1,2", "--read-once-rate-mib-s", "400", "--repeats", "1", "--dir", str(tmp_path),
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {(r["config"]["replicas"], r["system"]): r for r in json.loads(out.read_text())["results"]
               if r["scenario"] == "read_once"}
    assert set(results) == {(r, s) for r in (1, 2) for s in ("stock", "fastdcp", "fastdcp_read_once")}
    for r in results.values():
        assert r["where"] == "s3@400MiB/s" and r["config"]["ranks"] == 2 * r["config"]["replicas"]
        assert r["extra"]["needed_bytes"] == [r["bytes"]]
    served = {key: r["extra"]["storage_bytes_read"][0] for key, r in results.items()}
    # Two replicas: fastdcp alone reads the shards twice; read-once about as much as one replica.
    assert served[(2, "fastdcp")] > 1.7 * served[(1, "fastdcp")]
    assert served[(2, "fastdcp_read_once")] < 1.3 * served[(1, "fastdcp")]
