"""Chunk validation of a global save plan (fastdcp.planners.chunk_validation) against stock's
``torch.distributed.checkpoint.default_planner._validate_global_plan`` on the same ``Metadata``.

Every case builds stock ``Metadata``, runs stock's function (with one or two dummy ``SavePlan``s, which
decides whether the fill check runs) and ours on ``table_from_metadata(metadata)``, and requires:
the same out-of-bounds and fill messages, word for word and in order; overlap messages that stock
also prints (ours reports at most ``OVERLAP_PAIRS_PER_ENTRY`` pairs per entry, stock every pair); the
same invalid keys with the same kinds of error; and where stock reports one overlapping pair for a
key, the same message. Chunkings come from hypothesis (derandomized: CI runs the same examples every
time): valid 1-D splits and grids of 1-D..4-D tensors with empty chunks, then perturbed (shifted,
resized, dropped, duplicated, emptied, negative and random chunks) next to bytes entries and 0-d
tensors; arbitrary small boxes. Scale cases: a Llama-7B-shaped FSDP Shard(0) table at 4,096 ranks
(valid, then with one row block moved), and a 64 x 64 FSDP x TP grid also checked by stock.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import default_planner as _stock_planner
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

import dcp_cases as C
from fastdcp.format.chunk_table import ChunkTable, table_from_metadata
from fastdcp.planners.chunk_validation import OVERLAP_PAIRS_PER_ENTRY, validate_chunk_table

CASES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROPERTIES = TensorProperties(dtype=torch.float32)
KINDS = {"out of bounds": "bounds", "overlapping chunks": "overlap", "invalid fill": "fill"}


def _kind(message: str) -> str:
    return next(kind for words, kind in KINDS.items() if words in message)


def _key(message: str) -> str:
    return message.split(" ", 1)[0].removeprefix("key:")


def _unordered(overlap_message: str) -> tuple[str, ...]:
    """An overlap message as its key and its two chunks in a fixed order: stock up to 2.9 prints a
    pair in chunk order, since 2.11 in the order of its sweep (ours follows the sweep)."""
    head, pair = overlap_message.split(" has overlapping chunks: ")
    first, second = pair.split(") ChunkStorageMetadata(")
    return (head, *sorted((first + ")", "ChunkStorageMetadata(" + second)))


def _kinds_by_key(messages: list[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for m in messages:
        found.setdefault(_key(m), set()).add(_kind(m))
    return found


def _stock(metadata: Metadata, several_ranks: bool) -> list[str]:
    """Stock's messages. Since 2.13 ``_validate_global_plan`` returns them; before it returned a
    bool and only logged each one (as a warning, the same words over several lines), which are
    collected from stock's logger then, in the one-line form."""
    plans = [SavePlan([])] * (2 if several_ranks else 1)
    with C.warnings_logged_by(_stock_planner.logger) as logged:
        result = _validate_global_plan(plans, metadata)
    if isinstance(result, bool):
        assert result == (not logged), (result, logged)
        return logged
    assert result == logged
    return result


def _assert_matches_stock(metadata: Metadata) -> list[str]:
    """Ours against stock, for one rank and for several; returns stock's messages (several ranks)."""
    table = table_from_metadata(metadata)
    for several_ranks in (False, True):
        stock = _stock(metadata, several_ranks)
        ours = validate_chunk_table(table, several_ranks)
        assert [m for m in ours if _kind(m) != "overlap"] == [m for m in stock if _kind(m) != "overlap"]
        assert _kinds_by_key(ours) == _kinds_by_key(stock)
        # Keys in stock's order, and within a key stock's order of kinds.
        assert [k for k, _ in itertools.groupby(map(_key, ours))] == [k for k, _ in itertools.groupby(map(_key, stock))]
        order = list(KINDS.values())
        for key, group in itertools.groupby(ours, _key):
            ranks = [order.index(_kind(m)) for m in group]
            assert ranks == sorted(ranks), key
        for key in {_key(m) for m in stock}:
            stock_overlaps = [_unordered(m) for m in stock if _key(m) == key and _kind(m) == "overlap"]
            our_overlaps = [_unordered(m) for m in ours if _key(m) == key and _kind(m) == "overlap"]
            # Distinct pairs, each also in stock's list (two pairs of identical chunks print alike).
            assert not Counter(our_overlaps) - Counter(stock_overlaps)
            assert len(our_overlaps) <= OVERLAP_PAIRS_PER_ENTRY
            if len(stock_overlaps) == 1:
                assert our_overlaps == stock_overlaps
    return stock


