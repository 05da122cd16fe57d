"""FastSavePlanner and FastLoadPlanner: DCP planners whose per-save and per-load cost does not grow
with Python work per item when the state dict keeps its structure.

Stock ``DefaultSavePlanner``/``DefaultLoadPlanner`` rebuild every plan from scratch on every call:
flatten the state dict, build a ``WriteItem``/``ReadItem`` (with its ``MetadataIndex``,
``torch.Size`` and ``TensorProperties``) per tensor, dedup and build ``Metadata`` on the coordinator,
and pickle all of it for the plan collectives. For 5,000 small tensors that is most of a save or load.
These planners produce the same plans and metadata (stock readers and writers accept them, and a
checkpoint they write loads bit-exactly with stock ``DefaultLoadPlanner``), but:

- **Structure key.** One pass over the state dict flattens it (stock ``flatten_state_dict``
  semantics, including ``flatten_sharded_tensors``) and records, per leaf, everything the stock plan
  depends on: the object path, and the type, shape, dtype, layout, requires_grad and pinning of a
  tensor; the global shape, placements, mesh shape and coordinate of a DTensor; the global metadata
  and local shard boxes of a ShardedTensor. (Strides and values do not change a plan, so they are
  not part of the key.) Leaves whose plan only stock code knows how to build (tensor subclasses
  with their own ``__create_write_items__``, meta tensors on load, ...) make the state dict
  uncacheable and those calls take the stock path.
- **Local plan cache** (every rank): structure key -> the local plan's items. On a hit,
  ``create_local_plan`` builds nothing.
- **Global plan cache** (coordinator): the local plans it received -> the deduplicated global plans
  and ``Metadata``. Every rank always sends its complete local plan, so the coordinator decides hit
  or miss from what it received (no rank guesses what the coordinator holds, and no extra
  collective is needed): if any rank's structure changed, its plan differs, and the coordinator
  replans for everyone. The ``storage_data`` of every plan (the writer's file prefixes, fresh per
  save for ``FastFileSystemWriter``) is never cached: it is taken from this save's plans, and the
  writer's ``prepare_global_plan`` runs on every save. ``Metadata`` is handed out as a fresh object
  with fresh top-level dicts, since writers assign ``storage_data``/``storage_meta`` on it.
- **Plan transfer.** Plan item lists pickle as one cached blob (:class:`_PackedItems`), and the
  receiving side keeps the lists it unpickled by blob, so an unchanged plan crosses the gather and
  scatter collectives as one memcpy-sized bytes object instead of thousands of pickled dataclasses.
- **Bulk construction on a miss.** Items for plain tensors are built in one pass, sharing equal
  ``TensorProperties``, offsets and chunks (which also makes ``.metadata`` smaller and faster to
  unpickle); DTensor/ShardedTensor/object leaves use stock's helpers; replicated items are
  deduplicated across ranks largest first onto the rank with the fewest bytes so far (each written
  exactly once, bytes spread by size). Garbage collection is paused while the many small objects of
  a plan are built or unpickled (a full collection of a large heap otherwise costs more than the
  work itself).
- **Per-item calls** (``resolve_data``, ``resolve_tensor``) look tensors up with one dict access.

``FastLoadPlanner`` caches the local read plan keyed on the destination's structure key and the
content of the checkpoint's ``state_dict_metadata``: loading the same checkpoint again, or another
checkpoint of the same model, reuses the plan; a checkpoint with other shapes or chunks replans.

Caches are per process, bounded (:data:`_CACHE_ENTRIES` structures each), hold no tensors, and can
be dropped with :func:`clear_plan_caches`. Plans handed out share their (frozen) items with the
cache; like DCP's own code, callers must not mutate a plan's item list or metadata entries in place.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import threading
from collections import ChainMap, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint import default_planner as _default_planner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _create_write_items
from torch.distributed.tensor import DTensor

from ._gc import gc_paused

__all__ = ["FastSavePlanner", "FastLoadPlanner", "clear_plan_caches"]

# How many state-dict structures each cache remembers (LRU). A training job saving a model and an
# optimizer as two checkpoints needs two; the bound keeps plans of long-gone structures from piling up.
_CACHE_ENTRIES = 8

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


# ============================================================================================= #
# Plan item lists that cross collectives as one cached blob
# ============================================================================================= #

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


# ============================================================================================= #
# Flattening with a structure key
# ============================================================================================= #


class _NeedsStock(Exception):
    """The state dict holds something only stock code handles exactly; take the stock path."""


@dataclass
class _FlatStateDict:
    """A flattened state dict and what its plans depend on.

    ``paths[i]`` is the object path of the i-th entry of ``state_dict`` (stock's flatten mapping
    values); ``signatures[i]`` describes its leaf (``None``: only stock code can describe it, so
    this state dict is not cached). ``dropped`` maps the keys of ShardedTensors without local
    shards, which stock's save leaves out of the state dict but keeps in the flatten mapping."""

    state_dict: dict[str, Any]
    paths: list[tuple[Any, ...]]
    signatures: list[tuple[Any, ...] | None]
    dropped: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple[Any, ...] | None:
        if any(s is None for s in self.signatures):
            return None
        return (tuple(self.paths), tuple(self.signatures), tuple(self.dropped.items()))

    def mappings(self) -> dict[str, tuple[Any, ...]]:
        mappings = dict(zip(self.state_dict, self.paths))
        mappings.update(self.dropped)
        return mappings


