"""Chunk validation of a global save plan in O(R log R): stock's ``_validate_global_plan`` verdict
(every chunk inside its tensor, no two chunks of a tensor overlapping, the chunks' volumes adding up
to the tensor's) computed on a :class:`~fastdcp.format.chunk_table.ChunkTable` with tensor operations.

Why: stock sweeps each tensor's chunks along the tensor's LARGEST dimension. A tensor sharded on dim 0
whose dim 1 is larger (Llama's 4096 x 11008 down projection over 4,096 ranks) has every chunk spanning
the whole sweep axis, so every chunk is compared with every other one: O(N^2) per tensor (1-2 s each at
4,096 ranks; a 7B model with AdamW has ~100 such entries, more with larger ones and more ranks).

How (R = rows of the table):

- bounds and volumes: one vectorised pass over every row; per-entry volume sums with ``index_add_``;
- overlaps, per entry, by layout:

  * one chunk: nothing to check;
  * a 1-D split (all chunks equal outside one dimension ``k``: Shard(d), FSDP, replicated copies),
    batched over all such entries with the same chunk count: sort by offset on ``k`` and compare each
    chunk with the running maximum end of the chunks before it (``cummax``), plus a sorted count
    for chunks that are empty or negative on ``k``;
  * a product grid of intervals (2-D sharding, FSDP + TP): the chunks overlap iff the intervals of
    one dimension do (checked as above) and every other dimension can supply a non-empty interval;
  * anything else: stock's sweep on that entry, along the dimension with the most distinct offsets
    (correct for arbitrary boxes, possibly slower; only unusual layouts get there).

Stock's semantics are reproduced exactly, quirks included: two boxes overlap when, in every dimension,
``o0 < o1 + s1 and o1 < o0 + s0`` (so an empty chunk strictly inside another one overlaps it, and
negative sizes take part as written); a chunk is out of bounds when an offset or size is negative or
``offset + size > tensor size``; the fill check (only when several ranks planned) sums the volumes of
ALL chunks, out-of-bounds ones included, and compares with the tensor's volume. Bytes entries and 0-d
tensors are skipped. Out-of-bounds and fill messages are stock's, each one; for overlaps at most
:data:`OVERLAP_PAIRS_PER_ENTRY` overlapping pairs are reported per entry (stock reports every pair),
each exactly as stock prints it (``current`` being the later chunk in stock's sweep order).

Entries holding numbers so large that int64 sums or products could overflow (beyond 2**61) are
checked with Python integers, one chunk at a time, like stock.

Implementation note: rows are picked with ``index_select``/``gather``/``scatter_``, never with
advanced indexing (``x[idx]``, ``x[idx] = y``), ``amin``/``amax`` rather than ``min(0)``/``max(0)``,
and no ``searchsorted``: on a coordinator whose cores are busy (other ranks' processes), those
parallelise even a few thousand elements and then cost ~20 ms per call instead of microseconds.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right, insort

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ..format.chunk_table import ChunkTable

__all__ = ["OVERLAP_PAIRS_PER_ENTRY", "validate_chunk_table"]

logger = logging.getLogger("fastdcp")  # the library's one logger: it prints nothing by itself

# Overlapping pairs reported per entry: enough to see what is wrong, bounded so that a badly broken plan
# at thousands of ranks does not produce millions of messages (stock reports every pair).
OVERLAP_PAIRS_PER_ENTRY = 10

# Entries with an offset, size, chunk volume or summed volume beyond this are checked with Python
# integers: below it, ``offset + size`` and int64 volume sums cannot overflow.
_INT64_SAFE = 1 << 61

Box = tuple[list[int], list[int]]  # (offsets, sizes) of one chunk, as Python ints
Pair = tuple[int, int]  # two chunk indices within an entry (not yet in stock's print order)


def validate_chunk_table(table: ChunkTable, several_ranks: bool) -> list[str]:
    """Stock ``_validate_global_plan``'s error messages for every tensor entry of ``table``.

    ``several_ranks`` is stock's ``len(global_plan) > 1``: only then is the fill check done. Messages
    come entry by entry in table order and, within an entry, as stock orders them: out-of-bounds chunks
    (in chunk order), overlapping pairs (at most :data:`OVERLAP_PAIRS_PER_ENTRY`), the fill error. Each
    message is also logged at warning level on the ``fastdcp`` logger, as stock logs them.

    Precondition: the table's layout (``row_start`` CSR over ``offsets``/``lengths`` [rows, width];
    numbers past an entry's ``ndim`` are ignored). The verdict (which entries are invalid, and with
    which kinds of error) equals stock's for any table, including empty, negative and out-of-bounds
    chunks. Cost: O(R log R) tensor work plus a few tensor calls per entry for 1-D splits and grids;
    entries of other layouts fall back to stock's sweep (exact, O(n^2) at worst for that entry), and
    entries with numbers beyond 2**61 to Python integers.
    """
    entries = len(table.fqns)
    ndims = [0 if size is None else len(size) for size in table.sizes]
    width = max([int(table.offsets.shape[1]), *ndims, 1])
    offsets = _widen(table.offsets, width)
    lengths = _widen(table.lengths, width)
    row_start = table.row_start.to(torch.int64)
    counts = row_start[1:] - row_start[:-1]
    row_entry = table.entry_of_rows()

    ndim_of_entry = torch.tensor(ndims, dtype=torch.int64)
    row_ndim = ndim_of_entry.index_select(0, row_entry)
    in_dims = torch.arange(width, dtype=torch.int64)[None, :] < row_ndim[:, None]  # [R, W]
    offsets = torch.where(in_dims, offsets, 0)
    lengths = torch.where(in_dims, lengths, 0)

    sizes = torch.tensor(
        [[*(size or ()), *[0] * (width - len(size or ()))] for size in table.sizes], dtype=torch.int64
    ).reshape(entries, width)

    # Entries whose numbers could overflow int64 arithmetic go to the Python-integer path. Usually one
    # bound for the whole table settles it: every sum is at most rows * largest**width.
    safe = _INT64_SAFE
    rows = int(offsets.shape[0])
    largest = 0
    if rows:
        largest = max(int(offsets.amax()), -int(offsets.amin()), int(lengths.amax()), -int(lengths.amin()))
    if rows * max(largest, 1) ** width <= safe:
        huge_row = torch.zeros(rows, dtype=torch.bool)
        huge_entry = torch.zeros(entries, dtype=torch.bool)
    else:
        huge_row = ((offsets > safe) | (offsets < -safe) | (lengths > safe) | (lengths < -safe)).any(1)
        volume_bound = torch.where(in_dims, lengths, 1).to(torch.float64).abs().prod(1)
        huge_row |= volume_bound > safe
        huge_entry = torch.zeros(entries, dtype=torch.int64).index_add_(0, row_entry, huge_row.long()) > 0
        huge_entry |= torch.zeros(entries, dtype=torch.float64).index_add_(0, row_entry, volume_bound) > safe

    # Bounds, one pass over every row (padding columns are 0 + 0 <= 0, never out of bounds).
    row_sizes = sizes.index_select(0, row_entry)
    outside = ((offsets < 0) | (lengths < 0) | (offsets + lengths > row_sizes)).any(1)
    if bool(huge_entry.any()):
        outside &= ~huge_entry.index_select(0, row_entry)

    # Volumes: ALL chunks count, out-of-bounds ones included (stock's sum).
    row_volume = torch.where(in_dims & ~huge_row[:, None], lengths, 1).prod(1)
    chunks_volume = torch.zeros(entries, dtype=torch.int64).index_add_(0, row_entry, row_volume).tolist()

    checked = [ndims[e] > 0 for e in range(entries)]
    huge = huge_entry.tolist()
    count_list = counts.tolist()
    starts = row_start.tolist()

    bounds_rows: dict[int, list[int]] = {}
    for r in outside.nonzero().flatten().tolist():
        bounds_rows.setdefault(_entry_of(starts, r), []).append(r)

    overlap_pairs = _overlapping_pairs(
        offsets, lengths, row_start, count_list, ndims,
        [checked[e] and not huge[e] and count_list[e] > 1 for e in range(entries)],
    )

    errors: list[str] = []
    for e in range(entries):
        if not checked[e]:
            continue
        key = table.fqns[e]
        size = table.sizes[e]
        assert size is not None
        ndim = ndims[e]
        if huge[e]:
            boxes = [_box(offsets, lengths, r, ndim) for r in range(starts[e], starts[e + 1])]
            messages = _python_entry(key, size, boxes, several_ranks)
        else:
            messages = []
            for r in bounds_rows.get(e, ()):
                chunk = _chunk(*_box(offsets, lengths, r, ndim))
                messages.append(f"key:{key} has out of bounds chunk: tensor-size:{size} chunk: {chunk}")
            pairs = overlap_pairs.get(e)
            if pairs:
                boxes_of = {i: _box(offsets, lengths, starts[e] + i, ndim) for pair in pairs for i in pair}
                messages.extend(_overlap_messages(key, size, boxes_of, pairs))
            tensor_volume = math.prod(size)
            if several_ranks and chunks_volume[e] != tensor_volume:
                messages.append(
                    f"key:{key} invalid fill tensor-volume: {tensor_volume} chunks-volume: {chunks_volume[e]}"
                )
        for message in messages:
            logger.warning("%s", message)
        errors.extend(messages)
    return errors


def _widen(columns: torch.Tensor, width: int) -> torch.Tensor:
    """``columns`` ([rows, w]) as int64 [rows, width], zero-padded on the right (a table may be
    narrower than a tensor entry that has no chunks at all)."""
    columns = columns.to(torch.int64)
    if columns.shape[1] < width:
        columns = torch.nn.functional.pad(columns, (0, width - columns.shape[1]))
    return columns


def _entry_of(starts: list[int], row: int) -> int:
    """The entry owning ``row`` (binary search in the CSR starts)."""
    return bisect_right(starts, row) - 1


def _box(offsets: torch.Tensor, lengths: torch.Tensor, row: int, ndim: int) -> Box:
    return offsets[row, :ndim].tolist(), lengths[row, :ndim].tolist()


def _chunk(offsets: list[int], sizes: list[int]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _overlap_messages(key: str, size: torch.Size, boxes: dict[int, Box], pairs: list[Pair]) -> list[str]:
    """Stock's message per pair: ``current`` is the chunk stock's sweep meets later (sorted by the
    offset on the largest dimension, then all offsets, then chunk index)."""
    ndim = len(size)
    sweep_dim = max(range(ndim), default=0, key=lambda d: size[d])

    def order(i: int) -> tuple[int, ...]:
        o = boxes[i][0]
        return (o[sweep_dim], *o, i)

    messages = []
    for i, j in pairs:
        other, current = sorted((i, j), key=order)
        messages.append(f"key:{key} has overlapping chunks: {_chunk(*boxes[current])} {_chunk(*boxes[other])}")
    return messages


def _boxes_overlap(box0: Box, box1: Box) -> bool:
    """Stock's ``_check_box_overlap``: in every dimension each box starts before the other one ends."""
    (o0, s0), (o1, s1) = box0, box1
    for d in range(len(o0)):
        if o0[d] >= o1[d] + s1[d] or o1[d] >= o0[d] + s0[d]:
            return False
    return True


