"""The benchmark's `tiered` scenario end to end, small: train_loop's loop checkpointing straight to the
shared tier (stock, fastdcp), to the local tier only (fastdcp_local) and tiered (fastdcp_tiered), one
record per system with the loop slowdown, the times to the local commit and to durability in the
shared tier, host memory, and every checkpoint verified bit-exact in every tier."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("none", "stock", "fastdcp", "fastdcp_local", "fastdcp_tiered")
STEPS, EVERY = 8, 2          # 4 checkpoints per loop
# Small and quick on 2 cores: a 16 MiB model + AdamW state, 20 ms steps, a 16 MiB storage probe.
SMALL = ["--size", "16MiB", "--repeats", "1", "--train-steps", str(STEPS), "--train-every", str(EVERY),
         "--train-step-ms", "20", "--no-shm", "--probe-size", "16MiB", "--cold", "fadvise_dontneed"]


@pytest.fixture
def local_tier():
    """A local tier of this test's own on /dev/shm, to see that the scenario leaves nothing there."""
    root = Path("/dev/shm") / f"fastdcp-bench-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", "--scenarios", "tiered", "--dir", str(tmp_path), *args],
        cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_tiered_scenario_records_every_system_and_verifies_every_tier(tmp_path, local_tier):
    out = tmp_path / "tiered.json"
    proc = _bench(tmp_path, *SMALL, "--local-tier", str(local_tier), "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {r["system"]: r for r in json.loads(out.read_text())["results"] if r["scenario"] == "tiered"}
    assert set(results) == set(SYSTEMS), (sorted(results), proc.stderr[-3000:])
    checkpoints = STEPS // EVERY
    for name, r in results.items():
        ex = r["extra"]
        assert r["where"] == "dir" and r["config"]["local_tier"] == str(local_tier)
        assert len(r["seconds"]) == 1 and r["seconds"][0] > 0
        assert ex["peak_host_bytes"][0] > 0 and ex["peak_host_bytes"][0] >= ex["start_host_bytes"][0]
        if name == "none":
            assert ex["loop_slowdown"] == [1.0] and ex["checkpoints"] == [0] and ex["verified_loads"] == [0]
            continue
        assert ex["loop_slowdown"][0] > 0
        assert ex["checkpoints"] == [checkpoints]
        committed = ex["committed_local_s"][0]
        assert len(committed) == checkpoints and all(t > 0 for t in committed)
        assert len(ex["blocked_s"][0]) == checkpoints
        durable = ex["durable_shared_s"][0]
        if name == "fastdcp_local":
            assert durable is None and ex["local_tier_bytes"][0] > 0
            assert ex["verified_loads"] == [checkpoints]
        elif name == "fastdcp_tiered":
            # committed locally first, durable in the shared directory later, by the drain
            assert len(durable) == checkpoints
            # Both times are noted by callbacks: the drain's can run before the one that resolves
            # upload_completion after the local commit, so allow that race's width.
            assert all(d >= c - 0.05 for d, c in zip(durable, committed)), (durable, committed)
            assert ex["shared_drain_s"][0] >= 0 and ex["local_tier_bytes"][0] > 0
            # each checkpoint from the shared directory, from its local copy, and through FastTieredReader
            assert ex["verified_loads"] == [3 * checkpoints] and ex["local_copies_unverified"] == [0]
            assert ex["reader_tiers"] == [["local"] * checkpoints]
        else:  # straight to the shared directory: committed there is durable there
            assert durable == committed and ex["shared_drain_s"] == [0.0]
            assert ex["verified_loads"] == [checkpoints]
    assert list(local_tier.iterdir()) == []  # every local tier directory the run made is gone
    assert "fastdcp_tiered" in proc.stdout and "vs fastdcp_local" in proc.stdout and "targets:" in proc.stdout


def test_a_tiered_checkpoint_that_loads_wrong_fails_the_run(tmp_path, local_tier):
    """The verification is live: one byte flipped after a load of a tiered checkpoint exits with 3."""
    proc = _bench(tmp_path, *SMALL, "--systems", "fastdcp", "--train-steps", "2", "--local-tier", str(local_tier),
                  "--corrupt-after-load", "fastdcp_tiered")
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "NOT bit-exact" in proc.stderr and "fastdcp_tiered" in proc.stderr
    assert list(local_tier.iterdir()) == []
