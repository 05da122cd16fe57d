"""The staging pipeline (``fastdcp.io.staging_pipeline``): fills overlap drains (shown by events,
not timing: a drain that waits for a later fill would hang without the overlap), a slot is never
refilled before its holder was released (the memory bound), and on an error in a fill or a drain
every thread stops and the memory goes back (to the pinned pool) after ``abort``."""

from __future__ import annotations

import threading

import pytest
import torch

from fastdcp.io.pinned_pool import pinned_pool_stats, reset_pinned_pool
from fastdcp.io.staging_pipeline import Filled, StagingPipeline

WAIT_S = 20  # a wait that only ends this way means the overlap is missing


@pytest.fixture
def pool():
    reset_pinned_pool()
    yield
    reset_pinned_pool()


class Recorder:
    """Events in order, and which item holds each slot (a fill into a held slot fails)."""

    def __init__(self, pipeline: StagingPipeline) -> None:
        self.pipeline = pipeline
        self.events: list[tuple[str, int]] = []
        self.holder: dict[int, int] = {}
        self.most_held = 0
        self.lock = threading.Lock()

    def log(self, what: str, index: int) -> None:
        with self.lock:
            self.events.append((what, index))

    def at(self, what: str, index: int) -> int:
        return self.events.index((what, index))

    def take(self, index: int, slot: torch.Tensor) -> None:
        memory = self.pipeline.memory
        assert slot.numel() == self.pipeline.slot_bytes
        assert memory.data_ptr() <= slot.data_ptr()
        assert slot.data_ptr() + slot.numel() <= memory.data_ptr() + self.pipeline.slots * self.pipeline.slot_bytes
        with self.lock:
            assert slot.data_ptr() not in self.holder, f"item {index} filled a slot item {self.holder} still holds"
            self.holder[slot.data_ptr()] = index
            self.most_held = max(self.most_held, len(self.holder))

    def give(self, slot: torch.Tensor) -> None:
        with self.lock:
            del self.holder[slot.data_ptr()]


def _pipeline(slots: int, slot_bytes: int = 64, **kw) -> StagingPipeline:
    return StagingPipeline(slot_bytes, slots, torch.empty(slots * slot_bytes, dtype=torch.uint8), **kw)


# --------------------------------------------------------------------------------------------- #
# fills on a filler thread (the loads)
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("slots", [2, 4])
def test_the_filler_fills_the_next_slot_while_the_current_drains(slots):
    pipeline = _pipeline(slots)
    rec = Recorder(pipeline)
    count = 9
    started = [threading.Event() for _ in range(count + 1)]
    started[count].set()

    def fill(k, slot):
        rec.take(k, slot)
        rec.log("fill", k)
        started[k].set()
        slot.fill_(k)
        return k * 10

    def drain(items):
        ((k, slot, value),) = items
        assert value == k * 10 and bool((slot == k).all())
        rec.log("drain", k)
        # Item k+1 is filled while item k drains: without the overlap this waits in vain.
        assert started[k + 1].wait(WAIT_S), f"item {k + 1} was not filled while item {k} drained"
        rec.give(slot)
        rec.log("drained", k)

    pipeline.run(count, fill, drain, fill_thread="fastdcp-test-fill")
    for k in range(count):
        assert rec.at("fill", k) < rec.at("drain", k)
        if k + slots < count:  # the slot's next holder waits for this one's release
            assert rec.at("drained", k) < rec.at("fill", k + slots)
    assert rec.most_held <= slots
    assert not [t for t in threading.enumerate() if t.name.startswith("fastdcp-test-fill")]


def test_a_slot_is_refilled_after_the_wait_its_drain_released_it_with():
    """A drain may release its slot early with a wait (a GPU upload's event): the fill that reuses
    the slot calls it first, on the filler's thread."""
    pipeline = _pipeline(2)
    rec = Recorder(pipeline)
    threads: dict[str, str] = {}

    def fill(k, slot):
        rec.log("fill", k)
        return k

    def drain(items):
        ((k, slot, _),) = items

        def wait(k=k):
            threads[f"wait {k}"] = threading.current_thread().name
            rec.log("wait", k)

        pipeline.release(k, wait)
        rec.log("drain", k)

    pipeline.run(6, fill, drain, fill_thread="fastdcp-test-fill")
    for k in range(4):
        assert rec.at("wait", k) < rec.at("fill", k + 2)
    assert all(name.startswith("fastdcp-test-fill") for name in threads.values())
    assert ("wait", 4) not in rec.events and ("wait", 5) not in rec.events  # no later fill needed them


@pytest.mark.parametrize("where", ["fill", "drain"])
def test_an_error_stops_the_filler_and_releases_the_memory(pool, where):
    order: list[str] = []
    pipeline = StagingPipeline.pinned(4096, 2, abort=lambda: order.append("abort"))
    assert pinned_pool_stats().bytes_leased >= 2 * 4096
    filled, drained = [], []

    def fill(k, slot):
        if where == "fill" and k == 3:
            raise OSError(5, "injected fill error")
        filled.append(k)
        return k

    def drain(items):
        ((k, _, _),) = items
        if where == "drain" and k == 3:
            raise ValueError("injected drain error")
        drained.append(k)

    real_release = pipeline._release
    pipeline._release = lambda: (order.append("release"), real_release())
    with pytest.raises((OSError, ValueError), match=f"injected {where} error"):
        with pipeline:
            pipeline.run(20, fill, drain, fill_thread="fastdcp-test-fill")
    assert not [t for t in threading.enumerate() if t.name.startswith("fastdcp-test-fill")]
    assert order == ["abort", "release"]
    assert pinned_pool_stats().bytes_leased == 0
    assert drained == [0, 1, 2]
    # a fill error: nothing filled after it; a drain error: only what its slot count allowed ahead
    if where == "fill":
        assert filled == [0, 1, 2]
    else:  # item 4 may have been filled (its slot was free) before the drain of item 3 failed
        assert filled in ([0, 1, 2, 3], [0, 1, 2, 3, 4])


