"""The convert scenario (fastdcp/bench/convert.py) end to end in the benchmark runner on a tiny
state: every system's output verified bit-exact by the scenario itself, rows in the JSON with the
peak memory each conversion needed, and the scenario outside --quick."""

from __future__ import annotations

import json

from fastdcp.bench.config import QUICK_SCENARIOS
from fastdcp.bench.runner import main

TINY = ["--size", "16MiB", "--repeats", "2", "--no-shm", "--probe-size", "32MiB", "--cold", "fadvise_dontneed"]


def test_convert_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main([*TINY, "--scenarios", "convert", "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    rows = [r for r in json.loads(out.read_text())["results"] if r["scenario"] == "convert"]
    by_system = {r["system"]: r for r in rows}
    assert set(by_system) == {"stock", "fastdcp", "fastdcp_pt"}, sorted(by_system)
    for r in rows:
        assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"])
        peaks = r["extra"]["peak_extra_bytes"]
        assert len(peaks) == 2 and all(p is None or p >= 0 for p in peaks)
    # stock loads the whole state into memory first; the streamed .safetensors export does not
    stock_peak, fast_peak = (max(by_system[s]["extra"]["peak_extra_bytes"]) for s in ("stock", "fastdcp"))
    if stock_peak is not None:
        assert fast_peak < stock_peak, (fast_peak, stock_peak)
    assert "convert" in captured.out


def test_convert_is_not_in_quick():
    assert "convert" not in QUICK_SCENARIOS
