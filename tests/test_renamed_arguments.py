"""The memory limits' old names (docs/api.md, "Renamed") still work, warn once, and lose to the new ones."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastdcp
from fastdcp.compat import renamed as _renamed
from fastdcp.io import pinned_pool
from fastdcp.save import staging_pool

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings afresh, and no renamed variable set."""
    monkeypatch.setattr(_renamed, "_warned", set())
    for new, old in _renamed.RENAMED_ENVIRONMENT.items():
        monkeypatch.delenv(new, raising=False)
        monkeypatch.delenv(old, raising=False)


def _renamed_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "renamed" in str(w.message)]


def _build(factory):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = factory()
    return obj, _renamed_warnings(caught)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("renamed")
    dcp.save({"w": torch.arange(16.0)}, storage_writer=fastdcp.FastFileSystemWriter(path), no_dist=True)
    return path


def test_signatures_show_only_the_new_names():
    for cls in (fastdcp.FastFileSystemWriter, fastdcp.FastFileSystemReader, fastdcp.FastS3Writer, fastdcp.FastS3Reader,
                fastdcp.LazyCheckpoint, fastdcp.open):
        params = inspect.signature(cls).parameters
        assert "memory_budget_bytes" not in params and "staging_budget_bytes" not in params, cls
    assert "pinned_ring_limit_bytes" in inspect.signature(fastdcp.FastFileSystemWriter).parameters
    assert "snapshot_limit_bytes" in inspect.signature(fastdcp.FastS3Writer).parameters
    assert "read_buffer_limit_bytes" in inspect.signature(fastdcp.open).parameters


def test_writer_old_names_work_and_warn_once(tmp_path):
    writer, caught = _build(lambda: fastdcp.FastFileSystemWriter(tmp_path, memory_budget_bytes=MiB))
    assert writer.pinned_ring_limit_bytes == MiB
    assert len(caught) == 1 and "memory_budget_bytes" in caught[0] and "pinned_ring_limit_bytes" in caught[0]
    writer, caught = _build(lambda: fastdcp.FastFileSystemWriter(tmp_path, memory_budget_bytes=2 * MiB))
    assert writer.pinned_ring_limit_bytes == 2 * MiB and caught == [], "warned twice"

    writer, caught = _build(lambda: fastdcp.FastFileSystemWriter(tmp_path, async_staging=True, staging_budget_bytes=3 * MiB))
    assert writer.snapshot_limit_bytes == 3 * MiB
    assert len(caught) == 1 and "snapshot_limit_bytes" in caught[0]


def test_writer_new_names_work_silently(tmp_path):
    writer, caught = _build(lambda: fastdcp.FastFileSystemWriter(
        tmp_path, pinned_ring_limit_bytes=MiB, async_staging=True, snapshot_limit_bytes=2 * MiB))
    assert (writer.pinned_ring_limit_bytes, writer.snapshot_limit_bytes, caught) == (MiB, 2 * MiB, [])
    with pytest.raises(ValueError, match="pinned_ring_limit_bytes"):
        fastdcp.FastFileSystemWriter(tmp_path, pinned_ring_limit_bytes=100)
    with pytest.raises(ValueError, match="snapshot_limit_bytes"):
        fastdcp.FastFileSystemWriter(tmp_path, snapshot_limit_bytes=MiB)  # needs async_staging


def test_both_names_at_once_is_an_error(tmp_path):
    with pytest.raises(TypeError, match="memory_budget_bytes"):
        fastdcp.FastFileSystemWriter(tmp_path, memory_budget_bytes=MiB, pinned_ring_limit_bytes=MiB)
    with pytest.raises(TypeError, match="read_buffer_limit_bytes"):
        fastdcp.FastFileSystemReader(tmp_path, memory_budget_bytes=MiB, read_buffer_limit_bytes=MiB)


def test_reader_old_name_works_and_loads(checkpoint):
    reader, caught = _build(lambda: fastdcp.FastFileSystemReader(checkpoint, memory_budget_bytes=MiB))
    assert reader.io_options.read_buffer_limit_bytes == MiB
    assert len(caught) == 1 and "FastFileSystemReader" in caught[0] and "read_buffer_limit_bytes" in caught[0]
    dest = {"w": torch.zeros(16)}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert torch.equal(dest["w"], torch.arange(16.0))
    reader, caught = _build(lambda: fastdcp.FastFileSystemReader(checkpoint, read_buffer_limit_bytes=2 * MiB))
    assert reader.io_options.read_buffer_limit_bytes == 2 * MiB and caught == []


