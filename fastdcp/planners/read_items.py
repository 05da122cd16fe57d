"""A rank's read plan from a checkpoint's :class:`~fastdcp.format.chunk_table.ChunkTable`: stock's
``ReadItem`` list without touching ``Metadata.state_dict_metadata``.

At thousands of ranks each saved tensor has thousands of chunks, and stock
``create_read_items_for_chunk_list`` looks at every one of them per destination chunk (in Python,
on ``ChunkStorageMetadata`` objects that first have to exist: millions of them). Here the saved
chunks stay columns, and a destination chunk finds the saved chunks it overlaps by bisection:

- **Once per table** (:func:`read_index`, cached on the table): per entry and dimension, whether
  the chunks' starts and ends both never decrease in row order (true of every ``Shard(d)`` split
  along ``d``, the usual layout, since DCP lists chunks in rank order) and the largest end (what
  stock's sweep-dimension choice needs). One vectorised pass over all rows, in blocks small
  enough for torch to run each op on the calling thread.
- **Per plan**: one query per destination chunk; all queries bisect together (a vectorised
  binary search over the rows of their entries, along a dimension in which the entry is sorted),
  giving a contiguous range of candidate rows; entries sorted in no dimension take all their rows
  as candidates. The candidates are tested for overlap in every dimension at once, put in stock's
  order and turned into ``ReadItem`` objects: Python work per item, none per saved chunk.

The result is exactly stock's: the same items in the same order, with the same index hints
(checked against stock on the equivalent ``Metadata`` for many saved and destination shardings).
Destination objects whose chunk lists only stock knows (tensor subclasses, unusual objects) get
their chunk list from stock's ``_create_chunk_list``; an entry whose chunks do not have the
destination's dimension count is planned by stock's ``create_read_items_for_chunk_list`` on a
``TensorStorageMetadata`` built for that one entry (:func:`entry_metadata`).

:func:`table_plan_key` is the plan cache's key for a table (the counterpart of
:func:`fastdcp.planners.items._metadata_key`, which walks ``state_dict_metadata``).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ..format.index_sections import RankSection
from ..format.chunk_table import ChunkTable
from ..io.gc import gc_paused
from .structure import _PLAIN_TENSOR_TYPES

__all__ = ["ReadIndex", "chunk_table_of", "covering_read_items", "entry_metadata", "read_index", "section_read_items",
           "table_plan_key", "table_read_items"]

_NOT_SORTED = -1  # ReadIndex.bisect_dim of an entry sorted along no dimension
_INDEX_ATTRIBUTE = "_fastdcp_read_index"
_KEY_ATTRIBUTE = "_fastdcp_plan_key"


def chunk_table_of(metadata: Any) -> ChunkTable | None:
    """The chunk table a checkpoint reader attached to ``metadata`` (``metadata.chunk_table``), or
    None when there is none (plain stock ``Metadata``: plan from ``state_dict_metadata``)."""
    table = getattr(metadata, "chunk_table", None)
    return table if isinstance(table, ChunkTable) else None


@dataclass
class ReadIndex:
    """What read planning needs to know about a table beyond its columns (see the module docstring).

    ``bisect_dim[e]`` is a dimension along which both the starts and the ends of entry ``e``'s
    chunks never decrease in row order and the starts are not all equal (the one whose starts
    spread widest), or ``_NOT_SORTED``.
    ``max_end[e][d]`` is the largest ``offset + length`` of entry ``e``'s chunks in dimension ``d``
    (empty for bytes entries and entries without chunks)."""

    entries: dict[str, int]
    row_start: list[int]
    bisect_dim: list[int]
    max_end: list[tuple[int, ...]]
    offsets: torch.Tensor  # the table's columns, contiguous int64 [rows, width]
    lengths: torch.Tensor
    ordinals: list[int] | None = None  # a section's rows: their positions in the whole entry (hints)


def read_index(table: ChunkTable) -> ReadIndex:
    """The :class:`ReadIndex` of ``table``, computed on first use and kept on the table (tables
    are not changed once built).

    Precondition: ``table`` follows the layout of :mod:`fastdcp.format.chunk_table`."""
    index = getattr(table, _INDEX_ATTRIBUTE, None)
    if index is None:
        with gc_paused():
            index = _build_read_index(table)
        setattr(table, _INDEX_ATTRIBUTE, index)
    return index


def _build_read_index(table: ChunkTable) -> ReadIndex:
    entries = len(table.fqns)
    offsets = table.offsets.to(torch.int64).contiguous()
    lengths = table.lengths.to(torch.int64).contiguous()
    row_start = [int(r) for r in table.row_start.tolist()]
    unsorted_starts, unsorted_ends = _unsorted_dims(offsets, lengths, row_start)
    first_rows, last_rows, nonempty = [], [], []
    for e in range(entries):
        if row_start[e + 1] > row_start[e]:
            nonempty.append(e)
            first_rows.append(row_start[e])
            last_rows.append(row_start[e + 1] - 1)
    # (index_select, not advanced indexing: the latter runs an OpenMP region even for a few
    # thousand rows, which costs milliseconds on a busy machine)
    first = torch.tensor(first_rows, dtype=torch.int64)
    last = torch.tensor(last_rows, dtype=torch.int64)
    last_offsets = offsets.index_select(0, last)
    last_ends = (last_offsets + lengths.index_select(0, last)).tolist()
    spread = (last_offsets - offsets.index_select(0, first)).tolist()
    bisect_dim = [_NOT_SORTED] * entries
    max_end: list[tuple[int, ...]] = [()] * entries
    for i, e in enumerate(nonempty):
        ndim = table.ndim(e)
        if not ndim:
            continue
        extent = list(last_ends[i][:ndim])
        best = _NOT_SORTED
        for d in range(ndim):
            if (e, d) in unsorted_ends:
                rows = slice(row_start[e], row_start[e + 1])
                extent[d] = int((offsets[rows, d] + lengths[rows, d]).max())
            elif (e, d) not in unsorted_starts and spread[i][d] > (0 if best == _NOT_SORTED else spread[i][best]):
                best = d  # sorted and not all at one start: bisection narrows the search
        bisect_dim[e] = best
        max_end[e] = tuple(extent)
    return ReadIndex(
        entries={fqn: e for e, fqn in enumerate(table.fqns)},
        row_start=row_start,
        bisect_dim=bisect_dim,
        max_end=max_end,
        offsets=offsets,
        lengths=lengths,
    )


# torch's parallel grain size: an elementwise op over fewer values runs on the calling thread; over
# more, it opens an OpenMP region, and on a machine whose cores are busy (other ranks, data
# loaders) each region waits for descheduled threads. Checking the sortedness of a 3.6-million-row
# table on a loaded 2-core machine took 0.6 to 3 s in blocks just over this size, and ~20 ms of
# CPU time (50 ms wall) in blocks just under it.
_PARALLEL_GRAIN = 1 << 15


def _unsorted_dims(offsets: torch.Tensor, lengths: torch.Tensor, row_start: list[int],
                   ) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The (entry, dim) pairs in which some chunk starts, and those in which some chunk ends,
    before the chunk in the row above it (comparing rows of one entry only)."""
    unsorted_starts: set[tuple[int, int]] = set()
    unsorted_ends: set[tuple[int, int]] = set()
    rows = int(offsets.shape[0])
    if rows < 2 or offsets.dim() != 2 or not offsets.shape[1]:
        return unsorted_starts, unsorted_ends
    width = int(offsets.shape[1])
    # Comparison r (of rows r and r + 1) straddles two entries when r + 1 starts one: not a
    # comparison within an entry, so masked out.
    straddling = [r - 1 for r in row_start[1:-1] if 0 < r < rows]
    straddling_tensor = torch.tensor(straddling, dtype=torch.int64)
    block_rows = max(1, (_PARALLEL_GRAIN - 1) // width - 1)  # every op below covers < grain values
    for a in range(0, rows - 1, block_rows):
        b = min(a + block_rows, rows - 1)  # comparisons a .. b - 1
        starts = offsets[a:b + 1]
        ends = starts + lengths[a:b + 1]
        start_decreases = starts[1:] < starts[:-1]
        end_decreases = ends[1:] < ends[:-1]
        lo, hi = bisect.bisect_left(straddling, a), bisect.bisect_left(straddling, b)
        if hi > lo:
            across = straddling_tensor[lo:hi] - a
            start_decreases.index_fill_(0, across, False)
            end_decreases.index_fill_(0, across, False)
        for decreases, found in ((start_decreases, unsorted_starts), (end_decreases, unsorted_ends)):
            if decreases.any():
                for comparison, dim in decreases.nonzero().tolist():
                    found.add((bisect.bisect_right(row_start, a + comparison + 1) - 1, dim))
    return unsorted_starts, unsorted_ends


def entry_metadata(table: ChunkTable, entry: int) -> TensorStorageMetadata | BytesStorageMetadata:
    """Stock's ``state_dict_metadata`` value of one entry, built from its rows (for the stock
    fallbacks; one Python step per chunk of this entry only)."""
    size = table.sizes[entry]
    if size is None:
        return BytesStorageMetadata()
    ndim = len(size)
    start, stop = int(table.row_start[entry]), int(table.row_start[entry + 1])
    offsets = table.offsets[start:stop, :ndim].tolist()
    lengths = table.lengths[start:stop, :ndim].tolist()
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in zip(offsets, lengths)]
    return TensorStorageMetadata(table.properties[entry], size, chunks)


