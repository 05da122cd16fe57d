"""Crash consistency: real saving processes killed with SIGKILL at chosen and at random moments.

After every kill the directory is loaded with both ``FastFileSystemReader`` and stock
``FileSystemReader`` and must hold, bit-exact, either the state it held before the killed save
(the old one) or the state that save was writing (the new one) -- never a mix, never an error; a
fresh directory killed before the commit must have no ``.metadata`` at all. Then a successful
save must leave nothing behind but ``.metadata`` and the files it references.

The saving processes are forked from a zygote (``tests/_crash_worker.py``) that has torch
imported already, so each kill costs a save, not an interpreter start. Kills land in a given
phase through the writer's test hook (``FASTDCP_TEST_PAUSE_AT``: the process notes the phase in
a file and sleeps there), or after a random delay from a seeded RNG, with the phase the process
had reached recorded by the same hook (sleeping 0 s).
"""

from __future__ import annotations

import collections
import os
import random
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from _crash_worker import Zygote, classify, make_state
from fastdcp import FastFileSystemWriter

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

SEED = 6006
PHASES = ("plan", "open", "write", "sync", "commit", "cleanup", "cleanup_mid")
COMMITTED = ("cleanup", "cleanup_mid")  # phases after the atomic rename of .metadata
READERS = ("fast", "stock")


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    z.prepare(SEED)
    yield z
    z.close()


def _notes(path: Path) -> list[tuple[str, int | None]]:
    """The child's notes: ('start', k) / ('done', k) around each save, (phase, None) per phase."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        word, _, rest = line.partition(" ")
        out.append((word, int(rest) if word in ("start", "staged", "done") else None))
    return out


# The automatic layout (thread_count unset: one file per engine thread, fastdcp.save.file_split)
# with its smallest-file rule shrunk so that these few-MiB states spread over several files.
SMALL_AUTO_FILE_BYTES = 1 << 19
_SHRINK_AUTO_FILES = f"import fastdcp.save.file_split as split; split.AUTO_MIN_FILE_BYTES = {SMALL_AUTO_FILE_BYTES}"


def _save_in_process(directory: Path, state: dict, kind: str = "fast", thread_count: int | None = 2, **kwargs) -> None:
    if kind == "fast":
        writer = FastFileSystemWriter(directory, thread_count=thread_count)
    else:
        writer = FileSystemWriter(directory, thread_count=thread_count or 1)
    dcp.save(state, storage_writer=writer, no_dist=True, **kwargs)


def _assert_holds(directory: Path, candidates: dict, expected: int | None, context: str) -> None:
    """Both readers see exactly state ``expected`` (None: no metadata at all)."""
    want = "none" if expected is None else f"state {expected}"
    for reader in READERS:
        got = classify(str(directory), candidates, reader)
        assert got == want, f"{context}: {reader} reader found {got!r}, expected {want!r}; files: {sorted(os.listdir(directory))}"


def _metadata_names(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n == ".metadata" or (n.startswith("__") and n.endswith(".metadata"))]


def _assert_only_referenced_files(directory: Path) -> None:
    """Nothing in the directory but metadata and the data files it references."""
    from torch.distributed.checkpoint import FileSystemReader

    referenced = set()
    metadata_files = _metadata_names(directory)
    for name in metadata_files:
        rank = None if name == ".metadata" else int(name[2:].split(".")[0])
        md = FileSystemReader(directory).read_metadata(**({} if rank is None else {"rank": rank}))
        referenced |= {info.relative_path for info in md.storage_data.values()}
    present = set(os.listdir(directory))
    assert present == referenced | set(metadata_files), (
        f"leftovers after a successful save: {sorted(present - referenced - set(metadata_files))}"
    )


def _wait_for_phase(zygote: Zygote, pid: int, notes: Path, phase: str, error_file: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(word == phase for word, _ in _notes(notes)):
            return
        if error_file.exists() and error_file.stat().st_size:
            zygote.kill(pid)
            pytest.fail(f"the saving process failed before reaching {phase!r}:\n{error_file.read_text()}")
        time.sleep(0.005)
    zygote.kill(pid)
    pytest.fail(f"the saving process never reached phase {phase!r} (notes: {_notes(notes)})")


_CASES = (
    [("fresh", p) for p in PHASES if p != "cleanup_mid"]  # a fresh save has nothing to clean up
    + [("overwrite", p) for p in PHASES]
    + [("overwrite-stock", p) for p in ("write", "commit", "cleanup_mid")]
    + [("overwrite-rank-local", p) for p in ("write", "commit", "cleanup_mid")]
    + [("fresh-auto-files", p) for p in ("write", "sync", "commit")]
    + [("overwrite-auto-files", p) for p in ("open", "write", "sync", "commit", "cleanup_mid")]
)


@pytest.mark.parametrize("mode,phase", _CASES, ids=[f"{m}-{p}" for m, p in _CASES])
def test_sigkill_in_each_phase(zygote, tmp_path, monkeypatch, mode, phase):
    """One SIGKILL exactly in ``phase`` of a fresh save or of a save over an existing checkpoint
    (written by fastdcp, by stock DCP, rank-local with ``use_collectives=False``, or by fastdcp
    with its automatic one-file-per-thread layout, then killed saving that layout again)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    rank_local = mode == "overwrite-rank-local"
    auto_files = mode.endswith("auto-files")
    save_kwargs = {"use_collectives": False} if rank_local else {}
    thread_count = None if auto_files else 2
    if auto_files:
        monkeypatch.setattr("fastdcp.save.file_split.AUTO_MIN_FILE_BYTES", SMALL_AUTO_FILE_BYTES)
    old = None
    if not mode.startswith("fresh"):
        old = 0
        _save_in_process(
            directory, make_state(SEED, 0), kind="stock" if mode == "overwrite-stock" else "fast",
            thread_count=thread_count, **save_kwargs,
        )
    notes, error_file = tmp_path / "notes", tmp_path / "error"
    pid = zygote.fork(
        {
            "thread_count": thread_count,
            "exec": _SHRINK_AUTO_FILES if auto_files else None,
            "dir": str(directory),
            "seed": SEED,
            "first": 1,
            "count": 1,
            "notes": str(notes),
            "error_file": str(error_file),
            "use_collectives": not rank_local,
            "env": {
                "FASTDCP_TEST_PAUSE_AT": phase,
                "FASTDCP_TEST_PAUSE_S": "120",
                "FASTDCP_TEST_PAUSE_NOTIFY": str(notes),
            },
        }
    )
    _wait_for_phase(zygote, pid, notes, phase, error_file)
    status = zygote.kill(pid)
    assert status["signal"] == 9, status

    candidates = {0: make_state(SEED, 0), 1: make_state(SEED, 1)}
    expected = 1 if phase in COMMITTED else old
    _assert_holds(directory, candidates, expected, f"killed in {phase!r} ({mode})")
    if mode.startswith("fresh") and phase not in COMMITTED:
        assert _metadata_names(directory) == [], "a fresh save killed before its commit left a .metadata"

    # The next successful save cleans up whatever the killed one left.
    _save_in_process(directory, make_state(SEED, 2), thread_count=thread_count, **save_kwargs)
    _assert_holds(directory, {2: make_state(SEED, 2)}, 2, "save after the kill")
    _assert_only_referenced_files(directory)
    if auto_files:
        data_files = [n for n in os.listdir(directory) if n.endswith(".distcp")]
        assert len(data_files) > 2, f"the automatic layout wrote {data_files}: the case did not test several files"


