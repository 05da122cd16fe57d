"""A checkpoint's metadata read one rank's section at a time: at thousands of ranks, a rank that
loads the layout it saved reads its own rows of the chunk index (tens of KB), not the whole index
(hundreds of MB) that every other rank also reads.

:func:`fastdcp.load.metadata_cache.load_table_metadata` returns a :class:`SectionedTableMetadata`
for a version 2 chunk index when the load runs on several ranks. It is a
:class:`~fastdcp.format.table_metadata.TableMetadata` whose table is read on first use, so every
consumer that needs the whole checkpoint (stock's planners, ``state_dict_metadata``, pickling,
``==``) gets it, read once and checked as before. What reads less:

* the reader binds the rank (:meth:`SectionedTableMetadata.bind_rank`) and
  :class:`~fastdcp.planners.FastLoadPlanner` plans from :meth:`SectionedTableMetadata.rank_section`
  when the section covers every destination chunk
  (:func:`fastdcp.planners.read_items.section_read_items`), else from the whole table;
* ``storage_data`` answers from the section until the whole table was read, from the whole table
  after (the section's rows are the whole table's rows, so both answer the same);
* ``planner_data``, ``storage_meta`` and ``version`` come with the section's shared objects.

A section that is missing, damaged or does not belong to the ``.metadata`` is ignored with a
warning on the ``fastdcp`` logger (the whole index is read); a whole index that turns out damaged
falls back to parsing ``.metadata`` itself, with a warning, as
:func:`~fastdcp.load.metadata_cache.load_table_metadata` does up front.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..format.chunk_table import table_from_metadata
from ..format.index_reader import read_chunk_index
from ..format.index_sections import IndexHeader, RankSection, read_rank_section
from ..format.metadata import CheckpointFormatError, parse_metadata
from ..format.sources import PositionalSource, read_exactly
from ..format.table_metadata import _SD, _SDM, _TABLE, _UNBUILT, TableEntries, TableMetadata, TableStorageData
from ..io.gc import gc_paused
from ..io.positional import ReadAhead

__all__ = ["IndexSource", "SectionedTableMetadata", "SectionStorageData", "metadata_bytes_read"]

logger = logging.getLogger("fastdcp")

# Sections remembered per index: a rank's own, and those a resharded load probed and used
# (fastdcp.planners.read_items.covering_read_items: about log2(ranks) probes, a few used).
_SECTIONS_KEPT = 48

_read_lock = threading.Lock()
_bytes_read = 0


def count_metadata_read(n: int) -> None:
    """Add ``n`` bytes to what this process read of checkpoint metadata (``.metadata`` and
    chunk indexes)."""
    global _bytes_read
    with _read_lock:
        _bytes_read += n


def metadata_bytes_read() -> int:
    """Bytes of checkpoint metadata (``.metadata`` files and chunk indexes) this process has read
    so far; the benchmark's per-rank metadata figures are differences of it."""
    return _bytes_read


