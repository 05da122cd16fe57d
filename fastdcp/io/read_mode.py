"""Which read mode a load uses, the page cache or O_DIRECT: the page cache whenever the files are in
it, otherwise what the process's own cold loads from that filesystem measured.

Measured on a 2-core VM (ext4 on virtio, 1 GiB, fastdcp load): files in the page cache read
at 7.4-8.1 GiB/s buffered and at 0.83-0.95 GiB/s with O_DIRECT (which goes to the disk even for
cached pages), so a file in the page cache must be read buffered. Cold files read at 0.95-1.05 GiB/s
buffered and 0.80-1.04 GiB/s with O_DIRECT, a tie there, while on fast NVMe O_DIRECT wins (it skips
the copy out of the page cache and the cache's own bookkeeping). A reader left at its default (no
``direct_io=`` argument, no ``FASTDCP_DIRECT_IO``) therefore asks this module for each load:

1. ``direct_io=`` or ``FASTDCP_DIRECT_IO`` given: as asked (``"asked"``; still never O_DIRECT on a
   memory filesystem, where it only adds a bounce copy);
2. a memory filesystem (tmpfs, ramfs): buffered (``"memory filesystem"``);
3. at least half of the bytes of the files to read are in the page cache: buffered
   (``"in page cache"``). At one half buffered reads the cached half ~8x faster, which beats
   O_DIRECT unless O_DIRECT reads cold data more than ~2x faster than buffered reads do.
   Residency comes from ``_C.page_cache_resident_fraction`` (mincore on a mapping: no page is
   read). Where the kernel cannot tell (a file that is not ours and not writable, for which Linux
   reports every page as resident; mmap refused; the file gone), its bytes count as *not cold*:
   when they make the majority the load is buffered (``"page cache unknown"``) and not timed.
   Reading warm files with O_DIRECT costs ~8x, reading cold ones buffered at most the copy, and a
   warm load timed as a cold one would skew the history below;
4. a load under ``MIN_TIMED_BYTES`` (64 MiB, the write side's constant): buffered (``"small
   load"``, not timed: latency-bound, and it leaves the files cached for the next load);
5. otherwise, by the timed cold loads from this filesystem: the first buffered (``"first cold
   load"``, the long-standing default), the second with O_DIRECT (``"trying O_DIRECT"``), later ones
   in the mode whose loads read faster (``"faster so far"``: bytes over the time from the first
   read to the last placement, the median of that mode's loads; a tie goes to buffered, which
   leaves the files cached). Every timed load adds its own timing, so a choice made on noisy first
   loads is corrected. A filesystem that refused O_DIRECT (any file fell back) reads buffered
   from then on (``"O_DIRECT refused"``).

Cost of the residency check, measured on a 2-core VM: ~0.15-0.3 ms for a cached 1 GiB file
(4096 pages sampled; ~0.2% of reading it from the page cache at ~8 GiB/s), and ~1.3 ms for a
1000-file checkpoint (1000 x 64 KiB, stock's file per item; 64 files sampled) whose warm load took
~230 ms (0.6%); checking all 1000 files took ~11 ms, hence the sampling: at most
``MAX_CHECKED_FILES`` files, evenly spread over the list, ``CHECKED_PAGES`` pages between them (at
least 64 each).

The history is kept per filesystem (``st_dev`` of the directory) for the life of the process
(:mod:`fastdcp.io.mode_history`, shared with :mod:`fastdcp.io.write_mode`); :func:`chosen_read_modes` reports it,
:func:`forget_read_modes` drops it.
"""

from __future__ import annotations

import logging
import os

from .._native import _C
from .engine import IoOptions
from .mode_history import HistoryBook, IoMode, ModeHistory
from .write_mode import MIN_TIMED_BYTES

__all__ = ["ReadMode", "read_mode_for", "record_read", "chosen_read_modes", "forget_read_modes",
           "page_cache_share", "MIN_TIMED_BYTES", "MAX_CHECKED_FILES", "CHECKED_PAGES"]

logger = logging.getLogger("fastdcp")

# Residency is checked on at most this many of a load's files and this many pages between them: a
# checkpoint's files are saved and read together, so a sample tells their state, and the check
# stays well under a millisecond (module docstring).
MAX_CHECKED_FILES = 64
CHECKED_PAGES = 4096
_MIN_PAGES_PER_FILE = 64

# A load at least this much in the page cache (or not known to be cold) is read buffered.
_WARM_SHARE = 0.5

# The reasons whose loads are timed and recorded: the modes this module learns.
_LEARNT = ("first cold load", "trying O_DIRECT", "faster so far")