def table_plan_key(table: ChunkTable) -> tuple[str, int]:
    """The plan cache's key for what a read plan depends on in ``table``: the table itself, by a
    serial number given to it on first use and kept on it.

    Precondition: a table is not changed once built (its columns are what the cached plans were
    built from). A table stays the same object across loads of one unchanged checkpoint: the
    reader's metadata cache hands out copies of one ``Metadata`` sharing it. A content digest
    would also let other checkpoints of the same model share plans, but hashing the ~160 MB of
    box columns of a 5-million-chunk table costs 70 to 110 ms, more than planning from the
    table (~35 ms)."""
    key = getattr(table, _KEY_ATTRIBUTE, None)
    if key is None:
        with _SERIAL_LOCK:
            key = ("chunk-table", next(_TABLE_SERIALS))
        setattr(table, _KEY_ATTRIBUTE, key)
    return key


_TABLE_SERIALS = itertools.count()
_SERIAL_LOCK = threading.Lock()


# --------------------------------------------------------------------------- #
# the plan
# --------------------------------------------------------------------------- #
@dataclass
class _Query:
    """One destination chunk: stock's ``local_chunks[local_index]`` of ``fqn`` (entry ``entry``),
    searched against the saved chunks with stock's sweep dimension ``sweep``."""

    fqn: str
    entry: int
    local_index: int
    offsets: torch.Size
    sizes: torch.Size
    sweep: int


