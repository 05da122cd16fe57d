"""Save plans as columns: what crosses DCP's plan collectives at thousands of ranks.

A rank's local save plan is ~1,190 ``WriteItem`` objects for a 7B model with AdamW; pickled one by
one, 4,096 of them take the coordinator minutes to unpickle. Split into two parts, they don't:

- the **structure** (per item: key, type, tensor properties, global size) is the same on every
  rank of an FSDP/DTensor job, so it travels as one pickled blob that the coordinator decodes once
  per distinct blob (:class:`ItemStructure`);
- the **numbers** (per item: the chunk's offsets and sizes and the index hint) are one buffer
  per rank, of the narrowest of int16/int32/int64 that holds them, which the coordinator's bulk
  planner reads as a tensor.

On the way back, a rank's global plan is its own local plan with some replicated items dropped
and index hints set: the coordinator sends only that difference (:class:`GlobalItems`: a keep
mask and the hints), and the rank applies it to the local plan it kept (registered in its
:class:`~fastdcp.planners.plan_cache.PlanProcessState` under a random token that travels with the
local plan).

Plans whose items do not fit these columns (an index offset other than the chunk's offsets,
write items of unknown kinds) travel as one pickled list, as before (``_PackedItems``).
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..compat.torch_internals import tensor_properties_key
from ..format.chunk_table import int64_values, tensor_bytes
from ..io.gc import gc_paused
from .process_state import current_process_state

__all__ = ["ItemStructure", "RankColumns", "ColumnarItems", "GlobalItems", "PlannedItems", "encode_columns"]

NO_HINT = -1  # the numbers' value for MetadataIndex.index None


@dataclass(frozen=True)
class ItemStructure:
    """The per-item facts of a plan that do not depend on the rank's position in a sharding.

    ``ndims[i]`` is ``-1`` for a ``BYTE_IO`` item (no numbers). For a tensor item the numbers
    hold ``[hint, offsets..., sizes...]`` (``1 + 2 * ndim`` values) at ``starts[i]``."""

    fqns: tuple[str, ...]
    types: tuple[WriteItemType, ...]
    bytes_io: tuple[Any, ...]
    properties: tuple[Any, ...]
    sizes: tuple[Any, ...]
    ndims: tuple[int, ...]

    def __post_init__(self) -> None:
        starts, position = [], 0
        for ndim in self.ndims:
            starts.append(position)
            position += 0 if ndim < 0 else 1 + 2 * ndim
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "number_count", position)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Only the fields: the derived starts (and cached gather indices) are rebuilt on arrival.
        return (ItemStructure, (self.fqns, self.types, self.bytes_io, self.properties, self.sizes, self.ndims))

    @property
    def width(self) -> int:
        return max([1, *self.ndims])

    def gather_indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indices into a rank's numbers (with one zero appended at ``number_count``) that give
        the hints [items], offsets [items, width] and sizes [items, width] (zero past ndim and for
        bytes items; bytes items' hint reads the zero too)."""
        cached = getattr(self, "_gather", None)
        if cached is not None:
            return cached
        width, pad = self.width, self.number_count
        hint = torch.full((len(self.ndims),), pad, dtype=torch.int64)
        offsets = torch.full((len(self.ndims), width), pad, dtype=torch.int64)
        sizes = torch.full((len(self.ndims), width), pad, dtype=torch.int64)
        for i, (ndim, start) in enumerate(zip(self.ndims, self.starts)):
            if ndim < 0:
                continue
            hint[i] = start
            if ndim:
                offsets[i, :ndim] = torch.arange(start + 1, start + 1 + ndim)
                sizes[i, :ndim] = torch.arange(start + 1 + ndim, start + 1 + 2 * ndim)
        cached = (hint, offsets, sizes)
        object.__setattr__(self, "_gather", cached)
        return cached

    def item(self, i: int, numbers: Sequence[int]) -> WriteItem:
        """Item ``i`` rebuilt from a rank's numbers (equal to the one the rank planned)."""
        fqn, ndim = self.fqns[i], self.ndims[i]
        if ndim < 0:
            return WriteItem(index=MetadataIndex(fqn), type=self.types[i], bytes_io_data=self.bytes_io[i])
        start = self.starts[i]
        hint = numbers[start]
        offsets = torch.Size(numbers[start + 1 : start + 1 + ndim])
        sizes = torch.Size(numbers[start + 1 + ndim : start + 1 + 2 * ndim])
        return WriteItem(
            index=MetadataIndex(fqn, offsets, None if hint == NO_HINT else hint),
            type=self.types[i],
            bytes_io_data=self.bytes_io[i],
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets, sizes), properties=self.properties[i], size=self.sizes[i]
            ),
        )


