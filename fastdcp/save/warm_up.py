"""``fastdcp.warm_up()``: pay a process's one-time costs of checkpointing before the first checkpoint.

The first save of a process allocates and page-locks host memory (the save ring, the staging slab
of ``dcp.async_save``, the buffers of loads into GPU tensors) and starts the copy machinery; later
saves reuse all of it (``fastdcp.io.pinned_pool``, ``fastdcp.save.staging_pool``). A training
script that wants its first checkpoint as fast as the later ones calls :func:`warm_up` once at
start-up, for example right after building the model and optimizer::

    fastdcp.warm_up(state_dict)          # state_dict: what dcp.async_save will be given

It takes the time the first checkpoint would otherwise take in its call (mostly pinning, at about
the speed of a copy of the same bytes), and holds the memory it allocates from then on, within the
pools' caps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..io.engine import IoOptions, cpu_share, get_engine
from ..io.pinned_pool import pinned_pool_stats, warm_up_pinned
from .staging import StateDictStager

__all__ = ["WarmUpReport", "warm_up", "DEFAULT_LOAD_PINNED_BYTES"]

# The pinned staging a load into GPU tensors leases with the reader's default budget.
DEFAULT_LOAD_PINNED_BYTES = 512 << 20


@dataclass(frozen=True)
class WarmUpReport:
    """What :func:`warm_up` prepared: pinned bytes now held by the pinned pool, staging bytes now
    idle in the staging pool for ``state_dict``'s layout, and the seconds it took."""

    pinned_bytes: int
    staging_bytes: int
    seconds: float


def warm_up(state_dict: Any = None, *, ring_bytes: int | None = 256 << 20,
            load_bytes: int | None = DEFAULT_LOAD_PINNED_BYTES) -> WarmUpReport:
    """Allocate, pin and fault in what the first checkpoint of this process would.

    Args:
        state_dict: when given, it is staged once as ``dcp.async_save`` stages it (a copy of its
            tensors, device tensors included), so the staging pool holds a slab of its layout and
            the first ``async_save`` of a state of the same structure reuses it.
        ring_bytes: pinned memory for the save ring of GPU tensors (a writer's ``pinned_ring_limit_bytes``,
            default 256 MiB); None or 0: none.
        load_bytes: pinned memory for loads into GPU tensors (default 512 MiB, what a load with the
            reader's default ``read_buffer_limit_bytes`` leases); None or 0: none.
    """
    t0 = time.perf_counter()
    sizes = [n for n in (ring_bytes, load_bytes) if n]
    for n in sizes:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"warm_up: byte counts must be ints >= 0, got {n!r}")
    warm_up_pinned(sizes)
    staging_bytes = 0
    if state_dict is not None:
        stager = StateDictStager()
        options = IoOptions.resolve(direct_io=None, default_direct_io=True, io_threads=cpu_share(), task_bytes=None)
        staged = stager.stage(state_dict, get_engine(options))
        report = stager.last_report
        staging_bytes = report.peak_host_bytes if report is not None else 0
        stager.release(staged)
        del staged
        stager.close()
    return WarmUpReport(pinned_pool_stats().bytes_held, staging_bytes, time.perf_counter() - t0)