def section_read_items(state_dict: Mapping[str, Any], section: RankSection, strict: bool) -> list[ReadItem] | None:
    """:func:`table_read_items` from one rank's section of the chunk index alone (the rows that
    rank planned in the save), or None when the section cannot give exactly stock's plan: some
    destination chunk is not covered in full by the section's chunks (another layout, or
    another rank's state), or the plan would need chunks the section may lack (an entry with an
    inner empty chunk, a destination chunk of no elements inside its tensor, a stock fallback).

    Why a covered plan is stock's: a checkpoint's chunks of one tensor never overlap (DCP
    validates the save), so a destination chunk covered in full by section chunks overlaps no
    other chunk of positive size, and empty chunks overlap nothing unless they lie strictly
    inside the tensor (``RankSection.inner_empty``). Index hints are the rows' positions in the
    whole checkpoint (``RankSection.ordinals``); stock's sweep dimension is chosen from the whole
    checkpoint's extents (``RankSection.extents``)."""
    return table_read_items(state_dict, section.table, strict, section=section)


def _section_index(section: RankSection) -> ReadIndex:
    index = getattr(section, _INDEX_ATTRIBUTE, None)
    if index is None:
        index = dataclasses.replace(read_index(section.table), max_end=list(section.extents),
                                    ordinals=section.ordinals.tolist())
        setattr(section, _INDEX_ATTRIBUTE, index)
    return index


class _NotCovered(Exception):
    """The section cannot plan this state dict (section_read_items returns None). ``box``: an
    (entry, offsets, sizes) destination chunk it does not cover, when more sections could."""

    def __init__(self, box: tuple[int, Any, Any] | None = None) -> None:
        super().__init__()
        self.box = box