def _chunk(offsets, sizes) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _tensor(size, boxes) -> TensorStorageMetadata:
    return TensorStorageMetadata(PROPERTIES, torch.Size(size), [_chunk(o, s) for o, s in boxes])


# ---------------------------------------------------------------------------------------------------
# Generated chunkings


@st.composite
def _intervals(draw, size: int) -> list[tuple[int, int]]:
    """A split of [0, size) into consecutive intervals, some of them empty (repeated cut points, or
    cut points at the end: the empty trailing chunks of an uneven Shard)."""
    pieces = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, size), min_size=pieces - 1, max_size=pieces - 1)))
    bounds = [0, *cuts, size]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(pieces)]


@st.composite
def _valid_chunking(draw, max_ndim: int = 4) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """(size, boxes): a 1-D split or a product grid of a 1-D..4-D tensor, chunks in shuffled order."""
    ndim = draw(st.integers(1, max_ndim))
    size = draw(st.lists(st.integers(1, 6) | st.just(0), min_size=ndim, max_size=ndim))
    layout = draw(st.sampled_from(["split", "grid"]))
    if layout == "split":
        split = {draw(st.integers(0, ndim - 1))}
    else:
        split = set(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True)))
    per_dim = [draw(_intervals(size[d])) if d in split else [(0, size[d])] for d in range(ndim)]
    boxes = [([i[0] for i in combo], [i[1] for i in combo]) for combo in itertools.product(*per_dim)]
    boxes = draw(st.permutations(boxes))
    return size, boxes


@st.composite
def _grid_chunking(draw) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """(size, boxes): a 2-D..4-D tensor split on at least two dimensions (FSDP x TP and the like)."""
    ndim = draw(st.integers(2, 4))
    size = draw(st.lists(st.integers(2, 6), min_size=ndim, max_size=ndim))
    split = set(draw(st.lists(st.integers(0, ndim - 1), min_size=2, max_size=ndim, unique=True)))
    per_dim = [draw(_intervals(size[d])) if d in split else [(0, size[d])] for d in range(ndim)]
    boxes = [([i[0] for i in combo], [i[1] for i in combo]) for combo in itertools.product(*per_dim)]
    return size, draw(st.permutations(boxes))


@st.composite
def _perturbed(draw, boxes: list[tuple[list[int], list[int]]], size: list[int]) -> list[tuple[list[int], list[int]]]:
    """``boxes`` with up to three changes, each of which may or may not break the chunking."""
    boxes = [(list(o), list(s)) for o, s in boxes]
    ndim = len(size)
    small = st.integers(-2, 7)
    for _ in range(draw(st.integers(1, 3))):
        change = draw(st.sampled_from(
            ["shift", "resize", "drop", "duplicate", "empty", "negative", "random", "shift_interval"]
        ))
        if change == "random" or not boxes:
            numbers = st.lists(small, min_size=ndim, max_size=ndim)
            boxes.insert(draw(st.integers(0, len(boxes))), (draw(numbers), draw(numbers)))
            continue
        i = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, ndim - 1))
        o, s = boxes[i]
        if change == "shift_interval":  # one interval of a grid, in every chunk that has it: still a grid
            delta = draw(st.sampled_from([-2, -1, 1, 2]))
            moved = (o[d], s[d])
            for other_o, other_s in boxes:
                if (other_o[d], other_s[d]) == moved:
                    other_o[d] += delta
        elif change == "shift":
            o[d] += draw(st.sampled_from([-2, -1, 1, 2]))
        elif change == "resize":
            s[d] += draw(st.sampled_from([-2, -1, 1, 2]))
        elif change == "drop":
            boxes.pop(i)
        elif change == "duplicate":
            boxes.insert(draw(st.integers(0, len(boxes))), (list(o), list(s)))
        elif change == "empty":
            s[d] = 0
            o[d] = draw(st.integers(-1, size[d] + 1))
        else:  # negative
            if draw(st.booleans()):
                o[d] = -draw(st.integers(1, 3))
            else:
                s[d] = -draw(st.integers(1, 3))
    return boxes


@st.composite
def _metadata(draw, perturb: bool) -> Metadata:
    """Several tensor entries (valid or perturbed chunkings) among a bytes entry and 0-d tensors."""
    entries: dict[str, object] = {}
    for t in range(draw(st.integers(1, 4))):
        size, boxes = draw(_valid_chunking())
        if perturb and draw(st.booleans()):
            boxes = draw(_perturbed(boxes, size))
        entries[f"t{t}"] = _tensor(size, boxes)
        if draw(st.booleans()):
            entries[f"b{t}"] = BytesStorageMetadata()
        if draw(st.booleans()):  # 0-d tensors are skipped by stock, whatever their chunks say
            zero_d = draw(st.sampled_from([[((), ())], [((), ()), ((), ())], []]))
            entries[f"s{t}"] = _tensor((), zero_d)
    return Metadata(entries)