def _sweep_pairs(boxes: list[Box], indices: list[int], limit: int) -> list[Pair]:
    """Stock's sweep over the given chunks, along the dimension where their offsets take the most
    distinct values; stops after ``limit`` overlapping pairs. Exact for arbitrary boxes (a chunk
    leaves the active list only once the sweep has passed its end, after which no later chunk can
    satisfy the overlap test on that dimension), O(N^2) only when many chunks stay active at once."""
    if len(indices) < 2:
        return []
    ndim = len(boxes[indices[0]][0])
    if ndim == 0:
        return []
    sweep_dim = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in indices}))
    ordered = sorted(indices, key=lambda i: (boxes[i][0][sweep_dim], i))
    active: list[tuple[int, int]] = []  # (end on sweep_dim, chunk index), sorted
    pairs: list[Pair] = []
    for i in ordered:
        offsets, sizes = boxes[i]
        start = offsets[sweep_dim]
        cutoff = bisect_right(active, (start, math.inf))
        if cutoff:
            del active[:cutoff]
        for _, j in active:
            if _boxes_overlap(boxes[i], boxes[j]):
                pairs.append((i, j))
                if len(pairs) >= limit:
                    return pairs
        insort(active, (start + sizes[sweep_dim], i))
    return pairs


def _python_entry(key: str, size: torch.Size, boxes: list[Box], several_ranks: bool) -> list[str]:
    """One entry checked with Python integers, as stock does (only for entries with numbers too large
    for int64 arithmetic)."""
    messages = []
    chunks_volume = 0
    for offsets, sizes in boxes:
        inside = all(offsets[d] >= 0 and sizes[d] >= 0 and offsets[d] + sizes[d] <= size[d] for d in range(len(size)))
        if not inside:
            messages.append(f"key:{key} has out of bounds chunk: tensor-size:{size} chunk: {_chunk(offsets, sizes)}")
        chunks_volume += math.prod(sizes)
    if len(boxes) > 1:
        pairs = _sweep_pairs(boxes, list(range(len(boxes))), OVERLAP_PAIRS_PER_ENTRY)
        messages.extend(_overlap_messages(key, size, dict(enumerate(boxes)), pairs))
    tensor_volume = math.prod(size)
    if several_ranks and chunks_volume != tensor_volume:
        messages.append(f"key:{key} invalid fill tensor-volume: {tensor_volume} chunks-volume: {chunks_volume}")
    return messages