def covering_read_items(state_dict: Mapping[str, Any], own: RankSection, section_of: Callable[[int], Any],
                        sections: int, strict: bool, *, max_sections: int = 64,
                        max_rounds: int = 4) -> tuple[list[ReadItem], RankSection] | None:
    """:func:`section_read_items` from ``own`` and, when it does not cover the plan, from the few
    other ranks' sections that hold the chunks it lacks (``section_of(rank)`` reads one; the index
    has ``sections``), or None when at most ``max_sections`` sections found in ``max_rounds``
    rounds do not cover it (the caller reads the whole table). Returns the items and the section
    (``own``, or ``own`` merged with the others) they were planned from.

    A load on another world size or layout (N ranks to N/2, FSDP to HSDP) needs each rank's
    chunks from a few save ranks. An uncovered destination chunk's first element is searched for
    among the sections by bisection on the position of each section's first chunk of that entry
    (ranks of a ``Shard`` save hold consecutive pieces; the first probe is where the element's
    position in the tensor points), then the following sections up to the chunk's last element
    are taken. Whatever the layout, the plan is used only if the sections found cover it, so a
    layout that breaks the ordering costs reads, never correctness."""
    from ..format.index_sections import merge_sections

    current, included = own, {own.rank}
    for _ in range(max_rounds):
        try:
            return _table_read_items(state_dict, current.table, strict, current), current
        except _NotCovered as e:
            box = e.box
        if box is None:
            return None
        found = _sections_holding(box, current, section_of, sections, max_sections)
        new = [k for k in found if k not in included]
        if not new or len(included) + len(new) > max_sections:
            return None
        more = [section_of(k) for k in new]
        if any(m is None for m in more):
            return None
        included.update(new)
        current = merge_sections([current, *more])
    return None


def _linear(offsets: Sequence[int], strides: list[int]) -> int:
    return sum(o * st for o, st in zip(offsets, strides))


def _sections_holding(box: tuple[int, Any, Any], current: RankSection, section_of: Callable[[int], Any],
                      sections: int, limit: int) -> list[int]:
    """The ranks whose sections hold the chunks of entry ``box[0]`` from the box's first element
    to its last, assuming sections in rank order hold that entry's chunks in increasing
    position (see :func:`covering_read_items`); [] when a probed section breaks the assumption."""
    entry, offsets, sizes = box
    size = list(current.table.sizes[entry])
    strides = [1] * len(size)
    for d in range(len(size) - 2, -1, -1):
        strides[d] = strides[d + 1] * size[d + 1]
    numel = strides[0] * size[0] if size else 1
    first = _linear(offsets, strides)
    last = _linear([o + n - 1 for o, n in zip(offsets, sizes)], strides)

    def start_of(rank: int) -> int | None:
        section = section_of(rank)
        if section is None:
            return None
        t = section.table
        lo, hi = int(t.row_start[entry]), int(t.row_start[entry + 1])
        if lo == hi:
            # No chunk of the entry with elements (sections leave out empty ones, which an uneven
            # split puts on the last ranks): after every element. A rank that saved none of the
            # entry breaks the ordering instead, and the coverage check then refuses the plan.
            return numel
        return min(_linear(row, strides) for row in t.offsets[lo:hi, :len(size)].tolist())

    # The last rank whose first chunk of the entry starts at or before `first`: a galloping
    # search from a guess, then bisection. The guess: with an even split (FSDP's Shard), rank k's
    # chunk starts at k times a chunk's elements, and the sections at hand show a chunk's size.
    t = current.table
    lo_row, hi_row = int(t.row_start[entry]), int(t.row_start[entry + 1])
    volumes = [math.prod(row[:len(size)]) for row in t.lengths[lo_row:hi_row].tolist()]
    chunk = max(volumes, default=0)
    guess = first // chunk if chunk else first * sections // max(numel, 1)
    guess = max(0, min(sections - 1, guess))

    def at_or_before(rank: int) -> bool | None:
        at = start_of(rank)
        return None if at is None else at <= first

    probe = at_or_before(guess)
    if probe is None:
        return []
    if probe:
        lo, hi, step = guess, sections - 1, 1
        while lo + step <= hi:
            ahead = at_or_before(lo + step)
            if ahead is None:
                return []
            if not ahead:
                hi = lo + step - 1
                break
            lo, step = lo + step, step * 2
    else:
        hi, step = guess - 1, 1
        lo = 0
        while hi - step + 1 > 0:
            behind = at_or_before(hi - step + 1)
            if behind is None:
                return []
            if behind:
                lo = hi - step + 1
                break
            hi, step = hi - step, step * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ahead = at_or_before(mid)
        if ahead is None:
            return []
        if ahead:
            lo = mid
        else:
            hi = mid - 1
    found = [lo]
    k = lo + 1
    while k < sections and len(found) < limit:
        at = start_of(k)
        if at is None or at > last:
            break
        found.append(k)
        k += 1
    return found


