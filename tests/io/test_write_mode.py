"""The write mode learnt per filesystem (fastdcp/io/write_mode.py): O_DIRECT first, one buffered
try, then the faster of the timed saves, corrected by every later save; explicit ``direct_io`` and
``FASTDCP_DIRECT_IO`` win; memory filesystems and refused O_DIRECT are buffered; small saves spend
no try; real saves through FastFileSystemWriter follow it and stay readable by stock DCP."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import dcp_cases as C
from fastdcp import FastFileSystemWriter
from fastdcp.io import write_mode as W
from fastdcp.io.engine import IoOptions

BIG = W.MIN_TIMED_BYTES
SHM = "/dev/shm"


@pytest.fixture(autouse=True)
def _fresh_history():
    W.forget_write_modes()
    yield
    W.forget_write_modes()


def _options(direct_io=None):
    return IoOptions.resolve(direct_io=direct_io, default_direct_io=True, io_threads=None, task_bytes=None)


def _save_and_record(directory, gibps_direct, gibps_buffered, nbytes=BIG):
    """One save as the writer does it, on a filesystem that writes at these speeds."""
    mode = W.write_mode_for(str(directory), _options(), nbytes)
    rate = gibps_direct if mode.direct else gibps_buffered
    W.record_write(str(directory), mode, nbytes, nbytes / (rate * (1 << 30)), direct_granted=True)
    return mode


def test_a_slow_direct_filesystem_ends_up_buffered(tmp_path):
    modes = [_save_and_record(tmp_path, 0.3, 0.9) for _ in range(4)]
    assert [(m.direct, m.reason) for m in modes] == [
        (True, "first save"), (False, "trying buffered"), (False, "faster so far"), (False, "faster so far")]
    assert modes[2].direct_gibps == pytest.approx(0.3) and modes[2].buffered_gibps == pytest.approx(0.9)


def test_a_fast_direct_filesystem_stays_direct(tmp_path):
    modes = [_save_and_record(tmp_path, 2.0, 1.0) for _ in range(4)]
    assert [m.direct for m in modes] == [True, False, True, True]


def test_a_choice_from_noisy_first_saves_is_corrected(tmp_path):
    _save_and_record(tmp_path, 1.0, 9.9)        # direct 1.0
    _save_and_record(tmp_path, 9.9, 1.2)        # buffered 1.2: looks faster
    chosen = [_save_and_record(tmp_path, 1.0, 0.7) for _ in range(3)]  # but buffered really writes 0.7
    assert chosen[0].direct is False             # chosen on the first two saves
    assert chosen[-1].direct is True             # the median of buffered's saves fell below direct's


def test_small_saves_spend_no_try(tmp_path):
    small = W.write_mode_for(str(tmp_path), _options(), BIG - 1)
    assert (small.direct, small.reason) == (True, "small save")
    W.record_write(str(tmp_path), small, BIG - 1, 0.01, direct_granted=True)  # not timed: too small
    assert W.write_mode_for(str(tmp_path), _options(), BIG).reason == "first save"


def test_refused_direct_io_is_remembered(tmp_path):
    mode = W.write_mode_for(str(tmp_path), _options(), BIG)
    W.record_write(str(tmp_path), mode, BIG, 0.1, direct_granted=False)
    after = W.write_mode_for(str(tmp_path), _options(), BIG)
    assert (after.direct, after.reason) == (False, "O_DIRECT refused")


@pytest.mark.parametrize("asked", [True, False])
def test_explicit_direct_io_wins_and_is_not_learnt(tmp_path, asked):
    for _ in range(3):
        mode = W.write_mode_for(str(tmp_path), _options(direct_io=asked), BIG)
        assert (mode.direct, mode.reason) == (asked, "asked")
        W.record_write(str(tmp_path), mode, BIG, 0.1, direct_granted=True)
    assert W.chosen_write_modes() == {}


@pytest.mark.parametrize("value, direct", [("1", True), ("0", False)])
def test_the_environment_variable_wins(tmp_path, monkeypatch, value, direct):
    monkeypatch.setenv("FASTDCP_DIRECT_IO", value)
    mode = W.write_mode_for(str(tmp_path), _options(), BIG)
    assert (mode.direct, mode.reason) == (direct, "asked")


@pytest.mark.skipif(not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)), reason="needs a writable /dev/shm")
def test_memory_filesystems_are_buffered(tmp_path):
    for asked in (None, True):
        mode = W.write_mode_for(SHM, _options(direct_io=asked), BIG)
        assert mode.direct is False


def test_real_saves_follow_the_learnt_mode_and_stay_stock_readable(tmp_path):
    sd = {f"w{i}": C.random_float((BIG // 4 // 4,), seed=i) for i in range(4)}  # 64 MiB
    expected = C.deepcopy_state_dict(sd)
    modes = []
    for i in range(3):
        path = tmp_path / f"ckpt{i}"
        writer = FastFileSystemWriter(path)  # a new writer per save: the history is the process's
        dcp.save(sd, storage_writer=writer, no_dist=True)
        modes.append(writer.last_write_mode)
        C.load_in_place_and_check(FileSystemReader(path), expected, C.destination_for(expected))
    if modes[0].reason == "memory filesystem":
        pytest.skip("the temporary directory is on a memory filesystem here")
    assert [(m.direct, m.reason) for m in modes[:2]] == [(True, "first save"), (False, "trying buffered")]
    third = modes[2]
    assert third.reason == "faster so far" and third.direct == (third.direct_gibps >= third.buffered_gibps)
    (directory, next_mode), = W.chosen_write_modes().items()
    assert next_mode.direct_gibps > 0 and next_mode.buffered_gibps > 0


def test_saves_without_fsync_are_not_timed(tmp_path):
    sd = {"w": torch.zeros(BIG // 4)}
    for i in range(2):
        writer = FastFileSystemWriter(tmp_path / f"c{i}", sync_files=False)
        dcp.save(sd, storage_writer=writer, no_dist=True)
    if writer.last_write_mode.reason == "memory filesystem":
        pytest.skip("the temporary directory is on a memory filesystem here")
    assert writer.last_write_mode.reason == "first save"  # the first save's timing was not recorded
