"""A state dict's structure key: one pass that flattens it (stock ``flatten_state_dict``
semantics) and records everything a stock plan depends on, or says only stock code can plan it.
"""


from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ..compat.torch_internals import TENSOR_PROPERTIES_HAVE_STRIDES
from ..io.gc import gc_paused


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


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
    # Since torch 2.15 a plan's TensorProperties record the tensor's strides.
    strides = value.stride() if TENSOR_PROPERTIES_HAVE_STRIDES else None
    return (type(value), value.shape, value.dtype, value.layout, value.requires_grad, value.is_pinned(), strides)


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


def _supported_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


_MISSING = object()
