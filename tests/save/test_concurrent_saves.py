"""Two jobs, one checkpoint directory: real processes saving into the same directory at the same
time while another process loads it (fastdcp/bench/concurrency.py runs the rounds).

What fastdcp promises there, and what every test here checks:

* a load never returns a mix of states and never fails: it returns one whole committed state;
* every save either succeeds or fails with ``fastdcp.ConcurrentSaveError`` (its text says
  "concurrent save" and names the directory) when another save made it impossible to commit
  safely; no save fails in any other way;
* afterwards the directory loads, with ``FastFileSystemReader`` and with stock
  ``FileSystemReader``, as exactly one state a writer saved successfully;
* leftovers of a save whose process was killed are removed by the next successful save.

The cases: 2 writers; 3 writers and a loader; a 2-rank (gloo) writer next to a one-process
writer; a previous job's process-mode ``dcp.async_save`` still in flight when a new job saves;
one writer SIGKILLed mid-loop. Each round also checks that it really was concurrent (saves of
different writers overlapped, loads ran while saves did), so a test cannot pass on a round
where nothing raced. Processes are forked from one zygote (torch imported once).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import _concurrency_worker as worker
from fastdcp.bench.concurrency import (MIX, OK, SEED_STATE, SharedDirectoryResult, Zygote, _read_jsonl,
                                    _tail, classify_loaded, final_load, make_state, referenced_files,
                                    run_shared_directory, tensor_elements, tensor_key)
from fastdcp import FastFileSystemWriter

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

ROUNDS = 3
TENSORS = 16
TENSOR_BYTES = 2 << 20
SAVES_PER_WRITER = 8
READERS = ("stock", "fastdcp")
TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def zygote():
    with Zygote(extra_paths=[TESTS_DIR]) as z:
        yield z


# "concurrent save" as words: "a concurrent save", "another (concurrent) save", and the type name
# ConcurrentSaveError (the recorded text starts with it) all say it.
_CONCURRENT_SAVE = re.compile(r"concurrent\W*save", re.IGNORECASE)


def _concurrent_save_failure(text: str | None, directory: str) -> bool:
    """A failure fastdcp allows: it says "concurrent save" (outside the paths it names, which
    could contain those words) and names the directory."""
    return (text is not None and directory in text
            and _CONCURRENT_SAVE.search(text.replace(directory, "<dir>")) is not None)


def _assert_round(result: SharedDirectoryResult) -> None:
    """The promises, for one fastdcp round."""
    print(result.describe())
    assert result.loads_mix == 0, [x for x in result.loads if x.outcome == MIX][:3]
    assert result.loads_failed == 0, result.load_errors().most_common(3)
    assert result.loads_of_failed_saves == 0, "a load returned the state of a save that failed"
    wrong = [s for s in result.failed_saves if not _concurrent_save_failure(s.error_text, result.directory)]
    assert not wrong, (f"{len(wrong)} saves failed otherwise than with a concurrent-save error: "
                       + "; ".join(f"writer {s.writer} save {s.k}: {s.error_type}: {s.error_line}" for s in wrong[:3])
                       + f"\nthe first one's text: {(wrong[0].error_text or '')[:1500]}")
    assert result.saves_ok >= 1, "no save succeeded"
    assert result.final_one_committed_state, (
        f"the directory did not end as one committed state: {result.final_description()}; "
        f"committed: {sorted(result.committed_states)}; files: {sorted(os.listdir(result.directory))}")


def _assert_concurrent(result: SharedDirectoryResult) -> None:
    """The round raced: saves of different writers overlapped, and with a loader, loads ran
    while saves did."""
    assert result.saves_overlapping_another_writer >= 2, "no two writers' saves overlapped"
    if result.loader:
        assert result.loads_during_saves >= 2, f"only {result.loads_during_saves} loads ran while saves did"


@pytest.mark.fastdcp_timeout(180)
@pytest.mark.parametrize("writers,loader", [(2, False), (3, True)], ids=["2-writers", "3-writers-and-a-loader"])
def test_writers_share_one_directory(zygote, tmp_path, writers, loader):
    """``writers`` processes each save 8 states into one directory, started together (with a
    loader loading it meanwhile), ROUNDS rounds."""
    for r in range(ROUNDS):
        result = run_shared_directory("fastdcp", str(tmp_path / f"round{r}"), writers=writers, loader=loader,
                                      saves_per_writer=SAVES_PER_WRITER, tensors=TENSORS,
                                      tensor_bytes=TENSOR_BYTES, zygote=zygote)
        _assert_round(result)
        _assert_concurrent(result)


@pytest.mark.fastdcp_timeout(180)
def test_multi_rank_writer_next_to_a_single_process_writer(zygote, tmp_path):
    """A 2-rank job (gloo; each rank saves its half of the tensors, rank 0 commits) and a
    one-process job (``no_dist``) saving into the same directory, a loader loading it."""
    for r in range(2):
        result = run_shared_directory("fastdcp", str(tmp_path / f"round{r}"), writers=2, ranks_per_writer=[2, 1],
                                      loader=True, saves_per_writer=6, tensors=TENSORS, tensor_bytes=TENSOR_BYTES,
                                      zygote=zygote)
        _assert_round(result)
        _assert_concurrent(result)


PREVIOUS_STATE, NEW_STATE = 1000, 2000


@pytest.mark.fastdcp_timeout(240)
@pytest.mark.parametrize("start_when", ["paused", "writing"])
def test_previous_jobs_async_save_overlaps_a_new_jobs_save(zygote, tmp_path, start_when):
    """A previous job's process-mode ``dcp.async_save`` is still in flight (``paused``: its data
    files written and fsynced, stopped before its commit; ``writing``: writing its data files)
    when a new job's blocking ``dcp.save`` into the same directory starts. Each must succeed or
    fail with a concurrent-save error, and the directory must end as the state of one that
    succeeded, with both readers."""
    directory, control = tmp_path / "ckpt", tmp_path / "control"
    control.mkdir()
    # The directory holds the jobs' earlier checkpoint (a restart resumes from one).
    dcp.save(make_state(SEED_STATE, TENSORS, TENSOR_BYTES), storage_writer=FastFileSystemWriter(directory),
             no_dist=True)
    records = str(control / "records.jsonl")
    common = {"directory": str(directory), "control": str(control), "records": records, "tensors": TENSORS,
              "tensor_bytes": TENSOR_BYTES}
    logs = {"previous": str(control / "previous.log"), "new": str(control / "new.log")}
    previous = zygote.fork(worker.previous_job_async_save, logs["previous"], state=PREVIOUS_STATE,
                           pause_before_commit_s=2.0 if start_when == "paused" else None, **common)
    new = zygote.fork(worker.new_job_blocking_save, logs["new"], state=NEW_STATE, start_when=start_when,
                      names_before=sorted(os.listdir(directory)), **common)
    for pid, name in ((new, "new"), (previous, "previous")):
        status = zygote.wait(pid, 200.0)
        if not status.done:
            zygote.kill(pid)
        assert status.done and status.code == 0, f"{name} job: {status.describe()}\n{_tail(logs[name])}"

    events = {(r["job"], r["event"]): r for r in _read_jsonl(records)}
    print({k: {f: v for f, v in r.items() if f != "error"} | ({"error": r["error"]["line"]} if r.get("error") else {})
           for k, r in events.items()})
    assert events[("new", "start")]["triggered"], f"the previous job's save was never seen in flight ({start_when})"
    # the new job's save started while the previous one's was in flight: they overlapped
    assert events[("new", "start")]["t"] < events[("previous", "end")]["t"]
    succeeded = set()
    for job, state in (("previous", PREVIOUS_STATE), ("new", NEW_STATE)):
        end = events[(job, "end")]
        if end["ok"]:
            succeeded.add(state)
        else:
            assert _concurrent_save_failure(end["error"]["text"], str(directory)), (
                f"the {job} job's save failed otherwise than with a concurrent-save error: "
                f"{end['error']['type']}: {end['error']['text'][-2000:]}")
    assert succeeded, "neither save succeeded"
    valid = {SEED_STATE, PREVIOUS_STATE, NEW_STATE}
    finals = [final_load(str(directory), reader, TENSORS, TENSOR_BYTES, valid) for reader in READERS]
    assert all(f.outcome == OK for f in finals) and len({f.state for f in finals}) == 1, (finals, os.listdir(directory))
    assert finals[0].state in succeeded, f"the directory holds state {finals[0].state}; saves that succeeded: {succeeded}"


# Where the kill lands: "before-commit" makes the killed writer stop in every save with its data
# files, metadata temp file and in-flight marker on disk, just before the rename of .metadata
# (the writer's test hook), and kills it in its third save there; "any-moment" kills it 50 ms
# into its third save, wherever that is.
KILL_CASES = {
    "before-commit": ({"FASTDCP_TEST_PAUSE_AT": "commit", "FASTDCP_TEST_PAUSE_S": "0.5"}, 0.3),
    "any-moment": (None, 0.05),
}


@pytest.mark.fastdcp_timeout(180)
@pytest.mark.parametrize("where", list(KILL_CASES))
def test_sigkill_of_a_writer_mid_loop(zygote, tmp_path, where):
    """One of two writers is SIGKILLed during its third save while the other and a loader go
    on; the round must keep every promise, and the next successful save must leave nothing of
    the killed writer behind."""
    directory = tmp_path / "ckpt"
    env, delay = KILL_CASES[where]
    result = run_shared_directory("fastdcp", str(directory), writers=2, loader=True, saves_per_writer=SAVES_PER_WRITER,
                                  tensors=TENSORS, tensor_bytes=TENSOR_BYTES, kill_writer_after_saves=2,
                                  kill_writer_after_s=delay, writer_env={2: env} if env else None, zygote=zygote)
    assert result.killed_writer == 2 and result.kill_landed_mid_loop, result.describe()
    assert result.writer_exits[2] == "killed by signal 9", result.writer_exits
    _assert_round(result)
    _assert_concurrent(result)

    # One more successful save (nothing else runs now): only it and its files stay.
    last = 9000
    dcp.save(make_state(last, TENSORS, TENSOR_BYTES), storage_writer=FastFileSystemWriter(directory), no_dist=True)
    present = set(os.listdir(directory))
    referenced = referenced_files(str(directory))
    assert referenced, "the final .metadata could not be read"
    of_the_kill = sorted((set(result.files_at_kill) & present) - referenced - {".metadata"})
    assert not of_the_kill, f"files present at the kill are still there after the next successful save: {of_the_kill}"
    assert present == referenced | {".metadata"}, f"leftovers: {sorted(present - referenced - {'.metadata'})}"
    for reader in READERS:
        final = final_load(str(directory), reader, TENSORS, TENSOR_BYTES, {last})
        assert (final.outcome, final.state) == (OK, last), final


def test_a_mix_or_torn_tensor_is_never_taken_for_a_state():
    """The runner's classification, which every assertion above relies on: one state is ``ok``;
    a tensor of another state, a tensor torn between two states, a tensor left unwritten, or a
    wrong ``state_id`` entry is a ``mix``; a state no writer saved is not ``ok`` either."""
    tensors, nbytes = 4, 4096
    base = torch.arange(tensor_elements(nbytes), dtype=torch.int64)
    a, b = make_state(1001, tensors, nbytes), make_state(2001, tensors, nbytes)
    valid = {1001, 2001}
    assert classify_loaded(dict(a), tensors, base, valid) == (OK, 1001, None)
    swapped = dict(a, **{tensor_key(2): b[tensor_key(2)]})
    torn = dict(a, **{tensor_key(1): torch.cat([a[tensor_key(1)][:100], b[tensor_key(1)][100:]])})
    unwritten = dict(a, **{tensor_key(0): torch.full_like(a[tensor_key(0)], -1)})
    renamed = dict(a, state_id=2001)
    other_index = dict(a, **{tensor_key(3): a[tensor_key(2)]})
    for case in (swapped, torn, unwritten, renamed, other_index):
        assert classify_loaded(case, tensors, base, valid)[0] == MIX
    assert classify_loaded(dict(a), tensors, base, {2001})[0] == MIX
