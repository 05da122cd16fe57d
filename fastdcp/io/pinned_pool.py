"""The process-wide pool of pinned host buffers that device transfers go through.

Page-locking host memory (``cudaHostRegister``) costs about as much as copying into it once, so a
buffer pinned per writer object, per load or per process start would be paid again by every new
writer, every load and every rank. Instead, the save ring (``fastdcp.save.device_ring``) and loads
into GPU tensors (``fastdcp.load.gpu_placement``) lease their buffers here for the length of one
save or load, and give them back:

* **Reuse.** A lease gets the smallest idle buffer at least as large as it asks for, else a new one.
  Buffers outlive the writers and readers that used them; a forked child starts with an empty pool.
* **Limit.** The pool holds at most ``limit`` bytes, idle and leased together: ``FASTDCP_PINNED_POOL_LIMIT_BYTES``
  if set, else :data:`DEFAULT_LIMIT` (1 GiB: the default save ring plus the default load buffers,
  twice). A lease that would pass the limit first drops idle buffers, least recently used first; if
  that is not enough it gets a buffer outside the pool, pinned for that lease and dropped after it
  (the transfer runs as fast, only the pinning is paid again). It never waits.
* **Warm-up.** :func:`warm_up_pinned` allocates and pins buffers ahead of the first save or load
  (``fastdcp.warm_up`` calls it), so that the first checkpoint of a process pays no pinning.

Without CUDA the buffers are ordinary page-aligned memory (or fake-pinned, see
``fastdcp.io.host_memory``); the pool works the same.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from .engine import env_bytes
from .host_memory import HostSlab, allocate_slab, slab_bytes

__all__ = ["PinnedLease", "PinnedPoolStats", "lease_pinned", "warm_up_pinned", "pinned_pool_stats",
           "set_pinned_pool_limit", "reset_pinned_pool", "DEFAULT_LIMIT", "LIMIT_ENV"]

LIMIT_ENV = "FASTDCP_PINNED_POOL_LIMIT_BYTES"  # formerly FASTDCP_PINNED_POOL_BYTES, still read
DEFAULT_LIMIT = 1 << 30


@dataclass(frozen=True)
class PinnedPoolStats:
    """A snapshot of the pool; counters run from the pool's start (or :func:`reset_pinned_pool`)."""

    limit_bytes: int
    bytes_held: int  # pooled buffers, idle and leased
    bytes_leased: int
    buffers_allocated: int  # new buffers, pooled or not
    buffers_reused: int  # leases served by an idle buffer
    buffers_unpooled: int  # of buffers_allocated: outside the pool (over the limit)
    pin_seconds: float  # time spent allocating and pinning new buffers


class PinnedLease:
    """One use of a pinned buffer: :attr:`tensor` (flat uint8, page-aligned, at least the bytes
    asked for) until :meth:`release`. Usable as a context manager."""

    def __init__(self, slab: HostSlab, pooled: bool) -> None:
        self.slab = slab
        self.pooled = pooled
        self._released = False

    @property
    def tensor(self) -> torch.Tensor:
        return self.slab.tensor

    def release(self) -> None:
        """Give the buffer back (idempotent). Precondition: no transfer still reads or writes it."""
        if not self._released:
            self._released = True
            _POOL._give_back(self)

    def __enter__(self) -> "PinnedLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Pool:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._idle: list[HostSlab] = []  # least recently used first
        self._leased_bytes = 0
        self._limit: int | None = None
        self._allocated = self._reused = self._unpooled = 0
        self._pin_s = 0.0

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    @property
    def limit(self) -> int:
        if self._limit is not None:
            return self._limit
        value = env_bytes(LIMIT_ENV)
        return DEFAULT_LIMIT if value is None else value

    def _held(self) -> int:
        return self._leased_bytes + sum(s.nbytes for s in self._idle)

    def lease(self, nbytes: int) -> PinnedLease:
        self._check_pid()
        size = slab_bytes(nbytes)
        with self._lock:
            fits = [i for i, s in enumerate(self._idle) if s.nbytes >= size]
            if fits:
                slab = self._idle.pop(min(fits, key=lambda i: self._idle[i].nbytes))
                self._leased_bytes += slab.nbytes
                self._reused += 1
                return PinnedLease(slab, pooled=True)
            limit = self.limit
            while self._idle and self._held() + size > limit:
                self._idle.pop(0)
            pooled = self._held() + size <= limit
            if pooled:
                self._leased_bytes += size  # reserved while it is allocated
        try:
            slab = self._allocate(size)
        except BaseException:
            if pooled:
                with self._lock:
                    self._leased_bytes -= size
            raise
        with self._lock:
            self._allocated += 1
            self._unpooled += not pooled
        return PinnedLease(slab, pooled)

    def _allocate(self, size: int) -> HostSlab:
        import time

        t0 = time.perf_counter()
        slab = allocate_slab(size, prefer_shared=False)
        with self._lock:
            self._pin_s += time.perf_counter() - t0
        return slab

    def _give_back(self, lease: PinnedLease) -> None:
        if not lease.pooled or lease.slab.pid != os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                return
            self._leased_bytes -= lease.slab.nbytes
            if self._held() + lease.slab.nbytes <= self.limit:
                self._idle.append(lease.slab)

    def stats(self) -> PinnedPoolStats:
        self._check_pid()
        with self._lock:
            return PinnedPoolStats(self.limit, self._held(), self._leased_bytes, self._allocated, self._reused,
                                   self._unpooled, self._pin_s)


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL._reset)


def lease_pinned(nbytes: int) -> PinnedLease:
    """A pinned buffer of at least ``nbytes`` from this process's pool (see the module docstring)."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"a pinned buffer needs a positive byte count, got {nbytes!r}")
    return _POOL.lease(nbytes)


def warm_up_pinned(sizes: list[int]) -> None:
    """Allocate and pin an idle buffer for each size in ``sizes`` that no idle buffer serves yet
    (within the limit), so the next leases of those sizes find them."""
    leases = [lease_pinned(n) for n in sizes if n > 0]
    for lease in leases:
        lease.release()


def pinned_pool_stats() -> PinnedPoolStats:
    """Buffers allocated and reused, bytes held, time spent pinning."""
    return _POOL.stats()


def set_pinned_pool_limit(nbytes: int | None) -> None:
    """Limit the pinned bytes this process keeps (None: ``FASTDCP_PINNED_POOL_LIMIT_BYTES`` or
    :data:`DEFAULT_LIMIT`); idle buffers over the new limit are dropped now."""
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
        raise ValueError(f"the pinned pool limit must be an int >= 0 or None, got {nbytes!r}")
    _POOL._check_pid()
    with _POOL._lock:
        _POOL._limit = nbytes
        while _POOL._idle and _POOL._held() > _POOL.limit:
            _POOL._idle.pop(0)


def reset_pinned_pool() -> None:
    """Forget every buffer and zero the counters (tests, benchmarks); leases out keep their memory."""
    _POOL._reset()
