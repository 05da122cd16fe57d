"""Where a load's files come from: the reader plans and places, a :class:`ReadSource` reads the
metadata, opens the data files and provides the engine that reads them.

:class:`FastFileSystemReader <fastdcp.load.reader.FastFileSystemReader>` holds one source
(``reader.source``): :class:`LocalReadSource` reads the checkpoint directory (its data files
pinned right after ``.metadata``, read again while a concurrent save keeps committing). A storage
that keeps the reader's pipeline and serves bytes otherwise supplies its own source.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Mapping
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .._native import _C
from ..format.table_metadata import TableMetadata, TableStorageData, referenced_files, table_file_extents
from ..io.checkpoint_files import check_data_paths, check_file_extents, check_relative_path, file_extents, \
    resolve_data_file
from ..io.engine import get_engine
from ..io.read_mode import ReadMode, read_mode_for
from .metadata_cache import metadata_cache
from .sectioned_metadata import SectionedTableMetadata, SectionStorageData

__all__ = ["ReadSource", "LocalReadSource", "pin_limit", "default_group_rank", "reopen_in_mode"]

logger = logging.getLogger("fastdcp")

# The most data files opened right after reading .metadata (a quarter of the descriptor limit at
# most). Beyond it (thousands of ranks' files), files are opened when read, and a load racing an
# overwrite may find one gone and fail with a clear error.
_PIN_FILES_LIMIT = 1024


def pin_limit() -> int:
    """How many data files a load opens right after reading ``.metadata``."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return _PIN_FILES_LIMIT
    if soft == resource.RLIM_INFINITY:
        return _PIN_FILES_LIMIT
    return max(0, min(_PIN_FILES_LIMIT, soft // 4))


class ReadSource(Protocol):
    """What a reader's storage does for a load."""

    def read_metadata(self, rank: int | None) -> Metadata:
        """The checkpoint's metadata (``__{rank}.metadata`` with ``rank``), validated; every data
        file it names checked to lie inside the checkpoint."""

    def choose_read_mode(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]) -> ReadMode | None:
        """O_DIRECT or buffered for this load's reads; None where the storage has no such choice."""

    def read_engine(self, direct: bool) -> Any:
        """What the reads go through: the native engine's read surface (``read``, ``read_runs``,
        ``box_copy``, ``crc32c``)."""

    def open(self, relative_path: str) -> Any:
        """Data file ``relative_path`` opened for the engine (``path``, ``direct``, ``size()``,
        ``close()``); byte ranges the metadata places past its end are refused here."""

    def release(self) -> None:
        """The load is over: close what the source holds for it."""


class LocalReadSource:
    """The checkpoint directory, through the native engine.

    Args:
        reader: the reader whose ``path``, ``io_options``, ``allow_unsafe_metadata``,
            ``storage_data`` and current mode it uses; it sets ``reader.last_read_mode``.
    """

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        # Data files opened right after reading .metadata, by relative path; consumed by the
        # reads, closed when the load ends.
        self._pinned: dict[str, tuple[_C.File, bool]] = {}  # relative path -> (file, opened O_DIRECT)
        self._extents: tuple[Any, Mapping] | None = None  # (storage_data, file_extents(storage_data))

    def read_metadata(self, rank: int | None) -> Metadata:
        """This load's metadata, its data files pinned. A data file missing right after
        ``.metadata`` was read means a concurrent save committed in between (its cleanup removed
        the file): ``.metadata`` is read again, as long as it keeps being replaced (up to
        ``_METADATA_READS`` times: saves committing back to back on a loaded machine can do that
        more than once). A file missing while ``.metadata`` is unchanged is a damaged checkpoint,
        reported by the read that needs the file."""
        group_rank = default_group_rank() if rank is None else None
        for attempt in range(_METADATA_READS):
            committed = _metadata_identity(self.reader.path)

            def settled(pinned: bool) -> bool:  # pinned; or the last try; or damage, not a commit
                return pinned or attempt == _METADATA_READS - 1 or _metadata_identity(self.reader.path) == committed

            metadata = metadata_cache.load(self.reader.path, rank, self.reader.allow_unsafe_metadata,
                                           sectioned=group_rank is not None)
            if isinstance(metadata, SectionedTableMetadata):
                # This rank's section (the default group's rank for now; set_up_storage_reader
                # rebinds when DCP names another): its files are checked and pinned, not all.
                metadata.bind_rank(group_rank)
                section = metadata.rank_section()
                if section is not None:
                    for rel in section.table.storage.files:  # type: ignore[union-attr]
                        check_relative_path(self.reader.path, rel)
                    if settled(self._pin_names(set(section.table.storage.files))):  # type: ignore[union-attr]
                        break
                    logger.info("a data file of %s vanished right after its .metadata was read (a concurrent "
                                "save committed): reading .metadata again", self.reader.path)
                    continue
            # Every data file the metadata names must stay inside the checkpoint (stock code reads
            # the items fastdcp hands back to it, so this is checked up front, not only in _open).
            if isinstance(metadata, TableMetadata) and metadata.table_answers_storage():
                for rel in metadata.chunk_table.storage.files:  # type: ignore[union-attr]
                    check_relative_path(self.reader.path, rel)
            else:
                check_data_paths(self.reader.path, metadata.storage_data)
            if settled(self._pin(metadata)):
                break  # a file missing under an unchanged .metadata is reported when read
            logger.info("a data file of %s vanished right after its .metadata was read (a concurrent save "
                        "committed): reading .metadata again", self.reader.path)
        return metadata

    def _pin(self, metadata: Metadata) -> bool:
        """Open every data file ``metadata`` names (when they are few enough), replacing earlier
        pins. False when one of them does not exist (no pins are kept then)."""
        if isinstance(metadata, TableMetadata) and metadata.table_answers_storage():
            names = set(referenced_files(metadata.chunk_table))
        else:
            names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        return self._pin_names(names)

    def _pin_names(self, names: set[Any]) -> bool:
        """Open the data files ``names`` (when they are few enough), replacing earlier pins. False
        when one of them does not exist (no pins are kept then)."""
        self._unpin()
        if not names or len(names) > pin_limit():
            return True
        direct = self.reader.io_options.direct_for(str(self.reader.path))
        try:
            for rel in sorted(names):
                path = resolve_data_file(self.reader.path, rel)
                self._pinned[rel] = (_C.File(path, "r", direct), direct)
        except FileNotFoundError:
            self._unpin()
            return False
        except Exception:  # noqa: BLE001 - anything else is reported by the read that needs the file
            self._unpin()
        return True

    def release(self) -> None:
        """Close the files pinned and not read."""
        self._unpin()

    def _unpin(self) -> None:
        pinned, self._pinned = self._pinned, {}
        for file, _ in pinned.values():
            file.close()

    def open(self, relative_path: str) -> _C.File:
        # Refuses paths leading out of the checkpoint (absolute, "..", symlinks), non-regular
        # files, and (before anything is allocated) byte ranges past the end of the file.
        pinned = self._pinned.pop(relative_path, None)
        if pinned is not None:
            file = pinned[0] if pinned[1] == self.reader._direct else reopen_in_mode(pinned[0], self.reader._direct)
            path = os.path.join(str(self.reader.path), relative_path)
        else:
            path = resolve_data_file(self.reader.path, relative_path)
            file = _C.File(path, "r", self.reader._direct)
        try:
            answering = self.reader.storage_data
            if isinstance(answering, SectionStorageData):
                answering = answering.current()  # the section's view, or the whole table's once read
            if self._extents is None or self._extents[0] is not answering:
                self._extents = (answering, _file_extents(answering))
            check_file_extents(self._extents[1], relative_path, path, file.size())
        except BaseException:
            file.close()
            raise
        return file

    def read_engine(self, direct: bool) -> Any:
        """What this load's reads go through: the native engine for the chosen mode."""
        return get_engine(self.reader.io_options.read_with(direct))

    def choose_read_mode(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]) -> ReadMode | None:
        """The mode of this load (fastdcp.io.read_mode), from the files it reads and the bytes of
        the stored blobs it needs (an upper bound when it reads parts of them)."""
        directory = str(self.reader.path)
        planned = 0
        for pairs in per_file.values():
            planned += sum({info.offset: info.length for _, info in pairs}.values())
        paths = [os.path.join(directory, rel) for rel in per_file]
        mode = self.reader.last_read_mode = read_mode_for(directory, self.reader.io_options, paths, planned)
        logger.debug("reading %d files (%d bytes) of %s %s (%s)", len(paths), planned, directory,
                     "with O_DIRECT" if mode.direct else "buffered", mode.reason)
        return mode


