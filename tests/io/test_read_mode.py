"""The read mode chosen per load (fastdcp/io/read_mode.py): files in the page cache are read
buffered; cold loads learn per filesystem (buffered first, one O_DIRECT try, then the faster of the
timed loads, corrected by every later load); explicit ``direct_io`` and ``FASTDCP_DIRECT_IO`` win;
memory filesystems, small loads and refused O_DIRECT are buffered. The residency check
(``_C.page_cache_resident_fraction``) is tested on real files evicted with
``POSIX_FADV_DONTNEED``; real loads through FastFileSystemReader follow the choice, read through
the files they pinned, and load bit-exact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

import dcp_cases as C
from fastdcp import FastFileSystemReader, FastFileSystemWriter, _C
from fastdcp.io import read_mode as R
from fastdcp.io.engine import IoOptions

BIG = R.MIN_TIMED_BYTES
SHM = "/dev/shm"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_history():
    R.forget_read_modes()
    yield
    R.forget_read_modes()


def _options(direct_io=None):
    return IoOptions.resolve(direct_io=direct_io, default_direct_io=False, io_threads=None, task_bytes=None,
                             for_reading=True)


def _evict(path: Path, offset: int = 0, length: int = 0) -> None:
    """Write the file's dirty pages back, then drop its pages in [offset, offset+length) (0: to
    the end) from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _evict_tree(directory: Path) -> None:
    for path in sorted(directory.iterdir()):
        if path.is_file():
            _evict(path)


def _write(path: Path, nbytes: int, byte: int = 7) -> Path:
    with open(path, "wb") as f:
        f.write(bytes([byte]) * nbytes)
    return path


@pytest.fixture
def disk_dir(tmp_path):
    """A directory whose files can be evicted from the page cache (not a memory filesystem)."""
    if _C.on_memory_filesystem(str(tmp_path)):
        pytest.skip("the temporary directory is on a memory filesystem here")
    return tmp_path


@pytest.fixture
def cold_file(disk_dir):
    path = _write(disk_dir / "cold.bin", MiB)
    _evict(path)
    if _C.page_cache_resident_fraction(str(path)) != 0.0:
        pytest.skip("this filesystem keeps pages that POSIX_FADV_DONTNEED asked to drop")
    return path


# --------------------------------------------------------------------------- residency check


def test_a_just_written_file_is_in_the_page_cache(tmp_path):
    path = _write(tmp_path / "warm.bin", 4 * MiB)
    assert _C.page_cache_resident_fraction(str(path)) == pytest.approx(1.0)


def test_an_evicted_file_is_not(disk_dir):
    path = _write(disk_dir / "f.bin", 4 * MiB)
    _evict(path)
    assert _C.page_cache_resident_fraction(str(path)) == pytest.approx(0.0, abs=0.01)
    with open(path, "rb") as f:
        f.read(MiB)  # reading brings (at least) the first MiB back
    assert _C.page_cache_resident_fraction(str(path)) >= 0.25


