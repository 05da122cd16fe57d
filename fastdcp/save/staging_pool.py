"""The process-wide pool of staging slabs that every writer's ``stage()`` draws from.

Most training scripts build a new writer per checkpoint
(``dcp.async_save(sd, storage_writer=FastFileSystemWriter(f"ckpt/step_{n}"))``), so a slab owned by
the writer would be allocated and faulted in again by every save. The pool outlives writers: a slab
is reused by any later ``stage()`` of the same layout, whichever writer makes it.

* **Key.** A slab is reused for a layout of the same signature (dtypes and shapes in traversal
  order, :class:`~fastdcp.save.staging.StagingLayout`) and memory preference, and only in the process
  that allocated it: a forked child starts with an empty pool and never touches its parent's slabs.
* **Leases.** :meth:`StagingPool.acquire` hands out a :class:`StagingLease`. Its slab is in use from
  then until the lease is released (the writer's ``write_data`` does it when its save is done:
  thread mode) or, independently, until every view given to :meth:`StagingLease.hold` is garbage
  (weak references: in process mode the writer's ``write_data`` runs in another process, and the
  views in this one go away once that process has answered). A slab in use is never refilled.
* **Memory limit.** The pool holds at most ``limit`` bytes of slabs, idle and in use together. A
  stage that finds no idle slab of its layout gets a new pooled slab when the limit allows it (so two
  saves in flight each have one without waiting); otherwise idle slabs are dropped, least recently
  used first, and if that is not enough the stage waits for a slab to be released. A wait longer
  than ``_WAIT_BEFORE_NEW_SLAB_S`` ends with a warning and a slab outside the pool; so does a single
  state bigger than the whole limit (one warning saying the limit and how to raise it). Slabs outside
  the pool are dropped once their save is done.
* **Default limit.** ``FASTDCP_STAGING_POOL_LIMIT_BYTES`` if set, else physical memory divided by
  ``4 × LOCAL_WORLD_SIZE`` (1 without it): every rank process has its own pool, and a rank's pool
  should leave most of the node's memory to the model, the optimizer, data loaders and the page
  cache. A quarter of the node over all ranks holds two in-flight stagings of a state of an eighth
  of the node per rank.

:func:`set_staging_pool_limit`, :func:`release_staging` and :func:`staging_pool_stats` are exported
by the package.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..io.engine import env_bytes, local_world_size
from ..io.host_memory import HostSlab, allocate_slab, slab_bytes

__all__ = [
    "StagingLease",
    "StagingPool",
    "StagingPoolStats",
    "default_limit",
    "release_staging",
    "reset_staging_pool",
    "set_staging_pool_limit",
    "staging_pool",
    "staging_pool_stats",
]

LIMIT_ENV = "FASTDCP_STAGING_POOL_LIMIT_BYTES"  # formerly FASTDCP_STAGING_POOL_BYTES, still read
_WAIT_BEFORE_NEW_SLAB_S = 60.0
_GC_EVERY_S = 0.5
_POLL_S = 0.02


@dataclass(frozen=True)
class StagingPoolStats:
    """A snapshot of the pool. Counters run from the pool's start (or :func:`reset_staging_pool`)."""

    limit_bytes: int  # the limit on pooled slabs, idle and in use
    bytes_held: int  # pooled slabs, idle and in use
    bytes_in_use: int  # pooled slabs a save may still read
    slabs_idle: int
    slabs_in_use: int
    slabs_allocated: int  # new slabs, pooled or not
    slabs_reused: int  # stages that found an idle slab of their layout
    slabs_unpooled: int  # of slabs_allocated: outside the pool (bigger than the limit, or after a long wait)
    slabs_dropped: int  # idle slabs dropped: evicted for the limit, or by release_staging()


def default_limit() -> int:
    """``FASTDCP_STAGING_POOL_LIMIT_BYTES``, else physical memory / (4 × ``LOCAL_WORLD_SIZE``)."""
    value = env_bytes(LIMIT_ENV)
    if value is not None:
        return value
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - not Linux
        physical = 16 << 30
    return physical // (4 * local_world_size())


class _Slot:
    """One slab (pooled or not), the key it serves and the lease using it (None: idle)."""

    __slots__ = ("slab", "key", "nbytes", "lease", "pooled", "retired")

    def __init__(self, key: Hashable, nbytes: int, pooled: bool) -> None:
        self.slab: HostSlab | None = None  # set once allocated; None again once dropped
        self.key = key
        self.nbytes = nbytes
        self.lease: StagingLease | None = None
        self.pooled = pooled
        self.retired = False  # release_staging() ran while in use: drop it once free


