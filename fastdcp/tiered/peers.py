"""The nodes of a job and the wire between them: which rank runs on which node, a process group
of its own for moving checkpoint files between nodes, and files sent and received whole over it.

A rank's **node** is ``FASTDCP_NODE`` when set (or the name a writer or reader is given), else
torchrun's ``GROUP_RANK`` (the node's rank), else the host name. Nodes are ordered by their lowest
rank. :class:`PeerGroup` is one gloo group per process and world (``dist.new_group``, created
collectively the first time a writer or reader with peers needs it), with the node map every rank
agrees on (one ``all_gather_object``).

On the wire a file is one message of ``(size, crc32c)`` and its bytes in pieces of at most
:data:`PIECE_BYTES`, sent from a read-only mapping of the file and received into a mapping of a
``.part`` file that is renamed into place only once its CRC-32C matches the sender's: a file in a
local tier is whole or absent, never torn."""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..format.checksums import crc32c

__all__ = ["NODE_ENV", "node_name", "ranks_on_this_node", "existing_peer_group", "NodeMap", "PeerGroup", "peer_group", "send_file", "recv_file",
           "send_bytes", "recv_bytes", "skip_file", "PeerTransferError", "PIECE_BYTES"]

NODE_ENV = "FASTDCP_NODE"
PIECE_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 600.0


class PeerTransferError(OSError):
    """A file sent between nodes did not arrive whole (the message names the file and the peer)."""


def node_name(explicit: str | None = None) -> str:
    """This process's node (see the module docstring)."""
    if explicit:
        return str(explicit)
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    if os.environ.get("GROUP_RANK"):
        return f"node{os.environ['GROUP_RANK']}"
    return socket.gethostname()


@dataclass(frozen=True)
class NodeMap:
    """Which ranks run on which node: ``nodes[j]`` the ranks of node j (ascending), nodes ordered
    by their lowest rank; ``names[j]`` its name."""

    nodes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]

    @classmethod
    def from_names(cls, names_by_rank: list[str]) -> "NodeMap":
        ranks: dict[str, list[int]] = {}
        for rank, name in enumerate(names_by_rank):
            ranks.setdefault(name, []).append(rank)
        ordered = sorted(ranks.items(), key=lambda item: item[1][0])
        return cls(tuple(tuple(r) for _, r in ordered), tuple(n for n, _ in ordered))

    def node_of(self, rank: int) -> int:
        for j, ranks in enumerate(self.nodes):
            if rank in ranks:
                return j
        raise ValueError(f"rank {rank} is on no node of {self.names}")

    def representative(self, node: int) -> int:
        """The rank that acts for node ``node`` (its lowest)."""
        return self.nodes[node][0]

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep ``rank``'s replicas: on each of the next ``replicas`` nodes (in node
        order, wrapping), the rank at the same position on its node (modulo its size).
        Precondition: ``replicas < len(self.nodes)``."""
        j = self.node_of(rank)
        i = self.nodes[j].index(rank)
        out = []
        for step in range(1, replicas + 1):
            peer_node = self.nodes[(j + step) % len(self.nodes)]
            out.append(peer_node[i % len(peer_node)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps (those whose :meth:`targets` name it), ascending."""
        return [r for ranks in self.nodes for r in ranks if rank in self.targets(r, replicas)]


class PeerGroup:
    """The process's group for moving files between nodes, and the job's node map.

    Args:
        group: a gloo process group over every rank of the default group.
        node_map: agreed by every rank.
        rank: this process's rank in ``group``.
    """

    def __init__(self, group: Any, node_map: NodeMap, rank: int) -> None:
        self.group = group
        self.node_map = node_map
        self.rank = rank
        self.broken: BaseException | None = None  # set after a failed exchange: the group is unusable

    @property
    def node(self) -> int:
        return self.node_map.node_of(self.rank)

    def is_representative(self) -> bool:
        return self.node_map.representative(self.node) == self.rank


_groups: dict[tuple[int, int], PeerGroup] = {}
_groups_lock = threading.Lock()


def peer_group(node: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> PeerGroup:
    """The process's :class:`PeerGroup` (created on first use: a collective, every rank calls it at
    the same point). Precondition: ``torch.distributed`` is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("peers need torch.distributed initialized (torchrun, or init_process_group)")
    key = (os.getpid(), id(dist.group.WORLD))  # the default group of this process's current init
    with _groups_lock:
        found = _groups.get(key)
        if found is not None:  # (a broken one too: a new group would need every rank to make it at once)
            return found
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, node_name(node), group=group)
        made = PeerGroup(group, NodeMap.from_names([str(n) for n in names]), dist.get_rank())
        _groups[key] = made
        return made


def ranks_on_this_node(peers: PeerGroup | None = None) -> set[int] | None:
    """The ranks that share this process's node: from ``peers``' node map when given, else from
    the launcher's environment (torchrun's ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: a node's
    ranks are consecutive); None when neither says (one node, as far as this process can tell)."""
    if peers is not None:
        return set(peers.node_map.nodes[peers.node])
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    first = rank - local_rank
    return set(range(first, first + local_world))


def existing_peer_group() -> PeerGroup | None:
    """The process's :class:`PeerGroup` when one was made (no collective), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    with _groups_lock:
        return _groups.get((os.getpid(), id(dist.group.WORLD)))


