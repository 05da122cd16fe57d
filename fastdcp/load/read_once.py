"""Read-once loads: ranks whose load plans are the same (data-parallel replicas: DDP, HSDP's and
FSDP's replicate dimension) split the plan's reads among themselves and send each other what they
read, so each stored byte of a replicated shard is read from storage once per job, not once per
replica.

How:

1. **Groups, from the plans DCP already gathers.** Each rank's local plan carries a
   :class:`ReplicaKey`: a 16-byte digest of its read items (each item's destination and stored
   region, :func:`plan_digest`) and its rank in the default process group. The coordinator, which
   sees every local plan, groups equal digests (:func:`replica_groups`) and hands each rank its
   :class:`ReplicaGroup` in the global plan: no extra collective, and a load with one plan
   (``no_dist``) or plans that all differ (pure sharding, most resharded loads) reads as without
   the mode.
2. **Split.** In a group of ``R`` ranks the tensor items, in storage order (file, offset), are cut
   into ``R`` runs of about equal bytes, one per member (:func:`deal_items`), the same on every
   member, so a member's reads stay together in the files; byte items (small, not tensors) are
   read by every member. A member reads only its own items, through the usual read path,
   straight into its destination tensors.
3. **Rounds, reads overlapped with the exchange.** Each member's run is cut into chunks of at
   most ``budget_bytes / R``; round k is every member's k-th chunk (:func:`_rounds`). A member reads
   its chunk of round k+1 (on a reader thread, through the usual read path) while it exchanges
   round k, so the storage is busy while the bytes travel between ranks.
4. **Status.** Before each round's exchange every member writes its status (ok, or its read
   error) to the default group's key-value store and waits for the other members' (at most
   ``timeout_s``): if a member failed, every member fails naming it and its error; no rank waits
   for bytes that will not come.
5. **Exchange.** The owner of each item of the round sends its destination's bytes to the other
   members (point-to-point on the default group, in item order, so sends and receives pair up): a
   contiguous destination receives in place, others through a buffer; a CUDA destination is sent
   on the device when the default group's backend is NCCL, through host memory otherwise.
   Received items are committed with ``planner.commit_tensor`` as read ones are.

Memory: at most ``budget_bytes`` of buffers per rank per round (only for destinations that are not
contiguous, or on a device the backend cannot send from). Every wait is bounded by ``timeout_s``:
past it the load fails naming the ranks it waited for.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .deadline import default_group_store

__all__ = ["ReplicaKey", "ReplicaGroup", "ReadOnceShare", "ReadOnceError", "plan_digest", "replica_groups",
           "deal_items", "replica_key", "DEFAULT_EXCHANGE_BYTES", "DEFAULT_EXCHANGE_TIMEOUT_S"]

# Where read-once loads keep their members' statuses in the default group's store.
_STORE_PREFIX = "fastdcp/read_once"

# Staging of one exchange round per rank (only for destinations that cannot receive in place).
DEFAULT_EXCHANGE_BYTES = 256 << 20
# How long a member waits for the others' status and bytes without a load deadline.
DEFAULT_EXCHANGE_TIMEOUT_S = 1800.0


class ReadOnceError(RuntimeError):
    """Another member of a read-once replica group failed its reads, or an exchange did not
    complete in time."""


@dataclass(frozen=True)
class ReplicaKey:
    """What a rank's local plan tells the coordinator: its plan's digest and its rank in the
    default process group."""

    digest: bytes
    rank: int


@dataclass(frozen=True)
class ReplicaGroup:
    """What the coordinator hands each member of a group of equal plans: the members (ranks of the
    default group, sorted) and a token naming this load's exchange."""

    members: tuple[int, ...]
    token: str


def _index_key(index: Any) -> tuple:
    offset = getattr(index, "offset", None)
    return (index.fqn, tuple(offset) if offset is not None else None, getattr(index, "index", None))


def plan_digest(items: list[ReadItem]) -> bytes:
    """16 bytes that are equal for two ranks exactly when their plans read the same stored regions
    into the same destination regions (in the same order)."""
    h = hashlib.blake2b(digest_size=16)
    for item in items:
        h.update(repr((item.type.value, _index_key(item.dest_index), tuple(item.dest_offsets),
                       _index_key(item.storage_index), tuple(item.storage_offsets), tuple(item.lengths))).encode())
        h.update(b"\0")
    return h.digest()


def replica_key(items: list[ReadItem]) -> ReplicaKey | None:
    """This rank's key, or None when it cannot take part (no default process group of several
    ranks, the ``fake`` backend, no key-value store)."""
    group = default_group_store(_STORE_PREFIX)
    return None if group is None else ReplicaKey(plan_digest(items), group[1])


