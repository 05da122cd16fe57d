"""Which write mode a filesystem is fastest with, O_DIRECT or buffered + fsync, learnt from the
saves themselves.

Neither mode wins everywhere: O_DIRECT skips the page-cache copy and wins on fast local NVMe;
buffered writes + fsync were ~1.5x faster on one host of a 2-core VM's virtio disk, and
network or parallel filesystems are reported 2-5x slower with O_DIRECT on some setups. A writer
left at its default (no ``direct_io=`` argument, no ``FASTDCP_DIRECT_IO``) therefore asks this
module for each save:

* the first save to a filesystem in a process writes with O_DIRECT (the long-standing default);
* the second writes buffered: one save in the other mode, timed like the first;
* from the third on, every save uses the mode whose saves wrote faster (bytes over the time from
  the first write to the last fsync, the median of that mode's saves). Each save adds its own
  timing, so a choice made on noisy first saves is corrected if the chosen mode keeps writing
  slower than the other did.

Only saves of at least ``MIN_TIMED_BYTES`` are timed and count as tries: below that a write is
bound by latency (file creation, fsync), not by bandwidth. No extra bytes are ever written (a
separate probe measured 3-4% of a 1 GiB save here and could not tell modes within ~20% apart).
Memory filesystems are buffered always; a filesystem that refuses O_DIRECT (the engine falls back
per file) is recorded as buffered-only.

The choice is kept per filesystem (``st_dev`` of the directory) for the life of the process
(:mod:`fastdcp.io.mode_history`, shared with the read side);
:func:`chosen_write_modes` reports it, :func:`forget_write_modes` drops it.
"""

from __future__ import annotations

import logging

from .._native import _C
from .engine import IoOptions
from .mode_history import HistoryBook, IoMode, ModeHistory

__all__ = ["WriteMode", "write_mode_for", "record_write", "chosen_write_modes",
           "forget_write_modes", "MIN_TIMED_BYTES"]

logger = logging.getLogger("fastdcp")

MIN_TIMED_BYTES = 64 << 20


# One record for both sides (fastdcp.io.mode_history.IoMode). This side's reasons:
# The write mode of one save and why: ``"asked"`` (``direct_io=`` or ``FASTDCP_DIRECT_IO``),
#     ``"memory filesystem"``, ``"first save"``, ``"trying buffered"``, ``"faster so far"``,
#     ``"O_DIRECT refused"``, or ``"small save"`` (below MIN_TIMED_BYTES: the mode chosen so far,
#     O_DIRECT before any choice).
WriteMode = IoMode

_WRITE_REASONS = {"refused": "O_DIRECT refused", "first": "first save", "other": "trying buffered",
                  "faster": "faster so far"}

_book = HistoryBook()


def _next_mode(history: ModeHistory) -> WriteMode:
    return history.next_mode(start_direct=True, reasons=_WRITE_REASONS)


def write_mode_for(directory: str, options: IoOptions, planned_bytes: int) -> WriteMode:
    """The mode for a save of ``planned_bytes`` into ``directory`` (which must exist): an explicit
    ``direct_io`` first, then memory filesystems (buffered), then what the timed saves to this
    filesystem say (module docstring)."""
    if options.direct_io_chosen:
        return WriteMode(direct=options.direct_io and not _C.on_memory_filesystem(directory), reason="asked")
    if _C.on_memory_filesystem(directory):
        return WriteMode(direct=False, reason="memory filesystem")
    mode = _book.update(directory, _next_mode)
    if planned_bytes < MIN_TIMED_BYTES and mode.reason in ("first save", "trying buffered"):
        # too small to time: no try spent on it; O_DIRECT unless buffered has already been chosen
        return WriteMode(direct=True, reason="small save", direct_gibps=mode.direct_gibps,
                         buffered_gibps=mode.buffered_gibps)
    return mode


def record_write(directory: str, mode: WriteMode, nbytes: int, seconds: float, direct_granted: bool) -> None:
    """Add a finished save's write phase (``nbytes`` in ``seconds``, from the first write to the
    last fsync) to its filesystem's history, when the mode was this module's to choose and the save
    was large enough to time. ``direct_granted``: every file asked for O_DIRECT got it."""
    if mode.reason in ("asked", "memory filesystem") or nbytes < MIN_TIMED_BYTES or seconds <= 0:
        return
    gibps = nbytes / seconds / (1 << 30)
    chosen = _book.record(directory, mode.direct, gibps, direct_granted, _next_mode)
    logger.debug("write mode for %s: %s wrote %.2f GiB/s; next: %s", directory,
                 "O_DIRECT" if mode.direct else "buffered", gibps, chosen)


def chosen_write_modes() -> dict[str, WriteMode]:
    """What the next save to each filesystem written in this process would use, by a directory on
    it (introspection; sizes below MIN_TIMED_BYTES aside)."""
    return {directory: _next_mode(history) for directory, history in _book.items()}


def forget_write_modes() -> None:
    """Drop every filesystem's history: the next saves learn again."""
    _book.clear()
