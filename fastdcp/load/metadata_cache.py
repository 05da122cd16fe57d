"""The parsed ``.metadata`` files this process read last, reused while each file is unchanged."""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict

from torch.distributed.checkpoint.metadata import Metadata

from ..io.checkpoint_files import load_metadata, metadata_path
from ..io.gc import gc_paused

__all__ = ["MetadataCache", "metadata_cache", "clear_metadata_cache"]


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

    def load(self, path: str | os.PathLike, rank: int | None, allow_unsafe: bool) -> Metadata:
        before = self._identity(path, rank)
        key = None if before is None else (before, allow_unsafe)
        if key is not None:
            with self._lock:
                cached = self._entries.get(key)
                if cached is not None:
                    self._entries.move_to_end(key)
            if cached is not None:
                return copy_metadata(cached)
        with gc_paused():  # tens of thousands of small objects; see fastdcp.io.gc
            metadata = load_metadata(path, rank=rank, allow_unsafe=allow_unsafe)
        if key is not None and self._identity(path, rank) == before:
            with self._lock:
                self._entries[key] = copy_metadata(metadata)
                held = sum(len(m.state_dict_metadata) + len(m.storage_data or ()) for m in self._entries.values())
                while len(self._entries) > self.capacity or (held > self.max_items and len(self._entries) > 1):
                    _, dropped = self._entries.popitem(last=False)
                    held -= len(dropped.state_dict_metadata) + len(dropped.storage_data or ())
        return metadata

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def copy_metadata(metadata: Metadata) -> Metadata:
    """A ``Metadata`` sharing the entries of ``metadata`` but with its own top-level containers."""
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