def test_items_without_a_slot_are_not_filled():
    pipeline = _pipeline(2)
    seen = []

    def fill(k, slot):
        assert slot is not None and k % 3
        return k

    def drain(items):
        seen.extend(items)

    pipeline.run(7, fill, drain, uses_slot=lambda k: k % 3 != 0, fill_thread="fastdcp-test-fill")
    assert [(f.index, f.slot is None, f.value) for f in seen] == [
        (k, k % 3 == 0, None if k % 3 == 0 else k) for k in range(7)]


# --------------------------------------------------------------------------------------------- #
# fills on the caller, drains in flight (the save ring)
# --------------------------------------------------------------------------------------------- #
def test_the_caller_fills_ahead_while_drains_are_in_flight():
    slots, count = 4, 12
    pipeline = _pipeline(slots)
    rec = Recorder(pipeline)
    filled = [threading.Event() for _ in range(count + 2)]
    for e in filled[count:]:
        e.set()

    def fill(k, slot):
        rec.take(k, slot)
        rec.log("fill", k)
        filled[k].set()
        return slot

    def drain(items):
        assert len(items) <= 2
        rec.log("drain", items[0].index)

        def work():
            # In flight on a lane: it ends only once the caller has filled a later slot meanwhile.
            last = items[-1].index
            assert filled[last + 2].wait(WAIT_S), f"nothing was filled while items up to {last} drained"
            for item in items:
                rec.give(item.slot)
        return work

    pipeline.run(count, fill, drain, batch=2, drains_in_flight=2, drain_thread="fastdcp-test-lane")
    assert rec.most_held <= slots
    assert not [t for t in threading.enumerate() if t.name.startswith("fastdcp-test-lane")]
    assert [k for what, k in rec.events if what == "fill"] == list(range(count))


def test_caller_fills_respect_the_slots_and_skip_items_without_one():
    pipeline = _pipeline(3)
    rec = Recorder(pipeline)
    drained: list[Filled] = []

    def fill(k, slot):
        rec.take(k, slot)
        return f"token {k}"

    def drain(items):
        for item in items:
            if item.slot is not None:
                assert item.value == f"token {item.index}"
                rec.give(item.slot)
        drained.extend(items)
        return None

    pipeline.run(10, fill, drain, uses_slot=lambda k: k % 4 != 1, batch=3)
    assert [f.index for f in drained] == list(range(10))
    assert all((f.slot is None) == (f.index % 4 == 1) for f in drained)
    assert rec.most_held <= 3


def test_a_batch_needing_more_slots_than_there_are_is_refused():
    with pytest.raises(AssertionError, match="fewer free slots than a batch"):
        _pipeline(2).run(5, lambda k, slot: None, lambda items: None, batch=3)
    with pytest.raises(ValueError, match="one at a time"):
        _pipeline(2).run(5, lambda k, slot: None, lambda items: None, batch=2, fill_thread="fastdcp-test-fill")


@pytest.mark.parametrize("where", ["fill", "drain"])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_an_error_in_a_caller_fill_or_a_drain_in_flight_stops_every_lane(pool, where, in_flight):
    order: list[str] = []
    pipeline = StagingPipeline.pinned(4096, 4, abort=lambda: order.append("abort"))
    active = []

    def fill(k, slot):
        if where == "fill" and k == 5:
            raise OSError(28, "injected fill error")
        return k

    def drain(items):
        def work():
            active.append(1)
            try:
                if where == "drain" and items[0].index == 4:
                    raise OSError(28, "injected drain error")
            finally:
                active.pop()
        return work

    with pytest.raises(OSError, match=f"injected {where} error"):
        with pipeline:
            pipeline.run(12, fill, drain, batch=2, drains_in_flight=in_flight, drain_thread="fastdcp-test-lane",
                         on_error=lambda: order.append("on_error"))
    assert order == ["on_error", "abort"]
    assert not active, "a drain still ran after the error was raised"
    assert not [t for t in threading.enumerate() if t.name.startswith("fastdcp-test-lane")]
    assert pinned_pool_stats().bytes_leased == 0


# --------------------------------------------------------------------------------------------- #
# the memory bound
# --------------------------------------------------------------------------------------------- #
def test_the_memory_bound():
    with pytest.raises(ValueError, match="need that much memory"):
        StagingPipeline(4096, 3, torch.empty(3 * 4096 - 1, dtype=torch.uint8))
    memory = torch.empty(5 * 100, dtype=torch.uint8)
    pipeline = StagingPipeline(100, 4, memory)
    spans = {(pipeline.slot(i).data_ptr(), pipeline.slot(i).numel()) for i in range(8)}
    assert spans == {(memory.data_ptr() + i * 100, 100) for i in range(4)}, "4 slots of 100 bytes, reused in turn"


def test_pinned_slots_lease_their_bytes_for_the_pipeline_only(pool):
    with StagingPipeline.pinned(8192, 3) as pipeline:
        leased = pinned_pool_stats().bytes_leased
        assert leased == 3 * 8192  # whole pages: nothing more
        assert pipeline.memory.numel() == 3 * 8192
    assert pinned_pool_stats().bytes_leased == 0
    with StagingPipeline.pinned(8192, 3):
        assert pinned_pool_stats().buffers_reused == 1
