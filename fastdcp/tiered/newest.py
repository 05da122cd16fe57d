"""Which tiered checkpoint a restarted job resumes from: the newest one every rank can load, from
its node's local tier (a restart on the same nodes, also when the drain never finished) or from
the shared tier.

Candidates are the checkpoints under a shared parent (``/shared/run1`` holding ``step100``,
``step200``, ... or ``s3://bucket/run1``) that are committed there, and those committed in this
node's local tier whose shared location lies under that parent (each local directory records its
shared location in ``.shared_location``). Newest means the largest number at the end of the
checkpoint's name (``step200`` after ``step100``), then the later commit. With a process group,
the ranks agree on the newest checkpoint every one of them can load (one all-reduce), so a copy
only some nodes hold is passed over.

With ``from_peers=True`` a checkpoint also counts when the nodes together can rebuild it from their
local tiers (one node holds its ``.metadata``, every file it names is on some node: replicas, see
:mod:`fastdcp.tiered.recovery`); a newer checkpoint passed over is named in a warning, with why."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ..format.metadata import METADATA_NAME
from ..io.backends import is_backend_url
from ..objstore.client import AzureOptions, S3Options, options_for, require_obstore, store_for
from ..objstore.location import ObjectLocation, is_object_url
from . import local_tier
from .peers import peer_group
from .recovery import Inventory, inventory, rebuildable
from .replicas import wait_idle

__all__ = ["newest_checkpoint", "SHARED_LOCATION_FILE"]

SHARED_LOCATION_FILE = local_tier.SHARED_LOCATION_FILE
logger = logging.getLogger("fastdcp")
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def _order(checkpoint_id: str, committed_at: float) -> tuple[int, float]:
    m = _TRAILING_NUMBER.search(checkpoint_id.rstrip("/").rsplit("/", 1)[-1])
    return (int(m.group(1)) if m else -1, committed_at)


def _shared_candidates(parent: str, s3_options: S3Options | None, azure_options: AzureOptions | None) -> dict[str, float]:
    """{checkpoint id: commit time} of the checkpoints committed directly under ``parent``."""
    found: dict[str, float] = {}
    if is_object_url(parent):
        location = ObjectLocation.parse(parent)
        options = options_for(location, s3_options, azure_options)
        obstore = require_obstore()
        prefix = location.key("")
        for batch in obstore.list(store_for(location, options), prefix or None):
            for meta in batch:
                rest = meta["path"][len(prefix):]
                name, _, leaf = rest.partition("/")
                if leaf == METADATA_NAME and name:
                    found[location.url(name)] = meta["last_modified"].timestamp()
        return found
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return found
    for name in names:
        path = os.path.join(parent, name, METADATA_NAME)
        try:
            found[os.path.join(os.path.abspath(parent), name)] = os.stat(path).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def _local_candidates(parent: str, local_root: str) -> dict[str, float]:
    """{checkpoint id: local commit time} of this node's local copies of checkpoints under
    ``parent`` that hold ``.metadata``."""
    found: dict[str, float] = {}
    try:
        names = os.listdir(local_root)
    except FileNotFoundError:
        return found
    parent = parent.rstrip("/")
    for name in names:
        directory = os.path.join(local_root, name)
        try:
            with open(os.path.join(directory, SHARED_LOCATION_FILE)) as f:
                shared = f.read().strip()
            committed_at = os.stat(os.path.join(directory, METADATA_NAME)).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            continue
        if shared.rsplit("/", 1)[0] == parent:
            found[shared] = committed_at
    return found


def _loadable_locally(checkpoint_id: str, local_root: str) -> bool:
    """Whether this rank's local copy of ``checkpoint_id`` is whole (``.metadata`` and its files)."""
    from ..io.checkpoint_files import load_metadata

    directory = local_tier.local_directory(local_root, checkpoint_id)
    try:
        metadata = load_metadata(directory)
    except Exception:  # noqa: BLE001 - missing or damaged: not loadable from here
        return False
    return local_tier.holds_every_file(directory, metadata)


