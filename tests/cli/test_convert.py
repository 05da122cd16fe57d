"""``python -m fastdcp convert``: .safetensors (one file or Hugging Face shards with an index) and
.pt output of stock- and fastdcp-written checkpoints, bit-exact against the saved state and against
stock's ``dcp_to_torch_save``; --dtype, --keys; peak memory of a conversion in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import dcp_cases as C
from fastdcp import FastFileSystemWriter
from fastdcp.cli import main
from fastdcp.cli.convert_command import SAFETENSORS_DTYPES, parse_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

KINDS = ("stock", "fast")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state() -> dict:
    dtypes = {C.dtype_name(d): C.random_tensor(d, (6, 5), ("cv", C.dtype_name(d))) for d in SAFETENSORS_DTYPES}
    return {
        "model": {**C.zoo_tensors(1, large=False), "embed": C.random_float((512, 300), "embed")},
        "dtypes": dtypes,
        "optim": {"state": {0: {"exp_avg": C.random_float((7, 3), "m"), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 12,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("convert")
    state = _state()
    paths = {}
    for kind in KINDS:
        paths[kind] = base / kind
        writer = FileSystemWriter(paths[kind]) if kind == "stock" else FastFileSystemWriter(paths[kind])
        dcp.save(state, storage_writer=writer, no_dist=True)
    return state, paths


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return C.tensor_leaves(state)


def test_safetensors_is_bit_exact_and_skips_objects(saved, kind, tmp_path, capsys):
    state, paths = saved
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(paths[kind]), str(out)]) == 0
    loaded = load_file(out)
    expected = _tensors(state)
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        C.assert_tensor_bitexact(loaded[key], value, key, check_stride=False)
    err = capsys.readouterr().err
    assert "skipped" in err and "step" in err and "safetensors holds tensors only" in err


def test_pt_matches_dcp_to_torch_save(saved, kind, tmp_path):
    _, paths = saved
    ours, stocks = tmp_path / "ours.pt", tmp_path / "stock.pt"
    assert main(["convert", str(paths[kind]), str(ours), "--include-objects"]) == 0
    dcp_to_torch_save(paths[kind], stocks)
    C.assert_same(torch.load(ours, weights_only=False), torch.load(stocks, weights_only=False))
    # Tensors only by default: loadable with weights_only=True.
    assert main(["convert", str(paths[kind]), str(ours)]) == 0
    plain = torch.load(ours, weights_only=True)
    assert "step" not in plain and isinstance(plain["optim"]["state"]["0"]["exp_avg"], torch.Tensor)


def test_sharded_output_and_index(saved, tmp_path):
    state, paths = saved
    out = tmp_path / "hf" / "model.safetensors"
    assert main(["convert", str(paths["fast"]), str(out), "--max-shard-size", "200KB"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not out.exists() and not list((tmp_path / "hf").glob("*.partial"))
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        shard = load_file(tmp_path / "hf" / name)
        assert {k for k, v in index["weight_map"].items() if v == name} == set(shard)
        if len(shard) > 1:
            assert os.path.getsize(tmp_path / "hf" / name) <= 200_000 + 8192  # + the header
        merged.update(shard)
    expected = _tensors(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for key, value in expected.items():
        C.assert_tensor_bitexact(merged[key], value, key, check_stride=False)


def test_dtype_and_keys(saved, tmp_path):
    state, paths = saved
    out = tmp_path / "bf16.safetensors"
    assert main(["convert", str(paths["stock"]), str(out), "--dtype", "bf16", "--keys", r"^(model|optim)\."]) == 0
    loaded = load_file(out)
    expected = {k: v for k, v in _tensors(state).items() if k.startswith(("model.", "optim."))}
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        C.assert_tensor_bitexact(loaded[key], want.contiguous(), key)


def test_small_budget_streams_rows(saved, tmp_path):
    state, paths = saved
    out = tmp_path / "small.safetensors"
    # 64 KiB budget: the 600 KB embedding is read in blocks of 27 rows.
    assert main(["convert", str(paths["fast"]), str(out), "--memory-budget", "64KiB", "--keys", "embed"]) == 0
    C.assert_tensor_bitexact(load_file(out)["model.embed"], state["model"]["embed"], "embed")


def test_usage_errors(saved, tmp_path, capsys):
    _, paths = saved
    assert main(["convert", str(paths["fast"]), str(tmp_path / "x.bin")]) == 2
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x.safetensors")]) == 2
    assert main(["convert", str(paths["fast"]), str(tmp_path / "x.pt"), "--max-shard-size", "1GB"]) == 2
    assert "must end in" in capsys.readouterr().err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1GiB") == 1 << 30 and parse_size("512") == 512
    with pytest.raises(ValueError):
        parse_size("lots")


_MEASURE = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch, fastdcp
from fastdcp.cli import main

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))

def peak_above_now(argv):
    # Writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0):
    # torch's import peaks far above what it leaves resident, and would hide the conversion.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    assert main(argv) == 0
    return status("VmHWM") - base

src, out = sys.argv[1], sys.argv[2]
st = peak_above_now(["convert", src, out + "/out.safetensors", "--memory-budget", sys.argv[3]])
pt = peak_above_now(["convert", src, out + "/out.pt", "--memory-budget", sys.argv[3]])
print(st, pt)
"""


def _conversion_peaks(ckpt, out, budget: str) -> tuple[float, float]:
    """MiB above the resident baseline at the peak of a .safetensors and a .pt conversion."""
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(ckpt), str(out), budget], capture_output=True,
                            text=True, cwd=_REPO, timeout=110)
    assert result.returncode == 0, result.stderr
    safetensors_peak, pt_peak = map(float, result.stdout.split()[-2:])
    return safetensors_peak, pt_peak


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
@pytest.mark.fastdcp_timeout(120)
def test_peak_memory_is_bounded(tmp_path):
    # ~200 MB: four 48 MiB tensors and a few small ones.
    state = {f"layer{i}.weight": torch.full((3072, 4096), float(i)) for i in range(4)}
    state.update({f"layer{i}.bias": torch.arange(4096.0) for i in range(4)})
    ckpt = tmp_path / "ckpt"
    dcp.save(state, storage_writer=FastFileSystemWriter(ckpt), no_dist=True)
    del state
    safetensors_peak, pt_peak = _conversion_peaks(ckpt, tmp_path, "32MiB")
    # safetensors: within the 32 MiB budget plus small change; .pt: plus the largest tensor (48 MiB).
    assert safetensors_peak < 32 + 16, safetensors_peak
    assert pt_peak < 32 + 48 + 16, pt_peak
    assert load_file(tmp_path / "out.safetensors")["layer3.weight"][0, 0] == 3.0
    assert torch.load(tmp_path / "out.pt", weights_only=True)["layer2.bias"][5] == 5.0
