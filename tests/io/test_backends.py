"""The storage seam (:mod:`fastdcp.io.backends`): the registry finds a backend from a checkpoint
id's scheme for ``enable()``, ``fastdcp.open`` and tiered checkpoints; a backend from outside the
package is added by a call or by an installed distribution's entry point; the built-in stores
implement the declared :class:`FileStore` interface."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
import fastdcp
from fastdcp.io import backends
from fastdcp.io.backends import Backend, FileStore, backend_for, register_backend, url_scheme

THIRD_PARTY = Path(__file__).resolve().parent / "thirdparty"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(backends, "_by_scheme", dict(backends._by_scheme))
    monkeypatch.syspath_prepend(str(THIRD_PARTY))
    return backends


def test_schemes_find_their_backends_and_paths_find_none():
    assert backend_for("s3://b/p").name == "s3"
    assert backend_for("az://c/p").name == backend_for("abfs://c@acct.dfs.core.windows.net/p").name == "azure"
    assert backend_for("S3://b/p").name == "s3"
    assert backend_for("/tmp/run") is None and backend_for(Path("s3://b/p")) is None
    assert backend_for("gs://b/p") is None  # unregistered: stock's choice (fsspec) stands
    assert url_scheme("hdfs+x://a") == "hdfs+x" and url_scheme("not a url") is None


def test_a_backend_is_declared_with_module_attribute_names():
    with pytest.raises(ValueError, match="module:attribute"):
        Backend("bad", ("bad",), writer="no_colon", reader="m:R")
    with pytest.raises(ValueError, match="lower-case"):
        Backend("bad", ("S3X",), writer="m:W", reader="m:R")
    with pytest.raises(NotImplementedError, match="offers no file store"):
        Backend("partial", ("partial",), writer="m:W", reader="m:R").load("file_store")
    with pytest.raises(ImportError, match="fastdcp_no_such_module"):
        Backend("gone", ("gone",), writer="fastdcp_no_such_module:W", reader="m:R").load("writer")


def test_a_scheme_already_served_is_not_taken_silently(registry):
    other = Backend("other-s3", ("s3",), writer="m:W", reader="m:R")
    with pytest.raises(ValueError, match=r"s3:// \(s3\) already served"):
        register_backend(other)
    register_backend(other, replace=True)
    assert backend_for("s3://b").name == "other-s3"


def test_a_backend_registered_by_a_call_serves_enable_open_and_tiers(registry, tmp_path):
    import dirurl_backend

    register_backend(dirurl_backend.BACKEND)
    url = f"dirurl://{tmp_path / 'ckpt'}"
    sd = {"w": torch.randn(100, 7), "step": 3}
    with fastdcp.enable():
        dcp.save(sd, checkpoint_id=url, no_dist=True)
        loaded = {"w": torch.zeros(100, 7), "step": 0}
        dcp.load(loaded, checkpoint_id=url, no_dist=True)
    C.assert_same(loaded, sd)
    assert (tmp_path / "ckpt" / ".metadata").is_file()  # written where the backend put it
    with fastdcp.open(url) as ckpt:
        assert torch.equal(ckpt["w"][:], sd["w"])
    shared = f"dirurl://{tmp_path / 'shared' / 'step1'}"
    writer = fastdcp.FastTieredWriter(shared, local_root=tmp_path / "local")
    dcp.save(sd, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    assert (tmp_path / "shared" / "step1" / ".metadata").is_file()  # drained through its file store


def test_a_backend_declared_by_an_installed_distribution_is_found(tmp_path):
    """A distribution on the path with a ``fastdcp.backends`` entry point: a fresh interpreter
    saves and loads through it with nothing but ``enable()``."""
    site = tmp_path / "site"
    dist_info = site / "dirurl_backend-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: dirurl-backend\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[fastdcp.backends]\ndirurl = dirurl_backend:BACKEND\n")
    (site / "dirurl_backend.py").write_text((THIRD_PARTY / "dirurl_backend.py").read_text())
    code = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp, fastdcp
        assert "dirurl" in [b.name for b in fastdcp.backends()]
        url = "dirurl://{tmp_path / 'ep'}"
        with fastdcp.enable():
            dcp.save({{"w": torch.arange(12.0)}}, checkpoint_id=url, no_dist=True)
            out = {{"w": torch.zeros(12)}}
            dcp.load(out, checkpoint_id=url, no_dist=True)
        assert torch.equal(out["w"], torch.arange(12.0))
        print("LOADED", fastdcp.io.backends.backend_for(url).load("writer").__name__)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "LOADED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "ep" / ".metadata").is_file()


def test_a_broken_entry_point_is_named(tmp_path):
    site = tmp_path / "site"
    dist_info = site / "broken-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[fastdcp.backends]\nbroken = broken_backend_module:BACKEND\n")
    code = "import fastdcp\ntry:\n    fastdcp.backends()\nexcept ImportError as e:\n    print('ERROR', e)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ERROR" in proc.stdout and "'broken'" in proc.stdout and "broken_backend_module" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]


def test_the_built_in_stores_implement_the_declared_interface(tmp_path):
    from fastdcp.objstore.storage import ObjectStorage
    from fastdcp.tiered.shared_tier import DirectoryTier

    directory = DirectoryTier(tmp_path / "d")
    assert isinstance(directory, FileStore)
    assert isinstance(ObjectStorage("s3://bucket/prefix"), FileStore)
    payload = bytes(range(256)) * 40
    directory.put_images([("a.distcp", len(payload), [(0, memoryview(payload))])])
    directory.put_bytes(".metadata", b"meta", create_only=True)
    with pytest.raises(FileExistsError):
        directory.put_bytes(".metadata", b"other", create_only=True)
    assert directory.size("a.distcp") == len(payload)
    assert directory.read_range("a.distcp", 300, 10) == payload[300:310]
    assert directory.existing({"a.distcp", "b.distcp", ".metadata"}) == {"a.distcp", ".metadata"}
    assert sorted(directory.list()) == [(".metadata", 4), ("a.distcp", len(payload))]
    assert directory.delete(["a.distcp", "missing"]) == []
    assert directory.existing({"a.distcp"}) == set()


def test_object_storage_serves_the_interface_against_a_real_server(bucket, s3_env):
    from fastdcp.objstore.storage import ObjectStorage

    store = ObjectStorage(f"s3://{bucket}/fs")
    payload = os.urandom(100_000)
    store.put_images([("a.distcp", len(payload), [(0, memoryview(payload))])])
    store.put_bytes(".metadata", b"meta", create_only=True)
    with pytest.raises(FileExistsError):
        store.put_bytes(".metadata", b"other", create_only=True)
    assert store.size("a.distcp") == len(payload) and store.read_range("a.distcp", 7, 9) == payload[7:16]
    assert sorted(store.list()) == [(".metadata", 4), ("a.distcp", len(payload))]
    assert store.delete(["a.distcp"]) == [] and store.existing({"a.distcp", ".metadata"}) == {".metadata"}