def table_read_items(state_dict: Mapping[str, Any], table: ChunkTable, strict: bool, *,
                     section: RankSection | None = None) -> list[ReadItem] | None:
    """Stock ``create_default_local_load_plan(state_dict, metadata, strict).items`` for a
    ``metadata`` whose contents ``table`` holds, computed from the table alone (``section``: see
    :func:`section_read_items`, the only caller that passes it; None is returned then when the
    section does not cover the plan).

    Preconditions: ``state_dict`` is flat (stock's flattening already applied); ``table`` names
    every entry of the checkpoint. Raises stock's errors, with stock's messages, for the first
    key in ``state_dict`` order that is missing (when ``strict``), whose size differs from the
    saved size, or whose object cannot be a tensor although the saved entry is one."""
    try:
        return _table_read_items(state_dict, table, strict, section)
    except _NotCovered:
        return None


def _table_read_items(state_dict: Mapping[str, Any], table: ChunkTable, strict: bool,
                      section: RankSection | None) -> list[ReadItem]:
    index = read_index(table) if section is None else _section_index(section)
    entries = index.entries
    sizes = table.sizes
    queries: list[_Query] = []
    # Items planned outside the batched search (objects, stock fallbacks), each to go in before
    # the items of query number ``position``.
    other: list[tuple[int, list[ReadItem]]] = []
    dtensor_chunks: dict[tuple[Any, ...], tuple[Any, list[ChunkStorageMetadata]]] = {}
    with gc_paused():
        for fqn, obj in state_dict.items():
            e = entries.get(fqn)
            if e is None:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            size = sizes[e]
            if size is not None and getattr(obj, "size", None) is not None and size != obj.size():
                raise ValueError(f"Size mismatch between saved {size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank is not in the DTensor's mesh: stock plans nothing for it
            if size is None:
                if section is not None and index.row_start[e + 1] == index.row_start[e]:
                    raise _NotCovered
                other.append((len(queries), [_bytes_read_item(fqn)]))
                continue
            local_chunks = _local_chunks(fqn, obj, dtensor_chunks)
            if section is not None and local_chunks and (e in section.inner_empty
                                                         or (not len(size) and section.row_counts[e] != 1)):
                raise _NotCovered  # (a 0-d tensor saved as several chunks: every one is read)
            if section is not None and local_chunks and index.row_start[e + 1] == index.row_start[e] \
                    and section.row_counts[e]:
                if all(_empty_at_edge(c, size) for c in local_chunks):
                    continue  # what stock plans for them: nothing (no saved chunk overlaps them)
                chunk = local_chunks[0]
                raise _NotCovered((e, chunk.offsets, chunk.sizes) if len(chunk.offsets) == len(size) else None)
            if not local_chunks or index.row_start[e + 1] == index.row_start[e]:
                continue
            ndim = len(size)
            if any(len(c.offsets) != ndim or len(c.sizes) != ndim for c in local_chunks):
                if section is not None:
                    raise _NotCovered
                other.append((len(queries), create_read_items_for_chunk_list(fqn, entry_metadata(table, e),
                                                                             local_chunks)))
                continue
            sweep = _sweep_dim(ndim, index.max_end[e], local_chunks)
            order = range(len(local_chunks)) if ndim == 0 else \
                sorted(range(len(local_chunks)), key=lambda i: local_chunks[i].offsets[sweep])
            for i in order:
                chunk = local_chunks[i]
                queries.append(_Query(fqn, e, i, chunk.offsets, chunk.sizes, sweep))
        query_items = _search(index, queries)
        if section is not None:
            _check_covered(queries, query_items, sizes)
        if not other:
            return query_items[0]
        flat, bounds = query_items
        items: list[ReadItem] = []
        done = 0
        for position, planned in other:
            items.extend(flat[bounds[done]:bounds[position]])
            items.extend(planned)
            done = position
        items.extend(flat[bounds[done]:])
        return items


def _empty_at_edge(chunk: Any, size: Any) -> bool:
    """Whether ``chunk`` has no elements and lies at its tensor's edge in every dimension where
    it has length 0 (offset 0 or the dimension's size): stock's overlap test finds no saved chunk
    overlapping it, so it is read from nothing."""
    if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
        return False
    zero = [d for d, n in enumerate(chunk.sizes) if n == 0]
    return bool(zero) and all(chunk.offsets[d] in (0, size[d]) for d in zero)


def _check_covered(queries: list[_Query], query_items: tuple[list[ReadItem], list[int]],
                   sizes: list[Any]) -> None:
    """Raise _NotCovered unless every query's items fill its box (see section_read_items)."""
    flat, bounds = query_items
    for q_number, q in enumerate(queries):
        volume = 1
        for n in q.sizes:
            volume *= n
        if not volume:
            if not _empty_at_edge(q, sizes[q.entry]):
                raise _NotCovered
            continue
        covered = 0
        for item in flat[bounds[q_number]:bounds[q_number + 1]]:
            piece = 1
            for n in item.lengths:
                piece *= n
            covered += piece
        if covered != volume:
            raise _NotCovered((q.entry, q.offsets, q.sizes))


def _bytes_read_item(fqn: str) -> ReadItem:
    """Stock ``_create_read_item_for_byteio`` for a whole object."""
    index = MetadataIndex(fqn)
    zero = torch.Size((0,))
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=zero, storage_index=MetadataIndex(fqn),
                    storage_offsets=zero, lengths=zero)


