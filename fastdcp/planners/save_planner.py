"""FastSavePlanner: stock's save plans and ``Metadata``, cached per state-dict structure (local
plans on every rank, global plans on the coordinator).
"""


from __future__ import annotations

import dataclasses
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
)

from ..io.gc import gc_paused
from ..io.phases import timed
from .items import _dedup_plans, _fresh_metadata, _global_plans_and_metadata, _local_write_items, _validate
from . import plan_cache
from ..format.table_metadata import TableMetadata
from .chunk_validation import validate_chunk_table
from .global_save_plan import BulkGlobalPlan, plan_globally_in_bulk
from .plan_cache import _PackedItems, _PackedMapping
from .plan_columns import ColumnarItems, GlobalItems, ItemStructure, RankColumns
from .structure import (
    _MISSING,
    _PLAIN_TENSOR_TYPES,
    _describe,
    _flatten,
    _legacy_flatten_active,
    _NeedsStock,
    _supported_kwargs,
)


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

    def fresh_metadata(self) -> Metadata:
        return _fresh_metadata(self.metadata)

    def matches(self, setting: tuple[Any, ...], plans: list[SavePlan], columns: Any) -> bool:
        if columns is not None or setting != self.setting or len(plans) != len(self.local_items):
            return False
        for plan, items, planner_data in zip(plans, self.local_items, self.local_planner_data):
            if not getattr(plan, "usable", True) or type(plan.items) is not _PackedItems \
                    or not plan.items.same_items(items):
                return False
            if plan.planner_data is not planner_data and plan.planner_data != planner_data:
                return False
        return True


@dataclass(frozen=True)
class _CachedBulkSavePlan:
    """What the coordinator planned in bulk for one set of local plans (sent as columns)."""

    setting: tuple[Any, ...]
    local_columns: list[RankColumns]  # per rank, as received
    local_planner_data: list[Any]
    global_items: list[GlobalItems]
    bulk: BulkGlobalPlan
    planner_data: Any

    def fresh_metadata(self) -> Metadata:
        planner_data = self.planner_data
        return TableMetadata(
            self.bulk.table, planner_data=dict(planner_data) if isinstance(planner_data, dict) else planner_data
        )

    def matches(self, setting: tuple[Any, ...], plans: list[SavePlan], columns: Any) -> bool:
        if columns is None or setting != self.setting or len(columns) != len(self.local_columns):
            return False
        for plan, (now, _), then, planner_data in zip(plans, columns, self.local_columns, self.local_planner_data):
            if now.itemsize != then.itemsize or now.numbers != then.numbers or (
                now.structure_blob is not then.structure_blob and now.structure_blob != then.structure_blob
            ):
                return False
            if plan.planner_data is not planner_data and plan.planner_data != planner_data:
                return False
        return True


def _columns_of(plans: list[SavePlan]) -> list[tuple[RankColumns, ItemStructure]] | None:
    """Every plan's items as columns, or None when some plan's items are not columns (then the
    global plan is built item by item)."""
    out = []
    for plan in plans:
        items = plan.items
        if isinstance(items, ColumnarItems):
            out.append((items.columns, items.structure))
        elif type(items) is _PackedItems and (columns := items.columns()) is not None:
            out.append(columns)
        else:
            return None
    return out


def _merged_planner_data(plans: list[SavePlan]) -> dict[str, Any]:
    """Stock's ``dict(ChainMap(*maps))`` of the ranks' flatten mappings, each distinct mapping
    object counted once (the coordinator receives the same unpickled object from every rank that
    sent the same mapping)."""
    maps = list({id(plan.planner_data): plan.planner_data for plan in plans}.values())
    return dict(maps[0]) if len(maps) == 1 else dict(ChainMap(*maps))


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

    @timed("plan")
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
        local_plans = plan_cache.current_process_state().local_save_plans
        cached = local_plans.get(self._structure_key) if self._structure_key is not None else None
        self._cached_local = cached
        if cached is not None:
            self.mappings = cached.mappings
        elif self.flatten_state_dict:
            self.mappings = _PackedMapping(flat.mappings())
        else:
            self.mappings = {}

    @timed("plan")
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
            local_plans = plan_cache.current_process_state().local_save_plans
            local_plans.put(self._structure_key, _CachedLocalSavePlan(items, self.mappings))
        self.plan = SavePlan(items, planner_data=planner_data)
        return self.plan

    @timed("plan")
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        setting = (type(self), self.flatten_state_dict, self.dedup_save_to_lowest_rank)
        if not all(getattr(plan, "usable", True) for plan in all_plans):  # older torch: no field
            raise ValueError("FastSavePlanner received an unusable (delta) plan; it only plans full local plans")
        columns = _columns_of(all_plans)
        cache = plan_cache.current_process_state().global_save_plans
        entry = None
        if self.cache_plans:
            for candidate in cache.values():
                if candidate.matches(setting, all_plans, columns):
                    entry = candidate
                    break
        if entry is not None:
            self.global_plan_hits += 1
            cache.put(id(entry), entry)  # most recently used
        else:
            self.global_plan_misses += 1
            if columns is not None:
                entry = self._plan_in_bulk(setting, all_plans, columns)
            else:
                entry = self._plan_globally(setting, all_plans)
            if self.cache_plans:
                cache.put(id(entry), entry)
        # storage_data is this save's (the writer's prefixes are chosen after this, every save).
        self.global_plan = [
            dataclasses.replace(plan, items=items)
            for plan, items in zip(all_plans, entry.global_items)
        ]
        self.metadata = entry.fresh_metadata()
        return self.global_plan, self.metadata

    def _plan_in_bulk(self, setting: tuple[Any, ...], all_plans: list[SavePlan],
                      columns: list[tuple[RankColumns, ItemStructure]]) -> _CachedBulkSavePlan:
        with gc_paused():
            bulk = plan_globally_in_bulk(columns, self.dedup_save_to_lowest_rank)
            errors = validate_chunk_table(bulk.table, several_ranks=len(all_plans) > 1)
            if errors:
                summary = "; ".join(errors)
                if len(summary) > 500:
                    summary = summary[:500] + "... (truncated)"
                raise ValueError(f"Failed to validate global plan: {summary}")
            planner_data = _merged_planner_data(all_plans) if self.flatten_state_dict else None
        return _CachedBulkSavePlan(
            setting=setting,
            local_columns=[c for c, _ in columns],
            local_planner_data=[plan.planner_data for plan in all_plans],
            global_items=bulk.global_items,
            bulk=bulk,
            planner_data=planner_data,
        )

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
            planner_data = _merged_planner_data(all_plans) if self.flatten_state_dict else None
            metadata = Metadata(state_dict_metadata, planner_data=planner_data)
            _validate([dataclasses.replace(p, items=i) for p, i in zip(all_plans, global_items)], state_dict_metadata)
        return _CachedGlobalSavePlan(
            setting=setting,
            local_items=[plan.items for plan in all_plans],
            local_planner_data=[plan.planner_data for plan in all_plans],
            global_items=global_items,
            metadata=metadata,
        )

    @timed("plan")
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if isinstance(new_plan.items, GlobalItems):  # not pickled on the way (no_dist, one rank)
            new_plan = dataclasses.replace(new_plan, items=new_plan.items.resolve())
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


