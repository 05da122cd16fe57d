"""The per-chunk parts of ``.metadata`` as fixed-size byte records built with tensor operations: a
record template (:class:`Record`: constant opcodes and int slots, each slot in the narrowest
opcode that holds its column) filled for many rows at once, and windows of table rows
(:class:`Window`) with one template per row shape, emitted as runs in row order. Used by
:func:`fastdcp.format.metadata_emit.write_metadata`.
"""

from __future__ import annotations

import pickle
import sys
from bisect import bisect_right
from typing import Any

import torch

from .chunk_table import NO_CHECKSUM, ChunkTable
from .pickle_stream import PickleStream, get_format, int_format, tensor_view, tuple_ops

__all__ = ["ZERO", "WHOLE", "Record", "WindowRows", "Window", "WindowCursor"]

_TUPLE1, _REDUCE = pickle.TUPLE1, pickle.REDUCE
_LITTLE_ENDIAN = sys.byteorder == "little"

# ---------------------------------------------------------------------------------------------
# Fixed-size records filled with tensor operations
# ---------------------------------------------------------------------------------------------


class Record:
    """A record template: constant opcodes and int slots, each slot filled from an int64 column
    (one value per row)."""

    def __init__(self, size_get: bytes) -> None:
        self.parts: list[bytes | tuple[torch.Tensor, str]] = []
        self.size_get = size_get  # BINGET of torch.Size

    def const(self, data: bytes) -> None:
        self.parts.append(data)

    def ints(self, values: torch.Tensor) -> None:
        self.parts.append((values, "int"))

    def memo_ref(self, values: torch.Tensor) -> None:
        self.parts.append((values, "get"))

    def size(self, columns: torch.Tensor) -> None:
        """A torch.Size of the row's values in ``columns`` [n, d]."""
        before, after = tuple_ops(columns.shape[1])
        self.const(self.size_get + before)
        for j in range(columns.shape[1]):
            self.ints(columns[:, j])
        self.const(after + _TUPLE1 + _REDUCE)

    def build(self, n: int) -> torch.Tensor:
        """uint8 [n, record bytes]: row i holds the record of value row i."""
        template = bytearray()
        slots: list[tuple[int, torch.Tensor, int]] = []
        for part in self.parts:
            if isinstance(part, (bytes, bytearray)):
                template += part
                continue
            values, kind = part
            lo, hi = (int(v) for v in torch.aminmax(values)) if n else (0, 0)
            prefix, width = int_format(lo, hi) if kind == "int" else get_format(hi)
            template += prefix
            slots.append((len(template), values, width))
            template += bytes(width)
        records = torch.empty((n, len(template)), dtype=torch.uint8)
        records.copy_(torch.frombuffer(template, dtype=torch.uint8).expand(n, len(template)))
        for at, values, width in slots:
            records[:, at : at + width] = _le_bytes(values, width)
        return records