def _local_chunks(fqn: str, obj: Any, dtensor_chunks: dict[tuple[Any, ...], tuple[Any, list[ChunkStorageMetadata]]],
                  ) -> list[ChunkStorageMetadata]:
    """Stock ``_create_chunk_list(obj)`` (with ``_create_read_items``'s error for objects that are
    no tensor). A plain DTensor's list depends only on its global shape, placements and mesh, so
    equal DTensors of one plan share it (computing it costs ~20 us each)."""
    cls = type(obj)
    if cls in _PLAIN_TENSOR_TYPES:
        shape = obj.shape
        return [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)]
    key = None
    if cls is DTensor and type(obj._local_tensor) in _PLAIN_TENSOR_TYPES:
        mesh = obj.device_mesh
        key = (id(mesh), obj.shape, tuple(obj.placements))
        known = dtensor_chunks.get(key)
        if known is not None and known[0] is mesh:
            return known[1]
    try:
        local_chunks = _create_chunk_list(obj)
    except ValueError as ex:
        raise ValueError(
            f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata but found {TensorStorageMetadata}",
        ) from ex
    if key is not None:
        dtensor_chunks[key] = (obj.device_mesh, local_chunks)  # holding the mesh keeps its id unique
    return local_chunks


def _sweep_dim(ndim: int, saved_extent: Sequence[int], local_chunks: list[ChunkStorageMetadata]) -> int:
    """Stock's sweep dimension: the first dimension with the largest extent over the saved and the
    local chunks (0 for tensors of fewer than two dimensions)."""
    if ndim <= 1:
        return 0
    sweep, max_size = 0, 0
    for d in range(ndim):
        dim_size = max(saved_extent[d], max(c.offsets[d] + c.sizes[d] for c in local_chunks))
        if dim_size > max_size:
            max_size, sweep = dim_size, d
    return sweep


