"""Staging through the slots of one host buffer: the next slot is filled while the current drains.

Items ``0..count-1`` are filled into slots, then drained in order. The j-th item that takes a slot
gets slot ``j % slots`` and is filled only once item j - slots (its slot's previous holder) was
released: after its drain, or after the wait its drain handed to :meth:`StagingPipeline.release`.
So at most ``slots * slot_bytes`` bytes are staged. Fills run on a filler thread (loads: reads)
or on the caller, ahead into every free slot (the save ring: asynchronous device copies).
On an error nothing more is filled, waiters wake, threads are joined, ``abort`` runs, then the
memory is released. Users: ``load/placement.py``, ``load/gpu_placement.py``, ``save/device_ring.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import torch

from .phases import span
from .pinned_pool import PinnedLease, lease_pinned

__all__ = ["StagingPipeline", "Filled"]


class Filled(NamedTuple):
    """An item handed to the drain step: its index, its slot (None if it takes none), what fill returned."""

    index: int
    slot: torch.Tensor | None
    value: Any


class _Cancelled(Exception):
    """The pipeline stopped (an error elsewhere): the filler fills no further item."""


def _maybe_span(name: str | None) -> Any:
    return span(name) if name else contextlib.nullcontext()


class StagingPipeline:
    """``slots`` slots of ``slot_bytes`` over ``memory`` (flat uint8, at least ``slots * slot_bytes``).

    A context manager: on leaving it ``abort`` runs first if an error is leaving, then ``release``
    (both optional; the memory's owner's hooks, e.g. a pinned lease's ``release``)."""

    def __init__(self, slot_bytes: int, slots: int, memory: torch.Tensor, *,
                 release: Callable[[], None] | None = None, abort: Callable[[], None] | None = None) -> None:
        if slots < 1 or slot_bytes < 1 or memory.numel() < slot_bytes * slots:
            raise ValueError(f"{slots} slots of {slot_bytes} bytes need that much memory, got {memory.numel()} bytes")
        self.slot_bytes, self.slots, self.memory = slot_bytes, slots, memory
        self._release, self._abort = release, abort
        self._released: list[threading.Event] = []
        self._reuse_waits: list[Callable[[], None] | None] = []
        self._rank: list[int | None] = []

    @classmethod
    def from_lease(cls, lease: PinnedLease | Any, slot_bytes: int, slots: int,
                   abort: Callable[[], None] | None = None) -> "StagingPipeline":
        """Slots over a lease (``.tensor``, ``.release()``), released when the pipeline's block ends."""
        return cls(slot_bytes, slots, lease.tensor[: slot_bytes * slots], release=lease.release, abort=abort)

    @classmethod
    def pinned(cls, slot_bytes: int, slots: int, abort: Callable[[], None] | None = None) -> "StagingPipeline":
        """Slots leased from the process-wide pinned pool (``fastdcp.io.pinned_pool``)."""
        with span("pin"):
            lease = lease_pinned(slot_bytes * slots)
        return cls.from_lease(lease, slot_bytes, slots, abort)

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index % slots``."""
        base = (index % self.slots) * self.slot_bytes
        return self.memory[base : base + self.slot_bytes]

    def __enter__(self) -> "StagingPipeline":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is not None and self._abort is not None:
                self._abort()  # nothing may still read or write the memory when it is released
        finally:
            if self._release is not None:
                self._release()

    # ------------------------------------------------------------------------------------------ #

    def release(self, index: int, wait: Callable[[], None] | None = None) -> None:
        """Give item ``index``'s slot back (idempotent); a fill reusing it first calls ``wait`` (on the
        filler's thread). A drain may call it early; the pipeline calls it after the drain otherwise."""
        rank = self._rank[index]
        if rank is not None and not self._released[rank].is_set():
            self._reuse_waits[rank] = wait
            self._released[rank].set()

    def _may_fill(self, rank: int) -> bool:
        return rank < self.slots or self._released[rank - self.slots].is_set()

    def run(self, count: int, fill: Callable[[int, torch.Tensor | None], Any],
            drain: Callable[[list[Filled]], Callable[[], None] | None], *,
            uses_slot: Callable[[int], bool] | None = None, fill_thread: str | None = None,
            fill_wait_span: str | None = None, issue_span: str | None = None, batch: int = 1,
            drains_in_flight: int = 1, drain_thread: str = "fastdcp-drain", drain_span: str | None = None,
            on_error: Callable[[], None] | None = None) -> None:
        """Fill and drain items ``0..count-1`` (see the module docstring).

        ``fill(index, slot)`` returns a value for the drain (items that take no slot are not filled).
        ``drain(items)`` gets ``batch`` items in order and returns None (done) or a callable run in
        flight: inline under ``drain_span`` or, with ``drains_in_flight > 1``, on a thread of its
        own (waited for under ``drain_span``); the items' slots are released once it has returned.
        ``fill_thread``: fill on a thread of that name (then one item per drain, on the caller), else
        on the caller. ``on_error``: runs after a failure once no fill or drain of this run is still
        running, before the error is raised."""
        if fill_thread is not None and (batch != 1 or drains_in_flight != 1):
            raise ValueError("fills on a filler thread are drained one at a time on the caller")
        ranks, used = [], 0
        for k in range(count):
            takes = uses_slot is None or uses_slot(k)
            ranks.append(used if takes else None)
            used += takes
        self._rank = ranks
        self._released = [threading.Event() for _ in range(used)]
        self._reuse_waits = [None] * used
        try:
            if fill_thread is not None:
                self._run_filler_thread(count, fill, drain, fill_thread, fill_wait_span)
            else:
                self._run_ahead(count, fill, drain, issue_span, batch, drains_in_flight, drain_thread, drain_span)
        except BaseException:
            if on_error is not None:
                on_error()
            raise

    def _slot_of(self, index: int) -> torch.Tensor | None:
        rank = self._rank[index]
        return None if rank is None else self.slot(rank)

    def _run_filler_thread(self, count: int, fill: Callable, drain: Callable, thread_name: str,
                           wait_span: str | None) -> None:
        """Fills on a filler thread, each as soon as its slot is released; drains on the caller."""
        stopping = threading.Event()

        def fill_item(index: int) -> Any:
            if stopping.is_set():
                raise _Cancelled()
            try:
                rank = self._rank[index]
                if rank is None:
                    return None
                if rank >= self.slots:
                    self._released[rank - self.slots].wait()
                    if stopping.is_set():
                        raise _Cancelled()
                    wait = self._reuse_waits[rank - self.slots]
                    if wait is not None:
                        wait()
                return fill(index, self.slot(rank))
            except BaseException:
                stopping.set()
                raise

        filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        try:
            filled = [filler.submit(fill_item, index) for index in range(count)]
            for index in range(count):
                with _maybe_span(wait_span):
                    value = filled[index].result()
                work = drain([Filled(index, self._slot_of(index), value)])
                if work is not None:
                    work()
                self.release(index)
        except BaseException:
            stopping.set()
            for event in self._released:
                event.set()  # a filler waiting for a slot stops instead
            raise
        finally:
            filler.shutdown(wait=True, cancel_futures=True)

    def _run_ahead(self, count: int, fill: Callable, drain: Callable, issue_span: str | None, batch: int,
                   drains_in_flight: int, thread_name: str, drain_span: str | None) -> None:
        """Fills on the caller, ahead into every free slot; drains of ``batch`` items, up to
        ``drains_in_flight`` at once; a slot is released when the drain holding it is retired."""
        if batch < 1 or drains_in_flight < 1:
            raise ValueError(f"a batch of {batch} items and {drains_in_flight} drains in flight: both must be >= 1")
        values: dict[int, Any] = {}
        in_flight: deque[tuple[Any, range]] = deque()  # (future, the items it drains), oldest first
        lanes = ThreadPoolExecutor(max_workers=drains_in_flight, thread_name_prefix=thread_name) \
            if drains_in_flight > 1 else None
        issued = 0

        def try_fill(index: int) -> bool:
            rank = self._rank[index]
            if rank is None:
                return True
            if not self._may_fill(rank):
                return False
            values[index] = fill(index, self.slot(rank))
            return True

        def retire_oldest() -> None:
            """Wait for the oldest drain in flight and give its slots back."""
            future, items = in_flight.popleft()
            with _maybe_span(drain_span):
                future.result()
            for index in items:
                self.release(index)

        try:
            pos = 0
            while pos < count:
                end = min(pos + batch, count)
                # This batch first (waiting for the oldest drains to give slots back), then ahead.
                while issued < end:
                    with _maybe_span(issue_span):
                        while issued < count and try_fill(issued):
                            issued += 1
                    if issued < end:
                        if not in_flight:
                            raise AssertionError("fastdcp: the staging pipeline has fewer free slots than a batch")
                        retire_oldest()
                items = range(pos, end)
                work = drain([Filled(k, self._slot_of(k), values.pop(k, None)) for k in items])
                if work is not None and lanes is not None:
                    in_flight.append((lanes.submit(work), items))
                else:
                    if work is not None:
                        with _maybe_span(drain_span):
                            work()
                    for index in items:
                        self.release(index)
                while len(in_flight) >= drains_in_flight:
                    retire_oldest()
                pos = end
            while in_flight:
                retire_oldest()
        finally:
            if lanes is not None:
                for future, _ in in_flight:
                    future.exception()  # wait: no drain may still read a slot (the first error is raised above)
                lanes.shutdown(wait=True)
