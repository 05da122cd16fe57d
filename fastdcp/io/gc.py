"""Pausing Python's cyclic garbage collector around bulk object construction."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while thousands of small acyclic objects are created.

    Every 700 allocations CPython runs a collection, and every so often a full one that walks the
    whole heap (every module, every tensor object of a training process): building or unpickling a
    5,000-item plan triggers several. Nothing built under it is cyclic, so nothing is lost by
    waiting; collection resumes (if it was enabled) when the block ends."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
