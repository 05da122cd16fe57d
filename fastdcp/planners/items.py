"""Plan items built in bulk: shared sizes, offsets and properties; replicated items deduplicated
across ranks largest first; the global plans and ``Metadata``; read items for a load.
"""


from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import default_planner as _default_planner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _create_write_items
from torch.distributed.tensor import DTensor

from ..compat.torch_internals import TENSOR_PROPERTIES_HAVE_STRIDES, validation_passed
from ..io.gc import gc_paused
from .structure import _PLAIN_TENSOR_TYPES


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
        # TensorProperties.create_from_tensor, shared between equal tensors (since torch 2.15 it
        # records the tensor's strides too).
        strides = tensor.stride() if TENSOR_PROPERTIES_HAVE_STRIDES else None
        key = (tensor.dtype, tensor.layout, tensor.requires_grad, tensor.is_pinned(), strides)
        props = self.properties.get(key)
        if props is None:
            fields = {"strides": strides} if TENSOR_PROPERTIES_HAVE_STRIDES else {}
            props = self.properties[key] = TensorProperties(
                dtype=key[0], layout=key[1], requires_grad=key[2], memory_format=torch.contiguous_format,
                pin_memory=key[3], **fields,
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
    to_check = {}
    for fqn, md in state_dict_metadata.items():
        if type(md) is TensorStorageMetadata:
            chunks = md.chunks
            if len(chunks) == 1 and chunks[0].sizes == md.size and not any(chunks[0].offsets):
                continue
            to_check[fqn] = md
    if not to_check:
        return
    passed, messages = validation_passed(_default_planner._validate_global_plan(global_plans, Metadata(to_check)))
    if not passed:
        summary = "; ".join(messages)
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