def reopen_in_mode(file: _C.File, direct: bool) -> _C.File:
    """``file`` (open for reading) opened again with or without O_DIRECT, and closed. Through its own
    descriptor, not its path: a pinned file stays the one the metadata named even when a
    concurrent save has replaced or unlinked its path since. Without /proc (the reopen fails) the
    file is kept as it is: the right bytes, in the other mode."""
    try:
        reopened = file.reopen(direct)
    except OSError:
        return file
    try:
        file.close()
    except OSError:
        pass  # read-only: nothing was written that a close could report lost
    return reopened


# How many times a load reads .metadata while saves keep committing new ones under it.
_METADATA_READS = 8


def _metadata_identity(path: Any) -> tuple[int, int, int] | None:
    """What changes when a save commits a new ``.metadata`` (it is renamed into place): inode,
    modification time and size; None when it cannot be read."""
    try:
        st = os.stat(os.path.join(str(path), ".metadata"))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def default_group_rank() -> int | None:
    """This process's rank in the default process group when that group has several ranks (a
    load that may read one rank's section of the chunk index), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.get_rank() if dist.get_world_size() > 1 else None
    except (RuntimeError, ValueError):
        return None


def _file_extents(storage_data: Any) -> Mapping[str, tuple[int, Any]]:
    """:func:`fastdcp.io.checkpoint_files.file_extents`, from the columns when ``storage_data`` is
    still a chunk table's view (iterating it would build every item)."""
    if isinstance(storage_data, SectionStorageData):
        storage_data = storage_data.current()
    if isinstance(storage_data, TableStorageData) and not storage_data.materialised:
        return table_file_extents(storage_data.chunk_table)
    return file_extents(storage_data)