@CASES
@given(_metadata(perturb=False))
def test_valid_splits_and_grids_pass_like_stock(metadata):
    assert _assert_matches_stock(metadata) == []


@settings(CASES, max_examples=300)
@given(_metadata(perturb=True))
def test_perturbed_chunkings_match_stock(metadata):
    _assert_matches_stock(metadata)


@st.composite
def _grid_metadata(draw) -> Metadata:
    size, boxes = draw(_grid_chunking())
    if draw(st.integers(0, 3)):  # mostly perturbed: the valid grids are covered above
        boxes = draw(_perturbed(boxes, size))
    return Metadata({"g": _tensor(size, boxes)})


@settings(CASES, max_examples=300)
@given(_grid_metadata())
def test_grids_valid_and_perturbed_match_stock(metadata):
    _assert_matches_stock(metadata)


@st.composite
def _random_boxes(draw) -> Metadata:
    """Arbitrary small boxes (negative, empty, overlapping): the layouts no sharding produces."""
    entries = {}
    for t in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        size = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
        box = st.tuples(
            st.lists(st.integers(-1, 4), min_size=ndim, max_size=ndim),
            st.lists(st.integers(-1, 3), min_size=ndim, max_size=ndim),
        )
        entries[f"t{t}"] = _tensor(size, draw(st.lists(box, max_size=6)))
    return Metadata(entries)


@CASES
@given(_random_boxes())
def test_arbitrary_boxes_match_stock(metadata):
    _assert_matches_stock(metadata)


# ---------------------------------------------------------------------------------------------------
# Named cases: each layout path, stock's quirks, message text, logging