# One record for both sides (fastdcp.io.mode_history.IoMode). This side's reasons:
# The read mode of one load and why: ``"asked"`` (``direct_io=`` or ``FASTDCP_DIRECT_IO``),
#     ``"memory filesystem"``, ``"in page cache"``, ``"page cache unknown"``, ``"small load"``,
#     ``"first cold load"``, ``"trying O_DIRECT"``, ``"faster so far"`` or ``"O_DIRECT refused"``.
ReadMode = IoMode

_READ_REASONS = {"refused": "O_DIRECT refused", "first": "first cold load", "other": "trying O_DIRECT",
                 "faster": "faster so far"}

_book = HistoryBook()


def _next_mode(history: ModeHistory) -> ReadMode:
    return history.next_mode(start_direct=False, reasons=_READ_REASONS)


def page_cache_share(files: list[str]) -> tuple[float, float]:
    """(resident, unknown): the shares of the bytes of ``files`` that are in the page cache and
    whose residency cannot be told (module docstring), from at most MAX_CHECKED_FILES of them,
    weighted by file size. A file that cannot be stat'ed or checked (gone, unreadable) counts as
    unknown with the mean size of the others: the load's own open reports it. No files: (1, 0)."""
    if not files:
        return 1.0, 0.0
    step = max(1, -(-len(files) // MAX_CHECKED_FILES))
    sample = files[::step]
    pages = max(_MIN_PAGES_PER_FILE, CHECKED_PAGES // len(sample))
    sized: list[tuple[int, float]] = []   # (bytes, fraction or -1)
    missing = 0
    for path in sample:
        try:
            size = os.stat(path).st_size
            fraction = _C.page_cache_resident_fraction(path, pages)
        except OSError:
            missing += 1
            continue
        sized.append((size, fraction))
    known_bytes = sum(size for size, _ in sized)
    mean = known_bytes / len(sized) if sized else 1.0
    total = known_bytes + missing * mean
    if total <= 0:
        return 1.0, 0.0  # empty files only: nothing to read from the disk
    resident = sum(size * fraction for size, fraction in sized if fraction >= 0)
    unknown = sum(size for size, fraction in sized if fraction < 0) + missing * mean
    return resident / total, unknown / total


def read_mode_for(directory: str, options: IoOptions, files: list[str], planned_bytes: int) -> ReadMode:
    """The mode for a load of ``planned_bytes`` from ``files`` (paths of the data files it reads)
    in ``directory`` (which must exist): an explicit ``direct_io`` first, then memory filesystems,
    the page cache, small loads, and what the timed cold loads from this filesystem say (module
    docstring)."""
    if options.direct_io_chosen:
        return ReadMode(direct=options.direct_for(directory), reason="asked")
    if _C.on_memory_filesystem(directory):
        return ReadMode(direct=False, reason="memory filesystem")
    learnt = _book.update(directory, _next_mode)
    d, b = learnt.direct_gibps, learnt.buffered_gibps
    resident, unknown = page_cache_share(files)   # outside the lock: it does I/O system calls
    if resident + unknown >= _WARM_SHARE:
        return ReadMode(False, "in page cache" if resident >= unknown else "page cache unknown", d, b)
    if planned_bytes < MIN_TIMED_BYTES:
        return ReadMode(False, "small load", d, b)
    return learnt


def record_read(directory: str, mode: ReadMode, nbytes: int, seconds: float, direct_granted: bool) -> None:
    """Add a finished load's read phase (``nbytes`` in ``seconds``, from the first read to the last
    placement) to its filesystem's history, when the mode was learnt (a cold load this module chose
    the mode of) and the load was large enough to time. ``direct_granted``: every file read with
    O_DIRECT got it."""
    if mode.reason not in _LEARNT or nbytes < MIN_TIMED_BYTES or seconds <= 0:
        return
    gibps = nbytes / seconds / (1 << 30)
    chosen = _book.record(directory, mode.direct, gibps, direct_granted, _next_mode)
    logger.debug("read mode for %s: %s read %.2f GiB/s cold; next cold load: %s", directory,
                 "O_DIRECT" if mode.direct else "buffered", gibps, chosen)


def chosen_read_modes() -> dict[str, ReadMode]:
    """What the next cold load (of at least MIN_TIMED_BYTES) from each filesystem read in this
    process would use, by a directory on it (introspection)."""
    return {directory: _next_mode(history) for directory, history in _book.items()}


def forget_read_modes() -> None:
    """Drop every filesystem's history: the next cold loads learn again."""
    _book.clear()
