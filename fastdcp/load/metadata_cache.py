"""The parsed ``.metadata`` files this process read last, reused while each file is unchanged;
and reading a checkpoint's metadata from its chunk index when the ``.metadata`` names one.

A ``.metadata`` that fastdcp's writer emitted names a chunk index file beside it in its first
bytes (:func:`fastdcp.format.index_link.find_chunk_index_name`). :func:`load_table_metadata`
reads that index instead of unpickling ``.metadata`` (at thousands of ranks, seconds and a few
hundred MB instead of minutes and gigabytes) and returns a
:class:`~fastdcp.format.table_metadata.TableMetadata`. It falls back to parsing ``.metadata``
(returns None) for stock-written metadata and, with a warning on the ``fastdcp`` logger, for an
index that is damaged, names a path outside the checkpoint, or was not written for this
``.metadata`` (its recorded size and head/tail CRC-32C differ).

The reading itself (:func:`metadata_from_index`) goes through positional sources
(:mod:`fastdcp.io.positional`), so a checkpoint in object storage is read by the same code with
ranged GETs in place of ``pread`` (``fastdcp.objstore.indexed_metadata``).
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import threading
from collections import OrderedDict
from typing import Callable

from torch.distributed.checkpoint.metadata import Metadata

from ..format.index_link import find_chunk_index_name, metadata_facts
from ..format.index_reader import read_chunk_index
from ..format.index_sections import read_index_header, read_shared_objects
from ..format.metadata import CheckpointFormatError
from ..format.sources import PositionalSource
from ..format.table_metadata import TableMetadata
from ..io.checkpoint_files import check_relative_path, load_metadata, metadata_path
from ..io.gc import gc_paused
from ..io.positional import FileSource, ReadAhead
from .sectioned_metadata import IndexSource, SectionedTableMetadata, count_metadata_read

__all__ = ["MetadataCache", "metadata_cache", "clear_metadata_cache", "load_table_metadata", "metadata_from_index"]

logger = logging.getLogger("fastdcp")

_HEAD_BYTES = 4 << 10  # where write_metadata puts the chunk index name (in its first ~100 bytes)
# An index larger than this many times its .metadata is not one fastdcp wrote (it is ~0.35x):
# refused before it is read, so a planted file cannot make every rank read gigabytes.
_INDEX_SIZE_RATIO = 4
_INDEX_SIZE_SLACK = 1 << 20

# What a cached TableMetadata row costs against MetadataCache.max_items: its columns are ~60
# bytes a chunk, stock's objects ~1 KB.
_TABLE_ROWS_PER_ITEM = 16


class MetadataCache:
    """Parsed, validated ``.metadata`` of the last few files read, keyed by the file's identity
    (device, inode, size, mtime and ctime in ns) and the unpickling mode.

    Parsing a 5,000-entry ``.metadata`` with the restricted unpickler and validating it costs
    ~0.1 s; loading the same checkpoint again (evaluation loops, benchmarks) skips that. Writers
    replace ``.metadata`` by renaming a new file over it (a new inode), so a rewritten checkpoint
    never matches an old entry. Entries are stored only when the file's identity is the same
    before and after reading it; every caller gets its own shallow copy (``Metadata`` and its
    top-level dicts), since DCP and planners assign attributes on it."""

    def __init__(self, capacity: int = 4, max_items: int = 2_000_000) -> None:
        self.capacity = capacity
        self.max_items = max_items  # entries over all cached files: bounds the memory held
        self._entries: OrderedDict[tuple, Metadata] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _identity(path: str | os.PathLike, rank: int | None) -> tuple | None:
        path = os.fspath(path)
        file = metadata_path(path, rank) if os.path.isdir(path) else path
        try:
            st = os.stat(file)
        except OSError:
            return None  # load_metadata reports it
        return (os.path.abspath(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def load(self, path: str | os.PathLike, rank: int | None, allow_unsafe: bool, sectioned: bool = False) -> Metadata:
        """The parsed metadata (a copy of the cached one when the file is unchanged);
        ``sectioned``: as :func:`load_table_metadata`'s."""
        before = self._identity(path, rank)
        key = None if before is None else (before, allow_unsafe, sectioned)
        if key is not None:
            with self._lock:
                cached = self._entries.get(key)
                if cached is not None:
                    self._entries.move_to_end(key)
            if cached is not None:
                return copy_metadata(cached)
        metadata: Metadata | None = load_table_metadata(path, rank, allow_unsafe, sectioned)
        if metadata is None:
            with gc_paused():  # tens of thousands of small objects; see fastdcp.io.gc
                metadata = load_metadata(path, rank=rank, allow_unsafe=allow_unsafe)
            count_metadata_read(_file_size(path, rank))
        if key is not None and self._identity(path, rank) == before:
            with self._lock:
                self._entries[key] = copy_metadata(metadata)
                held = sum(_held_items(m) for m in self._entries.values())
                while len(self._entries) > self.capacity or (held > self.max_items and len(self._entries) > 1):
                    _, dropped = self._entries.popitem(last=False)
                    held -= _held_items(dropped)
        return metadata

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _unusable(where: str, error: Exception, instead: str) -> None:
    """Log why the chunk index ``where`` is not used, and what is read ``instead``."""
    if isinstance(error, CheckpointFormatError):
        logger.warning("ignoring a damaged chunk index, %s: %s", instead, error)
    else:
        logger.warning("could not read %s (%s), %s", where, error, instead)