def test_a_large_file_is_sampled_across_its_length(disk_dir):
    """Past the pages checked whole, windows spread over the file see a cached first half and an
    evicted second half as half resident; a budget of one page still answers."""
    size = 64 * MiB  # 4x the 16 MiB checked whole
    path = _write(disk_dir / "large.bin", size)
    _evict(path, size // 2, 0)
    assert _C.page_cache_resident_fraction(str(path)) == pytest.approx(0.5, abs=0.05)
    assert _C.page_cache_resident_fraction(str(path), 64) == pytest.approx(0.5, abs=0.1)
    assert _C.page_cache_resident_fraction(str(path), 1) == 1.0  # one window, at the first page
    _evict(path)
    assert _C.page_cache_resident_fraction(str(path)) == 0.0


def test_an_empty_file_counts_as_resident(tmp_path):
    path = _write(tmp_path / "empty", 0)
    assert _C.page_cache_resident_fraction(str(path)) == 1.0


def test_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        _C.page_cache_resident_fraction(str(tmp_path / "missing"))


def test_what_is_not_a_regular_file_is_unknown_and_never_opened(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer came
    assert _C.page_cache_resident_fraction(str(fifo)) == -1.0
    assert _C.page_cache_resident_fraction(str(tmp_path)) == -1.0


def test_a_file_the_kernel_would_not_tell_about_is_unknown():
    """Linux >= 5.0 reports every page of a file the caller neither owns nor may write as resident:
    the check answers unknown for it instead of 1.0."""
    if os.geteuid() != 0:
        target = "/etc/passwd"
        if not os.path.exists(target) or os.stat(target).st_uid == os.geteuid() or os.access(target, os.W_OK):
            pytest.skip("no file here that this user neither owns nor may write")
        assert _C.page_cache_resident_fraction(target) == -1.0
        return
    directory = tempfile.mkdtemp()
    try:
        os.chmod(directory, 0o755)
        path = _write(Path(directory) / "root-owned", MiB)
        os.chmod(path, 0o644)
        code = ("import os, sys; from fastdcp import _C; os.setgid(65534); os.setuid(65534); "
                "print(_C.page_cache_resident_fraction(sys.argv[1]))")
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) == -1.0
    finally:
        shutil.rmtree(directory)


# --------------------------------------------------------------------------- choice


def _load_and_record(directory, files, gibps_direct, gibps_buffered, nbytes=BIG):
    """One cold load as the reader does it, from a filesystem that reads at these speeds."""
    mode = R.read_mode_for(str(directory), _options(), [str(f) for f in files], nbytes)
    rate = gibps_direct if mode.direct else gibps_buffered
    R.record_read(str(directory), mode, nbytes, nbytes / (rate * (1 << 30)), direct_granted=True)
    return mode


def test_a_slow_direct_filesystem_ends_up_buffered(cold_file):
    modes = [_load_and_record(cold_file.parent, [cold_file], 0.3, 0.9) for _ in range(4)]
    assert [(m.direct, m.reason) for m in modes] == [
        (False, "first cold load"), (True, "trying O_DIRECT"), (False, "faster so far"), (False, "faster so far")]
    assert modes[2].direct_gibps == pytest.approx(0.3) and modes[2].buffered_gibps == pytest.approx(0.9)


def test_a_fast_direct_filesystem_ends_up_direct(cold_file):
    modes = [_load_and_record(cold_file.parent, [cold_file], 2.0, 1.0) for _ in range(4)]
    assert [m.direct for m in modes] == [False, True, True, True]
    assert modes[-1].reason == "faster so far"


def test_a_choice_from_noisy_first_loads_is_corrected(cold_file):
    _load_and_record(cold_file.parent, [cold_file], 9.9, 1.0)   # buffered 1.0
    _load_and_record(cold_file.parent, [cold_file], 1.2, 9.9)   # O_DIRECT 1.2: looks faster
    chosen = [_load_and_record(cold_file.parent, [cold_file], 0.7, 1.0) for _ in range(3)]  # really 0.7
    assert chosen[0].direct is True              # chosen on the first two loads
    assert chosen[-1].direct is False            # O_DIRECT's median fell below buffered's


def test_small_loads_spend_no_try(cold_file):
    directory = str(cold_file.parent)
    small = R.read_mode_for(directory, _options(), [str(cold_file)], BIG - 1)
    assert (small.direct, small.reason) == (False, "small load")
    R.record_read(directory, small, BIG - 1, 0.01, direct_granted=True)  # not timed: too small
    first = R.read_mode_for(directory, _options(), [str(cold_file)], BIG)
    assert first.reason == "first cold load"
    R.record_read(directory, first, BIG - 1, 0.01, direct_granted=True)  # read less than planned: not timed
    assert R.read_mode_for(directory, _options(), [str(cold_file)], BIG).reason == "first cold load"


def test_refused_direct_io_is_remembered(cold_file):
    directory = str(cold_file.parent)
    _load_and_record(directory, [cold_file], 1.0, 1.0)
    trying = R.read_mode_for(directory, _options(), [str(cold_file)], BIG)
    assert trying.reason == "trying O_DIRECT"
    R.record_read(directory, trying, BIG, 0.1, direct_granted=False)
    after = R.read_mode_for(directory, _options(), [str(cold_file)], BIG)
    assert (after.direct, after.reason) == (False, "O_DIRECT refused")
    assert R.chosen_read_modes()[directory].reason == "O_DIRECT refused"


def test_files_in_the_page_cache_are_read_buffered_whatever_was_learnt(cold_file):
    for _ in range(3):
        _load_and_record(cold_file.parent, [cold_file], 5.0, 1.0)  # O_DIRECT chosen for cold loads
    assert R.read_mode_for(str(cold_file.parent), _options(), [str(cold_file)], BIG).direct is True
    warm = _write(cold_file.parent / "warm.bin", 4 * MiB)
    mode = R.read_mode_for(str(cold_file.parent), _options(), [str(warm)], BIG)
    assert (mode.direct, mode.reason) == (False, "in page cache")
    assert mode.direct_gibps == pytest.approx(5.0)  # the history is still reported


def test_residency_is_weighted_by_bytes(cold_file):
    warm = _write(cold_file.parent / "warm.bin", 3 * MiB)  # 3 MiB cached, 1 MiB cold
    resident, unknown = R.page_cache_share([str(cold_file), str(warm)])
    assert (resident, unknown) == (pytest.approx(0.75, abs=0.01), 0.0)
    big_cold = _write(cold_file.parent / "big_cold.bin", 6 * MiB)
    _evict(big_cold)
    assert R.page_cache_share([str(big_cold), str(warm)])[0] == pytest.approx(1 / 3, abs=0.01)
    mode = R.read_mode_for(str(cold_file.parent), _options(), [str(big_cold), str(warm)], BIG)
    assert (mode.direct, mode.reason) == (False, "first cold load")  # mostly cold: learnt


def test_unknown_residency_is_read_buffered_and_not_timed(cold_file):
    gone = str(cold_file.parent / "gone.bin")
    mode = R.read_mode_for(str(cold_file.parent), _options(), [gone], BIG)
    assert (mode.direct, mode.reason) == (False, "page cache unknown")
    R.record_read(str(cold_file.parent), mode, BIG, 0.1, direct_granted=True)
    assert R.read_mode_for(str(cold_file.parent), _options(), [str(cold_file)], BIG).reason == "first cold load"


@pytest.mark.parametrize("asked", [True, False])
def test_explicit_direct_io_wins_and_is_not_learnt(cold_file, asked):
    warm = _write(cold_file.parent / "warm.bin", MiB)
    for files in ([cold_file], [warm]):
        mode = R.read_mode_for(str(cold_file.parent), _options(direct_io=asked), [str(f) for f in files], BIG)
        assert (mode.direct, mode.reason) == (asked, "asked")
        R.record_read(str(cold_file.parent), mode, BIG, 0.1, direct_granted=True)
    assert R.chosen_read_modes() == {}


@pytest.mark.parametrize("value, direct", [("1", True), ("0", False)])
def test_the_environment_variable_wins(cold_file, monkeypatch, value, direct):
    monkeypatch.setenv("FASTDCP_DIRECT_IO", value)
    mode = R.read_mode_for(str(cold_file.parent), _options(), [str(cold_file)], BIG)
    assert (mode.direct, mode.reason) == (direct, "asked")


@pytest.mark.skipif(not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)), reason="needs a writable /dev/shm")
def test_memory_filesystems_are_buffered():
    for asked, reason in ((None, "memory filesystem"), (True, "asked")):
        mode = R.read_mode_for(SHM, _options(direct_io=asked), [], BIG)
        assert (mode.direct, mode.reason) == (False, reason)
    assert R.chosen_read_modes() == {}


