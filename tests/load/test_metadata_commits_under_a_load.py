"""A load while saves keep committing into its directory (fastdcp.load.reader): a data file that
vanished right after ``.metadata`` was read means a newer save committed, so the reader reads
``.metadata`` again for as long as it keeps being replaced; a file missing under an unchanged
``.metadata`` is a damaged checkpoint, reported naming the file."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastdcp
from fastdcp.load import read_source as source_module
from fastdcp.load.metadata_cache import metadata_cache

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(path: str, value: float) -> None:
    dcp.save({"w": torch.full((64,), value)}, storage_writer=fastdcp.FastFileSystemWriter(path), no_dist=True)


def test_a_load_reads_metadata_again_while_saves_keep_committing(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _save(path, 0.0)
    real_pin = source_module.LocalReadSource._pin
    commits = []

    def pin_after_a_commit(self, metadata):
        # Three saves commit between reading .metadata and opening its files, one after another:
        # each time the files just read are gone (the overwrite's cleanup) and .metadata is new.
        if len(commits) < 3:
            commits.append(len(commits) + 1.0)
            _save(path, commits[-1])
            return False
        return real_pin(self, metadata)

    monkeypatch.setattr(source_module.LocalReadSource, "_pin", pin_after_a_commit)
    state = {"w": torch.zeros(64)}
    dcp.load(state, storage_reader=fastdcp.FastFileSystemReader(path), no_dist=True)
    assert commits == [1.0, 2.0, 3.0]
    assert torch.equal(state["w"], torch.full((64,), 3.0))  # the newest committed state, whole


def test_a_missing_file_under_an_unchanged_metadata_is_reported_after_one_read(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _save(path, 1.0)
    data = [name for name in os.listdir(path) if name.endswith(".distcp")]
    os.remove(os.path.join(path, data[0]))
    reads = []
    real_load = metadata_cache.load

    def counted(*args, **kwargs):
        reads.append(1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(metadata_cache, "load", counted)
    with pytest.raises(BaseException, match=data[0]) as raised:  # CheckpointException is a BaseException
        dcp.load({"w": torch.zeros(64)}, storage_reader=fastdcp.FastFileSystemReader(path), no_dist=True)
    assert "does not exist" in str(raised.value)
    assert len(reads) == 1