class StagingLease:
    """One stage's use of a slab. In use until :meth:`release`, or until every view given to
    :meth:`hold` is garbage; a lease never becomes in use again."""

    __slots__ = ("_pool", "_slot", "fresh", "_views", "_held", "_released")

    def __init__(self, pool: "StagingPool", slot: _Slot, fresh: bool) -> None:
        self._pool = pool
        self._slot = slot
        self.fresh = fresh  # the slab was allocated for this lease (not reused)
        self._views: list[weakref.ref] = []
        self._held = False  # hold() was called: from then on the views say whether it is in use
        self._released = False

    @property
    def slab(self) -> HostSlab | None:
        """The slab (None once the pool dropped it, which happens only when the lease is free)."""
        return self._slot.slab

    @property
    def in_use(self) -> bool:
        if self._released:
            return False
        return not self._held or any(ref() is not None for ref in self._views)

    def hold(self, views: list[torch.Tensor]) -> None:
        """The tensors handed out from the slab: once all of them are garbage, the slab is free."""
        refs = [weakref.ref(v) for v in views]
        with self._pool._condition:
            self._views = refs
            self._held = True
            self._pool._condition.notify_all()

    def release(self) -> None:
        """The save that read the slab is done with it (idempotent)."""
        self._pool._release(self)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is this lease's slab while the lease is in use."""
        slab = self._slot.slab
        return slab is not None and self.in_use and slab.holds_storage_of(tensor)


class StagingPool:
    """The pool (see the module docstring). One per process: :func:`staging_pool`."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Forget every slab and zero the counters (a new lock: a forked child may have inherited
        the old one held)."""
        self._condition = threading.Condition()
        self._pid = os.getpid()
        self._slots: list[_Slot] = []  # pooled, least recently used first
        self._unpooled: list[_Slot] = []
        self._limit: int | None = None  # None: default_limit()
        self._warned_oversize = False
        self._allocated = self._reused = self._unpooled_count = self._dropped = 0

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked without the at-fork hook (it resets as well)
            self._reset()

    # -- limits ------------------------------------------------------------------------------ #

    @property
    def limit(self) -> int:
        return self._limit if self._limit is not None else default_limit()

    def set_limit(self, nbytes: int | None) -> None:
        """Limit the pooled bytes to ``nbytes`` (None: back to :func:`default_limit`); idle slabs
        over the new limit are dropped now, slabs in use stay until their save is done."""
        if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
            raise ValueError(f"the staging pool limit must be an int >= 0 or None, got {nbytes!r}")
        self._check_pid()
        with self._condition:
            self._limit = nbytes
            self._sweep()
            self._drop_idle_until(self.limit)
            self._condition.notify_all()

    def release_idle(self) -> int:
        """Drop every idle slab and return their bytes; slabs in use are dropped when their
        save is done."""
        self._check_pid()
        with self._condition:
            self._sweep()
            freed = 0
            for slot in list(self._slots):
                if self._in_use(slot):
                    slot.retired = True
                else:
                    freed += self._drop(slot)
            return freed

    def stats(self) -> StagingPoolStats:
        self._check_pid()
        with self._condition:
            self._sweep()
            in_use = [s for s in self._slots if self._in_use(s)]
            return StagingPoolStats(
                limit_bytes=self.limit,
                bytes_held=self._held_bytes(),
                bytes_in_use=sum(s.nbytes for s in in_use),
                slabs_idle=len(self._slots) - len(in_use),
                slabs_in_use=len(in_use),
                slabs_allocated=self._allocated,
                slabs_reused=self._reused,
                slabs_unpooled=self._unpooled_count,
                slabs_dropped=self._dropped,
            )

    # -- leases ------------------------------------------------------------------------------ #

    def acquire(self, nbytes: int, key: Hashable, *, prefer_shared: bool | None = None,
                segment_starts: Sequence[int] = ()) -> StagingLease:
        """A lease on a slab of at least ``nbytes`` for a layout ``key``: an idle pooled slab of
        that key, else a new one (see the module docstring for the limit). The slab is in use from
        now on; give the views cut from it to :meth:`StagingLease.hold`. ``prefer_shared`` and
        ``segment_starts`` are :func:`~fastdcp.io.host_memory.allocate_slab`'s for a new slab: the
        key must tell them apart."""
        self._check_pid()
        size = slab_bytes(nbytes)
        pid = os.getpid()
        with self._condition:
            self._sweep()
            waited_since: float | None = None
            last_gc = 0.0
            while True:
                slot = next(
                    (s for s in reversed(self._slots)
                     if s.key == key and not s.retired and s.slab is not None and s.slab.pid == pid
                     and not self._in_use(s)),
                    None,
                )
                if slot is not None:  # the most recently used idle slab of this layout
                    self._slots.remove(slot)
                    self._slots.append(slot)
                    self._reused += 1
                    slot.lease = StagingLease(self, slot, fresh=False)
                    return slot.lease
                limit = self.limit
                if size > limit:
                    if not self._warned_oversize:
                        self._warned_oversize = True
                        _warn_outside_pool(
                            f"this state needs {size} bytes of staging memory, more than the staging "
                            f"pool's limit of {limit} bytes; it is staged into memory outside the pool, "
                            "allocated for every save and dropped after it"
                        )
                    slot = self._new_slot(key, size, pooled=False)
                    break
                self._drop_idle_until(limit - size)
                if self._held_bytes() + size <= limit:
                    slot = self._new_slot(key, size, pooled=True)
                    break
                # Over the limit with nothing idle left to drop: wait for a save to finish.
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                if now - waited_since > _WAIT_BEFORE_NEW_SLAB_S:
                    _warn_outside_pool(
                        f"the previous async save still holds its staging memory after "
                        f"{_WAIT_BEFORE_NEW_SLAB_S:.0f} s; staging into a new slab of {size} bytes outside the "
                        f"staging pool (limit {limit} bytes) instead of waiting longer (waiting for the "
                        "previous save's future before the next save keeps within the limit)"
                    )
                    slot = self._new_slot(key, size, pooled=False)
                    break
                if now - last_gc > _GC_EVERY_S:
                    gc.collect()  # views kept only by reference cycles of a finished save
                    last_gc = time.monotonic()
                    self._sweep()
                    continue
                self._condition.wait(timeout=_POLL_S)
                self._sweep()
            lease = slot.lease = StagingLease(self, slot, fresh=True)
        try:  # allocated outside the lock; its bytes are reserved meanwhile
            slab = allocate_slab(size, prefer_shared=prefer_shared, segment_starts=segment_starts)
        except BaseException:
            with self._condition:
                lease._released = True
                self._forget(slot)
                self._condition.notify_all()
            raise
        with self._condition:
            slot.slab = slab
            self._allocated += 1
            self._unpooled_count += not slot.pooled
        return lease

    def _release(self, lease: StagingLease) -> None:
        with self._condition:
            lease._released = True
            if self._pid == os.getpid():
                self._sweep()
            self._condition.notify_all()

    # -- bookkeeping (condition held) --------------------------------------------------------- #

    def _new_slot(self, key: Hashable, size: int, pooled: bool) -> _Slot:
        slot = _Slot(key, size, pooled)
        (self._slots if pooled else self._unpooled).append(slot)
        return slot

    @staticmethod
    def _in_use(slot: _Slot) -> bool:
        return slot.lease is not None and slot.lease.in_use

    def _held_bytes(self) -> int:
        return sum(s.nbytes for s in self._slots)

    def _forget(self, slot: _Slot) -> bool:
        """Take ``slot`` out of the pool (its memory goes once no view of it is left)."""
        slot.slab = None
        for slots in (self._slots, self._unpooled):
            if any(s is slot for s in slots):
                slots.remove(slot)
                return True
        return False

    def _drop(self, slot: _Slot) -> int:
        """Forget a free slot; its bytes (counted as dropped when it was pooled)."""
        pooled = slot.pooled
        if not self._forget(slot):
            return 0
        self._dropped += pooled
        return slot.nbytes

    def _sweep(self) -> None:
        """Mark free slots idle; drop free slabs outside the pool and retired ones."""
        for slot in self._slots + self._unpooled:
            if slot.lease is not None and not slot.lease.in_use:
                slot.lease = None
            if slot.lease is None and (slot.retired or not slot.pooled):
                self._drop(slot)

    def _drop_idle_until(self, target: int) -> None:
        """Drop idle pooled slabs, least recently used first, until at most ``target`` bytes are held."""
        for slot in list(self._slots):
            if self._held_bytes() <= target:
                return
            if not self._in_use(slot):
                self._drop(slot)