def _shard0(rows: int, cols: int, ranks: int) -> list[tuple[list[int], list[int]]]:
    """FSDP2-style Shard(0): ceil(rows / ranks) rows each, empty trailing chunks at the end."""
    per = -(-rows // ranks)
    boxes = []
    for r in range(ranks):
        start = min(r * per, rows)
        boxes.append(([start, 0], [min(per, rows - start), cols]))
    return boxes


def test_wide_shard0_tensor_with_empty_chunks_is_valid():
    metadata = Metadata({"down_proj": _tensor((10, 37), _shard0(10, 37, 16))})
    assert _assert_matches_stock(metadata) == []


@pytest.mark.parametrize("delta", [-1, 1])
def test_one_shifted_row_block_is_one_overlap_or_hole(delta):
    boxes = _shard0(12, 40, 6)  # 2 rows each
    boxes[3] = ([boxes[3][0][0] + delta, 0], boxes[3][1])
    stock = _assert_matches_stock(Metadata({"w": _tensor((12, 40), boxes)}))
    assert {_kind(m) for m in stock} == {"overlap"}  # volume still adds up, but one pair overlaps


def test_exact_messages_for_single_errors():
    cases = {
        "oob": (_tensor((4, 4), [([0, 0], [2, 4]), ([3, 0], [2, 4])]), [
            "key:oob has out of bounds chunk: tensor-size:torch.Size([4, 4]) "
            "chunk: ChunkStorageMetadata(offsets=torch.Size([3, 0]), sizes=torch.Size([2, 4]))",
        ]),
        "gap": (_tensor((4, 4), [([0, 0], [1, 4]), ([2, 0], [2, 4])]), [
            "key:gap invalid fill tensor-volume: 16 chunks-volume: 12",
        ]),
        # Swept along dim 1 (the larger) by stock: the chunk with the larger row offset is "current".
        "overlap": (_tensor((4, 6), [([1, 0], [1, 6]), ([0, 0], [2, 6]), ([3, 0], [1, 6])]), [
            "key:overlap has overlapping chunks: "
            "ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([1, 6])) "
            "ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 6]))",
        ]),
    }
    for key, (md, expected) in cases.items():
        metadata = Metadata({key: md})
        assert _stock(metadata, True) == expected
        assert validate_chunk_table(table_from_metadata(metadata), True) == expected


def test_fill_is_checked_only_for_several_ranks():
    metadata = Metadata({"w": _tensor((4,), [([0], [2])])})
    table = table_from_metadata(metadata)
    assert validate_chunk_table(table, False) == []
    assert validate_chunk_table(table, True) == ["key:w invalid fill tensor-volume: 4 chunks-volume: 2"]


def test_fill_sums_out_of_bounds_chunks_too():
    # Two chunks, one out of bounds: 2 + 2 == 4, so stock reports no fill error.
    metadata = Metadata({"w": _tensor((4,), [([0], [2]), ([3], [2])])})
    assert [_kind(m) for m in _assert_matches_stock(metadata)] == ["bounds"]


def test_empty_chunk_strictly_inside_another_overlaps_it():
    # Stock's test (o0 < o1 + s1 and o1 < o0 + s0 on every dimension) calls this an overlap.
    inside = Metadata({"w": _tensor((4, 8), [([0, 0], [4, 8]), ([2, 0], [0, 8])])})
    assert {_kind(m) for m in _assert_matches_stock(inside)} == {"overlap"}
    at_edge = Metadata({"w": _tensor((4, 8), [([0, 0], [4, 8]), ([4, 0], [0, 8]), ([0, 0], [0, 8])])})
    assert _assert_matches_stock(at_edge) == []


def test_grids_valid_and_broken():
    cols = [(0, 3), (3, 3), (6, 1), (7, 0)]
    rows = [(0, 2), (2, 2), (4, 0)]
    grid = [([r[0], c[0]], [r[1], c[1]]) for r in rows for c in cols]
    assert _assert_matches_stock(Metadata({"g": _tensor((4, 7), grid)})) == []
    shifted = [([o[0], o[1] - 1 if o[1] == 3 else o[1]], s) for o, s in grid]  # column 3..6 moved left
    assert "overlap" in {_kind(m) for m in _assert_matches_stock(Metadata({"g": _tensor((4, 7), shifted)}))}
    duplicated = grid + [grid[1]]
    assert "overlap" in {_kind(m) for m in _assert_matches_stock(Metadata({"g": _tensor((4, 7), duplicated)}))}
    # Rows overlap, but the only column interval left (3, 0) is empty: no two chunks overlap (the
    # empty columns at 2 and 4 lie at the edge and are set aside before the grid check).
    rows_overlap = [([r, c], [2, 0]) for r in (0, 1) for c in (2, 3, 4)]
    assert _kinds_by_key(_assert_matches_stock(Metadata({"g": _tensor((4, 7), rows_overlap)}))) == {"g": {"fill"}}
    # With a non-empty column interval around it, the empty one overlaps it (stock's quirk).
    mixed = [([r, c], [2, w]) for r in (0, 1) for c, w in ((3, 0), (2, 2))]
    assert _kinds_by_key(_assert_matches_stock(Metadata({"g": _tensor((4, 7), mixed)}))) == {"g": {"overlap", "fill"}}


def test_irregular_tiling_takes_the_sweep():
    # Brick wall: rows of different column splits (not a product grid, not a 1-D split).
    bricks = [([0, 0], [1, 4]), ([0, 4], [1, 4]), ([1, 0], [1, 2]), ([1, 2], [1, 4]), ([1, 6], [1, 2])]
    assert _assert_matches_stock(Metadata({"w": _tensor((2, 8), bricks)})) == []
    bricks[3] = ([1, 1], [1, 4])
    assert {_kind(m) for m in _assert_matches_stock(Metadata({"w": _tensor((2, 8), bricks)}))} == {"overlap"}


def test_overlaps_are_capped_per_entry():
    metadata = Metadata({"w": _tensor((3, 5), [([0, 0], [3, 5])] * 30)})
    stock = _assert_matches_stock(metadata)
    assert len(stock) == 30 * 29 // 2 + 1  # every pair, and the fill error
    ours = validate_chunk_table(table_from_metadata(metadata), True)
    assert 1 <= len([m for m in ours if _kind(m) == "overlap"]) <= OVERLAP_PAIRS_PER_ENTRY


def test_numbers_beyond_int64_arithmetic_match_stock():
    big = 1 << 62
    metadata = Metadata({
        "w": _tensor((big, 4), [([0, 0], [big, 4]), ([big, 0], [big, 4])]),  # out of bounds; sums pass 2**63
        "v": _tensor((3 << 40, 1 << 40), [([0, 0], [3 << 40, 1 << 40]), ([1, 0], [1, 1 << 40])]),
    })
    stock = _assert_matches_stock(metadata)
    assert _kinds_by_key(stock) == {"w": {"bounds", "fill"}, "v": {"overlap", "fill"}}


def test_entries_without_chunks_and_skipped_entries():
    metadata = Metadata({
        "none": _tensor((3, 2), []),
        "blob": BytesStorageMetadata(),
        "scalar": _tensor((), [((), ()), ((), ())]),
        "ok": _tensor((2,), [([0], [2])]),
    })
    assert _kinds_by_key(_assert_matches_stock(metadata)) == {"none": {"fill"}}


def test_each_message_is_logged_as_a_warning(caplog):
    metadata = Metadata({"w": _tensor((4,), [([0], [3]), ([2], [3])])})
    with caplog.at_level(logging.WARNING, logger="fastdcp"):
        errors = validate_chunk_table(table_from_metadata(metadata), True)
    ours = [r for r in caplog.records if r.name == "fastdcp"]
    assert [r.getMessage() for r in ours] == errors and len(errors) == 3
    assert {r.levelno for r in ours} == {logging.WARNING}


# ---------------------------------------------------------------------------------------------------
# Scale: a Llama-7B-shaped AdamW state, FSDP Shard(0) over 4,096 ranks


def _llama_shapes(entries: int) -> list[tuple[int, ...]]:
    """Parameter shapes of Llama-7B (each once for the weights and twice for AdamW's moments),
    repeated to ``entries``. Includes 4096 x 11008 (dim 1 > dim 0: quadratic for stock's sweep)."""
    dim, hidden, vocab = 4096, 11008, 32000
    params = [(vocab, dim)]
    for _ in range(32):
        params += [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden), (dim,), (dim,)]
    params += [(dim,), (vocab, dim)]
    shapes = [p for p in params for _ in range(3)]
    return list(itertools.islice(itertools.cycle(shapes), entries))