def _file_size(path: str | os.PathLike, rank: int | None) -> int:
    path = os.fspath(path)
    try:
        return os.path.getsize(metadata_path(path, rank) if os.path.isdir(path) else path)
    except OSError:
        return 0


def _held_items(metadata: Metadata) -> int:
    """What ``metadata`` counts against ``MetadataCache.max_items`` (without building anything)."""
    if isinstance(metadata, SectionedTableMetadata) and not metadata.table_loaded:
        return metadata.index_source.header.entries  # (the sections it keeps are small)
    if isinstance(metadata, TableMetadata):
        return len(metadata.chunk_table.fqns) + metadata.chunk_table.rows // _TABLE_ROWS_PER_ITEM
    return len(metadata.state_dict_metadata) + len(metadata.storage_data or ())


def copy_metadata(metadata: Metadata) -> Metadata:
    """A ``Metadata`` sharing the entries of ``metadata`` but with its own top-level containers
    (a TableMetadata shares its table; nothing of it is built)."""
    if isinstance(metadata, TableMetadata):
        new = metadata.copy_containers()
    else:
        new = copy.copy(metadata)
        new.state_dict_metadata = dict(metadata.state_dict_metadata)
        if isinstance(metadata.storage_data, dict):
            new.storage_data = dict(metadata.storage_data)
    if isinstance(metadata.planner_data, dict):
        new.planner_data = dict(metadata.planner_data)
    if getattr(metadata, "storage_meta", None) is not None:
        new.storage_meta = copy.copy(metadata.storage_meta)
        if isinstance(getattr(metadata.storage_meta, "modules", None), list):
            new.storage_meta.modules = list(metadata.storage_meta.modules)
    return new


metadata_cache = MetadataCache()


def clear_metadata_cache() -> None:
    """Forget the parsed ``.metadata`` files this process remembers."""
    metadata_cache.clear()


def _open_regular(path: str) -> int | None:
    """A descriptor of ``path`` open for reading if it is a regular file (a FIFO never blocks the
    open), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd
    except BaseException:
        os.close(fd)
        raise


def load_table_metadata(path: str | os.PathLike, rank: int | None = None,
                        allow_unsafe: bool = False, sectioned: bool = False) -> TableMetadata | None:
    """The checkpoint's metadata from the chunk index its ``.metadata`` names, or None when the
    caller should parse ``.metadata`` instead (see the module docstring for when, and what is
    logged). ``path`` and ``rank`` are as :func:`fastdcp.io.checkpoint_files.load_metadata`'s;
    ``allow_unsafe`` unpickles the index's small objects with plain pickle, as ``.metadata``
    would be. Nothing is raised for a missing or damaged index: the fallback reports problems of
    ``.metadata`` itself.

    ``sectioned`` (a load on several ranks): for an index with per-rank sections, a
    :class:`~fastdcp.load.sectioned_metadata.SectionedTableMetadata` that reads only the header
    and the shared objects now, and a rank's section or the whole table when asked."""
    path = os.fspath(path)
    if os.path.isdir(path):
        directory, file = path, metadata_path(path, rank)
    elif rank is None and os.path.isfile(path):
        directory, file = os.path.dirname(path) or ".", path
    else:
        return None
    fd = _open_regular(file)
    if fd is None:
        return None

    def open_index(name: str) -> FileSource | None:
        index_path = check_relative_path(directory, name)
        g = _open_regular(index_path)
        return None if g is None else FileSource(g, index_path, count_metadata_read)

    return metadata_from_index(FileSource(fd, file, count_metadata_read), open_index, allow_unsafe, sectioned)


