"""Phases (``fastdcp.io.phases``): exclusive time per span, the caller's phases adding up to the wall
time with ``outside``, other threads' apart, nothing recorded without a recorder; and a real save
and load report the phases of their storage stages."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fastdcp import FastFileSystemReader, FastFileSystemWriter
from fastdcp.io import phases as P
from fastdcp.io.copy_engine import to_standin_device

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_spans_count_exclusive_time_and_the_caller_adds_up_to_the_wall():
    with P.recording() as rec:
        time.sleep(0.01)  # outside any span
        with P.span("outer"):
            time.sleep(0.02)
            with P.span("inner"):
                time.sleep(0.03)
        with P.span("inner"):
            time.sleep(0.01)
    got = rec.phases()
    assert 0.018 <= got["outer"] < 0.05 and 0.038 <= got["inner"] < 0.08 and got["outside"] >= 0.009
    assert abs(sum(v for k, v in got.items() if k != "background") - rec.wall) < 1e-3
    assert "background" not in got


def test_other_threads_are_background():
    with P.recording() as rec:
        def work():
            with P.span("write"):
                time.sleep(0.02)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    got = rec.phases()
    assert got["background"]["write"] >= 0.018 and "write" not in got
    assert got["outside"] == pytest.approx(rec.wall, abs=1e-3)


def test_nothing_is_recorded_without_a_recorder():
    with P.span("write"):
        pass
    assert P.active_recorder() is None
    with P.recording() as rec:
        pass
    assert rec.phases()["outside"] >= 0 and len(rec.phases()) == 1


def test_a_failing_span_still_counts_and_unwinds():
    with P.recording() as rec:
        with pytest.raises(ValueError):
            with P.span("write"):
                raise ValueError("boom")
        with P.span("fsync"):
            pass
    assert set(rec.phases()) == {"write", "fsync", "outside"}


def test_a_save_and_a_load_report_their_storage_phases(tmp_path):
    sd = {"a": to_standin_device(torch.randn(512, 512)), "b": torch.randn(1000), "step": 1}
    with P.recording() as rec:
        dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path, pinned_ring_limit_bytes=1 << 20), no_dist=True)
    saved = rec.phases()
    assert {"plan", "layout", "open", "write", "fsync", "commit", "pin", "d2h_issue", "d2h_wait"} <= set(saved)
    assert abs(sum(v for k, v in saved.items() if k != "background") - rec.wall) < 1e-3
    dest = {"a": torch.empty(512, 512), "b": torch.empty(1000), "step": 0}
    with P.recording() as rec:
        dcp.load(dest, storage_reader=FastFileSystemReader(tmp_path), no_dist=True)
    assert {"metadata", "plan", "read"} <= set(rec.phases())
    assert torch.equal(dest["a"], sd["a"])