# The integer widths the numbers travel in: the narrowest that holds all of a rank's numbers.
# (A 7B model's offsets and sizes fit int16 on every rank of a 16,384-rank FSDP job, a quarter of
# the bytes every rank sends the coordinator per save.)
_NUMBER_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RankColumns:
    """One rank's local plan as columns: ``token`` names the plan in the rank's process."""

    token: bytes
    structure_blob: bytes
    numbers: bytes  # structure.number_count values of ``itemsize`` bytes each (tensor_bytes)
    itemsize: int = 8  # 2, 4 or 8 (int16, int32, int64)

    def numbers_tensor(self) -> torch.Tensor:
        """The numbers as int64."""
        return number_values(self.numbers, self.itemsize)


def number_values(data: bytes | bytearray, itemsize: int) -> torch.Tensor:
    """``itemsize``-byte integers (:data:`_NUMBER_DTYPES`, native byte order, as
    :func:`tensor_bytes` wrote them) as an int64 tensor; a ``bytearray`` is read in place."""
    dtype = _NUMBER_DTYPES.get(itemsize)
    if dtype is None or len(data) % itemsize:
        raise ValueError(f"a save plan's numbers are {len(data)} bytes of {itemsize}-byte integers")
    if not len(data):
        return torch.zeros(0, dtype=torch.int64)
    values = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=dtype)
    return values if dtype == torch.int64 else values.to(torch.int64)


def narrowest_numbers(values: torch.Tensor) -> tuple[bytes, int]:
    """int64 ``values`` as bytes (:func:`tensor_bytes`) of the narrowest width in :data:`_NUMBER_DTYPES`
    that holds them all: (bytes, itemsize)."""
    if values.numel():
        low, high = (int(v) for v in torch.aminmax(values))
    else:
        low = high = 0
    for itemsize, dtype in _NUMBER_DTYPES.items():
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return tensor_bytes(values.to(dtype)), itemsize
    raise AssertionError("int64 values always fit int64")


def encode_columns(items: Sequence[WriteItem]) -> tuple[ItemStructure, bytes, bytes, int] | None:
    """``items`` as (structure, structure blob, numbers, their itemsize: :func:`narrowest_numbers`),
    or None when some item does not fit the columns (it then travels pickled whole)."""
    fqns, types, bytes_io, properties, sizes, ndims = [], [], [], [], [], []
    numbers: list[int] = []
    extend = numbers.extend
    shared: dict[Any, Any] = {}
    for item in items:
        if type(item) is not WriteItem:
            return None
        index = item.index
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO:
            if data is not None or index.offset is not None or index.index is not None:
                return None
            ndims.append(-1)
            properties.append(None)
            sizes.append(None)
        else:
            if data is None or data.chunk is None or index.offset != data.chunk.offsets:
                return None
            offsets, chunk_sizes = data.chunk.offsets, data.chunk.sizes
            if len(offsets) != len(chunk_sizes) or len(offsets) != len(data.size):
                return None
            ndims.append(len(offsets))
            # Equal properties and sizes as one object each, so the blob pickles each once.
            props = data.properties
            properties.append(shared.setdefault(tensor_properties_key(props), props))
            sizes.append(shared.setdefault(data.size, data.size))
            extend((NO_HINT if index.index is None else index.index, *offsets, *chunk_sizes))
        fqns.append(index.fqn)
        types.append(item.type)
        bytes_io.append(item.bytes_io_data)
    structure = ItemStructure(tuple(fqns), tuple(types), tuple(bytes_io), tuple(properties), tuple(sizes), tuple(ndims))
    # Keys repeat their prefixes ("model.layers.17.mlp..."): compressed, the structure every
    # rank sends is a fraction of its pickle.
    blob = zlib.compress(pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL), 1)
    try:
        packed = torch.tensor(numbers, dtype=torch.int64)
    except (OverflowError, RuntimeError):
        return None
    return (structure, blob, *narrowest_numbers(packed))


