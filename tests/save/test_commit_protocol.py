"""The commit protocol against other saves and loads in the same directory, step by step.

``tests/save/test_concurrent_saves.py`` runs whole jobs against each other; these tests put one
other actor at one exact moment: a save in flight (a live in-flight marker and its files) during
another save's cleanup; the marker of a save whose process died, or that was written on another
host; a file or the marker of this save removed just before its commit; a checkpoint overwritten
between a load's metadata read and its data reads; ranks of one load that read different saves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

import fastdcp.load.reader as fast_reader
from fastdcp.load.metadata_cache import metadata_cache as fast_metadata_cache
import fastdcp.save.commit as fast_commit
from fastdcp import ConcurrentOverwriteError, ConcurrentSaveError, FastFileSystemReader, FastFileSystemWriter
from fastdcp.save import inflight

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

_REPO = Path(__file__).resolve().parents[2]


def _state(seed: int, n: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(4096 + i, generator=g) for i in range(n)} | {"seed": seed}


def _save(directory: Path, state: dict) -> None:
    dcp.save(state, storage_writer=FastFileSystemWriter(directory), no_dist=True)


def _load(directory: Path, reader_cls=FastFileSystemReader, planner=None) -> dict:
    out = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in _state(0).items()}
    dcp.load(out, storage_reader=reader_cls(directory), planner=planner, no_dist=True)
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
    )


def _assert_holds(directory: Path, state: dict) -> None:
    for reader in (FastFileSystemReader, FileSystemReader):
        got = _load(directory, reader)
        assert _equal(got, state), f"{reader.__name__} did not load the expected state from {sorted(os.listdir(directory))}"


def _referenced(directory: Path) -> set[str]:
    md = FileSystemReader(directory).read_metadata()
    return {info.relative_path for info in md.storage_data.values()}


def _markers(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if inflight.marker_token(n) is not None]


def _fake_save_files(directory: Path, token: str) -> list[str]:
    """The files a save owning ``token`` has written so far (content does not matter)."""
    names = [f"__0_{token}_0.distcp", f"__1_{token}_0.distcp", f".metadata.{token}.tmp"]
    for name in names:
        (directory / name).write_bytes(b"x" * 100)
    return names


# ------------------------------------------------------------------------------------------- #
# Cleanup: only what is provably dead.


def test_cleanup_keeps_every_file_of_a_save_in_flight(tmp_path):
    _save(tmp_path, _state(1))
    replaced = _referenced(tmp_path)
    token = fast_commit.claim_token(str(tmp_path))  # a save of this (live) process, not committed
    in_flight = _fake_save_files(tmp_path, token)

    _save(tmp_path, _state(2))
    names = set(os.listdir(tmp_path))
    assert set(in_flight) <= names, f"the cleanup removed files of a save in flight: {sorted(names)}"
    assert inflight.marker_name(token) in names
    assert not (replaced & names), "the replaced checkpoint's files were kept"
    _assert_holds(tmp_path, _state(2))

    inflight.release(str(tmp_path), token)  # that save ended without committing
    _save(tmp_path, _state(3))
    assert set(os.listdir(tmp_path)) == _referenced(tmp_path) | {".metadata"}
    _assert_holds(tmp_path, _state(3))


def test_cleanup_removes_the_files_and_marker_of_a_save_whose_process_died(tmp_path):
    _save(tmp_path, _state(1))
    code = (
        "import sys; from fastdcp.save import commit; token = commit.claim_token(sys.argv[1]); "
        "open(f'{sys.argv[1]}/__0_{token}_0.distcp', 'wb').write(b'x'); print(token)"
    )
    env = dict(os.environ, PYTHONPATH=str(_REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    token = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()
    assert inflight.marker_name(token) in os.listdir(tmp_path)
    assert not inflight.is_live(str(tmp_path), token), "the marker of an exited process counts as live"

    _save(tmp_path, _state(2))
    assert set(os.listdir(tmp_path)) == _referenced(tmp_path) | {".metadata"}
    _assert_holds(tmp_path, _state(2))


def _foreign_marker(directory: Path, token: str, age_s: float, content: str | None = None) -> None:
    path = directory / inflight.marker_name(token)
    if content is None:
        content = json.dumps(
            {"host": "another-node", "boot_id": "b", "pid_namespace": "p", "pid": 1, "pid_start": "1"}
        )
    path.write_text(content)
    then = time.time() - age_s
    os.utime(path, (then, then))


@pytest.mark.parametrize("content", [None, ""], ids=["another-host", "still-being-written"])
def test_a_marker_that_cannot_be_checked_here_is_live_until_stale(tmp_path, monkeypatch, content):
    """A marker written on another node (its process cannot be looked up), or one still empty,
    protects its save's files until it has not been touched for FASTDCP_STALE_SAVE_S."""
    monkeypatch.setenv("FASTDCP_STALE_SAVE_S", "600")
    _save(tmp_path, _state(1))
    token = "0123abcd"
    _foreign_marker(tmp_path, token, age_s=5, content=content)
    files = _fake_save_files(tmp_path, token)
    _save(tmp_path, _state(2))
    assert set(files) <= set(os.listdir(tmp_path)), "a fresh marker from elsewhere did not protect its files"

    _foreign_marker(tmp_path, token, age_s=601, content=content)
    _save(tmp_path, _state(3))
    assert set(os.listdir(tmp_path)) == _referenced(tmp_path) | {".metadata"}
    _assert_holds(tmp_path, _state(3))