def _tensor_signature(value: torch.Tensor) -> tuple[Any, ...]:
    return (type(value), value.shape, value.dtype, value.layout, value.requires_grad, value.is_pinned())


def _leaf_signature(value: Any, for_load: bool) -> tuple[Any, ...] | None:
    """What the stock plan of one leaf depends on, or None when only stock code can tell.

    Raises :class:`_NeedsStock` for leaves that stock planning transforms first (meta tensors
    on load, nested ShardedTensors)."""
    cls = type(value)
    if cls in _PLAIN_TENSOR_TYPES:
        if for_load and value.is_meta:
            raise _NeedsStock  # stock's _init_state_dict materialises meta tensors
        return _tensor_signature(value)
    if cls is DTensor:
        local = value._local_tensor
        if type(local) not in _PLAIN_TENSOR_TYPES:
            return None  # a local tensor subclass plans its own items
        if for_load and local.is_meta:
            raise _NeedsStock
        mesh = value.device_mesh
        coordinate = mesh.get_coordinate()
        return (
            cls,
            value.shape,
            tuple(value.placements),
            tuple(mesh.shape),
            None if coordinate is None else tuple(coordinate),
            value.requires_grad,
            torch.is_grad_enabled(),  # DTensor.to_local() (used for the properties) depends on it
            _tensor_signature(local),
        )
    if cls is ShardedTensor:
        shards = value.local_shards()
        if any(isinstance(s.tensor, ShardedTensor) for s in shards):
            raise _NeedsStock  # nested (2-D FSDP) ShardedTensors: stock rewrites them
        if for_load and any(s.tensor.is_meta for s in shards):
            raise _NeedsStock  # stock raises its own error for these
        md = value.metadata()
        props = md.tensor_properties
        return (
            cls,
            md.size,
            (props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory),
            tuple((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in shards),
        )
    if isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
        return None  # tensor subclasses and other checkpointables: stock plans them
    return _OBJECT_SIGNATURE


_OBJECT_SIGNATURE = ("object",)


def _is_terminal(value: Any) -> bool:
    """Stock ``traverse_state_dict``'s rule: mappings are traversed; a list is traversed when it
    holds a tensor or a traversable container; anything else (tuples included) is a leaf."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
                return False
            if isinstance(entry, torch.Tensor):
                return False
    return True


def _flatten(state_dict: Mapping[Any, Any], *, flatten_sharded: bool, for_load: bool) -> _FlatStateDict:
    """Stock ``flatten_state_dict`` computing the structure key on the way, and with
    ``flatten_sharded`` the effect of stock's ``_flatten_sharded_tensors`` (which runs after
    flattening on save and before it on load): a ShardedTensor without local shards is left out.

    Raises :class:`_NeedsStock` where only stock code is exact: nested ShardedTensors, and on load
    meta tensors, non-dict mappings (stock's ``_init_state_dict`` replaces them) and list entries
    that hold no leaf (stock's re-nesting fills such a gap with ``None``)."""
    flat: dict[str, Any] = {}
    paths: list[tuple[Any, ...]] = []
    signatures: list[tuple[Any, ...] | None] = []
    dropped: dict[str, tuple[Any, ...]] = {}
    check_gaps = for_load and flatten_sharded

    def add(path: tuple[Any, ...], value: Any) -> None:
        fqn = path[0] if len(path) == 1 else ".".join(map(str, path))
        if fqn in flat or fqn in dropped:
            raise ValueError(f"duplicated flatten key {fqn}")
        if flatten_sharded and type(value) is ShardedTensor and not value.local_shards():
            if not for_load:
                dropped[fqn] = path
            return
        flat[fqn] = value
        paths.append(path)
        signatures.append(_leaf_signature(value, for_load))

    def visit(path: tuple[Any, ...], value: Any) -> None:
        if type(value) in _PLAIN_TENSOR_TYPES:
            add(path, value)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif isinstance(value, Mapping):
            if for_load:
                raise _NeedsStock
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif _is_terminal(value):
            add(path, value)
        else:  # a list holding tensors or containers
            for i, v in enumerate(value):
                before = len(flat)
                visit(path + (i,), v)
                if check_gaps and len(flat) == before:
                    raise _NeedsStock

    with gc_paused():
        for key, value in state_dict.items():
            visit((str(key),), value)
    return _FlatStateDict(flat, paths, signatures, dropped)


def _describe(state_dict: Mapping[str, Any], mappings: Mapping[str, Any] | None, for_load: bool) -> _FlatStateDict:
    """The structure key of a state dict stock code already flattened (with its flatten mapping,
    which may name dropped ShardedTensors the state dict no longer holds)."""
    paths = [mappings[k] if mappings else (k,) for k in state_dict]
    dropped = {k: v for k, v in mappings.items() if k not in state_dict} if mappings else {}
    try:
        signatures = [_leaf_signature(v, for_load) for v in state_dict.values()]
    except _NeedsStock:
        signatures = [None]
    return _FlatStateDict(dict(state_dict), paths, signatures, dropped)


def _legacy_flatten_active() -> bool:
    """Stock's flatten produces the pre-2.4 layout while ``_version._derived_version`` is set."""
    return getattr(_version, "_derived_version", None) is not None


def _has_legacy_keys(original_state_dict: dict[str, Any], missing: set[str]) -> bool:
    """Stock ``DefaultLoadPlanner``'s test for a checkpoint saved before torch 2.4: some key the
    destination lacks is a key of the pre-2.4 flattening of the destination."""
    _version._derived_version = "2_3"
    try:
        old_state_dict, _ = flatten_state_dict(original_state_dict)
    finally:
        _version._derived_version = None  # as stock leaves it
    return bool(old_state_dict.keys() & missing)


# ============================================================================================= #
# Building items in bulk
# ============================================================================================= #


class _SharedParts:
    """Equal pieces of plan items built once per plan: zero offsets per dimension count, sizes, chunks and
    tensor properties (also makes the pickled plans and ``.metadata`` smaller)."""

    def __init__(self) -> None:
        self.zeros: dict[int, torch.Size] = {}
        self.sizes: dict[torch.Size, torch.Size] = {}
        self.chunks: dict[torch.Size, ChunkStorageMetadata] = {}
        self.properties: dict[tuple[Any, ...], TensorProperties] = {}

    def zero(self, ndim: int) -> torch.Size:
        z = self.zeros.get(ndim)
        if z is None:
            z = self.zeros[ndim] = torch.Size([0] * ndim)
        return z

    def size(self, shape: torch.Size) -> torch.Size:
        return self.sizes.setdefault(shape, shape)

    def whole_chunk(self, shape: torch.Size) -> ChunkStorageMetadata:
        chunk = self.chunks.get(shape)
        if chunk is None:
            chunk = self.chunks[shape] = ChunkStorageMetadata(offsets=self.zero(len(shape)), sizes=self.size(shape))
        return chunk

    def tensor_properties(self, tensor: torch.Tensor) -> TensorProperties:
        # TensorProperties.create_from_tensor, shared between equal tensors.
        key = (tensor.dtype, tensor.layout, tensor.requires_grad, tensor.is_pinned())
        props = self.properties.get(key)
        if props is None:
            props = self.properties[key] = TensorProperties(
                dtype=key[0], layout=key[1], requires_grad=key[2], memory_format=torch.contiguous_format,
                pin_memory=key[3],
            )
        return props


def _local_write_items(state_dict: Mapping[str, Any]) -> list[WriteItem]:
    """Stock ``create_default_local_save_plan``'s items, plain tensors built in bulk.

    Plain tensor items carry index hint 0 (the coordinator's hint for a single chunk), so the
    global plan can reuse them unchanged."""
    parts = _SharedParts()
    items: list[WriteItem] = []
    append = items.append
    tensor_type, bytes_type = WriteItemType.TENSOR, WriteItemType.BYTE_IO
    for fqn, obj in state_dict.items():
        cls = type(obj)
        if cls in _PLAIN_TENSOR_TYPES:
            shape = parts.size(obj.shape)
            zero = parts.zero(len(shape))
            append(WriteItem(
                index=MetadataIndex(fqn, zero, 0),
                type=tensor_type,
                tensor_data=TensorWriteData(chunk=parts.whole_chunk(shape), properties=parts.tensor_properties(obj),
                                            size=shape),
            ))
        elif isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is not None:
                items.extend(_create_write_items(fqn, obj))
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            items.extend(_create_write_items(fqn, obj))
        else:
            append(WriteItem(index=MetadataIndex(fqn), type=bytes_type))
    return items


def _item_bytes(item: WriteItem) -> int:
    """Planned storage of an item, as stock dedup counts it (objects count 1)."""
    return item.tensor_storage_size() or 1


def _dedup_plans(all_items: list[list[WriteItem]], to_lowest_rank: bool) -> list[list[WriteItem]]:
    """Keep every item on exactly one rank.

    Items only one rank plans stay there. Each item several ranks plan (replicated tensors and
    objects) goes, largest first, to the rank with the fewest planned bytes so far (ties: the
    lowest rank), or to the lowest rank with ``to_lowest_rank`` (stock's
    ``dedup_save_to_lowest_rank``). Stock assigns in first-seen order instead of largest first."""
    if len(all_items) == 1:
        return all_items
    owners: dict[MetadataIndex, list[int]] = {}
    first: dict[MetadataIndex, WriteItem] = {}
    for rank, items in enumerate(all_items):
        for item in items:
            ranks = owners.get(item.index)
            if ranks is None:
                owners[item.index] = [rank]
                first[item.index] = item
            elif ranks[-1] != rank:
                ranks.append(rank)
    load = [0] * len(all_items)
    shared: list[tuple[int, int, MetadataIndex, list[int]]] = []
    for order, (index, ranks) in enumerate(owners.items()):
        size = _item_bytes(first[index])
        if len(ranks) == 1:
            load[ranks[0]] += size
        else:
            shared.append((-size, order, index, ranks))
    if not shared:
        return all_items
    shared.sort(key=lambda entry: (entry[0], entry[1]))
    chosen: dict[MetadataIndex, int] = {}
    for neg_size, _, index, ranks in shared:
        rank = ranks[0] if to_lowest_rank else min(ranks, key=lambda r: (load[r], r))
        load[rank] -= neg_size
        chosen[index] = rank
    return [
        [item for item in items if chosen.get(item.index, rank) == rank]
        for rank, items in enumerate(all_items)
    ]


_SHARED_BYTES_METADATA = BytesStorageMetadata()


def _global_plans_and_metadata(all_items: list[list[WriteItem]]) -> tuple[list[list[WriteItem]], dict[str, Any]]:
    """Stock ``create_default_global_save_plan``: the state-dict metadata and the items with
    their chunk index hints rewritten (an item is copied only when its hint changes)."""
    md: dict[str, Any] = {}
    new_all: list[list[WriteItem]] = []
    for items in all_items:
        new_items: list[WriteItem] = []
        for item in items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in md:
                    raise AssertionError("item.index.fqn not in md")
                md[fqn] = _SHARED_BYTES_METADATA
                new_items.append(item)
                continue
            if item.type != WriteItemType.SHARD and fqn in md:
                raise AssertionError("item.index.fqn not in md")
            data = item.tensor_data
            if data is None:
                raise AssertionError("item.tensor_data is not None")
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            hint = len(tensor_md.chunks)
            if item.index.index != hint:
                item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
            new_items.append(item)
            if data.chunk is None:
                raise AssertionError(f"Cannot create MD for tensor without bounds. FQN: {fqn}")
            tensor_md.chunks.append(data.chunk)
        new_all.append(new_items)
    return new_all, md


def _validate(global_plans: list[SavePlan], state_dict_metadata: dict[str, Any]) -> None:
    """Stock's global plan validation (chunk bounds, overlaps, coverage), skipping the tensors whose
    single chunk trivially covers them."""
    validate = getattr(_default_planner, "_validate_global_plan", None)
    if validate is None:  # pragma: no cover - a torch without it
        return
    to_check = {}
    for fqn, md in state_dict_metadata.items():
        if type(md) is TensorStorageMetadata:
            chunks = md.chunks
            if len(chunks) == 1 and chunks[0].sizes == md.size and not any(chunks[0].offsets):
                continue
            to_check[fqn] = md
    if not to_check:
        return
    result = validate(global_plans, Metadata(to_check))
    if result is False or (isinstance(result, list) and result):
        summary = "; ".join(result) if isinstance(result, list) else ""
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise ValueError(f"Failed to validate global plan: {summary}" if summary else "Failed to validate global plan")


def _fresh_metadata(cached: Metadata) -> Metadata:
    """A Metadata for one save: a new object with new top-level dicts (writers assign
    ``storage_data``/``storage_meta``/``version`` on it; users may get it back from ``dcp.save``)."""
    planner_data = cached.planner_data
    return Metadata(
        state_dict_metadata=dict(cached.state_dict_metadata),
        planner_data=dict(planner_data) if isinstance(planner_data, dict) else planner_data,
    )


def _supported_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


# ============================================================================================= #
# Save
# ============================================================================================= #


@dataclass(frozen=True)
class _CachedLocalSavePlan:
    items: _PackedItems
    mappings: dict[str, tuple[Any, ...]]


@dataclass(frozen=True)
class _CachedGlobalSavePlan:
    """What the coordinator planned for one set of local plans."""

    setting: tuple[Any, ...]
    local_items: list[Any]  # per rank, as received
    local_planner_data: list[Any]
    global_items: list[_PackedItems]  # per rank, deduplicated, index hints set
    metadata: Metadata

    def matches(self, setting: tuple[Any, ...], plans: list[SavePlan]) -> bool:
        if setting != self.setting or len(plans) != len(self.local_items):
            return False
        for plan, items, planner_data in zip(plans, self.local_items, self.local_planner_data):
            if not getattr(plan, "usable", True) or type(plan.items) is not _PackedItems \
                    or not plan.items.same_items(items):
                return False
            if plan.planner_data is not planner_data and plan.planner_data != planner_data:
                return False
        return True


class FastSavePlanner(DefaultSavePlanner):
    """Drop-in replacement for :class:`~torch.distributed.checkpoint.DefaultSavePlanner`.

    Takes stock's arguments with stock's meaning; the checkpoint (data and ``.metadata``) is what
    stock would write, except that replicated items are spread across ranks largest first.
    ``enable_plan_caching`` is accepted for compatibility: this planner always caches, in its own
    way (see the module docstring); stock's delta-plan mechanism is not used.

    fastdcp's own keyword argument:
        cache_plans: reuse local and global plans while the state dict's structure is unchanged
            (default True). False plans every save from scratch (still in bulk).
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        *,
        cache_plans: bool = True,
    ) -> None:
        stock = dict(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=False,
        )
        if dedup_replicated_tensors is not None:
            stock["dedup_replicated_tensors"] = dedup_replicated_tensors  # stock warns it is ignored
        super().__init__(**_supported_kwargs(DefaultSavePlanner, stock))
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        self.cache_plans = cache_plans
        self._structure_key: tuple[Any, ...] | None = None
        # Counters for tests and benchmarks: how this planner's plans were obtained.
        self.local_plan_hits = 0
        self.local_plan_misses = 0
        self.global_plan_hits = 0
        self.global_plan_misses = 0

    def _setting(self) -> tuple[Any, ...]:
        return (type(self), self.flatten_state_dict, self.flatten_sharded_tensors)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.is_coordinator = is_coordinator
        flat = None
        if self.flatten_state_dict and not _legacy_flatten_active():
            try:
                flat = _flatten(state_dict, flatten_sharded=self.flatten_sharded_tensors, for_load=False)
            except _NeedsStock:
                flat = None
        if flat is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            flat = _describe(self.state_dict, self.mappings if self.flatten_state_dict else None, False)
        self.state_dict = flat.state_dict
        key = flat.key if self.cache_plans else None
        self._structure_key = None if key is None else (self._setting(), key)
        cached = _local_save_plans.get(self._structure_key) if self._structure_key is not None else None
        self._cached_local = cached
        if cached is not None:
            self.mappings = cached.mappings
        elif self.flatten_state_dict:
            self.mappings = flat.mappings()
        else:
            self.mappings = {}

    def create_local_plan(self) -> SavePlan:
        planner_data = self.mappings if self.flatten_state_dict else None
        cached = self._cached_local
        if cached is not None:
            self.local_plan_hits += 1
            self.plan = SavePlan(cached.items, planner_data=planner_data)
            return self.plan
        self.local_plan_misses += 1
        with gc_paused():
            items = _PackedItems(_local_write_items(self.state_dict))
        if self._structure_key is not None:
            _local_save_plans.put(self._structure_key, _CachedLocalSavePlan(items, self.mappings))
        self.plan = SavePlan(items, planner_data=planner_data)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        setting = (type(self), self.flatten_state_dict, self.dedup_save_to_lowest_rank)
        entry = None
        if self.cache_plans:
            for candidate in _global_save_plans.values():
                if candidate.matches(setting, all_plans):
                    entry = candidate
                    break
        if entry is not None:
            self.global_plan_hits += 1
            _global_save_plans.put(id(entry), entry)  # most recently used
        else:
            self.global_plan_misses += 1
            entry = self._plan_globally(setting, all_plans)
            if self.cache_plans:
                _global_save_plans.put(id(entry), entry)
        # storage_data is this save's (the writer's prefixes are chosen after this, every save).
        self.global_plan = [
            dataclasses.replace(plan, items=items)
            for plan, items in zip(all_plans, entry.global_items)
        ]
        self.metadata = _fresh_metadata(entry.metadata)
        return self.global_plan, self.metadata

    def _plan_globally(self, setting: tuple[Any, ...], all_plans: list[SavePlan]) -> _CachedGlobalSavePlan:
        if not all(getattr(plan, "usable", True) for plan in all_plans):  # older torch: no field
            raise ValueError("FastSavePlanner received an unusable (delta) plan; it only plans full local plans")
        with gc_paused():
            deduped = _dedup_plans([list(plan.items) for plan in all_plans], self.dedup_save_to_lowest_rank)
            new_items, state_dict_metadata = _global_plans_and_metadata(deduped)
            global_items = [
                plan.items if type(plan.items) is _PackedItems and _same_list(items, plan.items)
                else _PackedItems(items)
                for plan, items in zip(all_plans, new_items)
            ]
            planner_data = None
            if self.flatten_state_dict:
                maps = [plan.planner_data for plan in all_plans]
                planner_data = dict(maps[0]) if len(maps) == 1 else dict(ChainMap(*maps))
            metadata = Metadata(state_dict_metadata, planner_data=planner_data)
            _validate([dataclasses.replace(p, items=i) for p, i in zip(all_plans, global_items)], state_dict_metadata)
        return _CachedGlobalSavePlan(
            setting=setting,
            local_items=[plan.items for plan in all_plans],
            local_planner_data=[plan.planner_data for plan in all_plans],
            global_items=global_items,
            metadata=metadata,
        )

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        # find_state_dict_object with one dict lookup for a plain tensor (its only chunk is at 0).
        obj = self.state_dict.get(index.fqn, _MISSING)
        if type(obj) in _PLAIN_TENSOR_TYPES and (index.offset is None or not any(index.offset)):
            return obj
        return super().lookup_object(index)

    def __getstate__(self) -> dict[str, Any]:
        # async_save(PROCESS) pickles the planner: leave out the last call's state dict and plans.
        state = dict(self.__dict__)
        for name in ("state_dict", "plan", "global_plan", "metadata", "mappings", "_cached_local"):
            state.pop(name, None)
        return state


def _same_list(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


_MISSING = object()


# ============================================================================================= #
# Load
# ============================================================================================= #


def _metadata_key(metadata: Metadata) -> tuple[Any, ...] | None:
    """What read plans depend on in a checkpoint's metadata: every entry's kind, size and chunk
    boxes (not file names or offsets, so other checkpoints of the same model share plans)."""
    key: list[Any] = []
    append = key.append
    with gc_paused():
        for fqn, md in metadata.state_dict_metadata.items():
            if type(md) is TensorStorageMetadata:
                chunks = md.chunks
                if len(chunks) == 1:
                    append((fqn, md.size, chunks[0].offsets, chunks[0].sizes))
                else:
                    append((fqn, md.size, tuple((c.offsets, c.sizes) for c in chunks)))
            else:
                append((fqn, type(md)))
        result = tuple(key)
    try:
        hash(result)
    except TypeError:
        return None  # unusual metadata (lists instead of torch.Size): no caching
    return result


def _local_read_items(state_dict: Mapping[str, Any], metadata: Metadata, strict: bool) -> list[ReadItem]:
    """Stock ``create_default_local_load_plan``'s items; plain tensors stored as one whole chunk
    (the usual case) are built in bulk."""
    parts = _SharedParts()
    items: list[ReadItem] = []
    state_md = metadata.state_dict_metadata
    tensor_type = LoadItemType.TENSOR
    for fqn, obj in state_dict.items():
        md = state_md.get(fqn)
        if md is None:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if type(obj) in _PLAIN_TENSOR_TYPES and type(md) is TensorStorageMetadata:
            shape = obj.shape
            if md.size != shape:
                raise ValueError(f"Size mismatch between saved {md.size} and current: {shape} for {fqn}")
            chunks = md.chunks
            if len(chunks) == 1 and chunks[0].sizes == shape and not any(chunks[0].offsets) and 0 not in shape:
                shape = parts.size(shape)
                zero = parts.zero(len(shape))
                index = MetadataIndex(fqn, zero, 0)
                items.append(ReadItem(type=tensor_type, dest_index=index, dest_offsets=zero, storage_index=index,
                                      storage_offsets=zero, lengths=shape))
                continue
        # Stock's per-key logic, verbatim.
        if (
            isinstance(md, TensorStorageMetadata)
            and getattr(obj, "size", None) is not None
            and md.size != obj.size()
        ):
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is not None:
                items.extend(_create_read_items(fqn, md, obj))
        else:
            items.extend(_create_read_items(fqn, md, obj))
    return items


class FastLoadPlanner(DefaultLoadPlanner):
    """Drop-in replacement for :class:`~torch.distributed.checkpoint.DefaultLoadPlanner`.

    Takes stock's arguments with stock's meaning and produces stock's read plan. The local plan is
    cached per (destination structure, checkpoint metadata content); loading into state dicts
    with meta tensors, and checkpoints saved before torch 2.4, take the stock path.

    fastdcp's own keyword argument:
        cache_plans: reuse read plans (default True).
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        cache_plans: bool = True,
    ) -> None:
        super().__init__(**_supported_kwargs(DefaultLoadPlanner, dict(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            allow_partial_load=allow_partial_load,
        )))
        self.allow_partial_load = allow_partial_load
        self.cache_plans = cache_plans
        self._structure_key: tuple[Any, ...] | None = None
        self.local_plan_hits = 0
        self.local_plan_misses = 0

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = None
        if self.flatten_state_dict and not _legacy_flatten_active():
            try:
                flat = _flatten(state_dict, flatten_sharded=self.flatten_sharded_tensors, for_load=True)
            except _NeedsStock:
                flat = None
        if flat is None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            flat = _describe(self.state_dict, self.mappings if self.flatten_state_dict else None, True)
        else:
            self.original_state_dict = state_dict
            self.state_dict = flat.state_dict
            self.mappings = flat.mappings()
            self.metadata = metadata
            self.is_coordinator = is_coordinator
        key = flat.key if self.cache_plans else None
        self._structure_key = None if key is None else (
            type(self), self.flatten_state_dict, self.flatten_sharded_tensors, self.allow_partial_load, key)

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("self.metadata is not None")
        key = None
        if self._structure_key is not None:
            metadata_key = _metadata_key(self.metadata)
            if metadata_key is not None:
                key = (self._structure_key, metadata_key)
        if key is not None:
            items = _local_load_plans.get(key)
            if items is not None:
                self.local_plan_hits += 1
                return LoadPlan(items)
        self.local_plan_misses += 1
        missing = self.metadata.state_dict_metadata.keys() - self.state_dict.keys()
        if missing and self.flatten_state_dict and _has_legacy_keys(self.original_state_dict, missing):
            return super().create_local_plan()  # a pre-2.4 checkpoint: stock re-flattens
        with gc_paused():
            items = _PackedItems(_local_read_items(self.state_dict, self.metadata, not self.allow_partial_load))
        if key is not None:
            _local_load_plans.put(key, items)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn, _MISSING)
        if type(obj) in _PLAIN_TENSOR_TYPES and (index.offset is None or not any(index.offset)):
            return obj
        return super().lookup_tensor(index)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        if read_item.lengths == tensor.shape:
            return tensor  # the whole tensor: narrow_tensor_by_index would not narrow any dim
        return super().transform_tensor(read_item, tensor)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("state_dict", "original_state_dict", "metadata", "mappings"):
            state.pop(name, None)
        return state
