"""``TableMetadata``: a ``Metadata`` backed by a :class:`~fastdcp.format.chunk_table.ChunkTable`,
building stock's per-chunk objects only when something asks for them.

A rank that loads a checkpoint from its chunk index (:mod:`fastdcp.format.index_reader`) holds the
checkpoint's ~5 million chunks as a few columns. Code that wants stock objects still gets them:

* ``state_dict_metadata`` is built (a dict of ``TensorStorageMetadata``/``BytesStorageMetadata``,
  exactly what ``table_to_metadata`` gives) the first time it is read;
* ``storage_data`` is first a :class:`TableStorageData`, a ``MutableMapping[MetadataIndex,
  _StorageInfo]`` that answers ``storage_data[index]`` from the table (fqn -> entry, the index
  hint -> row, checked against the offsets, else a search of the entry's rows) and builds only the
  ``_StorageInfo`` asked for; it becomes a plain dict inside the first time it is iterated or
  changed, so ``len``, iteration, ``==`` and item assignment behave as on stock's dict;
* each is lazy on its own, and assigning the attribute replaces it.

``isinstance(md, Metadata)`` holds; ``==`` compares with any ``Metadata`` like stock's dataclass
``==``; ``pickle`` writes a stock ``Metadata`` (class ``torch.distributed.checkpoint.metadata.
Metadata``, every field built); ``copy.copy`` shares the table (and whatever was built).
:meth:`TableMetadata.entry_views` is a read-only ``state_dict_metadata`` for lookups that builds
one chunk at a time (its ``chunks`` are a lazy sequence, not lists).

The table is treated as immutable, and its ``storage_data`` keys as unique (true of any table of a
valid checkpoint, and checked for fqns by :func:`fastdcp.format.index_reader.read_chunk_index`):
``len(storage_data)`` is the number of rows until the dict is built.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .chunk_table import NO_CHECKSUM, ChunkTable
from .metadata import CHECKSUM_ATTRIBUTE

__all__ = [
    "TableMetadata",
    "TableStorageData",
    "TableEntries",
    "TableChunks",
    "build_state_dict_metadata",
    "build_storage_data",
    "row_index",
    "referenced_files",
    "table_file_extents",
]

_UNBUILT = object()  # a lazy field nobody has read or assigned yet
# Attributes of a TableMetadata that are not Metadata attributes (left out when pickled).
_TABLE = "chunk_table"
_SDM = "_table_state_dict_metadata"
_SD = "_table_storage_data"
_LOOKUP = "_table_lookup"
_ENTRIES = "_table_entries"
# How this metadata pickles instead of as a stock Metadata, while its table still answers for it
# (set by the writer once the checkpoint is committed: DCP then broadcasts the metadata to every
# rank, which can read it back from the committed chunk index instead of receiving it whole).
_SENT_AS = "_table_sent_as"
_INTERNAL = frozenset({_TABLE, _SDM, _SD, _LOOKUP, _ENTRIES, _SENT_AS})
_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class _RowLookup:
    """Finds the row a ``MetadataIndex`` names, as a dict keyed by stock's ``MetadataIndex`` would
    (fqn and offset compared; the index hint only speeds the search up)."""

    def __init__(self, table: ChunkTable) -> None:
        self.table = table
        self.entry_of = {fqn: e for e, fqn in enumerate(table.fqns)}
        self.starts: list[int] = table.row_start.tolist()

    def entry(self, fqn: Any) -> int | None:
        try:
            return self.entry_of.get(fqn)
        except TypeError:  # unhashable
            return None

    def row_of(self, index: Any) -> int | None:
        """The row stored under ``index``, or None (a key stock's dict would not hold)."""
        e = self.entry(getattr(index, "fqn", None))
        if e is None:
            return None
        table = self.table
        first, end = self.starts[e], self.starts[e + 1]
        size = table.sizes[e]
        offset = getattr(index, "offset", None)
        if size is None:
            return first if offset is None else None
        if offset is None or end == first:
            return None
        try:
            wanted = [int(v) for v in offset]
        except (TypeError, ValueError):
            return None
        ndim = len(size)
        if len(wanted) != ndim:
            return None
        hint = getattr(index, "index", None)
        if type(hint) is int and 0 <= hint < end - first and table.offsets[first + hint, :ndim].tolist() == wanted:
            return first + hint
        if ndim == 0:
            return end - 1  # every chunk of a 0-d tensor has offset (): a dict keeps the last
        match = (table.offsets[first:end, :ndim] == torch.tensor(wanted, dtype=torch.int64)).all(1)
        hits = torch.nonzero(match)
        return first + int(hits[-1]) if len(hits) else None  # the last: what a dict built in row order keeps


def _storage_info(table: ChunkTable, row: int) -> _StorageInfo:
    s = table.storage
    assert s is not None
    info = _StorageInfo(s.files[int(s.file_index[row])], int(s.byte_offset[row]), int(s.byte_length[row]))
    crc = int(s.checksums[row])
    if crc != NO_CHECKSUM:
        setattr(info, CHECKSUM_ATTRIBUTE, crc)
    return info


def build_state_dict_metadata(table: ChunkTable) -> dict[str, Any]:
    """Stock's ``state_dict_metadata`` for ``table`` (one Python step per chunk)."""
    result: dict[str, Any] = {}
    starts = table.row_start.tolist()
    offsets, lengths = table.offsets.tolist(), table.lengths.tolist()
    Size = torch.Size
    for e, fqn in enumerate(table.fqns):
        size = table.sizes[e]
        if size is None:
            result[fqn] = BytesStorageMetadata()
            continue
        ndim = len(size)
        chunks = [ChunkStorageMetadata(Size(offsets[r][:ndim]), Size(lengths[r][:ndim]))
                  for r in range(starts[e], starts[e + 1])]
        result[fqn] = TensorStorageMetadata(table.properties[e], size, chunks)
    return result


def build_storage_data(table: ChunkTable, built: Mapping[int, _StorageInfo] | None = None) -> dict[MetadataIndex, Any]:
    """Stock's ``storage_data`` for ``table`` (one Python step per chunk); rows in ``built`` reuse
    those ``_StorageInfo`` objects."""
    s = table.storage
    assert s is not None
    built = built or {}
    result: dict[MetadataIndex, Any] = {}
    starts = table.row_start.tolist()
    offsets = table.offsets.tolist()
    files = s.files
    file_index, byte_offset = s.file_index.tolist(), s.byte_offset.tolist()
    byte_length, checksums = s.byte_length.tolist(), s.checksums.tolist()
    for e, fqn in enumerate(table.fqns):
        size = table.sizes[e]
        ndim = 0 if size is None else len(size)
        for hint, r in enumerate(range(starts[e], starts[e + 1])):
            key = MetadataIndex(fqn) if size is None else MetadataIndex(fqn, offsets[r][:ndim], hint)
            info = built.get(r)
            if info is None:
                info = _StorageInfo(files[file_index[r]], byte_offset[r], byte_length[r])
                if checksums[r] != NO_CHECKSUM:
                    setattr(info, CHECKSUM_ATTRIBUTE, checksums[r])
            result[key] = info
    return result


def row_index(table: ChunkTable, row: int) -> MetadataIndex:
    """The ``storage_data`` key of ``row`` (as :func:`build_storage_data` makes it)."""
    e = int(torch.searchsorted(table.row_start, row, right=True)) - 1
    size = table.sizes[e]
    if size is None:
        return MetadataIndex(table.fqns[e])
    return MetadataIndex(table.fqns[e], table.offsets[row, : len(size)].tolist(), row - int(table.row_start[e]))


def referenced_files(table: ChunkTable) -> list[str]:
    """The data files some row of ``table`` is stored in (in ``storage.files`` order)."""
    s = table.storage
    if s is None or not s.files:
        return []
    used = torch.bincount(s.file_index.to(torch.int64), minlength=len(s.files)) > 0
    return [name for name, hit in zip(s.files, used.tolist()) if hit]


class _FileExtents(Mapping):
    """Per data file: the end of the furthest byte range stored in it and that row's key (built
    when asked for). The same answers as ``fastdcp.io.checkpoint_files.file_extents`` over the
    table's ``storage_data``, from one vectorised pass."""

    def __init__(self, table: ChunkTable) -> None:
        s = table.storage
        assert s is not None
        self.table = table
        self.position = {name: f for f, name in enumerate(s.files)}  # a repeated name: its last index
        ends = s.byte_offset + s.byte_length
        file_index = s.file_index.to(torch.int64)
        nfiles = len(s.files)
        self.max_end = torch.full((nfiles,), -1, dtype=torch.int64).scatter_reduce(0, file_index, ends, "amax")
        at_max = ends == self.max_end[file_index]
        rows = torch.arange(table.rows, dtype=torch.int64)
        self.first_row = torch.full((nfiles,), table.rows, dtype=torch.int64).scatter_reduce(
            0, file_index[at_max], rows[at_max], "amin"
        )
        # Several entries of files may carry one name: fold them to the name's furthest end.
        self.by_name: dict[str, list[int]] = {}
        for f, name in enumerate(s.files):
            self.by_name.setdefault(name, []).append(f)

    def __getitem__(self, name: str) -> tuple[int, MetadataIndex]:
        files = self.by_name[name]
        f = max(files, key=lambda i: int(self.max_end[i]))
        end = int(self.max_end[f])
        if end < 0:
            raise KeyError(name)
        return end, row_index(self.table, int(self.first_row[f]))

    def __iter__(self) -> Iterator[str]:
        return (name for name, files in self.by_name.items() if max(int(self.max_end[f]) for f in files) >= 0)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def table_file_extents(table: ChunkTable) -> Mapping[str, tuple[int, MetadataIndex]]:
    """:func:`fastdcp.io.checkpoint_files.file_extents` of the table's ``storage_data``, computed
    from the columns (per file, the furthest ``byte_offset + byte_length`` and its row's key)."""
    return _FileExtents(table)


class TableStorageData(MutableMapping):
    """``storage_data`` answered from a chunk table: lookups build only the ``_StorageInfo``
    asked for (cached); iteration, ``len`` after a change, and changes use a plain dict built from
    the whole table the first time one of them is needed."""

    def __init__(self, table: ChunkTable, lookup: _RowLookup | None = None) -> None:
        if table.storage is None:
            raise ValueError("TableStorageData needs a table with storage columns")
        self.chunk_table = table
        self._lookup = lookup or _RowLookup(table)
        self._built: dict[int, _StorageInfo] = {}
        self._dict: dict[MetadataIndex, Any] | None = None

    @property
    def materialised(self) -> bool:
        """Whether the whole dict was built (then the table no longer answers)."""
        return self._dict is not None

    def as_dict(self) -> dict[MetadataIndex, Any]:
        """The plain dict (built from the table the first time)."""
        if self._dict is None:
            self._dict = build_storage_data(self.chunk_table, self._built)
            self._built = {}
        return self._dict

    def row_of(self, index: Any) -> int | None:
        """The table row ``index`` names (None if none, or once the dict was built or changed)."""
        return None if self._dict is not None else self._lookup.row_of(index)

    def __getitem__(self, index: Any) -> Any:
        if self._dict is not None:
            return self._dict[index]
        row = self._lookup.row_of(index)
        if row is None:
            raise KeyError(index)
        info = self._built.get(row)
        if info is None:
            info = self._built[row] = _storage_info(self.chunk_table, row)
        return info

    def __contains__(self, index: object) -> bool:
        if self._dict is not None:
            return index in self._dict
        return self._lookup.row_of(index) is not None

    def __len__(self) -> int:
        return len(self._dict) if self._dict is not None else self.chunk_table.rows

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self.as_dict())

    def __setitem__(self, index: Any, value: Any) -> None:
        self.as_dict()[index] = value

    def __delitem__(self, index: Any) -> None:
        del self.as_dict()[index]

    def copy(self) -> TableStorageData:
        """A view of the same table with its own cache and, if built, its own dict (the objects
        in it are shared, as ``dict.copy`` shares them)."""
        new = TableStorageData(self.chunk_table, self._lookup)
        new._built = dict(self._built)
        new._dict = dict(self._dict) if self._dict is not None else None
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickles as a plain dict (what stock code would have held).
        return (dict, (), None, None, iter(self.as_dict().items()))

    def __deepcopy__(self, memo: dict) -> TableStorageData:
        new = TableStorageData(copy.deepcopy(self.chunk_table, memo))
        new._dict = copy.deepcopy(self._dict, memo)
        memo[id(self)] = new
        return new

    def __repr__(self) -> str:
        state = "materialised" if self._dict is not None else f"{len(self._built)} built"
        return f"TableStorageData({len(self)} items, {state})"


