"""Faults during a save, on real filesystems: a full tmpfs (ENOSPC), a device that fails writeback
(ext4 on a loop device whose backing store is full), a read-only mount (EROFS), a directory the
saving user may not write (EACCES), a directory removed between planning and writing, and a
failure while committing the metadata.

Each must raise an error that says what failed, on which file (and at which offset for data
writes) and why (strerror); write no ``.metadata``; leave an existing checkpoint in the directory
loadable bit-exact; release every file descriptor and thread; remove the failed save's partial
files; and let the next save in the same process succeed.

Mounting needs root (CI runs as root): without it those tests skip and say so.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import fastdcp.save.commit as fast_commit
from _crash_worker import make_state, states_equal, template_like
from fastdcp import FastFileSystemReader, FastFileSystemWriter

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

MiB = 1 << 20


def _state(mib: float, seed: int) -> dict:
    """About ``mib`` MiB in three tensors and a non-tensor entry."""
    g = torch.Generator().manual_seed(seed)
    n = int(mib * MiB) // 4 // 64 * 64
    return {
        "a": torch.randn(n // 2, generator=g),
        "b": torch.randn(n // 4, generator=g).reshape(-1, 16),
        "c": torch.randn(n // 4, generator=g).to(torch.bfloat16),
        "meta": {"seed": seed},
    }


def _save(directory, state, **writer_kwargs) -> None:
    dcp.save(state, storage_writer=FastFileSystemWriter(directory, **writer_kwargs), no_dist=True)


def _failing_save(directory, state, **writer_kwargs) -> str:
    with pytest.raises(CheckpointException) as info:
        _save(directory, state, **writer_kwargs)
    return str(info.value)


def _assert_loads(directory, state) -> None:
    """Bit-exact with both the fast and the stock reader."""
    for reader in (FastFileSystemReader(directory), FileSystemReader(directory)):
        dest = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": None}) for k, v in state.items()}
        dcp.load(dest, storage_reader=reader, no_dist=True)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(dest[key].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)), key
            else:
                assert dest[key] == value, key


def _data_files(directory) -> set[str]:
    return {n for n in os.listdir(directory) if n.endswith(".distcp")}


def _referenced(directory) -> set[str]:
    md = FileSystemReader(directory).read_metadata()
    return {info.relative_path for info in md.storage_data.values()}


@dataclass(frozen=True)
class _Resources:
    """What a save could leak: open file descriptors (number -> target) and fastdcp's own threads.

    Other threads of the process (torch's pools, pytest's, the interpreter's) come and go on their
    own schedule, so their count is not compared: only the engine's native workers (named
    ``fastdcp-io-<i>``) and Python threads that did not exist before."""

    fds: dict[int, str]
    engine_threads: int
    python_threads: frozenset[int]


def _resources() -> _Resources:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor listdir itself used, closed by now
            pass
    engine_threads = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                engine_threads += comm.read().startswith("fastdcp-io")
        except OSError:  # the thread ended meanwhile
            pass
    python_threads = frozenset(t.ident for t in threading.enumerate() if t.is_alive())
    return _Resources(fds, engine_threads, python_threads)


def _assert_nothing_leaked(before: _Resources) -> None:
    """No descriptor opened since ``before`` is still open, no engine thread was added and no
    Python thread started since ``before`` is still running."""
    after = _resources()
    opened = {fd: target for fd, target in after.fds.items() if before.fds.get(fd) != target}
    assert not opened, f"file descriptors left open: {opened}"
    assert after.engine_threads <= before.engine_threads, (
        f"fastdcp engine threads: {before.engine_threads} before, {after.engine_threads} after"
    )
    started = [t.name for t in threading.enumerate() if t.is_alive() and t.ident not in before.python_threads]
    assert not started, f"Python threads left running: {started}"


@pytest.fixture
def resources(tmp_path):
    """Resources after warm-up saves and loads (the writer's and the reader's engines start their
    threads once per process and configuration; writes to a memory filesystem use their own
    thread count, so one warm-up goes to /dev/shm) and a parallel torch operation (torch's
    intra-op pool too)."""
    warmup = _state(0.1, 0)
    _save(tmp_path / "warmup", warmup)
    _assert_loads(tmp_path / "warmup", warmup)
    if os.path.isdir("/dev/shm"):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            _save(Path(shm) / "warmup", warmup)
            _assert_loads(Path(shm) / "warmup", warmup)
    torch.randn(1 << 22).to(torch.bfloat16).float().sum()
    before = _resources()
    assert before.engine_threads > 0, "the warm-up save started no named fastdcp-io thread"
    return before


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a filesystem / change user (CI runs as root)")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path, request):
    """A 4 MiB tmpfs mounted at ``tmp_path/mnt`` for this test."""
    _require_root()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        _run("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt))
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here: {getattr(error, 'stderr', error)}")
    request.addfinalizer(lambda: _umount(mnt))
    return mnt


def test_enospc_fresh_then_overwrite_on_a_full_tmpfs(small_tmpfs, resources):
    directory = small_tmpfs / "ckpt"
    big = _state(16, 1)

    # Fresh directory: 16 MiB cannot fit in 4 MiB.
    text = _failing_save(directory, big)
    assert "No space left on device" in text and "offset" in text, text
    assert str(directory / "__0_") in text, f"the error does not name the data file:\n{text}"
    assert os.listdir(directory) == [], "a failed save left files (partial data or .metadata) behind"
    _assert_nothing_leaked(resources)

    # The next save in the same process works.
    old = _state(1, 2)
    _save(directory, old)
    _assert_loads(directory, old)

    # Overwriting it with a state that does not fit: the old checkpoint survives untouched.
    text = _failing_save(directory, big)
    assert "No space left on device" in text, text
    assert _data_files(directory) == _referenced(directory), "partial files of the failed save remain"
    _assert_loads(directory, old)
    _assert_nothing_leaked(resources)

    new = _state(1, 3)
    _save(directory, new)
    _assert_loads(directory, new)
    assert _data_files(directory) == _referenced(directory)


def test_read_only_filesystem(small_tmpfs, resources):
    directory = small_tmpfs / "ckpt"
    old = _state(0.5, 4)
    _save(directory, old)
    _run("mount", "-o", "remount,ro", str(small_tmpfs))
    try:
        text = _failing_save(directory, _state(0.5, 5))
        # The first file a save creates is its in-flight marker (fastdcp.save.inflight).
        assert "Read-only file system" in text and f"cannot save into '{directory}'" in text, text
        _assert_loads(directory, old)
        _assert_nothing_leaked(resources)
    finally:
        _run("mount", "-o", "remount,rw", str(small_tmpfs))
    new = _state(0.5, 6)
    _save(directory, new)
    _assert_loads(directory, new)
    assert _data_files(directory) == _referenced(directory)


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered-fails-at-fsync", "direct-fails-at-pwrite"])
def test_device_write_failure(tmp_path, request, resources, direct_io):
    """ext4 on a loop device whose backing file lives on a 6 MiB tmpfs: ext4 believes it has room,
    the device cannot store it. Buffered writes fail at fsync (writeback error), O_DIRECT writes
    at the pwrite itself. (The kernel reports the loop device's failure as ENOSPC or EIO.)"""
    _require_root()
    for tool in ("losetup", "mkfs.ext4"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")
    back, mnt = tmp_path / "back", tmp_path / "mnt"
    back.mkdir()
    mnt.mkdir()
    try:
        _run("mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(back))
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here: {getattr(error, 'stderr', error)}")
    request.addfinalizer(lambda: _umount(back))
    image = back / "disk.img"
    with open(image, "wb") as f:
        f.truncate(64 * MiB)  # sparse: the tmpfs fills up as the device is written
    try:
        loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"no loop device available: {getattr(error, 'stderr', error)}")
    request.addfinalizer(lambda: subprocess.run(["losetup", "-d", loop], capture_output=True))
    _run("mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", loop)
    _run("mount", loop, str(mnt))
    request.addfinalizer(lambda: _umount(mnt))  # runs before the loop detach and the tmpfs umount

    directory = mnt / "ckpt"
    text = _failing_save(directory, _state(16, 7), direct_io=direct_io)
    assert "No space left on device" in text or "Input/output error" in text, text
    assert str(directory / "__0_") in text, text
    assert ("fsync failed" in text) if not direct_io else ("pwrite failed" in text and "offset" in text), text
    assert not (directory / ".metadata").exists()
    _assert_nothing_leaked(resources)


@pytest.fixture
def world_traversable_dir():
    """A directory every user can traverse (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="fastdcp-eacces-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run_as_nobody(fn) -> str:
    """Run ``fn`` in a forked child of this process after setuid(nobody); return what it raised
    ("" if nothing). The child is single-threaded torch-wise (set_num_threads(1), as DataLoader
    workers do) and builds its own I/O engine (engines are per pid)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            os.close(read_end)
            torch.set_num_threads(1)
            os.setgid(65534)
            os.setuid(65534)
            try:
                fn()
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                os.write(write_end, f"{type(error).__name__}: {error}".encode())
        except BaseException:  # noqa: BLE001
            code = 2
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 1 << 16):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child failed to run: status {status}"
    return b"".join(chunks).decode()


def test_permission_denied(world_traversable_dir):
    """A process running as ``nobody`` saves over a checkpoint in a directory it may not write."""
    _require_root()
    directory = world_traversable_dir / "ckpt"
    old = _state(0.5, 8)
    _save(directory, old)
    directory.chmod(0o555)
    text = _run_as_nobody(lambda: _save(directory, _state(0.5, 9)))
    assert text.startswith("CheckpointException") and "Permission denied" in text, text
    assert f"cannot save into '{directory}'" in text and "in-flight marker" in text, text
    directory.chmod(0o755)
    _assert_loads(directory, old)
    assert _data_files(directory) == _referenced(directory)


class _RemovingPlanner(DefaultSavePlanner):
    """Removes the checkpoint directory after planning, before any data file is written."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def finish_plan(self, central_plan):
        shutil.rmtree(self.directory)
        return super().finish_plan(central_plan)


def test_directory_removed_between_planning_and_writing(tmp_path, resources):
    directory = tmp_path / "ckpt"
    _save(directory, _state(0.5, 10))
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(0.5, 11), storage_writer=FastFileSystemWriter(directory), planner=_RemovingPlanner(directory), no_dist=True)
    text = str(info.value)
    assert f"checkpoint directory '{directory}' disappeared" in text and "No such file or directory" in text, text
    _assert_nothing_leaked(resources)
    state = _state(0.5, 12)
    _save(directory, state)
    _assert_loads(directory, state)


def test_failure_while_committing_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """Writing ``.metadata``'s temp file fails: no temp file, none of the new data files remain,
    the old checkpoint is intact."""
    directory = tmp_path / "ckpt"
    old = _state(0.5, 13)
    _save(directory, old, thread_count=2)
    before = set(os.listdir(directory))

    class _FullDisk:
        @staticmethod
        def dump(obj, f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)

    monkeypatch.setattr(fast_commit, "pickle", _FullDisk)
    text = _failing_save(directory, _state(0.5, 14), thread_count=2)
    assert "No space left on device" in text and ".metadata." in text, text
    assert set(os.listdir(directory)) == before
    _assert_loads(directory, old)


def test_overwriting_a_stock_checkpoint_in_place(tmp_path):
    """A stock-written checkpoint (and a stale stock temp file) is replaced; files that are neither
    stock's nor fastdcp's are never touched."""
    directory = tmp_path / "ckpt"
    dcp.save(_state(1, 15), storage_writer=FileSystemWriter(directory, thread_count=2), no_dist=True)
    assert _data_files(directory) == {"__0_0.distcp", "__0_1.distcp"}
    strangers = ["notes.txt", "__0_0.distcp.bak", "model.distcp", "__x_0.distcp", ".metadata.old"]
    for name in strangers + [".metadata.tmp"]:
        (directory / name).write_text("not ours")
    new = _state(1, 16)
    _save(directory, new, thread_count=2)
    _assert_loads(directory, new)
    expected = {".metadata"} | _referenced(directory) | set(strangers)
    assert set(os.listdir(directory)) == expected
    assert all(name.startswith("__0_") and len(name.split("_")) == 5 for name in _referenced(directory))


def test_rank_local_checkpoint_in_the_same_directory_is_kept(tmp_path):
    """A global save never deletes files that a rank-local ``__{rank}.metadata`` references."""
    directory = tmp_path / "ckpt"
    _save(directory, _state(0.3, 17))
    first_global = _data_files(directory)
    local = _state(0.3, 18)
    dcp.save(local, storage_writer=FastFileSystemWriter(directory), no_dist=True, use_collectives=False)
    local_files = _data_files(directory) - first_global
    _save(directory, _state(0.3, 19))
    # The first global checkpoint's files are gone (so the rank-local metadata was read), the
    # rank-local checkpoint's are all there.
    assert _data_files(directory) == local_files | _referenced(directory)
    md = FileSystemReader(directory).read_metadata(rank=0)
    assert {info.relative_path for info in md.storage_data.values()} == local_files


def test_async_save_commits_atomically(tmp_path):
    """``dcp.async_save`` goes through the same commit (the writer's ``finish``)."""
    directory = tmp_path / "ckpt"
    _save(directory, _state(0.3, 20))
    new = _state(0.3, 21)
    future = dcp.async_save(new, storage_writer=FastFileSystemWriter(directory), no_dist=True)
    future.result()
    _assert_loads(directory, new)
    assert _data_files(directory) == _referenced(directory)


def test_crash_worker_states_are_distinct():
    """The crash test's premise: neighbouring states differ in every tensor."""
    a, b = make_state(1, 5), make_state(1, 6)
    assert not any(states_equal({k: a[k]}, {k: b[k]}) for k in a)
    assert states_equal(make_state(1, 5), a) and set(template_like(a)) == set(a)


def test_hostile_rank_local_metadata_is_never_executed_and_blocks_cleanup(tmp_path):
    """The cleanup reads other metadata files with a restricted unpickler: a pickle that would run
    code is refused, and then no data file is deleted at all (conservative)."""
    directory = tmp_path / "ckpt"
    _save(directory, _state(0.2, 22))
    old_files = _data_files(directory)
    marker = tmp_path / "pwned"

    class _Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (directory / "__0.metadata").write_bytes(pickle.dumps(_Evil()))
    new = _state(0.2, 23)
    with pytest.warns(UserWarning, match="could not be read safely"):
        _save(directory, new)
    assert not marker.exists(), "the writer executed code from a pickle in the checkpoint directory"
    assert old_files <= _data_files(directory), "data files were deleted although a metadata file could not be read"
    _assert_loads(directory, new)
