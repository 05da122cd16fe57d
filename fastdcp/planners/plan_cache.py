"""Plan caches: item lists that cross collectives as one cached blob, and the bounded LRU caches
of save and load plans (per process; they hold no tensors).
"""


from __future__ import annotations

import pickle
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch.distributed.checkpoint.planner import ReadItem

from ..io.gc import gc_paused
from .plan_columns import RankColumns, _columnar_items, encode_columns, new_token
from .process_state import (  # noqa: F401 - re-exported: the planners' memory lives there
    _CACHE_ENTRIES,
    PlanProcessState,
    current_process_state,
    simulated_process,
)



def _remember_blob(blob: bytes, items: tuple[Any, ...]) -> None:
    current_process_state().unpacked.remember(blob, items)


def _unpack_items(blob: bytes) -> _PackedItems:
    """Unpickling side of :class:`_PackedItems`: the items of ``blob``, unpickled at most once."""
    items = current_process_state().unpacked.get(blob)
    if items is None:
        with gc_paused():
            items = tuple(pickle.loads(blob))
        _remember_blob(blob, items)
    return _PackedItems(items, blob)


def _unpack_read_items(blob: bytes) -> Any:
    """Unpickling side of a read plan's :class:`_PackedItems`. In the process that packed ``blob``
    (a rank receiving its global plan back) the items it remembered, without decoding; anywhere
    else (the coordinator of the load) an :class:`UndecodedReadItems` that decodes only if
    something reads it."""
    items = current_process_state().unpacked.get(blob)
    if items is not None:
        return _PackedItems(items, blob)
    return UndecodedReadItems(blob)


class UndecodedReadItems(Sequence):
    """A rank's read items as they crossed DCP's gather: the pickled blob, decoded on first use.

    Stock's global load plan is the identity (``create_default_global_load_plan``), so the
    coordinator of a load only passes every rank's read plan back through the scatter; decoding
    N plans of thousands of ``ReadItem`` there cost about as much as the rest of the load's
    planning at thousands of ranks. This read-only sequence pickles back as the same blob
    without decoding it. A planner or storage reader that does read the items gets them (decoded
    once); what a list has beyond a read-only sequence (``append``, ``sort``) is absent, so code
    that would change the items in place fails loudly instead of working on an empty list."""

    __slots__ = ("_blob", "_items")

    def __init__(self, blob: bytes) -> None:
        self._blob = blob
        self._items: tuple[Any, ...] | None = None

    @property
    def decoded(self) -> bool:
        """Whether the items were decoded (something read them)."""
        return self._items is not None

    def items(self) -> tuple[Any, ...]:
        """The decoded items (decoded on the first call)."""
        if self._items is None:
            with gc_paused():
                self._items = tuple(pickle.loads(self._blob))
        return self._items

    def __len__(self) -> int:
        return len(self.items())

    def __getitem__(self, index: Any) -> Any:
        return self.items()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, UndecodedReadItems) and other._blob == self._blob:
            return True
        if isinstance(other, (list, tuple, UndecodedReadItems)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment] - equal to lists, which are unhashable

    def __add__(self, other: Any) -> list[Any]:
        return list(self) + list(other)

    def __radd__(self, other: Any) -> list[Any]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        state = f"{len(self._items)} items" if self._items is not None else "not decoded"
        return f"UndecodedReadItems({len(self._blob)} bytes, {state})"

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (_unpack_read_items, (self._blob,))


def as_item_list(items: Any) -> Any:
    """``items`` as a list: :class:`UndecodedReadItems` decoded into a :class:`_PackedItems`
    that pickles as the same blob; anything else as it is."""
    if type(items) is UndecodedReadItems:
        return _PackedItems(items.items(), items._blob)
    return items


def _invalidating(name: str):
    method = getattr(list, name)

    def mutate(self: _PackedItems, *args: Any, **kwargs: Any) -> Any:
        self._blob = None
        self._columns = None
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

    __slots__ = ("_blob", "_columns")

    def __init__(self, items: Any = (), blob: bytes | None = None) -> None:
        super().__init__(items)
        self._blob = blob
        self._columns: Any = None  # (RankColumns, ItemStructure), False: not expressible as columns

    def columns(self) -> Any:
        """This save plan's items as (RankColumns, ItemStructure), computed once and registered
        in this process under the columns' token (so the global plan can be applied to it); None
        when the items do not fit columns (read items, unusual write items)."""
        if self._columns is None:
            encoded = encode_columns(self)
            if encoded is None:
                self._columns = False
            else:
                structure, blob, numbers, itemsize = encoded
                token = new_token()
                self._columns = (RankColumns(token, blob, numbers, itemsize), structure)
                current_process_state().sent_plans.put(token, self)
        return self._columns or None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        columns = self.columns()
        if columns is not None:
            rank_columns = columns[0]
            current_process_state().sent_plans.put(rank_columns.token, self)  # most recently used
            return (_columnar_items, (rank_columns.token, rank_columns.structure_blob, rank_columns.numbers,
                                      rank_columns.itemsize))
        blob = self._blob
        if blob is None:
            items = tuple(self)
            blob = self._blob = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
            _remember_blob(blob, items)
        if self and all(type(item) is ReadItem for item in self):
            # A read plan: the coordinator passes it on undecoded, and this process must still
            # know the blob when its plan comes back.
            if current_process_state().unpacked.get(blob) is None:
                _remember_blob(blob, tuple(self))
            return (_unpack_read_items, (blob,))
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


class _PackedMapping(dict):
    """A plan's ``planner_data`` (the flatten mapping: fqn -> object path) that pickles as one
    compressed blob, computed once. Every rank of an FSDP job sends the same mapping; the
    coordinator keeps what a blob unpickled to, so N identical mappings cost one decode and one
    object (and, compressed, far fewer of the bytes the gather moves and allocates: the
    mapping's repeated path strings were most of a first-save local plan). Read-only by
    convention, like the item lists (the unpickled object is shared)."""

    __slots__ = ("_blob",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._blob: bytes | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        if self._blob is None:
            self._blob = zlib.compress(pickle.dumps(dict(self), protocol=pickle.HIGHEST_PROTOCOL), 1)
            current_process_state().unpacked.remember(self._blob, self)
        return (_unpack_mapping, (self._blob,))


def _unpack_mapping(blob: bytes) -> _PackedMapping:
    mapping = current_process_state().unpacked.get(blob)
    if type(mapping) is not _PackedMapping:
        with gc_paused():
            mapping = _PackedMapping(pickle.loads(zlib.decompress(blob)))
        mapping._blob = blob
        current_process_state().unpacked.remember(blob, mapping)
    return mapping


def clear_plan_caches() -> None:
    """Forget every cached save and load plan of this process (the next calls replan)."""
    current_process_state().clear()
