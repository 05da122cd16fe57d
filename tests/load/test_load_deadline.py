"""Loads that cannot hang silently (fastdcp/load/deadline.py): on two real gloo ranks with real
files, a rank that stalls reading ``.metadata`` or its data files makes the other rank fail within
a few seconds of ``load_deadline_s`` with a ``LoadDeadlineError`` naming the stalled rank and what
it was doing; the stalled rank fails too when it arrives; loads without a stall, also after those
failures, are bit-exact; and a rank stalled for good does not hold the other one (the test kills
it). Unit tests on a real store (``HashStore``, ranks as threads): the messages, the verdict every
rank shares, the error leaving DCP's pickling, the deadline's argument and environment."""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from fastdcp import FastFileSystemReader, FastFileSystemWriter, LoadDeadlineError
from fastdcp.load import deadline as D

WORLD = 2
DEADLINE_S = 3.0
SHAPES = {"w": (64, 33), "b": (16,)}


# --------------------------------------------------------------------------- two real ranks


def _state(mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {name: distribute_tensor(C.random_tensor(torch.float32, shape, ("deadline", name)), mesh, [Shard(0)])
            for name, shape in SHAPES.items()}


def _exact(dest: dict, mesh) -> bool:
    expected = _state(mesh)
    return all(torch.equal(dest[k].to_local().view(torch.int32), v.to_local().view(torch.int32))
               for k, v in expected.items())


def _worker(rank: int, spec: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    root, path = spec["root"], spec["ckpt"]
    log = open(os.path.join(root, f"report.{rank}.jsonl"), "a")

    def record(phase: str, **kw) -> None:
        log.write(json.dumps({"phase": phase, "rank": rank, **kw}) + "\n")
        log.flush()

    def load(phase: str, mesh, **reader_kw) -> None:
        dest = {k: torch.zeros_like(v) for k, v in _state(mesh).items()}
        started = time.monotonic()
        try:
            dcp.load(dest, storage_reader=FastFileSystemReader(path, load_deadline_s=DEADLINE_S, **reader_kw))
        except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
            record(phase, ok=False, type=type(error).__name__, timeout=isinstance(error, TimeoutError),
                   message=str(error), seconds=time.monotonic() - started)
        else:
            record(phase, ok=True, exact=_exact(dest, mesh), seconds=time.monotonic() - started)

    try:
        import datetime

        dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (WORLD,))
        dcp.save(_state(mesh), storage_writer=FastFileSystemWriter(path))
        load("exact", mesh)
        # Rank 1 stalls until rank 0 has failed (then it arrives late, and fails too).
        for phase, point in (("stall_metadata", "read_metadata"), ("stall_data", "read_data")):
            release = os.path.join(root, f"release.{phase}")
            os.environ.update(FASTDCP_TEST_STALL_AT=f"{point}:1", FASTDCP_TEST_STALL_UNTIL=release,
                              FASTDCP_TEST_STALL_S="100")
            load(phase, mesh)
            if rank == 0:
                open(release, "w").close()
        os.environ.pop("FASTDCP_TEST_STALL_AT")
        load("after", mesh)  # the group and the check-ins' keys still agree
        # Rank 1 stalls for good: rank 0 fails, reports and ends; the test kills rank 1.
        os.environ.update(FASTDCP_TEST_STALL_AT="read_data:1", FASTDCP_TEST_STALL_UNTIL="", FASTDCP_TEST_STALL_S="600")
        load("forever", mesh)
    except BaseException as error:  # noqa: BLE001 - reported to the test
        record("worker", ok=False, type=type(error).__name__, message=repr(error))
    log.close()
    os._exit(0)  # no process-group teardown with a peer stalled


def _reports(root) -> dict[tuple[str, int], dict]:
    found = {}
    for rank in range(WORLD):
        name = root / f"report.{rank}.jsonl"
        if name.exists():
            for line in name.read_text().splitlines():
                r = json.loads(line)
                found[(r["phase"], r["rank"])] = r
    return found


@pytest.fixture(scope="module")
def stalled_loads(tmp_path_factory):
    from fastdcp.bench.process_group import free_port

    root = tmp_path_factory.mktemp("deadline")
    spec = {"root": str(root), "ckpt": str(root / "ckpt"), "init": f"tcp://127.0.0.1:{free_port()}"}
    ctx = mp.start_processes(_worker, args=(spec,), nprocs=WORLD, join=False, start_method="spawn")
    rank0, rank1 = ctx.processes
    try:
        rank0.join(150)
        stalled_for_good = rank1.is_alive()
        assert not rank0.is_alive(), f"rank 0 did not finish: {_reports(root)}"
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
            process.join(30)
    reports = _reports(root)
    assert ("worker", 0) not in reports and ("worker", 1) not in reports, reports
    return reports, spec["ckpt"], stalled_for_good


@pytest.mark.fastdcp_timeout(240)
def test_loads_without_a_stall_are_bit_exact_with_the_deadline_set(stalled_loads):
    reports, _, _ = stalled_loads
    for phase in ("exact", "after"):
        for rank in range(WORLD):
            r = reports[(phase, rank)]
            assert r["ok"] and r["exact"], r


@pytest.mark.fastdcp_timeout(240)
@pytest.mark.parametrize(("phase", "doing", "where"), [
    ("stall_metadata", "was reading .metadata of {path}", "at the start of the load"),
    ("stall_data", "was reading data file '__1_", "at the end of its reads"),
    ("forever", "was reading data file '__1_", "at the end of its reads"),
])
def test_a_stalled_rank_fails_the_others_within_seconds_naming_it(stalled_loads, phase, doing, where):
    reports, path, stalled_for_good = stalled_loads
    r = reports[(phase, 0)]
    assert not r["ok"] and r["type"] == "LoadDeadlineError" and r["timeout"], r
    message = r["message"]
    assert f"rank 1 {doing.format(path=path)}" in message, message
    assert f"the load of '{path}' waited 3 s (load_deadline_s) {where} for 1 of 2 ranks" in message, message
    if doing.endswith("'__1_"):
        assert f".distcp' of {path}" in message, message
    # It waited the deadline, then left dcp.load at once (without the escape it would wait in
    # DCP's next collective for the stalled rank, which here waits for rank 0 to fail).
    assert DEADLINE_S - 0.5 <= r["seconds"] < DEADLINE_S + 12, r
    if phase == "forever":
        assert stalled_for_good and ("forever", 1) not in reports  # it was still stalled, then killed


@pytest.mark.fastdcp_timeout(240)
@pytest.mark.parametrize(("phase", "where"), [("stall_metadata", "at the start of the load"),
                                             ("stall_data", "at the end of its reads")])
def test_the_stalled_rank_fails_too_when_it_arrives(stalled_loads, phase, where):
    reports, path, _ = stalled_loads
    r = reports[(phase, 1)]
    assert not r["ok"] and r["type"] == "LoadDeadlineError", r
    assert (f"the load of '{path}' failed on rank 1, which arrived {where} after the other ranks stopped "
            "waiting (3 s, load_deadline_s)") in r["message"], r
    assert "rank 0 was waiting for 1 of 2 ranks" in r["message"], r


# --------------------------------------------------------------------------- one store, ranks as threads


def _ranks(world: int, deadline_s: float, name: str = "/ckpt", n: int = 1) -> tuple[object, list[D.LoadCheckIns]]:
    store = dist.HashStore()
    prefixed = dist.PrefixStore("fastdcp/load", store)
    return prefixed, [D.LoadCheckIns(prefixed, r, world, name, n, deadline_s) for r in range(world)]


def _check_in_all(ranks: list[D.LoadCheckIns], point: str) -> dict[int, BaseException | None]:
    outcome: dict[int, BaseException | None] = {}

    def run(c: D.LoadCheckIns) -> None:
        try:
            c.check_in(point)
            outcome[c.rank] = None
        except BaseException as e:  # noqa: BLE001
            outcome[c.rank] = e

    threads = [threading.Thread(target=run, args=(c,)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcome


def test_every_rank_goes_on_when_all_arrive_within_the_deadline():
    _, ranks = _ranks(3, 5.0)
    late = ranks[2]

    def arrive_late() -> None:
        time.sleep(0.3)
        late.check_in(D.END)

    t = threading.Thread(target=arrive_late)
    t.start()
    assert _check_in_all(ranks[:2], D.END) == {0: None, 1: None}
    t.join(10)


def test_a_missing_rank_fails_every_waiting_rank_and_then_itself():
    _, ranks = _ranks(3, 1.0)
    ranks[2].status("reading .metadata of /ckpt")
    started = time.monotonic()
    outcome = _check_in_all(ranks[:2], D.START)
    assert 1.0 <= time.monotonic() - started < 10
    for rank in (0, 1):
        error = outcome[rank]
        # At the start (inside read_metadata) it is DCP's CheckpointException around the error.
        assert isinstance(error, CheckpointException), error
        inner = error.__cause__
        assert isinstance(inner, LoadDeadlineError) and isinstance(inner, TimeoutError)
        assert inner.missing == (2,) and inner.point == D.START and inner.path == "/ckpt"
        assert inner.statuses == {2: "reading .metadata of /ckpt"}
        assert ("the load of '/ckpt' waited 1 s (load_deadline_s) at the start of the load for 1 of 3 ranks "
                "to reach it: rank 2 was reading .metadata of /ckpt.") in str(inner)
    # The stalled rank arrives after the verdict: it fails at once, naming who gave up.
    started = time.monotonic()
    late = _check_in_all([ranks[2]], D.START)[2]
    assert time.monotonic() - started < 1.0
    assert isinstance(late.__cause__, LoadDeadlineError)
    assert re.search(r"failed on rank 2, which arrived at the start of the load after the other ranks stopped "
                     r"waiting \(1 s, load_deadline_s\); rank [01] was waiting for 1 of 3 ranks to reach it: "
                     r"rank 2 was reading \.metadata of /ckpt\.", str(late)), str(late)


def test_ranks_that_never_started_the_load_are_named_with_what_they_did_last():
    store, ranks = _ranks(4, 0.5, name="/ckpt", n=2)
    D.LoadCheckIns(store, 1, 4, "/ckpt", 1, 0.5).status("reading data file '__1_0.distcp' of /ckpt")
    ranks[3].status("reading data files '__3_0.distcp', '__3_1.distcp' of /ckpt")
    ranks[0].status("reading data file '__0_0.distcp' of /ckpt")
    with pytest.raises(LoadDeadlineError) as info:
        ranks[0].check_in(D.END)
    message = str(info.value)
    assert info.value.missing == (1, 2, 3)
    assert "waited 0.5 s (load_deadline_s) at the end of its reads for 3 of 4 ranks to finish theirs" in message
    assert ("rank 1 had not started this load (it was last reading data file '__1_0.distcp' of /ckpt, "
            "in an earlier load)") in message
    assert "rank 2 had not started a fastdcp load" in message
    assert "rank 3 was reading data files '__3_0.distcp', '__3_1.distcp' of /ckpt" in message


def test_the_error_refuses_its_first_pickling_then_round_trips():
    error = LoadDeadlineError("waited", path="/ckpt", point=D.END, deadline_s=3.0, missing=(1,),
                              statuses={1: "reading"})
    wrapped = CheckpointException("read", {0: (error, None)})
    with pytest.raises(LoadDeadlineError) as info:  # what DCP's collective does with it: it leaves
        pickle.dumps((wrapped, None))
    assert info.value is error
    back = pickle.loads(pickle.dumps(error))
    assert (str(back), back.path, back.point, back.deadline_s, back.missing, back.statuses) == \
        ("waited", "/ckpt", D.END, 3.0, (1,), {1: "reading"})


def test_the_deadline_from_the_argument_and_the_environment(monkeypatch):
    monkeypatch.delenv("FASTDCP_LOAD_DEADLINE_S", raising=False)
    assert D.resolve_load_deadline() is None  # off unless asked for
    assert D.resolve_load_deadline(None) is None and D.resolve_load_deadline(0) is None
    assert D.resolve_load_deadline(2.5) == 2.5
    for raw, expected in (("60", 60.0), ("0", None), ("off", None), ("none", None), ("", None)):
        monkeypatch.setenv("FASTDCP_LOAD_DEADLINE_S", raw)
        assert D.resolve_load_deadline() == expected, raw
        assert FastFileSystemReader("/nonexistent").load_deadline_s == expected
    assert FastFileSystemReader("/nonexistent", load_deadline_s=None).load_deadline_s is None  # the argument wins
    monkeypatch.setenv("FASTDCP_LOAD_DEADLINE_S", "soon")
    with pytest.raises(ValueError, match="FASTDCP_LOAD_DEADLINE_S='soon'"):
        D.resolve_load_deadline()
    with pytest.raises(ValueError, match="load_deadline_s"):
        D.resolve_load_deadline(-1)


def test_no_check_ins_without_other_ranks(tmp_path):
    assert not dist.is_initialized()
    assert D.begin_load(5.0, str(tmp_path), "reading .metadata") is None
    state = {"w": torch.arange(10.0)}
    dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
    dest = {"w": torch.zeros(10)}
    dcp.load(dest, storage_reader=FastFileSystemReader(tmp_path, load_deadline_s=0.001), no_dist=True)
    assert torch.equal(dest["w"], state["w"])


def test_statuses_and_the_stall_hook(tmp_path, monkeypatch):
    assert D.reading_files_status("/c", ["__1_0.distcp"]) == "reading data file '__1_0.distcp' of /c"
    assert D.reading_files_status("/c", [f"__1_{i}.distcp" for i in range(5)]) == \
        "reading data files '__1_0.distcp', '__1_1.distcp', '__1_2.distcp' and 2 more of /c"
    release = tmp_path / "go"
    monkeypatch.setenv("FASTDCP_TEST_STALL_AT", "read_data:1,read_metadata")
    monkeypatch.setenv("FASTDCP_TEST_STALL_S", "0.3")
    started = time.monotonic()
    D.stall_point("read_data")  # rank 0 here: not stalled
    assert time.monotonic() - started < 0.2
    D.stall_point("read_metadata")  # every rank
    assert time.monotonic() - started >= 0.3
    monkeypatch.setenv("FASTDCP_TEST_STALL_S", "30")
    monkeypatch.setenv("FASTDCP_TEST_STALL_UNTIL", str(release))
    threading.Timer(0.2, release.touch).start()
    started = time.monotonic()
    D.stall_point("read_metadata")
    assert time.monotonic() - started < 5
