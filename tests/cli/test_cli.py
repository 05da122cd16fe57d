"""``python -m fastdcp inspect|verify`` on good, damaged and non-checkpoints (stock- and
fastdcp-written). Most cases call ``fastdcp.cli.main`` in-process (a subprocess costs a torch
import, seconds on the 2-core machine); ``test_module_entry_point`` runs the real command line."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fastdcp import FastFileSystemWriter
from fastdcp.cli import main

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

KINDS = ("stock", "fast")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state():
    return {
        "layer.weight": torch.randn(64, 32),
        "layer.bias": torch.zeros(64, dtype=torch.bfloat16),
        "scalar": torch.tensor(3),
        "step": 11,
        "blob": io.BytesIO(b"raw bytes"),
    }


@pytest.fixture(scope="module")
def _originals(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    out = {}
    for kind in KINDS:
        path = base / kind
        writer = FileSystemWriter(path) if kind == "stock" else FastFileSystemWriter(path)
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        out[kind] = path
    return out


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def ckpt(kind, _originals, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(_originals[kind], dest)
    return dest


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _data_file(path):
    (f,) = path.glob("*.distcp")
    return f


def _md(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def _entry(md, fqn):
    return md.storage_data[next(k for k in md.storage_data if k.fqn == fqn)]


def test_inspect_good(ckpt, kind, capsys):
    code, out, _ = _run(capsys, "inspect", ckpt)
    assert code == 0
    assert "layer.weight" in out and "(64, 32)" in out and "float32" in out and "bfloat16" in out
    assert "step" in out and "blob" in out and _data_file(ckpt).name in out
    assert ("fastdcp" if kind == "fast" else "torch.save blobs") in out


def test_inspect_json(ckpt, kind, capsys):
    code, out, _ = _run(capsys, "inspect", ckpt, "--json")
    assert code == 0
    report = json.loads(out)
    tensors = {t["fqn"]: t for t in report["tensors"]}
    assert tensors["layer.weight"]["shape"] == [64, 32] and tensors["layer.weight"]["dtype"] == "float32"
    assert tensors["layer.weight"]["chunks"] == 1 and tensors["scalar"]["shape"] == []
    assert {b["fqn"] for b in report["byte_items"]} == {"step", "blob"}
    (f,) = report["files"]
    assert f["name"] == _data_file(ckpt).name and f["size"] == _data_file(ckpt).stat().st_size and f["entries"] == 5
    assert report["total_file_bytes"] == f["size"]
    assert report["tensor_bytes"] == 64 * 32 * 4 + 64 * 2 + 8
    assert report["writer"].startswith("fastdcp" if kind == "fast" else "torch.save")


def test_verify_good(ckpt, capsys):
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 0, out
    assert "OK" in out and "3 tensor blobs, 2 byte items" in out and "no checksums recorded" in out
    code, out, _ = _run(capsys, "verify", ckpt, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["problems"] == [] and report["tensor_blobs_checked"] == 3


def test_verify_truncated_data_file(ckpt, capsys):
    data = _data_file(ckpt)
    os.truncate(data, data.stat().st_size // 2)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 1
    assert "DAMAGED" in out and data.name in out and "past the end of the file" in out


def test_verify_corrupted_blob(ckpt, capsys):
    info = _entry(_md(ckpt), "layer.weight")
    data = _data_file(ckpt)
    raw = bytearray(data.read_bytes())
    eocd = info.offset + info.length - 22
    assert raw[eocd : eocd + 4] == b"PK\x05\x06"
    raw[eocd : eocd + 4] = b"XXXX"
    data.write_bytes(bytes(raw))
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 1
    assert f"{data.name} at offset {info.offset}" in out and "layer.weight" in out and "does not parse" in out
    # inspect still lists the checkpoint
    code, out, _ = _run(capsys, "inspect", ckpt)
    assert code == 0 and "layer.weight" in out


def test_verify_dtype_and_shape_mismatch(ckpt, capsys):
    md = _md(ckpt)
    md.state_dict_metadata["layer.weight"].properties.dtype = torch.float16
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 1 and "metadata says float16" in out and "layer.weight" in out


def test_verify_missing_and_escaping_files(ckpt, capsys, tmp_path):
    md = _md(ckpt)
    _entry(md, "step").relative_path = "../elsewhere.distcp"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    os.remove(_data_file(ckpt))
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 1
    assert "does not exist" in out and "'..' component" in out


def test_verify_missing_storage_entry(ckpt, capsys):
    md = _md(ckpt)
    del md.storage_data[next(k for k in md.storage_data if k.fqn == "layer.bias")]
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 1 and "layer.bias" in out and "no storage entry" in out


def test_hostile_metadata(ckpt, capsys, tmp_path):
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    md = _md(ckpt)
    md.planner_data = Payload()
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    for command in ("verify", "inspect"):
        code, out, _ = _run(capsys, command, ckpt)
        assert code == 1 and "disallowed global" in out and ".metadata" in out
    assert not (tmp_path / "pwned").exists()


def test_not_a_checkpoint(tmp_path, capsys):
    code, _, err = _run(capsys, "verify", tmp_path)
    assert code == 2 and "not a DCP checkpoint" in err and "no .metadata" in err
    code, _, err = _run(capsys, "inspect", tmp_path / "missing")
    assert code == 2 and "does not exist" in err
    (tmp_path / "file").write_text("x")
    code, _, err = _run(capsys, "inspect", tmp_path / "file")
    assert code == 2 and "not a directory" in err
    with pytest.raises(SystemExit) as info:
        main(["frobnicate", str(tmp_path)])
    assert info.value.code == 2


def test_rank_local_metadata(ckpt, capsys):
    os.rename(ckpt / ".metadata", ckpt / "__0.metadata")
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == 0 and "OK" in out
    code, out, _ = _run(capsys, "inspect", ckpt)
    assert code == 0 and "__0.metadata" in out


def test_module_entry_point(_originals, tmp_path):
    """The real command line, one run per exit code, at once (each pays a torch import)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(_originals["fast"], damaged)
    data = _data_file(damaged)
    os.truncate(data, data.stat().st_size - 100)
    runs = {
        "inspect_stock": (["inspect", _originals["stock"]], 0, "layer.weight"),
        "verify_damaged": (["verify", damaged], 1, data.name),
        "not_a_checkpoint": (["verify", tmp_path], 2, "not a DCP checkpoint"),
    }
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "fastdcp", *map(str, argv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, (argv, _, _) in runs.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        _, code, needle = runs[name]
        assert proc.returncode == code, (name, out, err)
        assert needle in out + err, (name, out, err)


def test_verify_checksums(tmp_path, capsys):
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=FastFileSystemWriter(path, checksums=True), no_dist=True)
    code, out, _ = _run(capsys, "verify", path)
    assert code == 0 and "5 of 5 recorded checksums match" in out
    info = _entry(_md(path), "layer.weight")
    data = _data_file(path)
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x01  # a tensor data byte: the structure stays valid
    data.write_bytes(bytes(raw))
    code, out, _ = _run(capsys, "verify", path)
    assert code == 1 and "checksum mismatch" in out and "layer.weight" in out and data.name in out
    assert "4 of 5 recorded checksums match" in out