N_RANDOM_KILLS = 16


def test_sigkill_at_random_moments(zygote, tmp_path):
    """SIGKILLs after seeded random delays into a process that saves new states back to back:
    even rounds overwrite one long-lived directory (leftovers of crashed saves accumulate there),
    odd rounds start in an empty directory. The phase each kill landed in is read from the writer's
    notes and decides which state must be on disk: before the rename of .metadata the old one
    (nothing for a fresh directory), after it the new one, at the rename itself either."""
    rng = random.Random(SEED)
    shared = tmp_path / "shared"
    shared.mkdir()
    _save_in_process(shared, make_state(SEED, 0))
    shared_state = 0  # the state the shared directory holds
    next_k = 1
    landed: collections.Counter[str] = collections.Counter()
    for round_index in range(N_RANDOM_KILLS):
        fresh = round_index % 2 == 1
        directory = tmp_path / f"fresh{round_index}" if fresh else shared
        directory.mkdir(exist_ok=True)
        notes, error_file = tmp_path / f"notes{round_index}", tmp_path / f"error{round_index}"
        first = next_k
        pid = zygote.fork(
            {
                "dir": str(directory),
                "seed": SEED,
                "first": first,
                "count": 0,  # forever, until killed
                "notes": str(notes),
                "error_file": str(error_file),
                "env": {
                    "FASTDCP_TEST_PAUSE_AT": ",".join(PHASES),
                    "FASTDCP_TEST_PAUSE_S": "0",
                    "FASTDCP_TEST_PAUSE_NOTIFY": str(notes),
                },
            }
        )
        # One save takes ~0.1-0.2 s here: spread the kills over the first few saves.
        time.sleep(rng.uniform(0.0, 0.2) if fresh else rng.uniform(0.0, 0.5))
        status = zygote.kill(pid)
        if error_file.exists() and error_file.stat().st_size:
            pytest.fail(f"round {round_index}: the saving process failed:\n{error_file.read_text()}")
        assert status["signal"] == 9, status

        events = _notes(notes)
        done = [k for word, k in events if word == "done"]
        started = [k for word, k in events if word == "start"]
        before = done[-1] if done else (None if fresh else shared_state)
        phase = events[-1][0] if events else "before start"
        in_flight = started[-1] if started and (not done or started[-1] != done[-1]) else None
        landed[phase if in_flight is not None else "between saves"] += 1
        if in_flight is None or phase in ("start", "plan", "open", "write", "sync"):
            allowed = {before}
        elif phase == "commit":
            allowed = {before, in_flight}  # killed at the rename itself: either is right
        else:
            allowed = {in_flight}  # after the rename
        ks = {k for k in (*allowed, before) if k is not None}
        candidates = {k: make_state(SEED, k) for k in ks}
        results = {reader: classify(str(directory), candidates, reader) for reader in READERS}
        wanted = {"none" if k is None else f"state {k}" for k in allowed}
        assert results["fast"] in wanted and results["stock"] == results["fast"], (
            f"round {round_index} ({'fresh' if fresh else 'overwrite'}), killed after {phase!r} "
            f"with state {in_flight} in flight: readers found {results}, allowed {wanted}; "
            f"files: {sorted(os.listdir(directory))}"
        )
        if fresh and results["fast"] == "none":
            assert _metadata_names(directory) == []
        if not fresh:
            shared_state = int(results["fast"].split()[1])
        next_k = max([first, *started]) + 1

    print(f"random kills landed in: {dict(landed)}")
    assert sum(landed.values()) == N_RANDOM_KILLS
    # A successful save cleans every leftover of the crashed ones.
    for directory in [shared] + sorted(tmp_path.glob("fresh*")):
        _save_in_process(directory, make_state(SEED, 10_000))
        _assert_only_referenced_files(directory)
    _assert_holds(shared, {10_000: make_state(SEED, 10_000)}, 10_000, "final save")
