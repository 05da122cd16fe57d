"""A checkpoint's chunks as columns: what ``Metadata.state_dict_metadata`` and
``Metadata.storage_data`` say, held as a few int64 tensors instead of millions of objects.

At thousands of ranks a 7B model's ``.metadata`` names ~5 million chunks. As ``Metadata`` objects
(a ``ChunkStorageMetadata`` with two ``torch.Size`` per chunk, a ``MetadataIndex`` and a
``_StorageInfo`` per stored item) that is gigabytes of memory and minutes of Python work on the
coordinator and on every rank that loads. A :class:`ChunkTable` is the same information as
columns, built and searched with tensor operations; :func:`table_to_metadata` and
:func:`table_from_metadata` convert to and from stock's objects (the reference the bulk paths
are tested against).

Layout: entries (one per key of ``state_dict_metadata``, in its order) own consecutive rows
(``row_start[e]:row_start[e + 1]``), one row per chunk in the order of that entry's ``chunks``
list. A bytes entry (``BytesStorageMetadata``) has exactly one row with no dimensions. Row ``r``
of tensor entry ``e`` is the chunk ``ChunkStorageMetadata(offsets[r, :ndim], lengths[r, :ndim])``
stored under ``MetadataIndex(fqns[e], offsets[r, :ndim], r - row_start[e])``; bytes rows are
stored under ``MetadataIndex(fqns[e])``. Columns past an entry's ``ndim`` are zero.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .metadata import CHECKSUM_ATTRIBUTE

__all__ = ["ChunkTable", "RankRows", "StorageColumns", "table_from_metadata", "table_to_metadata", "tensor_bytes", "int64_values"]

NO_CHECKSUM = -1  # value of StorageColumns.checksums for an item without a recorded CRC-32C


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor's values, in order: how columns travel in pickles (no numpy:
    it is not a dependency)."""
    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()) if tensor.numel() else b""


def int64_values(data: bytes) -> torch.Tensor:
    """The int64 tensor :func:`tensor_bytes` was made from (a copy: ``data`` is immutable)."""
    return torch.frombuffer(bytearray(data), dtype=torch.int64) if data else torch.zeros(0, dtype=torch.int64)


@dataclass(eq=False)  # tensors: compare columns with torch.equal
class StorageColumns:
    """Where each row's bytes are: ``_StorageInfo(files[file_index[r]], byte_offset[r],
    byte_length[r])``, with the CRC-32C attribute when ``checksums[r] != NO_CHECKSUM``."""

    files: list[str]
    file_index: torch.Tensor  # int32 [rows]
    byte_offset: torch.Tensor  # int64 [rows]
    byte_length: torch.Tensor  # int64 [rows]
    checksums: torch.Tensor  # int64 [rows]


@dataclass(eq=False)  # tensors: compare columns with torch.equal
class RankRows:
    """Which table rows each rank of the save planned: rank ``r``'s items are the table rows
    ``rows[start[r]:start[r + 1]]`` (ascending), including the rows of replicated items that
    another rank wrote. What the chunk index's per-rank sections are cut from, so that a rank
    loading the layout it saved finds every chunk it needs in its own section."""

    start: torch.Tensor  # int64 [ranks + 1]
    rows: torch.Tensor  # int64 [start[-1]]


@dataclass(eq=False)  # tensors: compare columns with torch.equal
class ChunkTable:
    """Every chunk of a checkpoint, as columns (see the module docstring for the layout).

    ``properties[e]`` and ``sizes[e]`` are ``None`` for a bytes entry. ``storage`` is ``None``
    while the table describes a plan whose data is not written yet."""

    fqns: list[str]
    properties: list[TensorProperties | None]
    sizes: list[torch.Size | None]
    row_start: torch.Tensor  # int64 [entries + 1]
    offsets: torch.Tensor  # int64 [rows, width]
    lengths: torch.Tensor  # int64 [rows, width]
    storage: StorageColumns | None = None
    rank_rows: RankRows | None = None  # set by the bulk save planner; not part of the content

    @property
    def rows(self) -> int:
        return int(self.offsets.shape[0])

    def ndim(self, entry: int) -> int:
        size = self.sizes[entry]
        return 0 if size is None else len(size)

    def entry_of_rows(self) -> torch.Tensor:
        """int64 [rows]: the entry each row belongs to."""
        counts = self.row_start[1:] - self.row_start[:-1]
        return torch.repeat_interleave(torch.arange(len(self.fqns), dtype=torch.int64), counts)


