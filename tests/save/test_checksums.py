"""Per-item CRC-32C: recorded by the writer, ignored by stock readers, checked on request."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from fastdcp import FastFileSystemReader, FastFileSystemWriter
from fastdcp.format.metadata import CHECKSUM_ATTRIBUTE


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "e": torch.empty(0, 4), "blob": io.BytesIO(b"payload" * 50), "step": 9}


def _dest():
    return {"w": torch.zeros(300, 200), "b": torch.zeros(7, dtype=torch.bfloat16), "e": torch.empty(0, 4),
            "blob": io.BytesIO(), "step": 0}


def _data_file(path):
    md = FileSystemReader(path).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    return path / info.relative_path, info


def test_checksums_recorded_and_stock_compatible(tmp_path):
    dcp.save(_state(), storage_writer=FastFileSystemWriter(tmp_path, checksums=True), no_dist=True)
    md = FileSystemReader(tmp_path).read_metadata()
    assert all(isinstance(getattr(v, CHECKSUM_ATTRIBUTE, None), int) for v in md.storage_data.values())
    for reader in (FileSystemReader(tmp_path), FastFileSystemReader(tmp_path, verify_checksums=True)):
        out = _dest()
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], _state()["w"]) and out["blob"].getvalue() == b"payload" * 50


def test_flipped_data_byte_is_named(tmp_path):
    dcp.save(_state(), storage_writer=FastFileSystemWriter(tmp_path, checksums=True), no_dist=True)
    path, info = _data_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01  # inside w's tensor bytes
    path.write_bytes(bytes(data))
    # torch never checks zip CRCs: without verification the damage loads silently
    out = _dest()
    dcp.load(out, storage_reader=FastFileSystemReader(tmp_path), no_dist=True)
    assert not torch.equal(out["w"], _state()["w"])
    with pytest.raises(CheckpointException) as err:
        dcp.load(_dest(), storage_reader=FastFileSystemReader(tmp_path, verify_checksums=True), no_dist=True)
    text = str(err.value)
    assert "checksum mismatch for 'w'" in text and path.name in text and f"offset {info.offset}" in text


def test_without_checksums_verification_is_a_no_op(tmp_path):
    dcp.save(_state(), storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
    md = FileSystemReader(tmp_path).read_metadata()
    assert not any(hasattr(v, CHECKSUM_ATTRIBUTE) for v in md.storage_data.values())
    out = _dest()
    dcp.load(out, storage_reader=FastFileSystemReader(tmp_path, verify_checksums=True), no_dist=True)
    assert torch.equal(out["w"], _state()["w"])


def test_environment_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDCP_CHECKSUMS", "1")
    monkeypatch.setenv("FASTDCP_VERIFY_CHECKSUMS", "1")
    assert FastFileSystemWriter(tmp_path).checksums and FastFileSystemReader(tmp_path).verify_checksums