class IndexSource:
    """The chunk index of one ``.metadata``, whose header was read and matched (size and edge
    CRC-32C) when this was made: one rank's section or the whole table, each read on demand
    and kept.

    Both are read through positional sources (:class:`fastdcp.format.sources.PositionalSource`),
    owned and closed with this object: local files held open (a save that replaces the
    checkpoint meanwhile, renaming a new ``.metadata`` over it and deleting the old index, cannot
    make a later read see another save than the one this load started with), or objects read
    by ranged GETs pinned to the version first read (a replaced ``.metadata`` is an error then,
    never another save's bytes).

    Args:
        metadata: the ``.metadata`` the index was matched against.
        index: the chunk index.
        header: the index's header, as read.
        shared: the index's shared objects (:func:`~fastdcp.format.index_sections.read_shared_objects`).
        allow_unsafe: unpickle the index's small objects with plain pickle.
    """

    def __init__(self, metadata: PositionalSource, index: PositionalSource, header: IndexHeader,
                 shared: dict[str, Any], allow_unsafe: bool) -> None:
        self.shared = shared
        self.metadata = metadata
        self.index = index
        self.header = header
        self.allow_unsafe = allow_unsafe
        self.metadata_file = metadata.name
        self.index_path = index.name
        self.where = f"checkpoint chunk index '{index.name}'"
        self._lock = threading.Lock()
        self._sections: OrderedDict[int, RankSection | None] = OrderedDict()
        self._full: TableMetadata | None = None

    def close(self) -> None:
        for name in ("index", "metadata"):
            source = getattr(self, name, None)
            if source is not None:
                source.close()

    def __del__(self) -> None:
        self.close()

    def section(self, rank: int) -> RankSection | None:
        """Rank ``rank``'s section, or None when the index has none for it or it cannot be used
        (logged)."""
        with self._lock:
            if rank in self._sections:
                self._sections.move_to_end(rank)
                return self._sections[rank]
            section = None
            try:
                with gc_paused():
                    section = read_rank_section(self.index, self.header, rank, self.where,
                                                allow_unsafe=self.allow_unsafe, shared=self.shared)
            except CheckpointFormatError as e:
                logger.warning("ignoring a damaged section of a chunk index, reading the whole index: %s", e)
            except OSError as e:
                logger.warning("could not read rank %d's section of %s (%s), reading the whole index", rank,
                               self.where, e)
            self._sections[rank] = section
            while len(self._sections) > _SECTIONS_KEPT:
                self._sections.popitem(last=False)
            return section

    def full(self) -> TableMetadata:
        """The whole checkpoint's metadata: from the index's table, or (damaged index, logged)
        parsed from ``.metadata``."""
        with self._lock:
            if self._full is None:
                self._full = self._read_full()
            return self._full

    def _read_full(self) -> TableMetadata:
        h = self.header
        try:
            with gc_paused():
                index = read_chunk_index(ReadAhead(self.index), self.where, allow_unsafe=self.allow_unsafe)
            facts = (index.metadata_size, index.metadata_head_crc, index.metadata_tail_crc)
            if facts != (h.metadata_size, h.metadata_head_crc, h.metadata_tail_crc):
                raise CheckpointFormatError(f"{self.where}: its table was written for another .metadata")
            return TableMetadata(index.table, index.planner_data, index.storage_meta, index.version)
        except (CheckpointFormatError, OSError) as e:
            logger.warning("ignoring a damaged chunk index, reading the metadata itself: %s", e)
        with gc_paused():
            data = read_exactly(self.metadata, 0, self.metadata.size(),
                                 lambda problem: CheckpointFormatError(f"'{self.metadata_file}': {problem}"))
            parsed = parse_metadata(data, f"checkpoint metadata '{self.metadata_file}'",
                                    allow_unsafe=self.allow_unsafe)
            table = table_from_metadata(parsed)
        return TableMetadata(table, parsed.planner_data, parsed.storage_meta, parsed.version)


_SOURCE = "_sectioned_source"
_RANK = "_sectioned_rank"
_PLANNED = "_sectioned_planned_from"


