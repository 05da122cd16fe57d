"""``dcp.save``'s metadata on every rank, read back from the committed chunk index on demand.

``dcp.save`` returns the checkpoint's ``Metadata`` on every rank: DCP pickles what the
coordinator's ``finish`` returns and broadcasts it. At thousands of ranks that is the whole
``.metadata`` (hundreds of MB) pickled once and unpickled by every rank, inside the save, although
almost nobody looks at it. Once ``FastFileSystemWriter`` has committed a save planned in bulk, its
``TableMetadata`` pickles as a :class:`CommittedIndex` instead (the chunk index's name and the
facts that tie it to this save), and each rank gets a :class:`CommittedTableMetadata` that reads
the index the first time any attribute is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..format.index_reader import read_chunk_index
from ..format.metadata import CheckpointFormatError
from ..format.table_metadata import TableMetadata
from .positional import ReadAhead, open_source

__all__ = ["CommittedIndex", "CommittedTableMetadata"]


@dataclass(frozen=True)
class CommittedIndex:
    """Where a committed save's chunk index is, and the facts it must carry (those of the
    ``.metadata`` committed with it)."""

    directory: str
    index_name: str
    metadata_size: int
    metadata_head_crc: int
    metadata_tail_crc: int

    def reduced(self) -> tuple[Any, tuple[Any, ...]]:
        return (CommittedTableMetadata, (self,))


_OWN = frozenset({"__dict__", "__class__", "_load", "__reduce_ex__", "__reduce__", "__repr__"})


class CommittedTableMetadata(TableMetadata):
    """A ``TableMetadata`` read from ``where`` the first time an attribute is used. Raises
    ``CheckpointFormatError`` then if the index is gone or belongs to another save (the directory
    was overwritten since)."""

    def __init__(self, where: CommittedIndex) -> None:  # noqa: super().__init__ runs in _load
        self.__dict__["_committed_where"] = where

    def _load(self) -> None:
        d = object.__getattribute__(self, "__dict__")
        if "_committed_loaded" in d:
            return
        where: CommittedIndex = d["_committed_where"]
        path = os.path.join(where.directory, where.index_name)
        try:
            with open_source(path) as source:
                index = read_chunk_index(ReadAhead(source), f"checkpoint chunk index '{path}'")
        except FileNotFoundError:
            raise CheckpointFormatError(
                f"the metadata dcp.save returned refers to chunk index '{path}', which no longer exists: the "
                "checkpoint directory was overwritten or removed since that save"
            ) from None
        facts = (index.metadata_size, index.metadata_head_crc, index.metadata_tail_crc)
        if facts != (where.metadata_size, where.metadata_head_crc, where.metadata_tail_crc):
            raise CheckpointFormatError(f"chunk index '{path}' no longer belongs to the save that returned this metadata")
        TableMetadata.__init__(self, index.table, index.planner_data, index.storage_meta, index.version)
        d["_committed_loaded"] = True

    def __getattribute__(self, name: str) -> Any:
        if name not in _OWN:
            object.__getattribute__(self, "_load")()
        return object.__getattribute__(self, name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        d = object.__getattribute__(self, "__dict__")
        if "_committed_loaded" not in d:
            return d["_committed_where"].reduced()
        return TableMetadata.__reduce_ex__(self, protocol)

    def __repr__(self) -> str:
        d = object.__getattribute__(self, "__dict__")
        if "_committed_loaded" not in d:
            return f"CommittedTableMetadata({d['_committed_where'].index_name}, not read yet)"
        return TableMetadata.__repr__(self)
