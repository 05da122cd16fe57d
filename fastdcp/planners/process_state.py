"""The planners' memory within one process: plan caches, unpickled blobs, save plans sent as
columns; and :func:`simulated_process`, which swaps it so one process can play many ranks.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

__all__ = ["PlanProcessState", "current_process_state", "simulated_process"]

# How many state-dict structures each cache remembers (LRU). A training job saving a model and an
# optimizer as two checkpoints needs two; the bound keeps plans of long-gone structures from piling up.
_CACHE_ENTRIES = 8


class _BlobMemory:
    """blob -> what it unpickled to: the item lists this process sent or received, so that an unchanged
    plan is unpickled once per structure, not once per save. A coordinator receives one blob per
    rank, so the bound is in bytes (a 5,000-item plan pickles to ~0.5 MB), not in entries."""

    max_bytes = 256 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blobs: OrderedDict[bytes, tuple[Any, ...]] = OrderedDict()
        self._bytes = 0

    def get(self, blob: bytes) -> Any:
        with self._lock:
            items = self._blobs.get(blob)
            if items is not None:
                self._blobs.move_to_end(blob)
            return items

    def remember(self, blob: bytes, items: Any) -> None:
        with self._lock:
            if blob not in self._blobs:
                self._bytes += len(blob)
            self._blobs[blob] = items
            self._blobs.move_to_end(blob)
            while self._bytes > self.max_bytes and len(self._blobs) > 1:
                dropped, _ = self._blobs.popitem(last=False)
                self._bytes -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._bytes = 0


class _LruCache:
    """A small thread-safe LRU map (plans of the last few structures)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def values(self) -> list[Any]:
        with self._lock:
            return list(reversed(self._entries.values()))  # most recent first

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class PlanProcessState:
    """Everything the planners remember within one process: the plan caches and the unpickled
    blobs. One instance is current (:data:`_process`); :func:`simulated_process` makes another
    current for a while, so a benchmark can play many ranks in one process, each with the memory
    a real rank process would have."""

    def __init__(self) -> None:
        self.local_save_plans = _LruCache(_CACHE_ENTRIES)  # rank side: structure key -> _CachedLocalSavePlan
        self.global_save_plans = _LruCache(_CACHE_ENTRIES)  # coordinator: id -> _CachedGlobalSavePlan
        self.local_load_plans = _LruCache(_CACHE_ENTRIES)  # structure + metadata key -> _PackedItems
        self.unpacked = _BlobMemory()  # blob -> what it unpickled to (item lists, plan structures)
        # Save plans this process sent as columns, by token (the global plan is applied to them),
        # and the global plans applied to them lately (a repeat save reuses them).
        self.sent_plans = _LruCache(_CACHE_ENTRIES)
        self.applied_plans = _LruCache(_CACHE_ENTRIES)

    def clear(self) -> None:
        for cache in (self.local_save_plans, self.global_save_plans, self.local_load_plans, self.unpacked,
                      self.sent_plans, self.applied_plans):
            cache.clear()


_process = PlanProcessState()


def current_process_state() -> PlanProcessState:
    return _process


@contextlib.contextmanager
def simulated_process(state: PlanProcessState) -> Iterator[PlanProcessState]:
    """Make ``state`` this process's planner memory inside the block (benchmarks that simulate
    many ranks in one process; not thread-safe against planners running concurrently)."""
    global _process
    previous, _process = _process, state
    try:
        yield state
    finally:
        _process = previous
