"""A progress line for long command-line operations: on stderr, only when stderr is a terminal
(so pipes, logs and tests see nothing), redrawn at most five times a second."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``{label}: {done}/{total} {items}, {GiB done}/{GiB total} GiB, {MiB/s}``; ``finish()`` ends
    the line. ``total_bytes`` 0: bytes are not shown."""

    def __init__(self, label: str, total_bytes: int, total_items: int, items: str = "items") -> None:
        self.enabled = sys.stderr.isatty()
        self.label, self.items = label, items
        self.total_bytes, self.total_items = total_bytes, total_items
        self.done_bytes = self.done_items = 0
        self.started = self._drawn = time.monotonic()

    def advance(self, nbytes: int, items: int = 0) -> None:
        self.done_bytes += nbytes
        self.done_items += items
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.2 or self.done_items == self.total_items):
            self._drawn = now
            line = f"\r{self.label}: {self.done_items}/{self.total_items} {self.items}"
            if self.total_bytes:
                rate = self.done_bytes / max(now - self.started, 1e-9) / (1 << 20)
                line += (f", {self.done_bytes / (1 << 30):.2f}/{self.total_bytes / (1 << 30):.2f} GiB, "
                         f"{rate:.0f} MiB/s")
            sys.stderr.write(line + " ")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