def metadata_from_index(metadata: PositionalSource, open_index: Callable[[str], PositionalSource | None],
                        allow_unsafe: bool = False, sectioned: bool = False) -> TableMetadata | None:
    """The metadata of the checkpoint whose ``.metadata`` is ``metadata``, from the chunk index it
    names, or None when the caller should parse ``.metadata`` instead: the one reading path of
    local files and objects alike (positional reads through
    :class:`~fastdcp.format.sources.PositionalSource`).

    Reads ``.metadata``'s first bytes for the index's name, the index's header, then the
    ``.metadata``'s size and edges to check that the index was written for it (the first bytes
    already read serve as its head when they cover it); then, with ``sectioned`` and a version 2
    index, only the shared objects (a :class:`SectionedTableMetadata` reads the rest on demand),
    else the whole table. Both sources are owned from now on: closed when this returns, or kept
    by the returned ``SectionedTableMetadata``.

    Args:
        metadata: the ``.metadata``; an ``OSError`` reading its first bytes is raised.
        open_index: the index of a name found in ``.metadata``: a source (reading it may fail with
            ``FileNotFoundError`` when it is missing), None when it is missing, or
            ``CheckpointFormatError`` for a name that leads out of the checkpoint.
        allow_unsafe: unpickle the index's small objects with plain pickle.
        sectioned: a load on several ranks (see :func:`load_table_metadata`).
    """
    index: PositionalSource | None = None
    kept = False
    try:
        buffer = bytearray(_HEAD_BYTES)
        head = bytes(buffer[:metadata.read_into(0, memoryview(buffer))])
        name = find_chunk_index_name(head)
        if name is None:
            return None  # stock-written (or damaged: the parse reports it)
        try:
            index = open_index(name)
        except CheckpointFormatError as e:
            logger.warning("ignoring the chunk index named by '%s': %s; reading the metadata itself", metadata.name, e)
            return None
        if index is None:
            logger.debug("'%s' names chunk index '%s', which is missing or not a regular file: reading the "
                         "metadata itself", metadata.name, name)
            return None
        where = f"checkpoint chunk index '{index.name}'"
        try:
            header = read_index_header(index, where)
        except FileNotFoundError:
            logger.debug("'%s' names chunk index '%s', which is missing: reading the metadata itself",
                         metadata.name, index.name)
            return None
        except (CheckpointFormatError, OSError) as e:
            _unusable(where, e, "reading the metadata itself")
            return None
        try:
            size, head_crc, tail_crc = metadata_facts(metadata, header.edge_bytes, head)
        except CheckpointFormatError as e:  # shorter than its size: truncated while it was read
            logger.warning("ignoring %s: %s; reading the metadata itself", where, e)
            return None
        if (header.metadata_size, header.metadata_head_crc, header.metadata_tail_crc) != (size, head_crc, tail_crc):
            logger.warning(
                "ignoring %s: it was written for another .metadata (size %d, CRC-32C %#010x/%#010x; '%s' has %d "
                "bytes, %#010x/%#010x); reading the metadata itself", where, header.metadata_size,
                header.metadata_head_crc, header.metadata_tail_crc, metadata.name, size, head_crc, tail_crc)
            return None
        if sectioned and header.v2 is not None:
            try:
                with gc_paused():
                    shared = read_shared_objects(index, header, where, allow_unsafe=allow_unsafe)
            except (CheckpointFormatError, OSError) as e:
                _unusable(where, e, "reading the whole index")
            else:
                source = IndexSource(metadata, index, header, shared, allow_unsafe)
                kept = True
                return SectionedTableMetadata(source, shared["planner_data"], shared["storage_meta"],
                                              shared["version"])
        # What read_chunk_index reads: the whole file, or version 2's table part (the per-rank
        # sections after it are not read, and may outgrow .metadata: it lists a replicated
        # chunk once, the sections once per rank that saved it).
        try:
            table_size = header.v2.common_offset if header.v2 is not None else index.size()
            if table_size > _INDEX_SIZE_RATIO * size + _INDEX_SIZE_SLACK:
                raise CheckpointFormatError(f"{where}: {table_size} bytes is implausibly large for a "
                                            f"{size}-byte .metadata")
            with gc_paused():
                chunk_index = read_chunk_index(ReadAhead(index), where, allow_unsafe=allow_unsafe)
        except (CheckpointFormatError, OSError) as e:
            _unusable(where, e, "reading the metadata itself")
            return None
    finally:
        if not kept:
            metadata.close()
            if index is not None:
                index.close()
    facts = (chunk_index.metadata_size, chunk_index.metadata_head_crc, chunk_index.metadata_tail_crc)
    if facts != (size, head_crc, tail_crc):
        logger.warning("ignoring %s: it changed while it was read; reading the metadata itself", where)
        return None
    return TableMetadata(chunk_index.table, chunk_index.planner_data, chunk_index.storage_meta, chunk_index.version)