class SectionedTableMetadata(TableMetadata):
    """A :class:`TableMetadata` whose table is read from its :class:`IndexSource` on first use;
    until then, one rank's section answers planning and storage lookups (see the module
    docstring)."""

    def __init__(self, source: IndexSource, planner_data: Any, storage_meta: Any, version: str | None) -> None:
        d = self.__dict__
        d[_SOURCE] = source
        d[_RANK] = None
        d[_SDM] = _UNBUILT
        d[_SD] = _UNBUILT
        self.planner_data = planner_data
        self.storage_meta = storage_meta
        self.version = version

    @property
    def chunk_table(self) -> Any:  # type: ignore[override]
        d = self.__dict__
        table = d.get(_TABLE)
        if table is None:
            table = d[_TABLE] = d[_SOURCE].full().chunk_table
        return table

    @property
    def table_loaded(self) -> bool:
        """Whether the whole table was read (every lookup answers from it from then on)."""
        return _TABLE in self.__dict__

    @property
    def index_source(self) -> IndexSource:
        return self.__dict__[_SOURCE]

    def bind_rank(self, rank: int | None) -> None:
        """The rank whose section :meth:`rank_section` returns (the reader sets it)."""
        if rank != self.__dict__[_RANK]:
            self.__dict__[_PLANNED] = None
        self.__dict__[_RANK] = rank

    def rank_section(self) -> RankSection | None:
        """The bound rank's section (None: no rank bound, or no usable section)."""
        rank = self.__dict__[_RANK]
        return None if rank is None else self.__dict__[_SOURCE].section(rank)

    def planned_from(self, section: RankSection) -> None:
        """The planner planned this load from ``section`` (the rank's own, or merged with other
        ranks' sections): storage lookups answer from it."""
        self.__dict__[_PLANNED] = section

    def answering_section(self) -> RankSection | None:
        """The section storage lookups answer from: the one the plan came from, else the rank's."""
        return self.__dict__.get(_PLANNED) or self.rank_section()

    def section_of(self, rank: int) -> RankSection | None:
        """Any rank's section (for a load whose layout differs from the save's)."""
        return self.__dict__[_SOURCE].section(rank)

    @property
    def section_count(self) -> int:
        """How many sections the index has (the save's rank count)."""
        v2 = self.__dict__[_SOURCE].header.v2
        return 0 if v2 is None else v2.sections

    @property
    def storage_data(self) -> Any:  # type: ignore[override]
        d = self.__dict__
        if d[_SD] is _UNBUILT and not self.table_loaded:
            d[_SD] = SectionStorageData(self)
        return TableMetadata.storage_data.fget(self)  # type: ignore[attr-defined]

    @storage_data.setter
    def storage_data(self, value: Any) -> None:
        self.__dict__[_SD] = value

    def entry_views(self) -> Mapping[str, Any]:
        if not self.table_loaded and not self.state_dict_metadata_built:
            section = self.rank_section()
            if section is not None:
                return TableEntries(section.table)  # chunks found by offsets (hints are whole-entry)
        return TableMetadata.entry_views(self)

    def table_answers_storage(self) -> bool:
        sd = self.__dict__[_SD]
        if isinstance(sd, SectionStorageData):
            return False
        return TableMetadata.table_answers_storage(self)

    def _copy(self) -> SectionedTableMetadata:
        new = SectionedTableMetadata.__new__(SectionedTableMetadata)
        new.__dict__.update(self.__dict__)
        if isinstance(new.__dict__[_SD], SectionStorageData):
            new.__dict__[_SD] = SectionStorageData(new)
        return new

    def __copy__(self) -> SectionedTableMetadata:
        return self._copy()

    def __deepcopy__(self, memo: dict) -> TableMetadata:
        return TableMetadata.__deepcopy__(_loaded(self), memo)

    # copy_containers: TableMetadata's, over __copy__ above (a section view of its own).

    def __repr__(self) -> str:
        if self.table_loaded:
            return TableMetadata.__repr__(self)
        h = self.index_source.header
        return f"SectionedTableMetadata({h.entries} entries, sections of {self.index_source.index_path})"


def _loaded(metadata: SectionedTableMetadata) -> SectionedTableMetadata:
    metadata.chunk_table  # noqa: B018 - reads the whole table
    return metadata


class SectionStorageData(MutableMapping):
    """``storage_data`` of a :class:`SectionedTableMetadata`: the bound rank's section answers
    while the whole table was not read; the whole table's view answers from then on (and for
    any key the section lacks, which reads the whole table)."""

    def __init__(self, metadata: SectionedTableMetadata) -> None:
        self._metadata = metadata
        self._section_view: tuple[RankSection, TableStorageData] | None = None
        self._full_view: TableStorageData | None = None

    def current(self) -> TableStorageData:
        """The view answering now (compare by identity to see when it changed)."""
        md = self._metadata
        if not md.table_loaded:
            section = md.answering_section()
            if section is not None:
                if self._section_view is None or self._section_view[0] is not section:
                    self._section_view = (section, TableStorageData(section.table))
                return self._section_view[1]
        return self._full()

    def _full(self) -> TableStorageData:
        if self._full_view is None:
            self._full_view = TableStorageData(self._metadata.chunk_table)
        return self._full_view

    def __getitem__(self, index: MetadataIndex) -> Any:
        view = self.current()
        try:
            return view[index]
        except KeyError:
            if view is self._full_view:
                raise
        return self._full()[index]

    def __contains__(self, index: object) -> bool:
        view = self.current()
        return index in view or (view is not self._full_view and index in self._full())

    def __len__(self) -> int:
        return len(self._full())

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._full())

    def __setitem__(self, index: Any, value: Any) -> None:
        self._full()[index] = value

    def __delitem__(self, index: Any) -> None:
        del self._full()[index]

    def as_dict(self) -> dict[MetadataIndex, Any]:
        return self._full().as_dict()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (dict, (self.as_dict(),))
