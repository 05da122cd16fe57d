"""FastLoadPlanner: stock's read plan, cached per (destination structure, checkpoint metadata content);
planned from the checkpoint's chunk table when the reader provides one.
"""


from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
)

from ..io.gc import gc_paused
from ..io.phases import timed
from .items import _local_read_items, _metadata_key
from . import plan_cache
from .plan_cache import _PackedItems, as_item_list
from .read_items import chunk_table_of, covering_read_items, table_plan_key, table_read_items
from .structure import (
    _MISSING,
    _PLAIN_TENSOR_TYPES,
    _describe,
    _flatten,
    _has_legacy_keys,
    _legacy_flatten_active,
    _NeedsStock,
    _supported_kwargs,
)


def _unread_rank_section(metadata: Any) -> Any:
    """This rank's section of the chunk index when the reader's metadata offers one and the
    whole table has not been read (a ``SectionedTableMetadata``, duck-typed: planners do not
    import the load stage)."""
    if getattr(metadata, "table_loaded", True):
        return None
    rank_section = getattr(metadata, "rank_section", None)
    return rank_section() if callable(rank_section) else None


class FastLoadPlanner(DefaultLoadPlanner):
    """Drop-in replacement for :class:`~torch.distributed.checkpoint.DefaultLoadPlanner`.

    Takes stock's arguments with stock's meaning and produces stock's read plan. The local plan is
    cached per (destination structure, checkpoint metadata content); loading into state dicts
    with meta tensors, and checkpoints saved before torch 2.4, take the stock path.

    When the reader's metadata carries a chunk table (``metadata.chunk_table``, a
    :class:`~fastdcp.format.chunk_table.ChunkTable`), the plan is built from the table alone
    (:func:`fastdcp.planners.read_items.table_read_items`) and ``state_dict_metadata``, whose
    millions of objects such a reader builds only on demand, is never touched.

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

    @timed("plan")
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

    @timed("plan")
    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("self.metadata is not None")
        section = _unread_rank_section(self.metadata)
        if section is not None:
            plan = self._plan_from_section(section)
            if plan is not None:
                return plan
        table = chunk_table_of(self.metadata)
        key = None
        if self._structure_key is not None:
            metadata_key = _metadata_key(self.metadata) if table is None else table_plan_key(table)
            if metadata_key is not None:
                key = (self._structure_key, metadata_key)
        if key is not None:
            items = plan_cache.current_process_state().local_load_plans.get(key)
            if items is not None:
                self.local_plan_hits += 1
                return LoadPlan(items)
        self.local_plan_misses += 1
        saved_keys = self.metadata.state_dict_metadata.keys() if table is None else table.fqns
        if self._saved_before_2_4(saved_keys):
            return super().create_local_plan()  # stock re-flattens
        strict = not self.allow_partial_load
        with gc_paused():
            if table is None:
                items = _PackedItems(_local_read_items(self.state_dict, self.metadata, strict))
            else:
                items = _PackedItems(table_read_items(self.state_dict, table, strict))
        if key is not None:
            plan_cache.current_process_state().local_load_plans.put(key, items)
        return LoadPlan(items)

    def _saved_before_2_4(self, saved_keys: Any) -> bool:
        """Whether the checkpoint's keys are the pre-2.4 flattening of this state dict's."""
        missing = set(saved_keys) - self.state_dict.keys()
        return bool(missing) and self.flatten_state_dict and _has_legacy_keys(self.original_state_dict, missing)

    def _plan_from_section(self, section: Any) -> LoadPlan | None:
        """The plan from this rank's section of the chunk index, with the few other ranks' sections
        a resharded load needs, or None when they do not cover it
        (:func:`~fastdcp.planners.read_items.covering_read_items`)."""
        key = None
        if self._structure_key is not None:
            key = (self._structure_key, ("section", table_plan_key(section.table)))
            cached = plan_cache.current_process_state().local_load_plans.get(key)
            if cached is not None:
                self.local_plan_hits += 1
                self.metadata.planned_from(cached[1])
                return LoadPlan(cached[0])
        if self._saved_before_2_4(section.table.fqns):
            return None  # stock re-flattens, from the whole metadata
        with gc_paused():
            found = covering_read_items(self.state_dict, section, self.metadata.section_of, self.metadata.section_count,
                                        not self.allow_partial_load)
        if found is None:
            return None
        self.local_plan_misses += 1
        self.metadata.planned_from(found[1])  # the reader's storage lookups answer from it
        items = _PackedItems(found[0])
        if key is not None:
            plan_cache.current_process_state().local_load_plans.put(key, (items, found[1]))
        return LoadPlan(items)

    @timed("plan")
    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        # A plan whose items this process no longer remembered comes back undecoded
        # (plan_cache.UndecodedReadItems); storage readers get a list.
        items = as_item_list(new_plan.items)
        if items is not new_plan.items:
            new_plan = dataclasses.replace(new_plan, items=items)
        return super().finish_plan(new_plan)

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
