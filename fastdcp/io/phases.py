"""Where a save or a load spends its time: named phases, measured where the work happens.

The storage layer wraps each stage of its work in :func:`span` (``"plan"``, ``"pin"``, ``"d2h_wait"``,
``"write"``, ``"fsync"``, ``"commit"``, ``"read"``, ``"h2d_wait"``, ...). A span costs two clock reads
and a thread-local lookup, and records nothing unless a :class:`PhaseRecorder` is active
(:func:`recording`), which the benchmark starts around each timed save or load.

Spans nest: a span's time is its own (exclusive) time, what its inner spans took is theirs, so
the phases of one thread add up to the time spent inside its outermost spans. The recorder keeps the
spans of the thread that started it (the caller of ``dcp.save``) apart from those of other threads
(a background ``async_save``'s writes): :meth:`~PhaseRecorder.phases` gives the caller's phases plus
``"outside"``, the caller's time inside no span (DCP's own planning, collectives and metadata, and
planners other than fastdcp's), so they add up to the wall time; the other threads' phases come
under ``"background"``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["span", "timed", "recording", "PhaseRecorder", "active_recorder"]

_active: "PhaseRecorder | None" = None
_local = threading.local()


class PhaseRecorder:
    """Seconds per phase from every thread while active (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}  # the calling thread's
        self.background: dict[str, float] = {}  # every other thread's
        self._thread = threading.get_ident()
        self.caller_inside = 0.0  # the calling thread's time inside outermost spans
        self.started = time.perf_counter()
        self.wall: float | None = None

    def _add(self, name: str, seconds: float, outermost: float) -> None:
        with self._lock:
            if threading.get_ident() == self._thread:
                self.seconds[name] = self.seconds.get(name, 0.0) + seconds
                self.caller_inside += outermost
            else:
                self.background[name] = self.background.get(name, 0.0) + seconds

    def phases(self, wall: float | None = None) -> dict[str, Any]:
        """The caller's seconds per phase, rounded to microseconds, with ``"outside"`` (``wall``
        minus the caller's time inside spans, at least 0), so that they add up to ``wall``; other
        threads' phases under ``"background"`` when there are any. ``wall``: default, the
        recorder's whole time."""
        wall = wall if wall is not None else (self.wall if self.wall is not None else time.perf_counter() - self.started)
        with self._lock:
            out: dict[str, Any] = {name: round(s, 6) for name, s in sorted(self.seconds.items())}
            out["outside"] = round(max(0.0, wall - self.caller_inside), 6)
            if self.background:
                out["background"] = {name: round(s, 6) for name, s in sorted(self.background.items())}
        return out


def active_recorder() -> PhaseRecorder | None:
    """The recorder spans report to now, or None."""
    return _active


@contextlib.contextmanager
def recording() -> Iterator[PhaseRecorder]:
    """Record every span of the process while the block runs (one recorder at a time: an inner
    ``recording`` replaces the outer one until it ends). The recorder's ``wall`` is the block's."""
    global _active
    recorder, previous = PhaseRecorder(), _active
    _active = recorder
    try:
        yield recorder
    finally:
        recorder.wall = time.perf_counter() - recorder.started
        _active = previous


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Count the block's time, less its inner spans', as phase ``name`` of the active recorder
    (nothing when none is active)."""
    recorder = _active
    if recorder is None:
        yield
        return
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(0.0)  # time of inner spans
    t0 = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - t0
        inner = stack.pop()
        if stack:
            stack[-1] += elapsed
        recorder._add(name, max(0.0, elapsed - inner), 0.0 if stack else elapsed)


def timed(name: str):
    """Decorator: each call of the function is a :func:`span` ``name``."""

    def wrap(fn):
        import functools

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with span(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