class TableChunks(Sequence):
    """The chunks of one tensor entry (``ChunkStorageMetadata``, built on first access)."""

    def __init__(self, table: ChunkTable, first: int, end: int, ndim: int) -> None:
        self.chunk_table, self._first, self._end, self._ndim = table, first, end, ndim
        self._built: dict[int, ChunkStorageMetadata] = {}

    def __len__(self) -> int:
        return self._end - self._first

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        chunk = self._built.get(i)
        if chunk is None:
            r, ndim = self._first + i, self._ndim
            t = self.chunk_table
            chunk = self._built[i] = ChunkStorageMetadata(
                torch.Size(t.offsets[r, :ndim].tolist()), torch.Size(t.lengths[r, :ndim].tolist())
            )
        return chunk


class TableEntries(Mapping):
    """A read-only ``state_dict_metadata`` for lookups: each entry is built when looked up, its
    ``chunks`` a :class:`TableChunks` (a sequence, not a list; nothing per chunk is built until
    asked for)."""

    def __init__(self, table: ChunkTable, lookup: _RowLookup | None = None) -> None:
        self.chunk_table = table
        self._lookup = lookup or _RowLookup(table)
        self._built: dict[str, Any] = {}

    def __getitem__(self, fqn: Any) -> Any:
        md = self._built.get(fqn) if type(fqn) is str else None
        if md is not None:
            return md
        e = self._lookup.entry(fqn)
        if e is None:
            raise KeyError(fqn)
        t = self.chunk_table
        size = t.sizes[e]
        if size is None:
            md = BytesStorageMetadata()
        else:
            chunks = TableChunks(t, self._lookup.starts[e], self._lookup.starts[e + 1], len(size))
            md = TensorStorageMetadata(t.properties[e], size, chunks)  # type: ignore[arg-type]
        self._built[fqn] = md
        return md

    def __len__(self) -> int:
        return len(self.chunk_table.fqns)

    def __iter__(self) -> Iterator[str]:
        return iter(self.chunk_table.fqns)


