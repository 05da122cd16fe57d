"""The coordinator's global save plan built in bulk from every rank's plan columns.

Stock ``create_default_global_save_plan`` walks every item of every rank in Python: dedup by
``MetadataIndex``, one ``ChunkStorageMetadata`` appended per chunk, a chunk index hint rewritten
per item; then ``_validate_global_plan`` sweeps each tensor's chunks (O(N^2) for a tensor split on
its smaller dimension). Here the same decisions are tensor operations over all rows at once (a row
is one item of one rank, in rank order then plan order):

1. replicated items (the same key ``(fqn, offsets)`` on several ranks) are found by sorting one
   int64 key per row; each goes, largest first, to the rank with the fewest bytes so far (or to
   the lowest rank with ``dedup_save_to_lowest_rank``) — exactly ``items._dedup_plans``;
2. the kept rows, stably sorted by the first appearance of their key, become the
   :class:`~fastdcp.format.chunk_table.ChunkTable` of the checkpoint (entry order and chunk order
   as stock's dict insertion gives them); a row's position within its entry is its index hint;
3. :func:`~fastdcp.planners.chunk_validation.validate_chunk_table` checks bounds, overlaps and
   coverage in O(R log R);
4. each rank's global plan is its local plan's keep mask and hints (:class:`GlobalItems`).

Python work is per rank and per distinct plan structure, never per row.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from ..format.chunk_table import ChunkTable, RankRows, tensor_bytes
from .plan_columns import NO_HINT, GlobalItems, ItemStructure, RankColumns, number_values
from .sort_order import stable_argsort

__all__ = ["BulkGlobalPlan", "plan_globally_in_bulk"]


@dataclass
class BulkGlobalPlan:
    """What the coordinator planned: the checkpoint's chunks (no storage yet), each rank's
    global plan items, and where each rank's kept items landed in the table
    (``table_rows[kept_start[r] + p]`` is the row of rank r's p-th global plan item)."""

    table: ChunkTable
    global_items: list[GlobalItems]
    table_rows: torch.Tensor  # int64 [kept rows], rank order then global plan order
    kept_start: torch.Tensor  # int64 [ranks + 1]


@dataclass
class _StructureFacts:
    """Per distinct structure: its tensors for the row arrays."""

    structure: ItemStructure
    fqn_ids: torch.Tensor  # int64 [items], global fqn ids
    is_shard: torch.Tensor  # bool [items]
    is_bytes: torch.Tensor  # bool [items]
    item_bytes: torch.Tensor  # int64 [items]: stock dedup's size (tensor_storage_size or 1)


def _structure_facts(structure: ItemStructure, fqn_ids: dict[str, int]) -> _StructureFacts:
    ids, shard, is_bytes, sizes = [], [], [], []
    for fqn, kind, props, size, ndim in zip(structure.fqns, structure.types, structure.properties,
                                            structure.sizes, structure.ndims):
        ids.append(fqn_ids.setdefault(fqn, len(fqn_ids)))
        shard.append(kind == WriteItemType.SHARD)
        is_bytes.append(ndim < 0)
        if ndim < 0:
            sizes.append(1)
        else:
            numel = 1
            for d in size:
                numel *= d
            sizes.append(numel * torch._utils._element_size(props.dtype) or 1)
    return _StructureFacts(
        structure,
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(shard, dtype=torch.bool),
        torch.tensor(is_bytes, dtype=torch.bool),
        torch.tensor(sizes, dtype=torch.int64),
    )


def plan_globally_in_bulk(plans: list[tuple[RankColumns, ItemStructure]], to_lowest_rank: bool) -> BulkGlobalPlan:
    """Stock's deduplicated global plans and chunk metadata for ``plans`` (one per rank, in rank
    order). Raises ``AssertionError`` where stock's ``create_default_global_save_plan`` does (a
    non-shard key planned twice after dedup); validation is the caller's."""
    ranks = len(plans)
    fqn_ids: dict[str, int] = {}
    facts: dict[int, _StructureFacts] = {}
    groups: dict[int, list[int]] = defaultdict(list)  # structure id -> ranks
    counts = []
    for rank, (_, structure) in enumerate(plans):
        key = id(structure)
        if key not in facts:
            facts[key] = _structure_facts(structure, fqn_ids)
        groups[key].append(rank)
        counts.append(len(structure.fqns))
    width = max([1] + [f.structure.width for f in facts.values()])
    row_start = torch.zeros(ranks + 1, dtype=torch.int64)
    row_start[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    rows = int(row_start[-1])

    fqn_of_row = torch.empty(rows, dtype=torch.int64)
    rank_of_row = torch.repeat_interleave(torch.arange(ranks, dtype=torch.int64), torch.tensor(counts))
    shard_row = torch.empty(rows, dtype=torch.bool)
    bytes_row = torch.empty(rows, dtype=torch.bool)
    size_row = torch.empty(rows, dtype=torch.int64)
    hint_row = torch.empty(rows, dtype=torch.int64)
    offsets = torch.zeros((rows, width), dtype=torch.int64)
    lengths = torch.zeros((rows, width), dtype=torch.int64)
    for key, group in groups.items():
        f = facts[key]
        items = len(f.structure.fqns)
        if not items:
            continue
        # The group's numbers, one row per rank with a zero appended (what the gather indices
        # of a missing number read); bytearray().join copies once and stays writable.
        count = f.structure.number_count
        padded = torch.zeros((len(group), count + 1), dtype=torch.int64)
        if count:
            itemsizes = {plans[r][0].itemsize for r in group}
            if len(itemsizes) == 1:  # the usual case: one conversion for the group
                numbers = bytearray().join(plans[r][0].numbers for r in group)
                padded[:, :-1] = number_values(numbers, itemsizes.pop()).view(len(group), -1)
                del numbers
            else:
                for i, r in enumerate(group):
                    padded[i, :-1] = plans[r][0].numbers_tensor()
        hint_index, offset_index, length_index = f.structure.gather_indices()
        g_width = offset_index.shape[1]
        hints = padded[:, hint_index]
        hints[:, f.is_bytes] = NO_HINT
        group_offsets = padded[:, offset_index]
        group_lengths = padded[:, length_index]
        del padded
        # Ranks of one structure are mostly consecutive (FSDP: all ranks, or all but the last
        # few), so their rows are one span: filled by broadcasting copies, not by an index.
        for first, end in _consecutive_runs(group):
            span = slice(int(row_start[group[first]]), int(row_start[group[end - 1] + 1]))
            runs = end - first
            fqn_of_row[span].view(runs, items).copy_(f.fqn_ids)
            shard_row[span].view(runs, items).copy_(f.is_shard)
            bytes_row[span].view(runs, items).copy_(f.is_bytes)
            size_row[span].view(runs, items).copy_(f.item_bytes)
            hint_row[span].view(runs, items).copy_(hints[first:end])
            offsets[span, :g_width].unflatten(0, (runs, items)).copy_(group_offsets[first:end])
            lengths[span, :g_width].unflatten(0, (runs, items)).copy_(group_lengths[first:end])

    keep, key_of_row = _dedup(fqn_of_row, offsets, rank_of_row, size_row, ranks, to_lowest_rank)
    kept = keep.nonzero().squeeze(1) if keep is not None else torch.arange(rows)
    kept_fqn = fqn_of_row[kept]

    # Entries in order of first appearance; rows grouped by entry, stable (rank, plan order).
    first = torch.full((len(fqn_ids),), rows, dtype=torch.int64)
    first.scatter_reduce_(0, kept_fqn, kept, reduce="amin")
    # A key seen again after dedup must come as a shard of the same tensor (stock asserts it).
    if bool(((first[kept_fqn] != kept) & ~shard_row[kept]).any()):
        raise AssertionError("item.index.fqn not in md")
    present = (first < rows).nonzero().squeeze(1)
    entry_order = present[torch.argsort(first[present], stable=True)]
    entry_of_fqn = torch.full((len(fqn_ids),), -1, dtype=torch.int64)
    entry_of_fqn[entry_order] = torch.arange(len(entry_order))
    kept_entry = entry_of_fqn[kept_fqn]
    order = stable_argsort(kept_entry)  # table row t holds kept row order[t]
    table_rows = torch.empty_like(order)
    table_rows[order] = torch.arange(len(order))
    entry_counts = torch.bincount(kept_entry, minlength=len(entry_order))
    entry_start = torch.zeros(len(entry_order) + 1, dtype=torch.int64)
    entry_start[1:] = torch.cumsum(entry_counts, 0)
    new_hints = table_rows - entry_start[kept_entry]
    new_hints[bytes_row[kept]] = NO_HINT

    table = _table(plans, facts, fqn_ids, entry_order.tolist(), entry_start, kept, order, offsets, lengths,
                   rank_of_row, row_start)
    table.rank_rows = _rank_rows(row_start, kept, table_rows, key_of_row)

    kept_start = torch.zeros(ranks + 1, dtype=torch.int64)
    kept_start[1:] = torch.cumsum(torch.bincount(rank_of_row[kept], minlength=ranks), 0)
    # Every rank's slices of three byte strings made once (per-rank tensor_bytes calls cost
    # more than the copies at thousands of ranks).
    bounds = kept_start.tolist()
    starts = row_start.tolist()
    all_keep = None if keep is None else tensor_bytes(keep.to(torch.uint8))
    all_hints, all_rows = tensor_bytes(new_hints), tensor_bytes(table_rows)
    global_items = []
    for rank, (columns, _) in enumerate(plans):
        kept_lo, kept_hi = bounds[rank], bounds[rank + 1]
        mask = None
        if all_keep is not None and kept_hi - kept_lo != starts[rank + 1] - starts[rank]:
            mask = all_keep[starts[rank]: starts[rank + 1]]
        global_items.append(GlobalItems(columns.token, mask, all_hints[8 * kept_lo: 8 * kept_hi],
                                        all_rows[8 * kept_lo: 8 * kept_hi]))
    return BulkGlobalPlan(table, global_items, table_rows, kept_start)


def _consecutive_runs(group: list[int]) -> list[tuple[int, int]]:
    """``group`` (ascending ranks) as maximal runs of consecutive ranks: (start, end) positions
    in ``group``."""
    runs = []
    start = 0
    for i in range(1, len(group) + 1):
        if i == len(group) or group[i] != group[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def _rank_rows(row_start: torch.Tensor, kept: torch.Tensor, table_rows: torch.Tensor,
               key_of_row: torch.Tensor | None) -> RankRows:
    """The table row of every rank's every item (a replicated item's is the row of the copy that
    was kept), ascending within each rank: :class:`RankRows`."""
    if key_of_row is None:  # every row kept
        rows = table_rows
    else:
        row_of_key = torch.empty(int(key_of_row.max()) + 1 if len(key_of_row) else 0, dtype=torch.int64)
        row_of_key[key_of_row[kept]] = table_rows
        rows = row_of_key[key_of_row]
    if len(rows) > 1:
        # Ascending already but for replicated items (each points at the row of the copy kept on
        # some other rank, numbered where that rank's items are): sort within each rank only.
        step_down = rows[1:] < rows[:-1]
        boundaries = row_start[1:-1]
        boundaries = boundaries[(boundaries > 0) & (boundaries < len(rows))] - 1
        step_down[boundaries] = False
        if bool(step_down.any()):
            rows = rows.clone() if key_of_row is None else rows
            _sort_within_ranks(rows, row_start)
    return RankRows(start=row_start.clone(), rows=rows)


def _sort_within_ranks(rows: torch.Tensor, row_start: torch.Tensor) -> None:
    """Sort ``rows`` in place within each rank's span ``row_start[r]:row_start[r + 1]``: runs of
    consecutive ranks with as many rows each are one [ranks, rows] block sorted along its rows
    (a rank's rows fit in cache; one sort over all rows would cost ~3 s at 16,384 ranks)."""
    counts = (row_start[1:] - row_start[:-1]).tolist()
    starts = row_start.tolist()
    first = 0
    for r in range(1, len(counts) + 1):
        if r == len(counts) or counts[r] != counts[first]:
            if counts[first] > 1:
                block = rows[starts[first]:starts[r]].view(r - first, counts[first])
                block.copy_(torch.sort(block, dim=1).values)
            first = r


def _dedup(fqn_of_row: torch.Tensor, offsets: torch.Tensor, rank_of_row: torch.Tensor, size_row: torch.Tensor,
           ranks: int, to_lowest_rank: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which rows stay (None: all), ``items._dedup_plans`` over rows; and, when some do not, a
    number per row equal exactly for rows of one key (None otherwise)."""
    if ranks == 1:
        return None, None
    key = _row_keys(fqn_of_row, offsets)
    # Rows grouped by key (one linear-time stable sort: within a key, rows stay in row = rank order).
    by_key = stable_argsort(key)
    sorted_key = key.index_select(0, by_key)
    del key
    starts_group = torch.ones(len(sorted_key), dtype=torch.bool)
    starts_group[1:] = sorted_key[1:] != sorted_key[:-1]
    del sorted_key
    group_of_sorted = torch.cumsum(starts_group, 0).sub_(1)
    group_rows = torch.bincount(group_of_sorted)
    shared_sorted = group_rows.index_select(0, group_of_sorted) > 1
    if not bool(shared_sorted.any()):
        return None, None
    inverse = torch.empty_like(by_key)
    inverse[by_key] = group_of_sorted
    shared_row = torch.empty_like(shared_sorted)
    shared_row[by_key] = shared_sorted
    load = torch.zeros(ranks, dtype=torch.int64)
    load.index_add_(0, rank_of_row[~shared_row], size_row[~shared_row])
    shared = by_key[shared_sorted]  # the shared rows, grouped by key, each key's rows in row order
    group_of = group_of_sorted[shared_sorted]
    del by_key, group_of_sorted, shared_sorted
    boundaries = torch.ones(len(shared), dtype=torch.bool)
    boundaries[1:] = group_of[1:] != group_of[:-1]
    group_first = boundaries.nonzero().squeeze(1)
    group_end = torch.cat([group_first[1:], torch.tensor([len(shared)])])
    first_row = shared[group_first]  # first-seen row of each shared key
    size = size_row[first_row]
    # Largest first, then first seen.
    by_priority = torch.argsort(first_row, stable=True)
    by_priority = by_priority[torch.argsort(-size[by_priority], stable=True)]
    keep = torch.ones(len(fqn_of_row), dtype=torch.bool)
    keep[shared] = False
    shared_ranks = rank_of_row[shared]
    starts, ends, sizes = group_first.tolist(), group_end.tolist(), size.tolist()
    for g in by_priority.tolist():
        candidates = shared_ranks[starts[g]: ends[g]]
        if to_lowest_rank:
            owner = int(candidates[0])
        else:
            owner = int(candidates[torch.argmin(load[candidates])])  # first minimum: lowest rank
        load[owner] += sizes[g]
        rows_of_group = shared[starts[g]: ends[g]]
        keep[rows_of_group[candidates == owner]] = True
    return keep, inverse


def _row_keys(fqn_of_row: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One int64 per row, equal exactly when (fqn, offsets) are (mixed radix over the observed
    ranges; falls back to ranks of unique rows when that would not fit 63 bits)."""
    key = fqn_of_row.clone()
    bound = int(fqn_of_row.max()) + 1 if len(fqn_of_row) else 1
    fits = True
    for d in range(offsets.shape[1]):
        column = offsets[:, d]
        low, high = (int(column.min()), int(column.max())) if len(column) else (0, 0)
        radix = high - low + 1
        if bound * radix >= 1 << 62:
            fits = False
            break
        key.mul_(radix).add_(column)  # in place: rows x 8 bytes per temporary at scale
        if low:
            key.sub_(low)
        bound *= radix
    if fits:
        return key
    _, inverse = torch.unique(torch.cat([fqn_of_row.unsqueeze(1), offsets], 1), dim=0, return_inverse=True)
    return inverse


def _table(plans, facts, fqn_ids, entry_fqns, entry_start, kept, order, offsets, lengths, rank_of_row,
           row_start) -> ChunkTable:
    """The ChunkTable of the kept rows: each entry's properties and size from its first row."""
    names = [None] * len(fqn_ids)
    for fqn, i in fqn_ids.items():
        names[i] = fqn
    table_kept = kept[order]
    first_rows = table_kept[entry_start[:-1]].tolist() if len(entry_fqns) else []
    first_ranks = rank_of_row[table_kept[entry_start[:-1]]].tolist() if len(entry_fqns) else []
    starts = row_start.tolist()
    properties, sizes = [], []
    for row, rank in zip(first_rows, first_ranks):
        structure = plans[rank][1]
        i = row - starts[rank]
        properties.append(structure.properties[i])
        sizes.append(structure.sizes[i])
    return ChunkTable(
        fqns=[names[i] for i in entry_fqns],
        properties=properties,
        sizes=sizes,
        row_start=entry_start,
        offsets=offsets.index_select(0, table_kept),
        lengths=lengths.index_select(0, table_kept),
    )