def table_from_metadata(metadata: Metadata) -> ChunkTable:
    """The columns of a ``Metadata`` (reference conversion, one Python step per chunk).

    Storage columns are filled when ``metadata.storage_data`` names every row with a plain
    ``_StorageInfo`` (no ``transform_descriptors``); otherwise ``storage`` is ``None``."""
    fqns: list[str] = []
    properties: list[TensorProperties | None] = []
    sizes: list[torch.Size | None] = []
    row_start = [0]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    keys: list[MetadataIndex] = []
    for fqn, md in metadata.state_dict_metadata.items():
        fqns.append(fqn)
        if isinstance(md, TensorStorageMetadata):
            properties.append(md.properties)
            sizes.append(md.size)
            for hint, chunk in enumerate(md.chunks):
                boxes.append((tuple(chunk.offsets), tuple(chunk.sizes)))
                keys.append(MetadataIndex(fqn, chunk.offsets, hint))
        else:
            properties.append(None)
            sizes.append(None)
            boxes.append(((), ()))
            keys.append(MetadataIndex(fqn))
        row_start.append(len(boxes))
    width = max([1] + [len(o) for o, _ in boxes])
    offsets = torch.zeros((len(boxes), width), dtype=torch.int64)
    lengths = torch.zeros((len(boxes), width), dtype=torch.int64)
    for r, (o, s) in enumerate(boxes):
        if o:
            offsets[r, : len(o)] = torch.tensor(o, dtype=torch.int64)
            lengths[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
    table = ChunkTable(fqns, properties, sizes, torch.tensor(row_start, dtype=torch.int64), offsets, lengths)
    table.storage = _storage_columns(metadata.storage_data, keys)
    return table


def _storage_columns(storage_data: Any, keys: list[MetadataIndex]) -> StorageColumns | None:
    if not isinstance(storage_data, dict) or len(storage_data) != len(keys):
        return None
    files: dict[str, int] = {}
    file_index, byte_offset, byte_length, checksums = [], [], [], []
    for key in keys:
        info = storage_data.get(key)
        if type(info) is not _StorageInfo or info.transform_descriptors:
            return None
        file_index.append(files.setdefault(info.relative_path, len(files)))
        byte_offset.append(info.offset)
        byte_length.append(info.length)
        checksums.append(getattr(info, CHECKSUM_ATTRIBUTE, NO_CHECKSUM))
    return StorageColumns(
        files=list(files),
        file_index=torch.tensor(file_index, dtype=torch.int32),
        byte_offset=torch.tensor(byte_offset, dtype=torch.int64),
        byte_length=torch.tensor(byte_length, dtype=torch.int64),
        checksums=torch.tensor(checksums, dtype=torch.int64),
    )


def table_to_metadata(
    table: ChunkTable,
    planner_data: Any = None,
    storage_meta: Any = None,
    version: str | None = None,
) -> Metadata:
    """Stock's ``Metadata`` objects for ``table`` (reference conversion, one Python step per chunk)."""
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] | None = {} if table.storage is not None else None
    starts = table.row_start.tolist()
    offsets = table.offsets.tolist()
    lengths = table.lengths.tolist()
    storage = table.storage
    if storage is not None:
        file_index = storage.file_index.tolist()
        byte_offset = storage.byte_offset.tolist()
        byte_length = storage.byte_length.tolist()
        checksums = storage.checksums.tolist()
    for e, fqn in enumerate(table.fqns):
        rows = range(starts[e], starts[e + 1])
        size = table.sizes[e]
        keys: list[MetadataIndex]
        if size is None:
            state_dict_metadata[fqn] = BytesStorageMetadata()
            keys = [MetadataIndex(fqn)]
        else:
            ndim = len(size)
            chunks = [
                ChunkStorageMetadata(torch.Size(offsets[r][:ndim]), torch.Size(lengths[r][:ndim])) for r in rows
            ]
            state_dict_metadata[fqn] = TensorStorageMetadata(table.properties[e], size, chunks)
            keys = [MetadataIndex(fqn, chunk.offsets, hint) for hint, chunk in enumerate(chunks)]
        if storage_data is not None:
            for key, r in zip(keys, rows):
                info = _StorageInfo(storage.files[file_index[r]], byte_offset[r], byte_length[r])
                if checksums[r] != NO_CHECKSUM:
                    setattr(info, CHECKSUM_ATTRIBUTE, checksums[r])
                storage_data[key] = info
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=version,
    )
