"""Plan caches: item lists that cross collectives as one cached blob, and the bounded LRU caches
of save and load plans (per process; they hold no tensors).
"""


from __future__ import annotations

import contextlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any


from ..io.gc import gc_paused


# How many state-dict structures each cache remembers (LRU). A training job saving a model and an
# optimizer as two checkpoints needs two; the bound keeps plans of long-gone structures from piling up.
_CACHE_ENTRIES = 8

class _BlobMemory:
    """blob -> the items it holds: the lists this process sent or received, so that an unchanged
    plan is unpickled once per structure, not once per save. A coordinator receives one blob per
    rank, so the bound is in bytes (a 5,000-item plan pickles to ~0.5 MB), not in entries."""

    max_bytes = 256 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blobs: OrderedDict[bytes, tuple[Any, ...]] = OrderedDict()
        self._bytes = 0

    def get(self, blob: bytes) -> tuple[Any, ...] | None:
        with self._lock:
            items = self._blobs.get(blob)
            if items is not None:
                self._blobs.move_to_end(blob)
            return items

    def remember(self, blob: bytes, items: tuple[Any, ...]) -> None:
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


def _remember_blob(blob: bytes, items: tuple[Any, ...]) -> None:
    _process.unpacked.remember(blob, items)


def _unpack_items(blob: bytes) -> _PackedItems:
    """Unpickling side of :class:`_PackedItems`: the items of ``blob``, unpickled at most once."""
    items = _process.unpacked.get(blob)
    if items is None:
        with gc_paused():
            items = tuple(pickle.loads(blob))
        _remember_blob(blob, items)
    return _PackedItems(items, blob)


def _invalidating(name: str):
    method = getattr(list, name)

    def mutate(self: _PackedItems, *args: Any, **kwargs: Any) -> Any:
        self._blob = None
        return method(self, *args, **kwargs)

    mutate.__name__ = name
    return mutate


class _PackedItems(list):
    """A plan's item list (a real ``list``) that pickles as one bytes blob, computed once.

    DCP sends plans through ``gather_object``/``scatter_object_list``, which pickle every
    ``WriteItem``/``ReadItem`` (a few dataclasses and ``torch.Size`` objects each): ~40 us per item
    per direction. A cached plan's items never change, so the blob is computed once and reused;
    the receiving process keeps what it unpickled by blob (:func:`_unpack_items`). Any in-place
    change to the list drops the blob."""

    __slots__ = ("_blob",)

    def __init__(self, items: Any = (), blob: bytes | None = None) -> None:
        super().__init__(items)
        self._blob = blob

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        blob = self._blob
        if blob is None:
            items = tuple(self)
            blob = self._blob = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
            _remember_blob(blob, items)
        return (_unpack_items, (blob,))

    def same_items(self, other: Any) -> bool:
        """True when ``other`` holds the same items: the same list, or one unpickled from the same
        blob (byte equality of two pickles of frozen dataclasses means equal items)."""
        if other is self:
            return True
        if type(other) is not _PackedItems or self._blob is None or other._blob is None:
            return False
        return self._blob is other._blob or self._blob == other._blob


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
              "__setitem__", "__delitem__", "__iadd__", "__imul__"):
    setattr(_PackedItems, _name, _invalidating(_name))
del _name


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
        self.unpacked = _BlobMemory()

    def clear(self) -> None:
        for cache in (self.local_save_plans, self.global_save_plans, self.local_load_plans, self.unpacked):
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


def clear_plan_caches() -> None:
    """Forget every cached save and load plan of this process (the next calls replan)."""
    _process.clear()