def test_stale_after_must_be_a_positive_number(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDCP_STALE_SAVE_S", "soon")
    with pytest.raises(ValueError, match="FASTDCP_STALE_SAVE_S"):
        inflight.stale_after_seconds()


def test_tokens_are_claimed_exclusively(tmp_path):
    assert inflight.claim(str(tmp_path), "deadbeef")
    assert not inflight.claim(str(tmp_path), "deadbeef")
    assert inflight.is_live(str(tmp_path), "deadbeef")
    inflight.release(str(tmp_path), "deadbeef")
    assert not inflight.is_live(str(tmp_path), "deadbeef")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_a_marker_appears_complete_in_one_step(tmp_path, monkeypatch, where):
    """On Linux filesystems with O_TMPFILE (ext4 here, tmpfs) the marker is written into an
    anonymous inode and then linked into place: it is never created empty and filled afterwards,
    so a process killed while claiming cannot leave an empty marker (which counts as live until
    it is stale)."""
    import tempfile

    if not hasattr(os, "O_TMPFILE"):
        pytest.skip("no O_TMPFILE on this platform")
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        directory = tempfile.mkdtemp(dir="/dev/shm")
    else:
        directory = str(tmp_path)
    opened: list[tuple[str, int]] = []
    real_open = inflight.os.open

    def spy(path, flags, *args, **kwargs):
        opened.append((str(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(inflight.os, "open", spy)
    try:
        assert inflight.claim(directory, "c0ffee00")
        marker = os.path.join(directory, inflight.marker_name("c0ffee00"))
        assert not [p for p, flags in opened if p == marker and flags & os.O_CREAT], (
            f"the marker was created by name, then written: {opened}"
        )
        assert json.loads(Path(marker).read_text())["pid"] == os.getpid()
        assert not inflight.claim(directory, "c0ffee00")  # still exclusive
    finally:
        if where == "shm":
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def test_a_successful_save_leaves_no_marker(tmp_path):
    _save(tmp_path, _state(1))
    _save(tmp_path, _state(2))
    assert _markers(tmp_path) == []
    assert set(os.listdir(tmp_path)) == _referenced(tmp_path) | {".metadata"}


# ------------------------------------------------------------------------------------------- #
# The check before the rename.


def _interfere_before_commit(monkeypatch, action) -> list[str]:
    """Run ``action(directory, token)`` just before the commit's check (as a concurrent save's
    cleanup would); returns the names the directory held then, for the assertions."""
    seen: list[str] = []
    real_touch = inflight.touch

    def touch(directory: str, token: str) -> bool:
        action(directory, token)
        seen.extend(os.listdir(directory))
        return real_touch(directory, token)

    monkeypatch.setattr(inflight, "touch", touch)
    return seen


@pytest.mark.parametrize("removed", ["data-file", "marker", "metadata-temp-file"])
def test_a_save_whose_files_were_removed_is_not_committed(tmp_path, monkeypatch, removed):
    _save(tmp_path, _state(1))
    old_files = _referenced(tmp_path)

    def remove(directory: str, token: str) -> None:
        if removed == "marker":
            name = inflight.marker_name(token)
        elif removed == "metadata-temp-file":
            name = f".metadata.{token}.tmp"
        else:
            name = next(n for n in sorted(os.listdir(directory)) if f"_{token}_" in n)
        os.unlink(os.path.join(directory, name))

    seen = _interfere_before_commit(monkeypatch, remove)
    with pytest.raises(CheckpointException) as info:
        _save(tmp_path, _state(2))
    assert seen, "the interference never ran: the test did not reach the commit"
    error = next(iter(info.value.failures.values()))
    error = error[0] if isinstance(error, tuple) else error  # (exception, traceback) in DCP
    assert isinstance(error, ConcurrentSaveError), repr(error)
    text = str(error)
    assert "concurrent" in text and f"'{tmp_path}'" in text, text
    monkeypatch.undo()
    # Nothing of the failed save is left, and the previous checkpoint is whole.
    assert set(os.listdir(tmp_path)) == old_files | {".metadata"}, sorted(os.listdir(tmp_path))
    _assert_holds(tmp_path, _state(1))


# ------------------------------------------------------------------------------------------- #
# Loads racing an overwrite.


class _OverwriteDuringPlanning(DefaultLoadPlanner):
    """Commits another save into the directory after the load read its metadata, before it
    reads any data (the window of planning, collectives included)."""

    def __init__(self, directory: Path, state: dict) -> None:
        super().__init__()
        self.directory, self.state = directory, state

    def set_up_planner(self, *args, **kwargs) -> None:
        super().set_up_planner(*args, **kwargs)
        before = _referenced(self.directory)
        _save(self.directory, self.state)
        assert not (before & set(os.listdir(self.directory))), "the overwrite kept the old files: nothing raced"


def test_a_load_reads_the_save_it_started_with_while_an_overwrite_commits(tmp_path):
    _save(tmp_path, _state(1))
    got = _load(tmp_path, FastFileSystemReader, planner=_OverwriteDuringPlanning(tmp_path, _state(2)))
    assert _equal(got, _state(1))
    _assert_holds(tmp_path, _state(2))


def test_stock_reader_fails_in_the_same_race(tmp_path):
    """What the test above protects against: stock's reader opens files when it reads them."""
    _save(tmp_path, _state(1))
    with pytest.raises(CheckpointException):
        _load(tmp_path, FileSystemReader, planner=_OverwriteDuringPlanning(tmp_path, _state(2)))


def test_a_file_gone_before_it_was_opened_means_reading_the_metadata_again(tmp_path, monkeypatch):
    """The overwrite commits between reading .metadata and opening its files: the reader reads
    the metadata again and loads the new save, whole."""
    _save(tmp_path, _state(1))
    real_load = fast_metadata_cache.load
    calls = []

    def load_then_overwrite(path, rank, allow_unsafe, **kwargs):
        metadata = real_load(path, rank, allow_unsafe, **kwargs)
        calls.append(path)
        if len(calls) == 1:
            _save(tmp_path, _state(2))
        return metadata

    monkeypatch.setattr(fast_metadata_cache, "load", load_then_overwrite)
    got = _load(tmp_path, FastFileSystemReader)
    assert len(calls) == 2, f"the metadata was read {len(calls)} times"
    assert _equal(got, _state(2))


def test_ranks_that_read_different_saves_fail_the_load_clearly(tmp_path):
    reader = FastFileSystemReader(tmp_path)
    plans = [LoadPlan([], storage_data=fast_reader._SaveIdentity(save_id)) for save_id in ("a", "b")]
    with pytest.raises(ConcurrentOverwriteError, match="different saves") as info:
        reader.prepare_global_plan(plans)
    assert str(tmp_path) in str(info.value)
    same = [LoadPlan([], storage_data=fast_reader._SaveIdentity("a")) for _ in range(2)]
    assert len(reader.prepare_global_plan(same)) == 2


def test_pinned_files_are_closed_when_the_load_ends(tmp_path):
    _save(tmp_path, _state(1))

    def open_in_checkpoint() -> int:
        fds = os.listdir("/proc/self/fd")
        targets = []
        for fd in fds:
            try:
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return sum(t.startswith(str(tmp_path)) for t in targets)

    reader = FastFileSystemReader(tmp_path)
    reader.read_metadata()
    assert open_in_checkpoint() == len(_referenced(tmp_path)), "the data files were not opened with the metadata"
    out = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in _state(0).items()}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert _equal(out, _state(1))
    assert open_in_checkpoint() == 0