def _interval_overlaps(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For G independent sets of n intervals (``starts``/``ends`` int64 [G, n], ends may lie before
    starts): ``(hit, witness)``, both [G, n] in the given column order. ``hit[g, i]`` says interval i
    meets an interval j before it in sorted-start order under stock's test (``start_i < end_j and
    start_j < end_i``), and ``witness[g, i]`` is such a j. Some interval of a set hits iff two of its
    intervals overlap (every overlapping pair is seen from its later member). O(G n log n).

    Why it is exact: for a later interval i with ``end_i > start_i``, every earlier j has
    ``start_j <= start_i < end_i``, so only ``end_j > start_i`` is left to test: against the running
    maximum of the ends before i. For an empty or reversed i (``end_i <= start_i``) the candidates are
    the j with ``start_j < end_i`` (all before i in sorted order, i excluded), a prefix of the sorted
    starts: test the maximum end over that prefix."""
    # Chunks of a split usually come in rank order, their starts ascending: then the sorted order
    # is the given one (a stable sort leaves it as it is) and no gather or scatter is needed.
    in_order = starts.shape[1] < 2 or bool((starts[:, 1:] >= starts[:, :-1]).all())
    order = None if in_order else torch.argsort(starts, dim=1, stable=True)
    a = starts if order is None else starts.gather(1, order)
    b = ends if order is None else ends.gather(1, order)
    max_end, max_at = torch.cummax(b, dim=1)
    proper = b > a
    hit = torch.zeros_like(proper)
    witness = torch.zeros_like(a)
    hit[:, 1:] = proper[:, 1:] & (max_end[:, :-1] > a[:, 1:])
    witness[:, 1:] = max_at[:, :-1]
    sets = (~proper).any(1).nonzero().flatten()  # only the sets holding empty or reversed intervals
    if sets.numel():
        a_d, b_d = a.index_select(0, sets), b.index_select(0, sets)
        before = _count_below(a_d, b_d)
        prefix_last = (before - 1).clamp_min(0)
        max_end_d, max_at_d = max_end.index_select(0, sets), max_at.index_select(0, sets)
        degenerate_hit = (b_d <= a_d) & (before > 0) & (max_end_d.gather(1, prefix_last) > a_d)
        hit.index_copy_(0, sets, hit.index_select(0, sets) | degenerate_hit)
        witness.index_copy_(
            0, sets, torch.where(degenerate_hit, max_at_d.gather(1, prefix_last), witness.index_select(0, sets))
        )
    if order is None:
        return hit, witness
    # Back to the caller's column order: sorted position p is column order[g, p].
    hit_out = torch.zeros_like(hit).scatter_(1, order, hit)
    witness_out = torch.zeros_like(order).scatter_(1, order, order.gather(1, witness))
    return hit_out, witness_out


def _count_below(sorted_values: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """int64 [G, n]: how many of ``sorted_values[g]`` (ascending) are < ``bounds[g, i]``."""
    return torch.searchsorted(sorted_values.contiguous(), bounds.contiguous())


def _overlapping_pairs(
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    row_start: torch.Tensor,
    counts: list[int],
    ndims: list[int],
    to_check: list[bool],
) -> dict[int, list[Pair]]:
    """entry -> up to :data:`OVERLAP_PAIRS_PER_ENTRY` overlapping chunk pairs (indices within the
    entry), for the entries flagged in ``to_check``; entries without overlaps are absent."""
    entries = len(counts)
    if not any(to_check):
        return {}
    width = offsets.shape[1]
    row_entry = torch.repeat_interleave(torch.arange(entries, dtype=torch.int64), row_start[1:] - row_start[:-1])
    first_row = row_start[:-1].index_select(0, row_entry)
    differs = (offsets != offsets.index_select(0, first_row)) | (lengths != lengths.index_select(0, first_row))
    varying = torch.zeros((entries, width), dtype=torch.int64).index_add_(0, row_entry, differs.long()) > 0
    varying_dims = varying.sum(1).tolist()
    split_dim = varying.long().argmax(1).tolist()  # the varying dimension (0 when none varies)

    found: dict[int, list[Pair]] = {}
    one_dim_by_count: dict[int, list[int]] = {}
    for e in range(entries):
        if not to_check[e]:
            continue
        if varying_dims[e] <= 1:
            # Chunks agree outside dim k: there the test is ``o < o + s``, so any common size <= 0 on
            # another dimension rules every pair out; otherwise it is the 1-D test on k.
            k = split_dim[e]
            common = lengths[int(row_start[e])].tolist()
            if all(common[d] > 0 for d in range(ndims[e]) if d != k):
                one_dim_by_count.setdefault(counts[e], []).append(e)
        else:
            pairs = _grid_or_sweep_pairs(offsets, lengths, int(row_start[e]), counts[e], ndims[e])
            if pairs:
                found[e] = pairs

    for n, group in one_dim_by_count.items():
        group_t = torch.tensor(group, dtype=torch.int64)
        rows = row_start.index_select(0, group_t)[:, None] + torch.arange(n, dtype=torch.int64)[None, :]  # [G, n]
        k = torch.tensor([split_dim[e] for e in group], dtype=torch.int64)[:, None]
        cells = (rows * width + k).flatten()  # (row, k) in the flattened [R, W] columns
        starts = offsets.reshape(-1).index_select(0, cells).reshape(len(group), n)
        ends = starts + lengths.reshape(-1).index_select(0, cells).reshape(len(group), n)
        hit, witness = _interval_overlaps(starts, ends)
        where = hit.nonzero()
        if where.numel() == 0:
            continue
        later = where[:, 1]
        earlier = witness.reshape(-1).index_select(0, where[:, 0] * n + later)
        for g, i, j in zip(where[:, 0].tolist(), later.tolist(), earlier.tolist()):
            pairs = found.setdefault(group[g], [])
            if len(pairs) < OVERLAP_PAIRS_PER_ENTRY:
                pairs.append((i, j))
    return found


def _distinct_intervals(starts: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (start, size) pairs of one dimension, sorted, as int64 [m, 2], and each chunk's
    index into them (int64 [n]). Two stable sorts instead of ``torch.unique(dim=0)``, which is
    ~100x slower on a few thousand rows."""
    order = torch.argsort(sizes, stable=True)
    order = order.index_select(0, torch.argsort(starts.index_select(0, order), stable=True))
    sorted_starts, sorted_sizes = starts.index_select(0, order), sizes.index_select(0, order)
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = (sorted_starts[1:] != sorted_starts[:-1]) | (sorted_sizes[1:] != sorted_sizes[:-1])
    inverse = torch.empty_like(order).scatter_(0, order, torch.cumsum(first, 0) - 1)
    values = torch.stack([sorted_starts.masked_select(first), sorted_sizes.masked_select(first)], 1)
    return values, inverse