def _pieces(size: int) -> list[tuple[int, int]]:
    return [(start, min(PIECE_BYTES, size - start)) for start in range(0, size, PIECE_BYTES)]


def send_bytes(group: Any, dst: int, data: bytes) -> list[Any]:
    """Post ``data`` to ``dst`` as one file message (read by :func:`recv_bytes` or :func:`recv_file`);
    returns the works and buffers to keep until they are done."""
    head = torch.tensor([len(data), crc32c(data)], dtype=torch.int64)
    works: list[Any] = [dist.isend(head, dst, group=group), head]
    if data:
        whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for start, length in _pieces(len(data)):
            piece = whole[start:start + length]
            works += [dist.isend(piece, dst, group=group), piece]
    return works


def recv_bytes(group: Any, src: int) -> bytes:
    """One file message from ``src`` whose CRC-32C matches, as bytes (raises :class:`PeerTransferError`)."""
    head = torch.empty(2, dtype=torch.int64)
    dist.recv(head, src, group=group)
    size, crc = int(head[0]), int(head[1])
    payload = torch.empty(size, dtype=torch.uint8)
    for start, length in _pieces(size):
        dist.recv(payload[start:start + length], src, group=group)
    data = payload.numpy().tobytes()
    if crc32c(data) != crc:
        raise PeerTransferError(f"{size} bytes from rank {src} arrived damaged (CRC-32C mismatch)")
    return data


def send_file(group: Any, dst: int, path: str) -> tuple[list[Any], int]:
    """Post file ``path`` to ``dst`` (size, CRC-32C, then its bytes from a mapping); returns the
    works and buffers to keep until they are done, and the file's CRC-32C."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    crc = crc32c(mapping) if mapping is not None else 0
    head = torch.tensor([size, crc], dtype=torch.int64)
    works: list[Any] = [dist.isend(head, dst, group=group), head]
    if mapping is not None:
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        for start, length in _pieces(size):
            piece = whole[start:start + length]
            works += [dist.isend(piece, dst, group=group), piece]
        works.append(mapping)
    return works, crc


def _discard(group: Any, src: int, size: int) -> None:
    """Read ``size`` bytes from ``src`` into scratch memory: the stream stays in step when there is
    nowhere to put them."""
    scratch = torch.empty(min(size, PIECE_BYTES), dtype=torch.uint8)
    for _, length in _pieces(size):
        dist.recv(scratch[:length], src, group=group)


def skip_file(group: Any, src: int) -> int:
    """Read one file message from ``src`` and drop it (a file that must not be written); returns its size."""
    head = torch.empty(2, dtype=torch.int64)
    dist.recv(head, src, group=group)
    _discard(group, src, int(head[0]))
    return int(head[0])


def recv_file(group: Any, src: int, path: str) -> tuple[int, int]:
    """Receive one file from ``src`` into ``path`` (through ``path.<random>.part``, its room
    reserved first, renamed once its CRC-32C matches the sender's); returns (size, crc32c). Every
    byte sent is read even when the file cannot be written (then the ``OSError`` is raised after).
    Raises :class:`PeerTransferError` when the bytes arrived damaged."""
    head = torch.empty(2, dtype=torch.int64)
    dist.recv(head, src, group=group)
    size, crc = int(head[0]), int(head[1])
    part = f"{path}.{secrets.token_hex(6)}.part"
    try:
        f = open(part, "w+b")
        try:
            if size:
                os.posix_fallocate(f.fileno(), 0, size)  # a full tmpfs: ENOSPC here, not SIGBUS in the copy
        except BaseException:
            f.close()
            raise
    except OSError:
        _discard(group, src, size)
        _unlink_quietly(part)
        raise
    try:
        with f:
            if size:
                with mmap.mmap(f.fileno(), size) as mapping:
                    whole = torch.frombuffer(mapping, dtype=torch.uint8)
                    for start, length in _pieces(size):
                        dist.recv(whole[start:start + length], src, group=group)
                    found = crc32c(mapping)
                    del whole
            else:
                found = 0
        if found != crc:
            raise PeerTransferError(f"'{path}' from rank {src} arrived damaged (CRC-32C {found:08x}, sent {crc:08x})")
        os.replace(part, path)
    except BaseException:
        _unlink_quietly(part)
        raise
    return size, crc


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def wait_all(works: list[Any]) -> None:
    """Wait for every work in ``works`` (buffers beside them are kept alive until here)."""
    for work in works:
        if hasattr(work, "wait"):
            work.wait()
