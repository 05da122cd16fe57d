"""The write results a rank sends to the coordinator after writing its data files.

Stock gathers one ``WriteResult`` (a ``MetadataIndex``, a ``_StorageInfo``) per item of every
rank: at 4,096 ranks of a 7B model, ~5 million pickled objects the coordinator unpickles only to
copy them into ``Metadata.storage_data``. When the save was planned in bulk
(``FastSavePlanner``: every item of the rank's global plan knows its row in the checkpoint's
``ChunkTable``), the results travel as columns instead (:class:`ResultColumns`: each result's
table row, file, byte range and CRC-32C), and ``finish`` places them into the table's storage
columns with a few tensor operations (:func:`storage_columns`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ..format.chunk_table import NO_CHECKSUM, StorageColumns, int64_values, tensor_bytes
from ..format.metadata import CHECKSUM_ATTRIBUTE

__all__ = ["pack_write_results", "ResultColumns", "result_columns", "storage_columns"]


@dataclass(frozen=True)
class ResultColumns:
    """One rank's write results as columns (int64 bytes, one value per result)."""

    files: tuple[str, ...]
    rows: bytes  # the checkpoint table row of each result's item
    file_index: bytes
    byte_offset: bytes
    byte_length: bytes
    checksums: bytes  # NO_CHECKSUM where none was recorded


class PackedWriteResults(list):
    """A rank's ``WriteResult`` list (a real list on the rank) that pickles as columns."""

    __slots__ = ("columns",)

    def __init__(self, results: list[WriteResult], columns: ResultColumns) -> None:
        super().__init__(results)
        self.columns = columns

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (ColumnarWriteResults, (self.columns,))


class ColumnarWriteResults(Sequence):
    """Write results received as columns (the coordinator's side). ``finish`` reads
    :attr:`columns`; the results cannot be rebuilt as ``WriteResult`` objects here (their
    ``MetadataIndex`` is in the coordinator's table, not in the message)."""

    def __init__(self, columns: ResultColumns) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns.rows) // 8

    def __getitem__(self, i: Any) -> Any:
        raise TypeError(
            "write results sent as columns (a save planned by FastSavePlanner) can only be committed by "
            "FastFileSystemWriter.finish"
        )

    def __iter__(self) -> Iterator[WriteResult]:
        if len(self):
            self[0]  # raises: see __getitem__
        return iter(())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (ColumnarWriteResults, (self.columns,))


def pack_write_results(plan: SavePlan, results: list[WriteResult]) -> list[WriteResult]:
    """The results of writing ``plan``'s items, in the form they travel to the coordinator:
    columns when the plan was planned in bulk (its items carry ``table_rows``) and every item has
    exactly one result; otherwise ``results`` unchanged."""
    table_rows = getattr(plan.items, "table_rows", None)
    if table_rows is None or len(results) != len(plan.items):
        return results
    position = {item.index: p for p, item in enumerate(plan.items)}
    if len(position) != len(results):
        return results
    rows_of_items = int64_values(table_rows).tolist()
    files: dict[str, int] = {}
    rows, file_index, byte_offset, byte_length, checksums = [], [], [], [], []
    for result in results:
        p = position.get(result.index)
        info = result.storage_data
        if p is None or getattr(info, "transform_descriptors", None):
            return results
        rows.append(rows_of_items[p])
        file_index.append(files.setdefault(info.relative_path, len(files)))
        byte_offset.append(info.offset)
        byte_length.append(info.length)
        checksums.append(getattr(info, CHECKSUM_ATTRIBUTE, NO_CHECKSUM))
    columns = ResultColumns(
        files=tuple(files),
        rows=tensor_bytes(torch.tensor(rows, dtype=torch.int64)),
        file_index=tensor_bytes(torch.tensor(file_index, dtype=torch.int64)),
        byte_offset=tensor_bytes(torch.tensor(byte_offset, dtype=torch.int64)),
        byte_length=tensor_bytes(torch.tensor(byte_length, dtype=torch.int64)),
        checksums=tensor_bytes(torch.tensor(checksums, dtype=torch.int64)),
    )
    return PackedWriteResults(results, columns)


def result_columns(results: Any) -> ResultColumns | None:
    """The columns of one rank's results as ``finish`` received them (None: plain results)."""
    columns = getattr(results, "columns", None)
    return columns if isinstance(columns, ResultColumns) else None


def storage_columns(rows: int, per_rank: list[ResultColumns]) -> StorageColumns:
    """The table's storage columns from every rank's results. Raises ``ValueError`` unless every
    row of the table got exactly one result."""
    files: list[str] = []
    bases, counts = [], []
    for rank, columns in enumerate(per_rank):
        sizes = {len(columns.rows), len(columns.file_index), len(columns.byte_offset), len(columns.byte_length),
                 len(columns.checksums)}
        if len(sizes) != 1 or len(columns.rows) % 8:
            raise ValueError(f"rank {rank}'s write results have columns of different lengths")
        bases.append(len(files))
        counts.append(len(columns.rows) // 8)
        files.extend(columns.files)

    def joined(field: str) -> torch.Tensor:
        # One buffer per field for all ranks (per-rank tensors cost more than the copy at
        # thousands of ranks); bytearray().join copies once and stays writable.
        data = bytearray().join(getattr(columns, field) for columns in per_rank)
        return torch.frombuffer(data, dtype=torch.int64) if data else torch.zeros(0, dtype=torch.int64)

    row = joined("rows")
    rank_file = joined("file_index")
    if len(rank_file):  # each rank's file numbers, after the files of the ranks before it
        rank_file += torch.repeat_interleave(torch.tensor(bases, dtype=torch.int64),
                                             torch.tensor(counts, dtype=torch.int64))
    # The same file name from two ranks cannot happen (names carry the rank); dedup anyway.
    unique: dict[str, int] = {}
    remap = torch.tensor([unique.setdefault(name, len(unique)) for name in files] or [0], dtype=torch.int64)
    seen = torch.bincount(row, minlength=rows) if len(row) else torch.zeros(rows, dtype=torch.int64)
    if len(seen) != rows or bool((seen != 1).any()):
        missing = int((seen == 0).sum()) if len(seen) >= rows else 0
        raise ValueError(
            f"the ranks' write results do not cover the checkpoint's {rows} chunks exactly once "
            f"({missing} without a result, {int((seen > 1).sum())} with several)"
        )
    file_index = torch.empty(rows, dtype=torch.int64)
    byte_offset = torch.empty(rows, dtype=torch.int64)
    byte_length = torch.empty(rows, dtype=torch.int64)
    checksums = torch.empty(rows, dtype=torch.int64)
    file_index[row] = remap[rank_file]
    byte_offset[row] = joined("byte_offset")
    byte_length[row] = joined("byte_length")
    checksums[row] = joined("checksums")
    return StorageColumns(
        files=list(unique),
        file_index=file_index.to(torch.int32),
        byte_offset=byte_offset,
        byte_length=byte_length,
        checksums=checksums,
    )