class ColumnarItems(Sequence):
    """The items of a local plan another process sent, kept as columns.

    The coordinator's bulk planner reads :attr:`columns`; anything else that iterates it gets
    ``WriteItem`` objects, built on first use. Pickles back as the same columns."""

    def __init__(self, columns: RankColumns, structure: ItemStructure) -> None:
        self.columns = columns
        self.structure = structure
        self._items: list[WriteItem] | None = None

    def _materialised(self) -> list[WriteItem]:
        if self._items is None:
            numbers = self.columns.numbers_tensor().tolist()
            with gc_paused():
                self._items = [self.structure.item(i, numbers) for i in range(len(self.structure.fqns))]
        return self._items

    def __len__(self) -> int:
        return len(self.structure.fqns)

    def __getitem__(self, i: Any) -> Any:
        return self._materialised()[i]

    def __iter__(self) -> Iterator[WriteItem]:
        return iter(self._materialised())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ColumnarItems):
            return self.columns.structure_blob == other.columns.structure_blob and \
                self.columns.itemsize == other.columns.itemsize and self.columns.numbers == other.columns.numbers
        return list(self) == other

    __hash__ = None  # type: ignore[assignment]

    def same_items(self, other: Any) -> bool:
        """True when ``other`` holds the same items (compared as columns)."""
        return isinstance(other, ColumnarItems) and (
            other is self
            or (other.structure is self.structure and other.columns.itemsize == self.columns.itemsize
                and other.columns.numbers == self.columns.numbers)
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        c = self.columns
        return (_columnar_items, (c.token, c.structure_blob, c.numbers, c.itemsize))

    def __repr__(self) -> str:
        return f"ColumnarItems({len(self)} items)"


def _columnar_items(token: bytes, structure_blob: bytes, numbers: bytes, itemsize: int = 8) -> Any:
    """Unpickling side of a local plan sent as columns: the rank that sent it gets its own list
    back; any other process gets :class:`ColumnarItems` (structure decoded once per blob)."""
    state = current_process_state()
    own = state.sent_plans.get(token)
    if own is not None:
        return own
    structure = state.unpacked.get(structure_blob)
    if structure is None:
        with gc_paused():
            structure = pickle.loads(zlib.decompress(structure_blob))
        if type(structure) is not ItemStructure:
            raise TypeError("a save plan's structure blob did not hold an ItemStructure")
        state.unpacked.remember(structure_blob, structure)
    return ColumnarItems(RankColumns(token, structure_blob, numbers, itemsize), structure)


def new_token() -> bytes:
    return secrets.token_bytes(16)


class PlannedItems(list):
    """A rank's global plan items (a real list), with the checkpoint table row of each item
    (int64 bytes) that the writer's results carry to the coordinator
    (``fastdcp.save.results.pack_write_results``)."""

    __slots__ = ("table_rows",)

    def __init__(self, items: list[WriteItem], table_rows: bytes) -> None:
        super().__init__(items)
        self.table_rows = table_rows


class GlobalItems(Sequence):
    """A rank's global plan as the difference from its local plan: which of its items it keeps
    (``keep``: a byte per local item, or None for all), the index hints of the kept items (int64,
    ``NO_HINT`` for bytes items) and the checkpoint table row of each kept item (int64; the
    writer's results name them, so the coordinator places results without looking them up).
    Pickles to ~16 bytes per item; the rank applies it to the local plan it registered under
    ``token`` (:func:`apply_global_items`)."""

    def __init__(self, token: bytes, keep: bytes | None, hints: bytes, rows: bytes) -> None:
        self.token = token
        self.keep = keep
        self.hints = hints
        self.rows = rows
        self._items: list[WriteItem] | None = None

    def resolve(self) -> list[WriteItem]:
        if self._items is None:
            self._items = apply_global_items(self.token, self.keep, self.hints, self.rows)
        return self._items

    def __len__(self) -> int:
        return len(self.hints) // 8

    def __getitem__(self, i: Any) -> Any:
        return self.resolve()[i]

    def __iter__(self) -> Iterator[WriteItem]:
        return iter(self.resolve())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (apply_global_items, (self.token, self.keep, self.hints, self.rows))

    def __repr__(self) -> str:
        return f"GlobalItems({len(self)} kept items)"


def _rank() -> int | None:
    """This process's rank in the default process group, or None outside one."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def plan_mismatch_message(local_fqns: list[str], keep_count: int | None, kept_count: int, global_count: int,
                          rank: int | None, shown: int = 3) -> str:
    """Why a rank cannot apply its global save plan: how many items the coordinator planned for it
    against how many its local plan has (``local_fqns``: their keys) and keeps, the keys only the
    local plan has when that can be told, the likely cause and what to do."""
    who = "this rank" if rank is None else f"rank {rank}"
    local_count = len(local_fqns)
    counts = f"its local plan has {local_count} items"
    if keep_count is not None:
        counts += f" (the coordinator's deduplication mask covers {keep_count} items and keeps {kept_count})"
    # How many items the coordinator saw in the local plan: the mask covers them all.
    seen = keep_count if keep_count is not None else global_count
    if local_count > seen:
        extra = local_fqns[seen:]
        names = ", ".join(repr(name) for name in extra[:shown]) + (", ..." if len(extra) > shown else "")
        more = local_count - seen
        differs = (f"the local plan has {more} more item{'s' * (more != 1)} than the coordinator saw, "
                   f"from {names} on")
    else:
        fewer = seen - local_count
        differs = f"the local plan has {fewer} fewer item{'s' * (fewer != 1)} than the coordinator saw"
    return (f"FastSavePlanner: the global save plan {who} received does not match the local plan it sent: "
            f"the coordinator planned {global_count} items for it, but {counts}; {differs}. The local plan "
            f"changed after it was sent to the coordinator: a custom planner or hook edited a plan's item "
            f"list in place (a cached plan edited so stays wrong for every later save). Build a new "
            f"SavePlan instead of editing one (dataclasses.replace(plan, items=[...])), call "
            f"fastdcp.planners.clear_plan_caches() on every rank, and save again.")


def apply_global_items(token: bytes, keep: bytes | None, hints: bytes, rows: bytes) -> Any:
    """The rank's global plan items: its registered local plan's items, kept per ``keep``, with
    index hints ``hints`` (items whose hint does not change are shared, not copied), carrying
    their table ``rows`` (:class:`PlannedItems`)."""
    state = current_process_state()
    key = (token, keep, hints, rows)
    cached = state.applied_plans.get(key)
    if cached is not None:
        return cached
    local = state.sent_plans.get(token)
    if local is None:
        raise RuntimeError(
            "FastSavePlanner: this process received a global save plan for a local plan it does not know "
            "(every rank must plan with FastSavePlanner, and receive the global plan in the process that "
            "made the local plan)"
        )
    hint_values = int64_values(hints).tolist()
    if keep is None:
        kept = local
    else:
        kept = [item for item, flag in zip(local, keep) if flag]
    if (keep is not None and len(keep) != len(local)) or len(kept) != len(hint_values):
        raise RuntimeError(plan_mismatch_message([item.index.fqn for item in local],
                                                 None if keep is None else len(keep), len(kept), len(hint_values),
                                                 _rank()))
    out = []
    with gc_paused():
        for item, hint in zip(kept, hint_values):
            if hint != NO_HINT and item.index.index != hint:
                item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
            out.append(item)
    items = PlannedItems(out, rows)
    state.applied_plans.put(key, items)
    return items