def _grid_or_sweep_pairs(offsets: torch.Tensor, lengths: torch.Tensor, first: int, n: int, ndim: int) -> list[Pair]:
    """Overlapping pairs of one entry whose chunks vary in several dimensions.

    Chunks that are empty or reversed on a dimension where they lie at or beyond the edge of all the
    entry's chunks (``offset >= every end`` or ``end <= every offset``) overlap nothing and are set
    aside. The remaining chunks, when every combination of their per-dimension intervals is one of
    them (a product grid, possibly with repeated chunks), overlap iff a non-empty chunk is repeated, or
    some dimension has two overlapping intervals while every other dimension has a non-empty interval
    or an overlapping pair (the witness pair is built from those). Otherwise stock's sweep runs on
    them. O(n log n) for grids."""
    # Contiguous copies: reductions over a strided slice of the table are far slower.
    o = offsets[first : first + n, :ndim].contiguous()
    s = lengths[first : first + n, :ndim].contiguous()
    end = o + s
    lowest, highest = o.amin(0), end.amax(0)
    inert = ((s <= 0) & ((o >= highest) | (end <= lowest))).any(1)
    kept = (~inert).nonzero().flatten()
    if kept.numel() < 2:
        return []
    o, s = o.index_select(0, kept), s.index_select(0, kept)

    intervals, codes = zip(*(_distinct_intervals(o[:, d], s[:, d]) for d in range(ndim)))
    grid_size = math.prod(len(v) for v in intervals)
    cell = None
    if grid_size <= len(kept):
        stride, cell = 1, torch.zeros(len(kept), dtype=torch.int64)
        for d in reversed(range(ndim)):
            cell += codes[d] * stride
            stride *= len(intervals[d])
        copies = torch.bincount(cell, minlength=grid_size)
        if bool((copies == 0).any()):
            cell = None
    if cell is None:
        boxes = {r: _box(offsets, lengths, first + r, ndim) for r in kept.tolist()}
        return _sweep_pairs([boxes.get(i, ([], [])) for i in range(n)], list(boxes), OVERLAP_PAIRS_PER_ENTRY)

    pairs: list[Pair] = []
    # A repeated chunk overlaps its copy when it is non-empty on every dimension.
    non_empty_chunk = torch.stack(
        [intervals[d][:, 1].index_select(0, codes[d]) > 0 for d in range(ndim)], 1
    ).all(1)
    repeated = (copies.index_select(0, cell) > 1) & non_empty_chunk
    if bool(repeated.any()):
        kept_rows = kept.tolist()
        for c in torch.unique(cell.masked_select(repeated)).tolist()[:OVERLAP_PAIRS_PER_ENTRY]:
            first_two = (cell == c).nonzero().flatten()[:2].tolist()
            pairs.append((kept_rows[first_two[1]], kept_rows[first_two[0]]))

    # Chunk (x_1..x_D) overlaps (y_1..y_D) iff every dimension's intervals pass the test; on a dimension
    # where both take the same interval, that means the interval is non-empty.
    overlapping: list[tuple[int, int] | None] = []
    non_empty: list[int | None] = []
    for values in intervals:
        pair = None
        if len(values) > 1:
            hit, witness = _interval_overlaps(values[None, :, 0], (values[:, 0] + values[:, 1])[None, :])
            at = hit[0].nonzero().flatten()
            if at.numel():
                i = int(at[0])
                pair = (i, int(witness[0, i]))
        overlapping.append(pair)
        proper = (values[:, 1] > 0).nonzero().flatten()
        non_empty.append(int(proper[0]) if proper.numel() else None)
    if any(p is not None for p in overlapping) and all(
        p is not None or q is not None for p, q in zip(overlapping, non_empty)
    ):
        split = next(d for d, p in enumerate(overlapping) if p is not None)
        x = y = 0
        for d in range(ndim):
            pair = overlapping[d]
            if d == split or non_empty[d] is None:
                assert pair is not None
                xd, yd = pair
            else:
                xd = yd = non_empty[d]
            x, y = x * len(intervals[d]) + xd, y * len(intervals[d]) + yd
        rows = [int(kept[int((cell == c).nonzero()[0, 0])]) for c in (x, y)]
        pairs.append((rows[0], rows[1]))
    return pairs[:OVERLAP_PAIRS_PER_ENTRY]
