"""The local tier of tiered checkpoints: where each checkpoint lives on the node (a directory under
the local root, e.g. ``/dev/shm/fastdcp-tiered``), the markers the drainer leaves in it, and the
local retention budget.

Markers, in a checkpoint's local directory:

* ``.drained.rank{R}``: rank R's data files are complete in the shared tier;
* ``.durable``: the coordinator committed ``.metadata`` in the shared tier (only on its node).

* ``.replica.<name>``: file ``name`` is a replica another node's rank sent
  (:mod:`fastdcp.tiered.replicas`), with its size and CRC-32C.

A local checkpoint is evicted (beyond the newest ``keep`` of the local root) only once it is
durable: its directory holds ``.durable``, or, on a node without the coordinator's own ``.metadata``,
every rank whose own files it holds has drained them; a directory holding replicas also needs the
checkpoint committed in the shared tier (its other ranks' drains are not seen here). A checkpoint
that never reached the shared tier is never evicted: it may be the only copy."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from typing import Any, Callable

from ..format.metadata import METADATA_NAME

__all__ = ["DEFAULT_LOCAL_ROOT", "local_root_from", "local_directory", "mark_drained", "mark_durable",
           "is_durable", "evict", "holds_every_file", "record_shared_location", "SHARED_LOCATION_FILE",
           "REPLICA_PREFIX", "shared_location_of", "files_named"]

logger = logging.getLogger("fastdcp")

DEFAULT_LOCAL_ROOT = "/dev/shm/fastdcp-tiered"
LOCAL_ROOT_ENV = "FASTDCP_LOCAL_TIER"
DURABLE_MARKER = ".durable"
REPLICA_PREFIX = ".replica."
SHARED_LOCATION_FILE = ".shared_location"
_DRAINED_RE = re.compile(r"^\.drained\.rank(\d+)$")
_RANK_FILE_RE = re.compile(r"^__(\d+)_.*\.distcp$")


def local_root_from(local_root: str | os.PathLike | None) -> str:
    """``local_root``, else ``$FASTDCP_LOCAL_TIER``, else ``/dev/shm/fastdcp-tiered``."""
    return os.fspath(local_root) if local_root else os.environ.get(LOCAL_ROOT_ENV) or DEFAULT_LOCAL_ROOT


def local_directory(local_root: str, checkpoint_id: str | os.PathLike) -> str:
    """The local directory of the checkpoint whose shared location is ``checkpoint_id``: its last
    path component and a hash of the whole location (readable, and unique per location)."""
    text = os.fspath(checkpoint_id).rstrip("/")
    base = re.sub(r"[^A-Za-z0-9._-]", "_", text.rsplit("/", 1)[-1]) or "checkpoint"
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return os.path.join(local_root, f"{base}-{digest}")


def _touch(path: str) -> None:
    with open(path, "wb"):
        pass


def mark_drained(directory: str, rank: int) -> None:
    _touch(os.path.join(directory, f".drained.rank{rank}"))


def mark_durable(directory: str) -> None:
    _touch(os.path.join(directory, DURABLE_MARKER))


def is_durable(directory: str, committed_in_shared: Callable[[str], bool] | None = None) -> bool:
    """Whether the local checkpoint in ``directory`` may go: see the module docstring.
    ``committed_in_shared(shared location)``: whether the shared tier holds it committed (asked only
    for a directory holding replicas; without it such a directory stays)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return False
    if DURABLE_MARKER in names:
        return True
    # (a sidecar counts while its replica is still arriving, and after an overwrite removed its file)
    replicas = {n[len(REPLICA_PREFIX):] for n in names if n.startswith(REPLICA_PREFIX) and not n.endswith(".tmp")}
    if METADATA_NAME in names and METADATA_NAME not in replicas:
        return False  # the coordinator's node: only the commit in the shared tier makes it durable
    own = {int(m.group(1)) for m in map(_RANK_FILE_RE.match, names) if m and m.group(0) not in replicas}
    drained = {int(m.group(1)) for m in map(_DRAINED_RE.match, names) if m}
    if not own <= drained or not (own or replicas):
        return False
    if replicas:
        location = shared_location_of(directory)
        return committed_in_shared is not None and location is not None and committed_in_shared(location)
    return True


def shared_location_of(directory: str) -> str | None:
    """The shared location the local directory is a copy of (``.shared_location``), or None."""
    try:
        with open(os.path.join(directory, SHARED_LOCATION_FILE)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def record_shared_location(directory: str, shared_path: str) -> None:
    """Note in the local directory which shared location it is a copy of (what
    :func:`fastdcp.tiered.newest.newest_checkpoint` finds local copies by)."""
    path = os.path.join(directory, SHARED_LOCATION_FILE)
    if not os.path.exists(path):
        part = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(part, "w") as f:
            f.write(shared_path + "\n")
        os.replace(part, path)


def _committed_at(directory: str) -> int:
    """When the local copy in ``directory`` was written: its newest ``.metadata`` or data file (not
    the markers, which a late drain writes after later checkpoints were committed)."""
    newest = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return newest
    for name in names:
        if name == METADATA_NAME or name.endswith(".distcp"):
            try:
                newest = max(newest, os.stat(os.path.join(directory, name)).st_mtime_ns)
            except OSError:
                continue
    return newest


def evict(local_root: str, keep: int, protect: str | None = None,
          committed_in_shared: Callable[[str], bool] | None = None) -> list[str]:
    """Remove durable local checkpoints (:func:`is_durable`) beyond the newest ``keep`` under
    ``local_root`` (newest by when they were written), never ``protect``; returns the directories
    removed."""
    try:
        entries = [os.path.join(local_root, n) for n in os.listdir(local_root)]
    except FileNotFoundError:
        return []
    dirs = []
    for path in entries:
        if os.path.isdir(path) and not os.path.islink(path):
            dirs.append((_committed_at(path), path))
    dirs.sort(reverse=True)
    removed = []
    for _, path in dirs[max(0, keep):]:
        if path == protect or not is_durable(path, committed_in_shared):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        logger.debug("tiered: evicted the local copy %s (durable in the shared tier)", path)
    return removed


def files_named(metadata: Any) -> set[str]:
    """The data files ``metadata`` names."""
    table = getattr(metadata, "chunk_table", None)
    if table is not None and getattr(table, "storage", None) is not None:
        return set(table.storage.files)
    names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    names.discard(None)
    return {str(name) for name in names}


def holds_every_file(directory: str, metadata: Any) -> bool:
    """Whether ``directory`` holds every data file ``metadata`` names (a local copy that is whole)."""
    return all(os.path.isfile(os.path.join(directory, name)) for name in files_named(metadata))
