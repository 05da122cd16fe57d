"""The storages the benchmark mounts for a run (fastdcp/bench/storages.py): a loop-mounted xfs
image and a FUSE passthrough (bindfs), real mounts made and taken down by the harness.

Mounting needs root and the tools (Debian xfsprogs, bindfs). Where this machine lacks them the
mount tests skip, saying which; CI installs the tools and sets FASTDCP_REQUIRE_STORAGES=1, which
turns such a skip into a failure, so that a machine that silently cannot mount never passes there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdcp.bench.storages import MOUNTED_STORAGES, StorageUnavailable, image_bytes_for, mount_storage

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def _need(name: str) -> None:
    package, tool = MOUNTED_STORAGES[name]
    why = ("not root" if os.geteuid() != 0 else
           f"{tool} not installed (Debian package {package})" if shutil.which(tool) is None else None)
    if why is None:
        return
    if os.environ.get("FASTDCP_REQUIRE_STORAGES") == "1":
        pytest.fail(f"storage {name} cannot be mounted here ({why}) but FASTDCP_REQUIRE_STORAGES=1")
    pytest.skip(f"storage {name}: {why}")


def _mounts() -> str:
    with open("/proc/self/mounts") as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(MOUNTED_STORAGES))
def test_mount_write_read_and_take_down(tmp_path, name):
    _need(name)
    storage = mount_storage(name, str(tmp_path), 4 * GIB)
    try:
        assert os.path.ismount(storage.path) and storage.path in _mounts()
        expected = "xfs" if name == "xfs" else "fuse"
        fstype = next(line.split()[2] for line in _mounts().splitlines() if line.split()[1] == storage.path)
        assert fstype == expected, fstype
        payload = os.urandom(1 << 20)
        target = os.path.join(storage.path, "f.bin")
        with open(target, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        with open(target, "rb") as f:
            assert f.read() == payload
    finally:
        errors = storage.close()
    assert errors == []
    assert storage.path not in _mounts()
    assert list(tmp_path.iterdir()) == [], "the mount's directory, image or backing files were left"
    if name == "xfs":
        out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
        assert str(tmp_path) not in out, f"loop device left attached: {out}"


def test_missing_tool_is_a_clear_refusal_that_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))
    for name, (package, tool) in MOUNTED_STORAGES.items():
        with pytest.raises(StorageUnavailable) as e:
            mount_storage(name, str(tmp_path), 4 * GIB)
        assert name in str(e.value)
        if os.geteuid() == 0:
            assert tool in str(e.value) and package in str(e.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unknown storage"):
        mount_storage("nfs4", str(tmp_path), 4 * GIB)


def test_a_failing_mount_takes_down_what_it_made(tmp_path, monkeypatch):
    """mkfs succeeds and losetup attaches, then mount fails (an xfs image that is not one): the
    loop device is detached and the image removed."""
    _need("xfs")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "mkfs.xfs").write_text("#!/bin/sh\nexit 0\n")  # leaves the image unformatted
    (bindir / "mkfs.xfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    parent = tmp_path / "parent"
    parent.mkdir()
    with pytest.raises(StorageUnavailable, match="mount"):
        mount_storage("xfs", str(parent), 4 * GIB)
    assert list(parent.iterdir()) == []
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(parent) not in out, f"loop device left attached: {out}"


def test_image_holds_every_checkpoint_and_the_probe():
    assert image_bytes_for(1 << 20, 3, 1 << 20) == 4 * GIB   # at least 4 GiB
    size = image_bytes_for(GIB, 8, GIB)
    assert size >= 10 * GIB and size % GIB == 0


def test_bench_saves_and_loads_on_mounted_storages(tmp_path):
    """The harness mounts both storages, runs save + load on each beside the disk, reports each
    storage's limits by I/O mode and the per-storage table, and takes the mounts down."""
    for name in MOUNTED_STORAGES:
        _need(name)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdcp.bench", "--size", "8MiB", "--scenarios", "save,load", "--repeats", "1",
         "--systems", "stock,fastdcp", "--peers", "none", "--no-shm", "--probe-size", "16MiB",
         "--cold", "fadvise_dontneed", "--storages", "xfs,fuse", "--dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads(out.read_text())
    wheres = {(r["where"], r["scenario"]) for r in doc["results"] if r["system"] == "fastdcp"}
    assert {("xfs", "save"), ("xfs", "load"), ("fuse", "save"), ("fuse", "load"), ("dir", "save")} <= wheres
    assert doc["machine"]["targets"]["xfs"]["fstype"] == "xfs"
    assert doc["machine"]["targets"]["fuse"]["fstype"].startswith("fuse")
    for where in ("dir", "xfs", "fuse"):
        limit = doc["limits"]["storage"][where]
        assert set(limit["write_by_mode"]) == {"O_DIRECT", "buffered"} or "O_DIRECT" not in limit["write_by_mode"]
        assert limit["write_gibps"] == max(limit["write_by_mode"].values())
    saves = [r for r in doc["results"] if r["system"] == "fastdcp" and r["scenario"] == "save"]
    assert all(r["extra"]["io_mode"] for r in saves)
    assert "| xfs | save (fsync) |" in proc.stdout and "| fuse | load, cold |" in proc.stdout
    assert "storage xfs: xfs on /dev/loop" in proc.stdout
    assert str(tmp_path) not in _mounts(), "a storage was left mounted"
    assert not list(tmp_path.glob("fastdcp_bench_*")), "temp directories were not removed"


@pytest.mark.parametrize("name", sorted(MOUNTED_STORAGES))
def test_checkpoints_cross_between_fastdcp_and_stock_on_the_mounted_storage(tmp_path, name):
    """On each mounted storage, in each I/O mode: fastdcp's checkpoint loads with stock DCP and
    stock's with fastdcp, bit-exact (the compatibility promise, on every storage we benchmark)."""
    _need(name)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import fastdcp

    state = {"w": torch.randn(1 << 20), "b": torch.arange(4096, dtype=torch.bfloat16), "step": 7,
             "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}

    def fresh():
        return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}

    def same(loaded):
        return all(torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v
                   for k, v in state.items())

    storage = mount_storage(name, str(tmp_path), 4 * GIB)
    try:
        for direct in (True, False, None):
            root = os.path.join(storage.path, f"direct_{direct}")
            dcp.save(state, storage_writer=fastdcp.FastFileSystemWriter(os.path.join(root, "fast"), direct_io=direct),
                     no_dist=True)
            out = fresh()
            dcp.load(out, storage_reader=FileSystemReader(os.path.join(root, "fast")), no_dist=True)
            assert same(out), (name, direct, "stock reading fastdcp")
            dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, "stock")), no_dist=True)
            out = fresh()
            dcp.load(out, storage_reader=fastdcp.FastFileSystemReader(os.path.join(root, "stock"), direct_io=direct),
                     no_dist=True)
            assert same(out), (name, direct, "fastdcp reading stock")
    finally:
        assert storage.close() == []