def _shard0_table(shapes: list[tuple[int, ...]], ranks: int) -> ChunkTable:
    """The ChunkTable of FSDP2 Shard(0) chunks (built directly: the reference conversion from
    ``Metadata`` would take minutes at this size)."""
    offsets, lengths = [], []
    for shape in shapes:
        rows = shape[0]
        per = -(-rows // ranks)
        start = torch.clamp(torch.arange(ranks, dtype=torch.int64) * per, max=rows)
        o = torch.zeros((ranks, 2), dtype=torch.int64)
        s = torch.zeros((ranks, 2), dtype=torch.int64)
        o[:, 0] = start
        s[:, 0] = torch.clamp(rows - start, max=per)
        if len(shape) == 2:
            s[:, 1] = shape[1]
        offsets.append(o)
        lengths.append(s)
    return ChunkTable(
        fqns=[f"state.{i}" for i in range(len(shapes))],
        properties=[PROPERTIES] * len(shapes),
        sizes=[torch.Size(s) for s in shapes],
        row_start=torch.arange(len(shapes) + 1, dtype=torch.int64) * ranks,
        offsets=torch.cat(offsets),
        lengths=torch.cat(lengths),
    )


def test_llama_shard0_at_4096_ranks_validates(capsys):
    ranks, entries = 4096, 1190
    table = _shard0_table(_llama_shapes(entries), ranks)
    started = time.perf_counter()
    assert validate_chunk_table(table, True) == []
    elapsed = time.perf_counter() - started
    with capsys.disabled():
        print(f"\nvalidate_chunk_table: {entries} entries x {ranks} ranks ({table.rows:,} chunks): {elapsed:.2f} s")

    # The same table with one row block of one wide tensor moved down by a row: exactly that entry is
    # reported, with an overlap and no fill error (its volume is unchanged).
    wide = next(e for e, size in enumerate(table.sizes) if size == (4096, 11008))
    row = int(table.row_start[wide]) + 1000
    table.offsets[row, 0] += 1
    errors = validate_chunk_table(table, True)
    assert _kinds_by_key(errors) == {f"state.{wide}": {"overlap"}}
    assert len(errors) == 1  # the moved block overlaps the next one; the hole it leaves is no error


def test_grid_layout_at_scale_matches_a_sample_checked_by_stock():
    """FSDP Shard(0) x TP Shard(1) on a 64 x 64 mesh: product grids take the grid path; one entry,
    converted to Metadata, is checked by stock too."""
    ranks0, ranks1, rows, cols = 64, 64, 256, 352
    r_cuts = [(min(i * 4, rows), 4) for i in range(ranks0)]
    c_cuts = [(min(j * 6, cols), min(6, max(cols - j * 6, 0))) for j in range(ranks1)]  # empty trailing
    c_cuts = [(min(o, cols), s) for o, s in c_cuts]
    grid = [([r[0], c[0]], [r[1], c[1]]) for r in r_cuts for c in c_cuts]
    metadata = Metadata({"g": _tensor((rows, cols), grid)})
    assert _assert_matches_stock(metadata) == []
    broken = list(grid)
    broken[64 * 10 + 5] = ([40, 31], [4, 6])  # one tile moved right by one column
    assert _kinds_by_key(_assert_matches_stock(Metadata({"g": _tensor((rows, cols), broken)}))) == {"g": {"overlap"}}