def test_open_and_tiered_take_the_old_names(checkpoint, tmp_path):
    ckpt, caught = _build(lambda: fastdcp.open(checkpoint, memory_budget_bytes=MiB))
    with ckpt:
        assert ckpt.io_options.read_buffer_limit_bytes == MiB
        assert torch.equal(ckpt["w"], torch.arange(16.0))
    assert len(caught) == 1 and "fastdcp.open" in caught[0]
    ckpt, caught = _build(lambda: fastdcp.open(checkpoint, read_buffer_limit_bytes=MiB))
    ckpt.close()
    assert caught == []

    writer, caught = _build(lambda: fastdcp.FastTieredWriter(tmp_path / "shared", local_root=tmp_path / "local",
                                                             memory_budget_bytes=MiB))
    assert writer.pinned_ring_limit_bytes == MiB and len(caught) == 1


def test_s3_classes_take_the_old_names():
    pytest.importorskip("obstore")
    writer, caught = _build(lambda: fastdcp.FastS3Writer("s3://bucket/ckpt", async_staging=True, staging_budget_bytes=MiB))
    assert writer.snapshot_limit_bytes == MiB and len(caught) == 1 and "FastS3Writer" in caught[0]
    reader, caught = _build(lambda: fastdcp.FastS3Reader("s3://bucket/ckpt", memory_budget_bytes=MiB))
    assert reader.io_options.read_buffer_limit_bytes == MiB and len(caught) == 1 and "FastS3Reader" in caught[0]


def test_old_environment_variables_still_work(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDCP_READ_BUDGET_BYTES", str(3 * MiB))
    reader, caught = _build(lambda: fastdcp.FastFileSystemReader(tmp_path))
    assert reader.io_options.read_buffer_limit_bytes == 3 * MiB
    assert len(caught) == 1 and "FASTDCP_READ_BUFFER_LIMIT_BYTES" in caught[0]
    monkeypatch.setenv("FASTDCP_READ_BUFFER_LIMIT_BYTES", str(5 * MiB))  # the new name wins
    reader, caught = _build(lambda: fastdcp.FastFileSystemReader(tmp_path))
    assert reader.io_options.read_buffer_limit_bytes == 5 * MiB and caught == []

    monkeypatch.setenv("FASTDCP_STAGING_BUDGET_BYTES", str(MiB))
    writer, caught = _build(lambda: fastdcp.FastFileSystemWriter(tmp_path, async_staging=True))
    assert writer.snapshot_limit_bytes == MiB and len(caught) == 1

    monkeypatch.setenv("FASTDCP_STAGING_POOL_BYTES", str(7 * MiB))
    limit, caught = _build(staging_pool.default_limit)
    assert limit == 7 * MiB and len(caught) == 1 and "FASTDCP_STAGING_POOL_LIMIT_BYTES" in caught[0]
    monkeypatch.setenv("FASTDCP_STAGING_POOL_LIMIT_BYTES", str(9 * MiB))
    assert staging_pool.default_limit() == 9 * MiB

    monkeypatch.setenv("FASTDCP_PINNED_POOL_BYTES", str(11 * MiB))
    # set_pinned_pool_limit reads the variable too when earlier tests left idle pinned buffers.
    stats, caught = _build(lambda: (fastdcp.set_pinned_pool_limit(None), fastdcp.pinned_pool_stats())[1])
    assert stats.limit_bytes == 11 * MiB and len(caught) == 1
    monkeypatch.setenv("FASTDCP_PINNED_POOL_BYTES", "lots")
    with pytest.raises(ValueError, match="FASTDCP_PINNED_POOL_BYTES"):  # the error names what was set
        fastdcp.pinned_pool_stats()
    monkeypatch.delenv("FASTDCP_PINNED_POOL_BYTES")
    assert fastdcp.pinned_pool_stats().limit_bytes == pinned_pool.DEFAULT_LIMIT