def _search(index: ReadIndex, queries: list[_Query]) -> tuple[list[ReadItem], list[int]]:
    """The read items of every query, in query order, and where each query's items start
    (``bounds[q]``; ``bounds[len(queries)]`` is the item count).

    Within a query, items follow stock's order: saved chunks by (end in the sweep dimension,
    row)."""
    nq = len(queries)
    if not nq:
        return [], [0]
    offsets, lengths = index.offsets, index.lengths
    width = int(offsets.shape[1])
    row_start = index.row_start
    # Query boxes as [nq, width]; dimensions past the tensor's overlap everything (the table pads
    # them with zero offsets and lengths).
    lo_rows, hi_rows, first, stop, bisect_dims, sweep = [], [], [], [], [], []
    pad_lo, pad_hi = [-1] * width, [1] * width
    for q in queries:
        ndim = len(q.offsets)
        lo = list(q.offsets) + pad_lo[ndim:]
        hi = [o + s for o, s in zip(q.offsets, q.sizes)] + pad_hi[ndim:]
        lo_rows.append(lo)
        hi_rows.append(hi)
        first.append(row_start[q.entry])
        stop.append(row_start[q.entry + 1])
        bisect_dims.append(index.bisect_dim[q.entry] if ndim else _NOT_SORTED)
        sweep.append(q.sweep if ndim else -1)
    q_lo = torch.tensor(lo_rows, dtype=torch.int64).reshape(nq, width)
    q_hi = torch.tensor(hi_rows, dtype=torch.int64).reshape(nq, width)
    q_first = torch.tensor(first, dtype=torch.int64)
    q_stop = torch.tensor(stop, dtype=torch.int64)
    q_bisect = torch.tensor(bisect_dims, dtype=torch.int64)
    q_sweep = torch.tensor(sweep, dtype=torch.int64)

    # Candidate rows: for sorted entries, those with end > lo and start < hi along the sorted
    # dimension (a contiguous range); for the others, all rows of the entry.
    sorted_entry = q_bisect >= 0
    if bool(sorted_entry.any()):
        dim = q_bisect.clamp(min=0)
        lo_d = q_lo.gather(1, dim[:, None])[:, 0]
        hi_d = q_hi.gather(1, dim[:, None])[:, 0]
        flat_offsets, flat_lengths = offsets.view(-1), lengths.view(-1)

        def start_at(row: torch.Tensor) -> torch.Tensor:
            return flat_offsets.index_select(0, row * width + dim)

        def end_at(row: torch.Tensor) -> torch.Tensor:
            at = row * width + dim
            return flat_offsets.index_select(0, at) + flat_lengths.index_select(0, at)

        # first row whose end > lo; first row whose start >= hi
        range_first = _bisect(end_at, q_first, q_stop, lo_d, strictly_greater=True)
        range_stop = _bisect(start_at, q_first, q_stop, hi_d, strictly_greater=False)
        range_stop = torch.maximum(range_stop, range_first)
        q_first = q_first + sorted_entry * (range_first - q_first)
        q_stop = q_stop + sorted_entry * (range_stop - q_stop)
    cand_query, cand_row = _expand(q_first, q_stop)

    # Stock's overlap test in every dimension at once.
    c_start = offsets.index_select(0, cand_row)
    c_end = c_start + lengths.index_select(0, cand_row)
    c_lo = q_lo.index_select(0, cand_query)
    c_hi = q_hi.index_select(0, cand_query)
    overlaps = ((c_start < c_hi) & (c_end > c_lo)).all(dim=1)
    keep = overlaps.nonzero()[:, 0]
    m_query, m_row, m_start, m_end, m_lo, m_hi = (
        t.index_select(0, keep) for t in (cand_query, cand_row, c_start, c_end, c_lo, c_hi))

    # Stock's order within a query: by the saved chunk's end in the sweep dimension, then by row
    # (candidates are in (query, row) order already; two stable sorts make it a lexicographic one).
    m_sweep = q_sweep.index_select(0, m_query)
    sweep_end = m_end.gather(1, m_sweep.clamp(min=0)[:, None])[:, 0] * (m_sweep >= 0)  # 0-d: all equal
    by_end = torch.sort(sweep_end, stable=True).indices
    order = by_end.index_select(0, torch.sort(m_query.index_select(0, by_end), stable=True).indices)
    m_query, m_row, m_start, m_end, m_lo, m_hi = (
        t.index_select(0, order) for t in (m_query, m_row, m_start, m_end, m_lo, m_hi))

    dest_offsets = (m_start - m_lo).clamp(min=0).tolist()
    storage_offsets = (m_lo - m_start).clamp(min=0).tolist()
    lengths_out = (torch.minimum(m_end, m_hi) - torch.maximum(m_start, m_lo)).tolist()
    saved_offsets = m_start.tolist()
    m_query_list = m_query.tolist()
    m_row_list = m_row.tolist()
    per_query = torch.bincount(m_query, minlength=nq).tolist()
    bounds = [0]
    for n in per_query:
        bounds.append(bounds[-1] + n)
    return _build_items(queries, row_start, m_query_list, m_row_list, saved_offsets, dest_offsets, storage_offsets,
                        lengths_out, index.ordinals), bounds


