"""Plan caches: item lists that cross collectives as one cached blob, and the bounded LRU caches
of save and load plans (per process; they hold no tensors).
"""


from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from typing import Any


from ..io.gc import gc_paused


# How many state-dict structures each cache remembers (LRU). A training job saving a model and an
# optimizer as two checkpoints needs two; the bound keeps plans of long-gone structures from piling up.
_CACHE_ENTRIES = 8

_unpacked_lock = threading.Lock()

# blob -> the items it holds: the lists this process sent or received, so that an unchanged plan
# is unpickled once per structure, not once per save. A coordinator receives one blob per rank,
# so the bound is in bytes (a 5,000-item plan pickles to ~0.5 MB), not in entries.
_unpacked: OrderedDict[bytes, tuple[Any, ...]] = OrderedDict()

_UNPACKED_MAX_BYTES = 256 << 20

_unpacked_bytes = 0


def _remember_blob(blob: bytes, items: tuple[Any, ...]) -> None:
    global _unpacked_bytes
    with _unpacked_lock:
        if blob not in _unpacked:
            _unpacked_bytes += len(blob)
        _unpacked[blob] = items
        _unpacked.move_to_end(blob)
        while _unpacked_bytes > _UNPACKED_MAX_BYTES and len(_unpacked) > 1:
            dropped, _ = _unpacked.popitem(last=False)
            _unpacked_bytes -= len(dropped)


def _unpack_items(blob: bytes) -> _PackedItems:
    """Unpickling side of :class:`_PackedItems`: the items of ``blob``, unpickled at most once."""
    with _unpacked_lock:
        items = _unpacked.get(blob)
        if items is not None:
            _unpacked.move_to_end(blob)
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


_local_save_plans = _LruCache(_CACHE_ENTRIES)  # rank side: structure key -> _CachedLocalSavePlan

_global_save_plans = _LruCache(_CACHE_ENTRIES)  # coordinator: id -> _CachedGlobalSavePlan

_local_load_plans = _LruCache(_CACHE_ENTRIES)  # structure + metadata key -> _PackedItems


def clear_plan_caches() -> None:
    """Forget every cached save and load plan of this process (the next calls replan)."""
    global _unpacked_bytes
    for cache in (_local_save_plans, _global_save_plans, _local_load_plans):
        cache.clear()
    with _unpacked_lock:
        _unpacked.clear()
        _unpacked_bytes = 0