def _warn_outside_pool(why: str) -> None:
    """One warning for a stage that gets a slab outside the pool: ``why``, then how to raise the limit
    (stacklevel: the caller of ``FastFileSystemWriter.stage``)."""
    warnings.warn(
        f"fastdcp: {why}. Raise the limit with fastdcp.set_staging_pool_limit(nbytes) or {LIMIT_ENV} "
        "to reuse staging memory.",
        stacklevel=5,
    )


_POOL = StagingPool()
if hasattr(os, "register_at_fork"):
    # A child never reuses (or unpins) the parent's slabs, and must not inherit a held lock.
    os.register_at_fork(after_in_child=_POOL._reset)


def staging_pool() -> StagingPool:
    """This process's pool."""
    return _POOL


def set_staging_pool_limit(nbytes: int | None) -> None:
    """Limit the staging memory this process keeps for ``dcp.async_save`` to ``nbytes`` (idle and
    in use together; None: the default, ``FASTDCP_STAGING_POOL_LIMIT_BYTES`` or physical memory /
    (4 × ``LOCAL_WORLD_SIZE``)). Idle slabs over the new limit are dropped now."""
    _POOL.set_limit(nbytes)


def release_staging() -> int:
    """Drop every idle staging slab and return the bytes dropped; slabs a save still reads are
    dropped when that save is done. The next ``async_save`` allocates again."""
    return _POOL.release_idle()


def staging_pool_stats() -> StagingPoolStats:
    """Slabs allocated and reused, bytes held (for tests and benchmarks)."""
    return _POOL.stats()


def reset_staging_pool() -> None:
    """Forget every slab, zero the counters and restore the default limit (tests, benchmarks).
    Saves in flight keep their memory through their views."""
    with _POOL._condition:
        for slot in _POOL._slots + _POOL._unpooled:
            slot.slab = None
    _POOL._reset()