def _node_inventories(parent: str, local_root: str) -> dict[str, tuple[Inventory, float]]:
    """{checkpoint id: (this node's inventory of it, when its .metadata was written here or 0)} of
    the local copies (whole or partial) of checkpoints under ``parent``; replicas taken by their
    sidecars (the reader checks their bytes)."""
    found: dict[str, tuple[Inventory, float]] = {}
    try:
        names = os.listdir(local_root)
    except FileNotFoundError:
        return found
    for name in names:
        directory = os.path.join(local_root, name)
        shared = local_tier.shared_location_of(directory)
        if shared is None or shared.rsplit("/", 1)[0] != parent.rstrip("/"):
            continue
        try:
            written = os.stat(os.path.join(directory, METADATA_NAME)).st_mtime
        except OSError:
            written = 0.0
        found[shared] = (inventory(directory, check_replicas=False), written)
    return found


def newest_checkpoint(shared_parent: str | os.PathLike, *, local_root: str | os.PathLike | None = None,
                      s3_options: S3Options | None = None, azure_options: AzureOptions | None = None,
                      process_group: Any = None, from_peers: bool = False,
                      node: str | None = None) -> str | None:
    """The checkpoint id (its shared location) to resume from, or None when there is none; see the
    module docstring. With ``torch.distributed`` initialized it is a collective over
    ``process_group`` (default: the default group; one ``all_gather_object``): call it on every
    rank. Only the first rank lists the shared tier. ``from_peers``/``node``: as
    :class:`fastdcp.FastTieredReader`'s (``from_peers`` needs the default group)."""
    import torch.distributed as dist

    parent = str(shared_parent) if is_backend_url(shared_parent) else os.path.abspath(os.fspath(shared_parent))
    root = local_tier.local_root_from(local_root)
    distributed = dist.is_available() and dist.is_initialized()
    first = not distributed or dist.get_rank(process_group) == 0
    shared = _shared_candidates(parent, s3_options, azure_options) if first else {}
    local = {c: t for c, t in _local_candidates(parent, root).items() if _loadable_locally(c, root)}
    nodes = None
    if from_peers and distributed:
        peers = peer_group(node)
        wait_idle()  # the replicas of this process's last saves are in place before they are counted
        nodes = _node_inventories(parent, root) if peers.is_representative() else None
    proposals = [(shared, local, nodes)]
    if distributed:
        proposals = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(proposals, (shared, local, nodes), group=process_group)
    in_shared = proposals[0][0]
    times: dict[str, float] = dict(in_shared)
    for _, rank_local, _ in proposals:
        for c, t in rank_local.items():
            times.setdefault(c, t)  # the shared commit time where both (the later one)
    loadable = {c for c in times if all(c in in_shared or c in rank_local for _, rank_local, _ in proposals)}
    reports = [report for _, _, report in proposals if report is not None]
    why: dict[str, str] = {}
    for c in sorted(set().union(*reports)) if reports else ():
        source, missing = rebuildable([report.get(c, (None, 0.0))[0] for report in reports])
        if source is not None and not missing:
            loadable.add(c)
            times.setdefault(c, max(report.get(c, (None, 0.0))[1] for report in reports))
        elif c not in loadable:
            times.setdefault(c, max(report.get(c, (None, 0.0))[1] for report in reports))
            why[c] = ("no node holds its .metadata" if source is None else
                      f"{len(missing)} of its files are on no node ({', '.join(missing[:3])})")
    chosen = max(loadable, key=lambda c: _order(c, times[c])) if loadable else None
    passed = [c for c in why if chosen is None or _order(c, times[c]) > _order(chosen, times[chosen])]
    if passed and first:
        logger.warning("newest_checkpoint: %s passed over (%s); resuming from %s", ", ".join(passed),
                       "; ".join(why[c] for c in passed), chosen or "nothing")
    return chosen