class TableMetadata(Metadata):
    """A ``Metadata`` whose chunks are ``chunk_table`` (see the module docstring)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # ``dataclasses.replace(md, version=...)`` (torch 2.11's ``FileSystemWriter.finish``; any
        # planner may do the same) calls the class with stock's five fields, every one read from
        # ``md`` and so built, and no table: the copy is then what it would be for a stock
        # ``Metadata``, a stock ``Metadata`` with the same fields (extra attributes are dropped by
        # ``replace`` as they are for stock's). Python skips ``__init__`` for it (not a TableMetadata).
        if "state_dict_metadata" in kwargs:
            if isinstance(kwargs.get("storage_data"), TableStorageData):
                kwargs["storage_data"] = kwargs["storage_data"].as_dict()
            return Metadata(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, chunk_table: ChunkTable, planner_data: Any = None, storage_meta: Any = None,
                 version: str | None = None) -> None:
        # Metadata.__init__ is not called: it would assign the two lazy fields.
        d = self.__dict__
        d[_TABLE] = chunk_table
        d[_SDM] = _UNBUILT
        d[_SD] = _UNBUILT
        self.planner_data = planner_data
        self.storage_meta = storage_meta
        self.version = version

    # -- the lazy fields ----------------------------------------------------------------------

    def _lookup(self) -> _RowLookup:
        lookup = self.__dict__.get(_LOOKUP)
        if lookup is None:
            lookup = self.__dict__[_LOOKUP] = _RowLookup(self.chunk_table)
        return lookup

    @property
    def state_dict_metadata(self) -> Any:  # type: ignore[override]
        value = self.__dict__[_SDM]
        if value is _UNBUILT:
            value = self.__dict__[_SDM] = build_state_dict_metadata(self.chunk_table)
        return value

    @state_dict_metadata.setter
    def state_dict_metadata(self, value: Any) -> None:
        self.__dict__[_SDM] = value

    @property
    def storage_data(self) -> Any:  # type: ignore[override]
        value = self.__dict__[_SD]
        if value is _UNBUILT:
            table = self.chunk_table
            value = self.__dict__[_SD] = None if table.storage is None else TableStorageData(table, self._lookup())
        return value

    @storage_data.setter
    def storage_data(self, value: Any) -> None:
        self.__dict__[_SD] = value

    @property
    def state_dict_metadata_built(self) -> bool:
        """Whether ``state_dict_metadata`` was built or assigned (reading it would cost nothing)."""
        return self.__dict__[_SDM] is not _UNBUILT

    def entry_views(self) -> Mapping[str, Any]:
        """``state_dict_metadata`` for lookups, without building every chunk: the real dict once
        it was built or assigned, else a :class:`TableEntries` over the table."""
        if self.state_dict_metadata_built:
            return self.state_dict_metadata
        entries = self.__dict__.get(_ENTRIES)
        if entries is None:
            entries = self.__dict__[_ENTRIES] = TableEntries(self.chunk_table, self._lookup())
        return entries

    def table_answers_storage(self) -> bool:
        """Whether ``storage_data`` still is the table's (not assigned, not changed): columnar
        passes over ``chunk_table.storage`` then see exactly what ``storage_data`` holds."""
        sd = self.__dict__[_SD]
        if self.chunk_table.storage is None:
            return False
        if sd is _UNBUILT:
            return True
        return isinstance(sd, TableStorageData) and sd.chunk_table is self.chunk_table and not sd.materialised

    # -- Metadata protocol ----------------------------------------------------------------------

    def _stock_fields(self) -> tuple[Any, ...]:
        """Stock ``Metadata``'s fields for this metadata, every one built (plain dicts)."""
        sd = self.storage_data
        return (self.state_dict_metadata, self.planner_data, sd.as_dict() if isinstance(sd, TableStorageData) else sd,
                self.storage_meta, self.version)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Metadata):
            return NotImplemented

        def fields(md: Any) -> tuple:
            values = [getattr(md, name) for name in _FIELDS]
            if isinstance(values[2], TableStorageData):
                values[2] = values[2].as_dict()
            return tuple(values)

        return fields(self) == fields(other)

    __hash__ = None  # type: ignore[assignment]  # as Metadata: mutable, compared by value

    def send_as(self, reduced: tuple[Any, ...]) -> None:
        """Pickle as ``reduced`` (a ``__reduce__`` tuple) from now on, as long as nothing assigns
        ``storage_data``: the writer's compact form for a committed checkpoint."""
        self.__dict__[_SENT_AS] = reduced

    def __reduce_ex__(self, protocol: Any) -> Any:
        sent_as = self.__dict__.get(_SENT_AS)
        if sent_as is not None and self.table_answers_storage():
            return sent_as
        # A stock Metadata (readers without fastdcp unpickle it): ``Metadata(*fields)``, then any
        # other attribute set on this one. (Not NEWOBJ: pickle insists its class be type(self).)
        extra = {k: v for k, v in self.__dict__.items() if k not in _INTERNAL and k not in _FIELDS}
        return (Metadata, self._stock_fields(), extra or None)

    def __copy__(self) -> TableMetadata:
        new = TableMetadata.__new__(TableMetadata)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> TableMetadata:
        new = TableMetadata.__new__(TableMetadata)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in (_LOOKUP, _ENTRIES):  # (rebuilt over the copied table on demand)
                new.__dict__[key] = value if value is _UNBUILT else copy.deepcopy(value, memo)
        return new

    def copy_containers(self) -> TableMetadata:
        """A copy sharing the table and the objects built from it, with its own top-level
        containers (the built dicts, the storage view and its cache): what DCP and planners may
        assign into. ``planner_data``/``storage_meta`` are shared (copy them as needed)."""
        new = copy.copy(self)
        d = new.__dict__
        if isinstance(d[_SDM], dict):
            d[_SDM] = dict(d[_SDM])
        sd = d[_SD]
        if isinstance(sd, TableStorageData):
            d[_SD] = sd.copy()
        elif isinstance(sd, dict):
            d[_SD] = dict(sd)
        return new

    def __repr__(self) -> str:
        t = self.chunk_table
        files = len(t.storage.files) if t.storage is not None else 0
        return f"TableMetadata({len(t.fqns)} entries, {t.rows} chunks, {files} files, version={self.version!r})"
