"""The process-wide pinned pool (``fastdcp.io.pinned_pool``): reuse across leases, the cap, the
buffers outside the pool when it is full, warm-up, and a fresh pool in a forked child."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from fastdcp.io import pinned_pool as P

MIB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_pool():
    P.reset_pinned_pool()
    yield
    P.reset_pinned_pool()


def test_a_released_buffer_serves_the_next_lease_of_its_size_or_smaller():
    with P.lease_pinned(4 * MIB) as first:
        ptr = first.tensor.data_ptr()
        assert first.tensor.numel() >= 4 * MIB and ptr % 4096 == 0
    with P.lease_pinned(3 * MIB) as second:
        assert second.tensor.data_ptr() == ptr
    stats = P.pinned_pool_stats()
    assert stats.buffers_allocated == 1 and stats.buffers_reused == 1 and stats.bytes_leased == 0


def test_two_leases_at_once_get_two_buffers_and_the_smallest_fitting_is_chosen():
    big, small = P.lease_pinned(8 * MIB), P.lease_pinned(2 * MIB)
    assert big.tensor.data_ptr() != small.tensor.data_ptr()
    big.release(), small.release()
    with P.lease_pinned(MIB) as lease:
        assert lease.tensor.data_ptr() == small.tensor.data_ptr()
    big.release()  # a second release is a no-op
    assert P.pinned_pool_stats().bytes_leased == 0


def test_over_the_cap_a_lease_gets_a_buffer_outside_the_pool_and_never_waits():
    P.set_pinned_pool_limit(4 * MIB)
    held = P.lease_pinned(3 * MIB)
    outside = P.lease_pinned(2 * MIB)  # 3 + 2 > 4 with nothing idle to drop
    assert not outside.pooled and held.pooled
    outside.release()
    held.release()
    stats = P.pinned_pool_stats()
    assert stats.buffers_unpooled == 1 and stats.bytes_held == 3 * MIB


def test_idle_buffers_are_dropped_to_make_room_least_recently_used_first():
    P.set_pinned_pool_limit(6 * MIB)
    P.warm_up_pinned([2 * MIB, 3 * MIB])
    assert P.pinned_pool_stats().bytes_held == 5 * MIB
    with P.lease_pinned(4 * MIB) as lease:  # 5 + 4 > 6: the older (2 MiB) goes, then 3 + 4 > 6: both
        assert lease.pooled
        assert P.pinned_pool_stats().bytes_held == 4 * MIB
    allocated = P.pinned_pool_stats().buffers_allocated
    P.warm_up_pinned([3 * MIB])  # the idle 4 MiB buffer serves it: nothing new
    stats = P.pinned_pool_stats()
    assert stats.buffers_allocated == allocated and stats.bytes_held == 4 * MIB


def test_warm_up_makes_the_first_lease_a_reuse():
    P.warm_up_pinned([16 * MIB])
    P.warm_up_pinned([16 * MIB])  # already there: nothing new
    assert P.pinned_pool_stats().buffers_allocated == 1
    with P.lease_pinned(16 * MIB):
        pass
    assert P.pinned_pool_stats().buffers_reused == 2


def test_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv(P.LIMIT_ENV, str(2 * MIB))
    assert P.pinned_pool_stats().limit_bytes == 2 * MIB
    monkeypatch.setenv(P.LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match=P.LIMIT_ENV):
        P.pinned_pool_stats()


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        P.lease_pinned(0)
    with pytest.raises(ValueError, match="limit"):
        P.set_pinned_pool_limit(-1)


def _child(queue) -> None:
    stats = P.pinned_pool_stats()
    queue.put((stats.bytes_held, stats.buffers_allocated))


def test_a_forked_child_starts_with_an_empty_pool():
    P.warm_up_pinned([MIB])
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    assert queue.get(timeout=30) == (0, 0)
    proc.join(30)
    assert proc.exitcode == 0