# --------------------------------------------------------------------------- real loads


def _state():
    return {f"w{i}": C.random_float((BIG // 4 // 4,), seed=i) for i in range(4)}  # 64 MiB of data


def _saved(directory: Path, **writer_options) -> dict:
    sd = _state()
    dcp.save(sd, storage_writer=FastFileSystemWriter(directory, direct_io=False, **writer_options), no_dist=True)
    return C.deepcopy_state_dict(sd)


def _load(directory: Path, expected: dict, planner=None, **reader_options) -> R.ReadMode:
    reader = FastFileSystemReader(directory, **reader_options)
    C.load_in_place_and_check(reader, expected, C.destination_for(expected), planner=planner)
    return reader.last_read_mode


def test_a_cold_load_is_learnt_and_a_warm_one_reads_the_page_cache(disk_dir):
    expected = _saved(disk_dir)
    _evict_tree(disk_dir)
    first = _load(disk_dir, expected)
    assert (first.direct, first.reason) == (False, "first cold load")
    (directory, next_mode), = R.chosen_read_modes().items()
    assert next_mode.reason == "trying O_DIRECT" and next_mode.buffered_gibps > 0   # it was timed
    again = _load(disk_dir, expected)  # the first load left the files in the page cache
    assert (again.direct, again.reason) == (False, "in page cache")
    assert R.chosen_read_modes()[directory].reason == "trying O_DIRECT"  # a warm load is not timed


def test_the_second_cold_load_reads_with_o_direct_through_the_pinned_files(disk_dir):
    expected = _saved(disk_dir)
    _evict_tree(disk_dir)
    _load(disk_dir, expected)
    _evict_tree(disk_dir)
    second = _load(disk_dir, expected)
    assert (second.direct, second.reason) == (True, "trying O_DIRECT")
    (next_mode,) = R.chosen_read_modes().values()
    # O_DIRECT was granted on the reopened pinned files: timed, not recorded as refused.
    assert next_mode.reason == "faster so far" and next_mode.direct_gibps > 0 and next_mode.buffered_gibps > 0
    third = _load(disk_dir, expected)  # O_DIRECT reads leave the page cache as it was: still cold
    assert third.reason == "faster so far"


def test_a_load_refused_o_direct_reads_buffered_from_then_on(disk_dir, monkeypatch):
    expected = _saved(disk_dir)
    _evict_tree(disk_dir)
    _load(disk_dir, expected)
    _evict_tree(disk_dir)
    monkeypatch.setenv("FASTDCP_TEST_DIRECT_EINVAL", "open")  # the filesystem refuses O_DIRECT
    assert _load(disk_dir, expected).reason == "trying O_DIRECT"
    (next_mode,) = R.chosen_read_modes().values()
    assert (next_mode.direct, next_mode.reason) == (False, "O_DIRECT refused")


class _ReplaceFilesAfterPinning(DefaultLoadPlanner):
    """After the reader opened (pinned) the data files with its metadata, moves each away and puts
    a cold file of the same size holding other bytes at its path, as a concurrent save reusing the
    names would."""

    def __init__(self, directory: Path, names: list[str]) -> None:
        super().__init__()
        self.directory, self.names = directory, names

    def set_up_planner(self, *args, **kwargs) -> None:
        super().set_up_planner(*args, **kwargs)
        for name in self.names:
            path = self.directory / name
            size = path.stat().st_size
            path.rename(self.directory / f"{name}.moved")
            _evict(_write(path, size, byte=0))


def test_a_pinned_file_reopened_for_o_direct_is_the_one_the_metadata_named(disk_dir):
    expected = _saved(disk_dir)
    names = sorted(p.name for p in disk_dir.glob("*.distcp"))
    R.record_read(str(disk_dir), R.ReadMode(False, "first cold load"), BIG, 0.1, True)  # next: try O_DIRECT
    _evict_tree(disk_dir)
    mode = _load(disk_dir, expected, planner=_ReplaceFilesAfterPinning(disk_dir, names))
    assert (mode.direct, mode.reason) == (True, "trying O_DIRECT")  # the cold stand-ins were checked


def test_with_checksums_verified_the_load_reads_what_the_check_left_in_the_page_cache(disk_dir):
    expected = _saved(disk_dir, checksums=True)
    _evict_tree(disk_dir)
    mode = _load(disk_dir, expected, verify_checksums=True)
    assert (mode.direct, mode.reason) == (False, "in page cache")


def test_explicit_direct_io_on_a_reader_wins(disk_dir):
    expected = _saved(disk_dir)
    _evict_tree(disk_dir)
    mode = _load(disk_dir, expected, direct_io=True)
    assert (mode.direct, mode.reason) == (True, "asked")
    mode = _load(disk_dir, expected, direct_io=False)
    assert (mode.direct, mode.reason) == (False, "asked")
    assert R.chosen_read_modes() == {}


@pytest.mark.parametrize("direct, io_threads, expected", [
    (True, None, max(8, IoOptions.resolve(direct_io=None, default_direct_io=False, io_threads=None,
                                           task_bytes=None).io_threads)),
    (False, None, IoOptions.resolve(direct_io=None, default_direct_io=False, io_threads=None, task_bytes=None).io_threads),
    (True, 2, 2),  # asked for: kept
])
def test_o_direct_reads_keep_at_least_eight_requests_in_flight_unless_told(direct, io_threads, expected, monkeypatch):
    monkeypatch.delenv("FASTDCP_IO_THREADS", raising=False)
    options = IoOptions.resolve(direct_io=None, default_direct_io=False, io_threads=io_threads, task_bytes=None,
                                for_reading=True)
    assert options.read_with(direct).io_threads == expected
    assert options.read_with(direct).task_bytes == options.task_bytes


def test_an_o_direct_load_reads_through_the_engine_with_more_threads(disk_dir, monkeypatch):
    import fastdcp.load.read_source as reader_module
    used: list[IoOptions] = []
    real_get_engine = reader_module.get_engine
    monkeypatch.setattr(reader_module, "get_engine", lambda options: used.append(options) or real_get_engine(options))
    monkeypatch.delenv("FASTDCP_IO_THREADS", raising=False)
    expected = _saved(disk_dir)
    _evict_tree(disk_dir)
    _load(disk_dir, expected, direct_io=True)
    assert used and all(o.io_threads >= 8 for o in used)
    used.clear()
    _load(disk_dir, expected, direct_io=False)
    assert used and all(o.io_threads == IoOptions.resolve(direct_io=False, default_direct_io=False, io_threads=None,
                                                          task_bytes=None).io_threads for o in used)