def replica_groups(keys: list[ReplicaKey | None]) -> list[ReplicaGroup | None]:
    """Each plan's group (by position in ``keys``): plans with equal digests share one; a plan
    without a key, or alone with its digest, gets None (it reads everything itself)."""
    by_digest: dict[bytes, list[int]] = {}
    for key in keys:
        if key is not None:
            by_digest.setdefault(key.digest, []).append(key.rank)
    token = secrets.token_hex(8)
    groups: dict[bytes, ReplicaGroup] = {
        digest: ReplicaGroup(tuple(sorted(ranks)), f"{token}/{i}")
        for i, (digest, ranks) in enumerate(by_digest.items()) if len(set(ranks)) == len(ranks) > 1}
    return [groups.get(key.digest) if key is not None else None for key in keys]


def deal_items(sizes: list[int], members: int) -> list[int]:
    """The member (0 .. members-1) that reads each item, the items given in storage order: each
    member a run of consecutive items of about ``1/members`` of the bytes (a member's reads stay
    together in the files, so none fetches bytes between them that another member reads). A
    member takes the next item while the bytes dealt so far are at most its share's end."""
    owners = [0] * len(sizes)
    total = sum(sizes)
    dealt = 0
    member = 0
    for i, size in enumerate(sizes):
        while member < members - 1 and dealt + size / 2 > total * (member + 1) / members:
            member += 1
        owners[i] = member
        dealt += size
    return owners


def _store() -> Any:
    """The default group's store, under this module's prefix (a member of a group has one)."""
    group = default_group_store(_STORE_PREFIX)
    if group is None:
        raise ReadOnceError("read-once load: the default process group's store is gone")
    return group[0]


@dataclass
class _Shared:
    """One tensor item of the replica group: who reads it, and its size."""

    item: ReadItem
    owner: int  # a rank of the default group
    nbytes: int


