"""Rebuilding a tiered checkpoint from the local tiers of the nodes that survived, with no read of
the shared tier (``FastTieredReader(..., from_peers=True)``, ``newest_checkpoint(..., from_peers=True)``).

Every step is collective over the process's peer group (:mod:`fastdcp.tiered.peers`):

1. **Inventory** (:func:`plan_recovery`, in ``read_metadata``): one rank per node lists the
   checkpoint's local directory and checks every replica against its sidecar (size and CRC-32C,
   :mod:`fastdcp.tiered.replicas`): a damaged replica is removed and reported (a warning naming
   it), never loaded. The nodes' inventories are gathered; the checkpoint can be rebuilt when some
   node holds its ``.metadata`` and every data file it names is on some node.
2. **Metadata**: a node without ``.metadata`` receives it from one that has it.
3. **Files** (:func:`fetch_missing`, in ``read_data``): each rank names the files its read plan
   needs that its node lacks; each is sent once per node, from a node holding it, into the local
   tier (received whole, CRC-32C checked), then read there as any local file.

When the checkpoint cannot be rebuilt (no ``.metadata`` anywhere, or a file on no surviving node),
every rank reads the shared tier, and a warning says which files were missing where."""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..format.checksums import crc32c
from ..format.metadata import METADATA_NAME
from . import local_tier
from .peers import PeerGroup, recv_bytes, recv_file, send_bytes, send_file, wait_all
from .replicas import read_sidecar, replica_sidecar, wait_idle, write_sidecar

__all__ = ["Inventory", "Recovery", "RecoveryWarning", "inventory", "plan_recovery", "fetch_missing",
           "rebuildable"]

logger = logging.getLogger("fastdcp")


class RecoveryWarning(UserWarning):
    """A local copy could not be used (a damaged replica, or files on no surviving node)."""


@dataclass(frozen=True)
class Inventory:
    """What one node holds of a checkpoint: ``metadata_crc`` (None: no usable ``.metadata``),
    ``needed`` (the data files its ``.metadata`` names), ``held`` ({name: size}, replicas checked)."""

    metadata_crc: int | None
    needed: tuple[str, ...]
    held: dict[str, int]