def _le_bytes(values: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [n, width]: the low ``width`` bytes of each int64, little-endian (two's complement)."""
    if values.dtype != torch.int64 or values.stride(-1) != 1:
        values = torch.empty(values.shape, dtype=torch.int64).copy_(values)  # (a [1] view may have stride 2)
    if _LITTLE_ENDIAN:
        return values.view(torch.uint8).view(-1, 8)[:, :width]
    return torch.stack([(values >> (8 * i)) & 0xFF for i in range(width)], dim=1).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Windows of rows: one record template per row shape, runs of rows in row order
# ---------------------------------------------------------------------------------------------

# A row's shape code: base * 4 + variant. ``base`` fixes the record's layout apart from sharing
# (its ndim, and for storage_data whether it has a checksum); the variant bits say which parts
# reference a shared object: ZERO (offsets all zero: the zero Size of that ndim) and WHOLE (chunk
# sizes equal to the tensor's: the tensor's Size). Variant 0 is the generic record of the base,
# valid for any row of that base.
ZERO, WHOLE = 1, 2


class WindowRows:
    """What a window [start, end) of rows needs to pick its rows' shapes: their entries, the
    entries' kinds and, for rows of entries with at most ``few_rows`` chunks, whether the
    chunk's offsets are all zero and its sizes the tensor's. Tensor ops over the window's rows, a
    Python step per entry at most."""

    def __init__(self, table: ChunkTable, kinds: list[int], few_rows: int) -> None:
        self.table = table
        self.starts = table.row_start.tolist()
        self.kinds = torch.tensor(kinds, dtype=torch.int64).reshape(-1)  # ndim, -1 for bytes entries
        self.counts = table.row_start[1:] - table.row_start[:-1]
        self.few = (self.counts <= few_rows) & (self.counts > 0) & (self.kinds >= 0)  # tensor entries with few chunks
        width = table.offsets.shape[1]
        self.width_range = torch.arange(width, dtype=torch.int64)
        padded = [list(s) + [0] * (width - len(s)) if s is not None and len(s) <= width else [0] * width
                  for s in table.sizes]
        self.entry_sizes = torch.tensor(padded, dtype=torch.int64).reshape(-1, width)

    def entries(self, start: int, end: int) -> tuple[int, torch.Tensor]:
        """(first entry of the window, each of its entries' rows inside the window) for entries
        first .. the entry of row end - 1."""
        first = bisect_right(self.starts, start) - 1
        last = bisect_right(self.starts, end - 1) - 1
        bounds = self.table.row_start[first : last + 2]
        return first, bounds[1:].clamp(max=end) - bounds[:-1].clamp(min=start)

    def entry_of_rows(self, start: int, end: int) -> torch.Tensor:
        first, inside = self.entries(start, end)
        return torch.repeat_interleave(torch.arange(first, first + len(inside), dtype=torch.int64), inside)

    def codes(self, start: int, end: int, *, storage: bool) -> int | torch.Tensor:
        """The shape code of each row in [start, end) (an int when all rows share one): base
        ``ndim + 1`` (0 for bytes rows) for a chunk of state_dict_metadata, ``(kind + 1) * 2 +
        has_checksum`` for an item of storage_data; variants ZERO and (chunks only) WHOLE."""
        first, inside = self.entries(start, end)
        kinds = self.kinds[first : first + len(inside)]
        base = kinds + 1
        has: torch.Tensor | int = 0
        if storage:
            base = base * 2
            checks = self.table.storage.checksums[start:end] != NO_CHECKSUM
            has = int(checks[0]) if bool((checks == checks[0]).all()) else checks.to(torch.int64)
        few = self.few[first : first + len(inside)]
        any_few = bool(few.any())
        lo, hi = (int(v) for v in torch.aminmax(base))
        if lo == hi and isinstance(has, int) and not any_few:
            return (lo + has) * 4
        codes = (torch.repeat_interleave(base, inside) + has) * 4
        if any_few:
            rows = torch.nonzero(torch.repeat_interleave(few, inside)).flatten()
            entry = torch.repeat_interleave(torch.arange(first, first + len(inside), dtype=torch.int64), inside)[rows]
            outside = self.width_range >= self.kinds[entry][:, None]  # columns past the row's ndim
            zero = ((self.table.offsets[start + rows] == 0) | outside).all(1)
            variant = zero.to(torch.int64) * ZERO
            if not storage:
                whole = ((self.table.lengths[start + rows] == self.entry_sizes[entry]) | outside).all(1)
                variant += whole.to(torch.int64) * WHOLE
            codes[rows] += variant
        return codes


class Window:
    """The records of the rows [start, end), built once: per shape code a group of records (for
    its rows, gathered, or for a span of rows holding them) and the runs of rows in row order,
    each naming its group and the record of its first row there."""

    def __init__(self, start: int, end: int, codes: int | torch.Tensor, build: Any) -> None:
        """``build(sel, code)``: uint8 records [rows, bytes] for the window rows ``sel`` (a slice
        or an int64 tensor of positions in the window) of shape ``code``, or None for rows that
        are never emitted."""
        self.start, self.end = start, end
        n = end - start
        if isinstance(codes, int):
            bounds, run_codes = [0, n], [codes]
        else:
            cuts = (torch.nonzero(codes[1:] != codes[:-1]).flatten() + 1).tolist()
            bounds = [0] + cuts + [n]
            run_codes = codes[bounds[:-1]].tolist()
        groups: dict[int, tuple[Any, int | None]] = {}  # code -> (records, views, width | None; first row of a span)
        distinct = set(run_codes)
        for code in distinct:
            if len(distinct) == 1:
                sel: slice | torch.Tensor = slice(0, n)
            else:
                where = torch.nonzero(codes == code).flatten()
                first, last = int(where[0]), int(where[-1])
                # Records for a span of rows (sliced columns, no gather) when the holes in it are
                # at most as many as the code's own rows and are rows of the same base: their
                # records go unused, and their values (same ndim) do not widen the int opcodes.
                span = last - first + 1 == len(where) or (
                    last - first + 1 <= 2 * len(where) and bool(((codes[first : last + 1] >> 2) == (code >> 2)).all())
                )
                sel = slice(first, last + 1) if span else where
            records = build(sel, code)
            group = None if records is None else (records, tensor_view(records), records.shape[1])
            groups[code] = (group, sel.start if isinstance(sel, slice) else None)
        self.runs: list[tuple[int, int, Any, int]] = []  # (start, end, group, record of start)
        seen: dict[int, int] = {}
        for run_start, run_end, code in zip(bounds, bounds[1:], run_codes):
            group, span_start = groups[code]
            at = run_start - span_start if span_start is not None else seen.get(code, 0)
            seen[code] = seen.get(code, 0) + run_end - run_start
            self.runs.append((run_start, run_end, group, at))
        self.run_starts = bounds[:-1]

    def emit(self, stream: PickleStream, lo: int, hi: int) -> None:
        """Add the records of the table rows [lo, hi) (inside this window) to ``stream``."""
        lo -= self.start
        hi -= self.start
        if len(self.runs) == 1:  # the common case: one group for the whole window
            records, view, width = self.runs[0][2]
            stream.add_records(view[lo * width : hi * width], records)
            return
        i = bisect_right(self.run_starts, lo) - 1
        while i < len(self.runs) and self.runs[i][0] < hi:
            run_start, run_end, group, at = self.runs[i]
            a, b = max(lo, run_start), min(hi, run_end)
            records, view, width = group
            stream.add_records(view[(at + a - run_start) * width : (at + b - run_start) * width], records)
            i += 1


class WindowCursor:
    """Walks windows of ``block_rows`` rows in row order, building each window once."""

    def __init__(self, rows: int, make: Any, block_rows: int) -> None:
        self.rows = rows
        self.block_rows = block_rows
        self.make = make  # make(start, end) -> Window
        self.current: Window | None = None

    def window(self, row: int) -> Window:
        if self.current is None or not self.current.start <= row < self.current.end:
            start = row - row % self.block_rows
            self.current = self.make(start, min(self.rows, start + self.block_rows))
        return self.current