def _bisect(value_at, first: torch.Tensor, stop: torch.Tensor, target: torch.Tensor, *,
            strictly_greater: bool) -> torch.Tensor:
    """For every query at once: the first row ``r`` in ``[first, stop)`` with
    ``value_at(r) > target`` (``strictly_greater``) or ``>= target``, else ``stop``.

    Precondition: ``value_at`` never decreases over each query's rows (queries whose rows are not
    sorted get a meaningless answer, which the caller discards)."""
    lo, hi = first, stop
    longest = int((stop - first).max()) if first.numel() else 0
    last_row = int(stop.max()) - 1 if stop.numel() else 0
    for _ in range(max(longest, 1).bit_length()):
        active = lo < hi
        mid = ((lo + hi) // 2).clamp_(max=max(last_row, 0))  # a finished query's mid is not used
        value = value_at(mid)
        below = (value <= target) if strictly_greater else (value < target)
        go_up = active & below
        go_down = active & ~below
        lo = lo + go_up * (mid + 1 - lo)
        hi = hi - go_down * (hi - mid)
    return lo


def _expand(first: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (query, row) with ``first[query] <= row < stop[query]``, in (query, row) order.

    (Built from cumulative sums rather than ``repeat_interleave``, which like ``searchsorted``
    opens an OpenMP region from a few hundred values on: milliseconds each on a busy machine.)"""
    counts = stop - first
    total = int(counts.sum())
    if not total:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    nonempty = (counts > 0).nonzero()[:, 0]
    begins = torch.cumsum(counts, 0) - counts  # where each query's candidates begin
    marks = torch.zeros(total, dtype=torch.int64)
    marks.index_fill_(0, begins.index_select(0, nonempty), 1)
    query = nonempty.index_select(0, torch.cumsum(marks, 0) - 1)
    row = first.index_select(0, query) + torch.arange(total, dtype=torch.int64) - begins.index_select(0, query)
    return query, row


def _build_items(queries: list[_Query], row_start: list[int], m_query: list[int], m_row: list[int],
                 saved_offsets: list[list[int]], dest_offsets: list[list[int]], storage_offsets: list[list[int]],
                 lengths: list[list[int]], ordinals: list[int] | None = None) -> list[ReadItem]:
    """``ReadItem`` objects for the matched (query, row) pairs, sharing equal ``torch.Size``
    values (stock builds fresh but equal ones)."""
    sizes: dict[tuple[int, ...], torch.Size] = {}

    def size_of(values: list[int]) -> torch.Size:
        key = tuple(values)
        size = sizes.get(key)
        if size is None:
            size = sizes[key] = torch.Size(key)
        return size

    tensor_type = LoadItemType.TENSOR
    items: list[ReadItem] = []
    append = items.append
    dest_index = None
    last_query = -1
    for k, q_number in enumerate(m_query):
        q = queries[q_number]
        if q_number != last_query:
            dest_index = MetadataIndex(q.fqn, q.offsets, q.local_index)
            ndim = len(q.offsets)
            last_query = q_number
        row = m_row[k]
        append(ReadItem(
            type=tensor_type,
            dest_index=dest_index,
            dest_offsets=size_of(dest_offsets[k][:ndim]),
            storage_index=MetadataIndex(q.fqn, size_of(saved_offsets[k][:ndim]),
                                        row - row_start[q.entry] if ordinals is None else ordinals[row]),
            storage_offsets=size_of(storage_offsets[k][:ndim]),
            lengths=size_of(lengths[k][:ndim]),
        ))
    return items