def _file_crc(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return 0, 0
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapping:
            return size, crc32c(mapping)


def inventory(directory: str, check_replicas: bool = True) -> Inventory:
    """This node's inventory of the checkpoint in ``directory`` (see the module docstring; with
    ``check_replicas`` False, replicas are taken by their sidecars' sizes without reading them)."""
    from ..io.checkpoint_files import load_metadata

    try:
        names = os.listdir(directory)
    except OSError:
        return Inventory(None, (), {})
    held: dict[str, int] = {}
    for name in sorted(names):
        if name.startswith(".") and name != METADATA_NAME and not name.startswith(METADATA_NAME + "."):
            continue
        if name.endswith((".part", ".tmp")):
            continue
        path = os.path.join(directory, name)
        side = read_sidecar(directory, name)
        try:
            if side is not None and check_replicas:
                size, crc = _file_crc(path)
                if (size, crc) != (side.get("size"), side.get("crc32c")):
                    _drop_damaged(directory, name, f"{size} bytes with CRC-32C {crc:08x}, its sidecar records "
                                                   f"{side.get('size')} bytes with {side.get('crc32c', 0):08x}")
                    continue
            else:
                size = os.stat(path).st_size
        except OSError:
            continue
        held[name] = size
    metadata_crc, needed = None, ()
    if METADATA_NAME in held:
        try:
            metadata = load_metadata(directory)
            needed = tuple(sorted(local_tier.files_named(metadata)))
            metadata_crc = _file_crc(os.path.join(directory, METADATA_NAME))[1]
        except Exception:  # noqa: BLE001 - damaged or unreadable: this node holds no usable .metadata
            held.pop(METADATA_NAME, None)
    return Inventory(metadata_crc, needed, held)


def _drop_damaged(directory: str, name: str, why: str) -> None:
    path = os.path.join(directory, name)
    warnings.warn(f"fastdcp tiered checkpoint: the replica '{path}' is damaged ({why}): it is removed and "
                  "not loaded; another copy is used", RecoveryWarning, stacklevel=3)
    for victim in (path, replica_sidecar(directory, name)):
        try:
            os.unlink(victim)
        except OSError:
            pass


def rebuildable(inventories: list[Inventory | None]) -> tuple[int | None, list[str]]:
    """(the node whose ``.metadata`` is used, the data files no node holds); the node is None when
    no node holds a usable ``.metadata``. ``inventories``: one per node, in node order."""
    source = next((j for j, inv in enumerate(inventories) if inv is not None and inv.metadata_crc is not None), None)
    if source is None:
        return None, []
    held = set().union(*(inv.held for inv in inventories if inv is not None))
    return source, [name for name in inventories[source].needed if name not in held]


@dataclass
class Recovery:
    """The peers' decision for one load: ``tier`` "local" (this node held every file it read),
    "peers" (files came from other nodes), or "shared" (the checkpoint could not be rebuilt);
    ``holders``: {file name: nodes holding it}."""

    tier: str
    peers: PeerGroup
    directory: str
    holders: dict[str, list[int]]
    moved: int = 0   # files this rank received


def plan_recovery(peers: PeerGroup, directory: str, shared_path: str) -> Recovery:
    """Steps 1 and 2 of the module docstring (collective over ``peers``)."""
    wait_idle()  # this process's replication is over before the group carries anything else
    mine = inventory(directory) if peers.is_representative() else None
    gathered: list[Any] = [None] * dist.get_world_size(peers.group)
    dist.all_gather_object(gathered, mine, group=peers.group)
    by_node = [gathered[peers.node_map.representative(j)] for j in range(len(peers.node_map.nodes))]
    source, missing = rebuildable(by_node)
    if source is None or missing:
        why = ("no surviving node holds its .metadata" if source is None else
               f"{len(missing)} of its data files are on no surviving node ({', '.join(missing[:3])}"
               f"{' ...' if len(missing) > 3 else ''})")
        if peers.rank == 0:
            warnings.warn(f"fastdcp tiered checkpoint: '{shared_path}' cannot be rebuilt from the nodes' local tiers: "
                          f"{why}; it is read from the shared tier", RecoveryWarning, stacklevel=3)
        return Recovery("shared", peers, directory, {})
    holders: dict[str, list[int]] = {}
    for j, inv in enumerate(by_node):
        for name in inv.held if inv is not None else ():
            holders.setdefault(name, []).append(j)
    wanting = [j for j, inv in enumerate(by_node) if inv is None or inv.metadata_crc != by_node[source].metadata_crc]
    sender = peers.node_map.representative(source)
    works: list = []
    if peers.rank == sender and wanting:
        with open(os.path.join(directory, METADATA_NAME), "rb") as f:
            data = f.read()
        for j in wanting:
            works += send_bytes(peers.group, peers.node_map.representative(j), data)
    moved = 0
    if peers.node in wanting and peers.is_representative():
        data = recv_bytes(peers.group, sender)
        _store(directory, shared_path, METADATA_NAME, data, sender)
        moved = 1
    wait_all(works)
    dist.barrier(group=peers.group)  # every rank of a node sees the metadata its representative wrote
    # (a moved file gets a sidecar: it is a replica to this node, evicted only once the shared tier has it)
    return Recovery("peers" if wanting else "local", peers, directory, holders, moved)


def _store(directory: str, shared_path: str, name: str, data: bytes, source: int) -> None:
    os.makedirs(directory, exist_ok=True)
    local_tier.record_shared_location(directory, shared_path)
    part = os.path.join(directory, f"{name}.{os.getpid()}.tmp")
    with open(part, "wb") as f:
        f.write(data)
    write_sidecar(directory, name, size=len(data), crc32c=crc32c(data), from_rank=source)
    os.replace(part, os.path.join(directory, name))


def fetch_missing(recovery: Recovery, needed: set[str], shared_path: str) -> None:
    """Step 3 of the module docstring (collective over the peer group): this rank needs ``needed``."""
    peers, directory = recovery.peers, recovery.directory
    lacking = sorted(n for n in needed if not os.path.exists(os.path.join(directory, n)))
    gathered: list[Any] = [None] * dist.get_world_size(peers.group)
    dist.all_gather_object(gathered, lacking, group=peers.group)
    transfers: list[tuple[int, str, int]] = []   # (receiving rank, file, sending rank), in one order everywhere
    for j, ranks in enumerate(peers.node_map.nodes):
        first_asker: dict[str, int] = {}
        for rank in ranks:
            for name in gathered[rank] or []:
                first_asker.setdefault(name, rank)
        for k, (name, rank) in enumerate(sorted(first_asker.items())):
            holding = [h for h in recovery.holders.get(name, []) if h != j]
            if not holding:
                raise FileNotFoundError(f"'{os.path.join(directory, name)}' is needed by rank {rank} and held by no "
                                        f"node (rebuilding '{shared_path}' from the local tiers)")
            source_ranks = peers.node_map.nodes[holding[k % len(holding)]]  # any rank of a holder reads its files:
            transfers.append((rank, name, source_ranks[(k // len(holding)) % len(source_ranks)]))  # spread the sends
    works: list = []
    for receiver, name, sender in transfers:
        if sender == peers.rank:
            works += send_file(peers.group, receiver, os.path.join(directory, name))[0]
    for receiver, name, sender in transfers:
        if receiver == peers.rank:
            size, crc = recv_file(peers.group, sender, os.path.join(directory, name))
            write_sidecar(directory, name, size=size, crc32c=crc, from_rank=sender)
            recovery.moved += 1
    wait_all(works)
    if transfers:
        recovery.tier = "peers"
        logger.info("tiered: %d files of %s moved between nodes for this load", len(transfers), shared_path)
    dist.barrier(group=peers.group)  # the files a node's representative received are there for its other ranks
