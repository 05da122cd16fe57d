"""A writer's own settings, resolved once: each from its argument, else its ``FASTDCP_*``
environment variable, else its default, and validated here (one place, one message per mistake).
Every fastdcp writer (local, object stores, tiered) builds its settings through
:meth:`WriterOptions.resolve`."""

from __future__ import annotations

from dataclasses import dataclass

from ..io.engine import DIRECT_ALIGN, IoOptions, env_bytes, env_flag

__all__ = ["WriterOptions", "DEFAULT_RING_BYTES", "RING_SLOTS"]

DEFAULT_RING_BYTES = 256 << 20  # the pinned ring GPU tensor bytes are written through
RING_SLOTS = 4  # the fewest slots of a ring


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class WriterOptions:
    """fastdcp's writer settings (docs/api.md, FastFileSystemWriter).

    Args:
        io: the engine's settings (``direct_io``, ``io_threads``, ``task_bytes``).
        checksums: record a CRC-32C per stored item (``FASTDCP_CHECKSUMS``).
        pinned_ring_limit_bytes: the pinned ring of GPU tensor bytes, at least ``RING_SLOTS`` blocks.
        async_staging: ``stage()`` returns a future (``FASTDCP_ASYNC_STAGING``).
        snapshot_limit_bytes: with ``async_staging``, the most bytes one stage copies
            (``FASTDCP_SNAPSHOT_LIMIT_BYTES``); None: the whole state.
    """

    io: IoOptions
    checksums: bool
    pinned_ring_limit_bytes: int
    async_staging: bool
    snapshot_limit_bytes: int | None

    @staticmethod
    def resolve(*, direct_io: bool | None = None, io_threads: int | None = None, task_bytes: int | None = None,
                checksums: bool | None = None, pinned_ring_limit_bytes: int | None = None,
                async_staging: bool | None = None, snapshot_limit_bytes: int | None = None) -> "WriterOptions":
        """Arguments first (None: not given), then the environment, then the defaults; a
        ValueError or TypeError naming the argument or variable for anything invalid."""
        io = IoOptions.resolve(direct_io=direct_io, default_direct_io=True, io_threads=io_threads,
                               task_bytes=task_bytes)
        ring = pinned_ring_limit_bytes if pinned_ring_limit_bytes is not None else DEFAULT_RING_BYTES
        if not _is_int(ring) or ring < RING_SLOTS * DIRECT_ALIGN:
            raise ValueError(f"pinned_ring_limit_bytes must be an int of at least {RING_SLOTS * DIRECT_ALIGN}, "
                             f"got {pinned_ring_limit_bytes!r}")
        if async_staging is not None and not isinstance(async_staging, bool):
            raise TypeError(f"async_staging must be a bool or None, got {async_staging!r}")
        staged = bool(async_staging if async_staging is not None else (env_flag("FASTDCP_ASYNC_STAGING") or False))
        if snapshot_limit_bytes is None:
            # The environment sets a default for writers that stage overlapped; others ignore it.
            snapshot_limit_bytes = env_bytes("FASTDCP_SNAPSHOT_LIMIT_BYTES") if staged else None
        elif not _is_int(snapshot_limit_bytes) or snapshot_limit_bytes < 0:
            raise ValueError(f"snapshot_limit_bytes must be an int >= 0 or None, got {snapshot_limit_bytes!r}")
        elif not staged:
            raise ValueError("snapshot_limit_bytes needs async_staging=True (FASTDCP_ASYNC_STAGING=1): a blocking "
                             "stage always copies the whole state")
        summed = bool(checksums if checksums is not None else (env_flag("FASTDCP_CHECKSUMS") or False))
        return WriterOptions(io, summed, ring, staged, snapshot_limit_bytes)
