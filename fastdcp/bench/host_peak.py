"""Peak resident memory of this process over a region of a scenario (``HostPeak``): ``VmHWM``
after a reset through ``/proc/self/clear_refs``, or, where the reset is refused, the largest
``VmRSS`` sampled every 10 ms."""

from __future__ import annotations

import ctypes
import gc
import threading

__all__ = ["HostPeak"]



def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _trim_heap(collect: bool = True) -> None:
    """Return freed heap to the kernel so that every loop starts from a comparable RSS (after a full
    garbage collection unless ``collect`` is False: seconds on a large heap)."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HostPeak:
    """Peak resident memory over a region: VmHWM after a reset through /proc/self/clear_refs;
    where the reset is refused, a sampling thread (every 10 ms) tracks the maximum VmRSS."""

    def __init__(self) -> None:
        self.start_bytes = 0
        self.method = "VmHWM"
        self._max = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self, collect: bool = True) -> None:
        _trim_heap(collect)
        self.start_bytes = (_status_kib("VmRSS") or 0) * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "VmRSS sampled every 10 ms"
            self._max = self.start_bytes
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        assert self._stop is not None
        while not self._stop.wait(0.01):
            self._max = max(self._max, (_status_kib("VmRSS") or 0) * 1024)

    def stop(self) -> int:
        if self._thread is not None:
            assert self._stop is not None
            self._stop.set()
            self._thread.join()
            self._thread = None
            return max(self._max, (_status_kib("VmRSS") or 0) * 1024)
        return (_status_kib("VmHWM") or 0) * 1024