def _rounds(shared: list[_Shared], members: tuple[int, ...], budget: int) -> list[list[_Shared]]:
    """The group's items in exchange rounds: each member's run (consecutive items in storage order)
    cut into chunks of at most ``budget / len(members)`` bytes (at least one item each); round k
    holds every member's k-th chunk. The same on every member."""
    per_member = max(1, budget // len(members))
    runs: dict[int, list[list[_Shared]]] = {m: [] for m in members}
    filled: dict[int, int] = {m: 0 for m in members}  # bytes in each member's last chunk
    for item in shared:
        chunks = runs[item.owner]
        if not chunks or filled[item.owner] + item.nbytes > per_member:
            chunks.append([])
            filled[item.owner] = 0
        chunks[-1].append(item)
        filled[item.owner] += item.nbytes
    depth = max((len(c) for c in runs.values()), default=0)
    return [[item for m in members if k < len(runs[m]) for item in runs[m][k]] for k in range(depth)]


@dataclass
class ReadOnceShare:
    """This rank's part of a read-once load (see the module docstring).

    Args:
        group: the replica group the coordinator handed this rank.
        rank: this rank in the default group.
        byte_items: the plan's byte items (every member reads them, with its first round).
        rounds: the group's tensor items with their owners, in exchange rounds (:func:`_rounds`).
        budget_bytes: the bytes of one round; timeout_s: the longest wait.
    """

    group: ReplicaGroup
    rank: int
    byte_items: list[ReadItem]
    rounds: list[list[_Shared]] = field(default_factory=list)
    budget_bytes: int = DEFAULT_EXCHANGE_BYTES
    timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S

    @classmethod
    def deal(cls, items: list[ReadItem], planner: LoadPlanner, group: ReplicaGroup, where: Any, *,
             budget_bytes: int | None = None, timeout_s: float | None = None) -> "ReadOnceShare":
        """This rank's share of ``items`` (the plan every member of ``group`` has); ``where(item)``
        gives an item's place in storage (file, offset) to deal the items in storage order."""
        rank = dist.get_rank()
        tensor_items = sorted((i for i, item in enumerate(items) if item.type != LoadItemType.BYTE_IO),
                              key=lambda i: (where(items[i]), i))
        sizes = []
        for i in tensor_items:
            target = planner.resolve_tensor(items[i])
            sizes.append(target.numel() * target.element_size())
        owners = deal_items(sizes, len(group.members))
        shared = [_Shared(items[i], group.members[m], n) for i, m, n in zip(tensor_items, owners, sizes)]
        byte_items = [item for item in items if item.type == LoadItemType.BYTE_IO]
        budget = DEFAULT_EXCHANGE_BYTES if budget_bytes is None else int(budget_bytes)
        return cls(group, rank, byte_items, _rounds(shared, group.members, budget), budget,
                   DEFAULT_EXCHANGE_TIMEOUT_S if timeout_s is None else float(timeout_s))

    def own_items(self, k: int) -> list[ReadItem]:
        """What this rank reads for round ``k`` (its chunk of the round; the byte items with round 0)."""
        own = [s.item for s in self.rounds[k] if s.owner == self.rank] if k < len(self.rounds) else []
        return (self.byte_items + own) if k == 0 else own

    @property
    def read_bytes(self) -> int:
        """Tensor bytes this rank reads itself."""
        return sum(s.nbytes for r in self.rounds for s in r if s.owner == self.rank)

    @property
    def received_bytes(self) -> int:
        """Tensor bytes this rank receives from the other members."""
        return sum(s.nbytes for r in self.rounds for s in r if s.owner != self.rank)

    # --- after each round's reads --------------------------------------------------------------- #

    def exchange(self, k: int, planner: LoadPlanner, error: BaseException | None) -> None:
        """Round ``k``: publish this rank's status and wait for the other members' (see the module
        docstring), then send and receive the round's items. Raises this rank's ``error``, or a
        :class:`ReadOnceError` naming the member that failed."""
        self._statuses(k, error)
        if error is not None:
            raise error
        if k < len(self.rounds):
            self._send_and_receive(planner, self.rounds[k])

    def _statuses(self, k: int, error: BaseException | None) -> None:
        store = _store()
        base = f"{self.group.token}/{k}"
        message = "" if error is None else f"{type(error).__name__}: {error}"
        store.set(f"{base}/{self.rank}", ("!" + message) if error is not None else "ok")
        others = [r for r in self.group.members if r != self.rank]
        keys = [f"{base}/{r}" for r in others]
        try:
            store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as wait_error:  # noqa: BLE001 - a store timeout: named below
            missing = [r for r, key in zip(others, keys) if not store.check([key])]
            raise ReadOnceError(f"read-once load: rank {self.rank} waited more than {self.timeout_s:g} s for ranks "
                                f"{missing} of its replica group {list(self.group.members)} to finish their reads"
                                ) from (error or wait_error)
        if error is not None:
            return
        for r, key in zip(others, keys):
            value = store.get(key).decode()
            if value != "ok":
                raise ReadOnceError(f"read-once load: rank {r} of this rank's replica group {list(self.group.members)} "
                                    f"failed its reads, so its items cannot be sent: {value[1:]}")

    def _device_p2p(self, tensor: torch.Tensor) -> bool:
        """Whether the default group sends ``tensor`` where it is (CUDA tensors need NCCL)."""
        if tensor.device.type == "cpu":
            return True
        return "nccl" in str(dist.get_backend()).lower()

    def _send_and_receive(self, planner: LoadPlanner, batch: list[_Shared]) -> None:
        ops: list[Any] = []
        received: list[tuple[_Shared, torch.Tensor, torch.Tensor]] = []  # (item, destination, buffer)
        keep: list[torch.Tensor] = []
        for shared in batch:
            target = planner.resolve_tensor(shared.item).detach()
            direct = self._device_p2p(target)
            if shared.owner == self.rank:
                payload = target if target.is_contiguous() else target.contiguous()
                if not direct:
                    payload = payload.cpu()
                keep.append(payload)
                ops += [dist.P2POp(dist.isend, payload, peer) for peer in self.group.members if peer != self.rank]
            else:
                if direct and target.is_contiguous():
                    buffer = target
                else:
                    buffer = torch.empty(target.shape, dtype=target.dtype, device=target.device if direct else "cpu")
                received.append((shared, target, buffer))
                ops.append(dist.P2POp(dist.irecv, buffer, shared.owner))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                self._wait(work, batch)
        for shared, target, buffer in received:
            if buffer is not target:
                target.copy_(buffer)
            planner.commit_tensor(shared.item, target)

    def _wait(self, work: Any, batch: list[_Shared]) -> None:
        cause: BaseException | None = None
        try:
            done = work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            done, cause = False, error
        if done is False:
            owners = sorted({s.owner for s in batch if s.owner != self.rank})
            raise ReadOnceError(f"read-once load: rank {self.rank} waited more than {self.timeout_s:g} s for the "
                                f"items of ranks {owners} (replica group {list(self.group.members)})") from cause
