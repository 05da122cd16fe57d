"""Timed runs per filesystem and I/O mode (O_DIRECT or buffered): the one history behind the write
mode (:mod:`fastdcp.io.write_mode`) and the read mode (:mod:`fastdcp.io.read_mode`) choices.

Both choose the same way: the first timed run in the long-standing mode (``start_direct``), the
second in the other, then the mode whose runs were faster (median GiB/s, a tie to the starting
mode), every later run adding its own timing; a filesystem that refused O_DIRECT stays buffered.
Histories are kept per process and filesystem (``st_dev`` of a directory on it): threads of an
engine do not survive fork, and a choice belongs to the device it measured.
"""

from __future__ import annotations

import os
import statistics
import threading
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["IoMode", "ModeHistory", "HistoryBook"]


@dataclass(frozen=True)
class IoMode:
    """The I/O mode of one save or load and why (the reasons are the write and read modules'), with
    the medians of the timed runs of each mode so far on its filesystem."""

    direct: bool
    reason: str
    direct_gibps: float | None = None     # median of the timed O_DIRECT runs so far
    buffered_gibps: float | None = None   # median of the timed buffered runs so far


@dataclass
class ModeHistory:
    """The timed runs to or from one filesystem: GiB/s per mode."""

    direct: list[float] = field(default_factory=list)
    buffered: list[float] = field(default_factory=list)
    direct_refused: bool = False

    def median(self, direct: bool) -> float | None:
        rates = self.direct if direct else self.buffered
        return statistics.median(rates) if rates else None

    def add(self, direct: bool, gibps: float, direct_granted: bool) -> None:
        """One timed run; an O_DIRECT run the filesystem did not grant marks O_DIRECT refused."""
        if direct and not direct_granted:
            self.direct_refused = True
        else:
            (self.direct if direct else self.buffered).append(gibps)

    def next_direct(self, start_direct: bool) -> tuple[bool, str]:
        """(whether the next timed run uses O_DIRECT, the stage that says why): ``"refused"``,
        ``"first"`` (no run in the starting mode yet), ``"other"`` (the one try of the other mode),
        ``"faster"`` (the faster median; a tie to the starting mode)."""
        if self.direct_refused:
            return False, "refused"
        start, other = self.median(start_direct), self.median(not start_direct)
        if start is None:
            return start_direct, "first"
        if other is None:
            return not start_direct, "other"
        return (start_direct if start >= other else not start_direct), "faster"

    def next_mode(self, start_direct: bool, reasons: dict[str, str]) -> IoMode:
        """:meth:`next_direct` as an :class:`IoMode`, its stage named by ``reasons``."""
        direct, stage = self.next_direct(start_direct)
        return IoMode(direct, reasons[stage], self.median(True), self.median(False))


class HistoryBook:
    """The histories of this process, by filesystem, with a directory seen on each (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histories: dict[tuple[int, int], ModeHistory] = {}
        self._directory_of: dict[tuple[int, int], str] = {}

    def update(self, directory: str, change=None):
        """Under the lock: the history of ``directory``'s filesystem (made when new), passed to
        ``change`` when given (its result returned), else returned as a copy."""
        key = (os.getpid(), os.stat(directory).st_dev)
        with self._lock:
            history = self._histories.setdefault(key, ModeHistory())
            self._directory_of.setdefault(key, directory)
            if change is not None:
                return change(history)
            return ModeHistory(list(history.direct), list(history.buffered), history.direct_refused)

    def record(self, directory: str, direct: bool, gibps: float, direct_granted: bool, next_mode):
        """Add one timed run to ``directory``'s filesystem; returns ``next_mode(history)`` after it."""

        def add(history: ModeHistory):
            history.add(direct, gibps, direct_granted)
            return next_mode(history)

        return self.update(directory, add)

    def items(self) -> Iterator[tuple[str, ModeHistory]]:
        """(a directory on it, a copy of its history) for every filesystem of this process."""
        pid = os.getpid()
        with self._lock:
            rows = [(self._directory_of[k], ModeHistory(list(h.direct), list(h.buffered), h.direct_refused))
                    for k, h in self._histories.items() if k[0] == pid]
        return iter(rows)

    def clear(self) -> None:
        with self._lock:
            self._histories.clear()
            self._directory_of.clear()
