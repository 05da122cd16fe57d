"""The raw limit again, inside the save and load loops: ``raw_io``.

The storage probe (limits.py) runs once, before the scenarios. On shared or virtual disks the
storage's speed drifts during a run: on a 2-core VM every system's saves slowed from
repeat to repeat while the host wrote back (safetensors 0.98 -> 0.42 GiB/s in one run), so a
fraction of a limit probed minutes earlier mixes the system's speed with the drift. ``raw_io``
runs the probe's best configuration (I/O mode, block, threads, files) on the state's bytes as one
more entry of the interleaved loops, after the systems of each repeat: a write + fsync in the
save loop, a cold read in the load loop (the same cold method as the loads). Its median is the
limit measured at the same time as the systems', reported beside the probe's limit.
"""

from __future__ import annotations

import os
import shutil

from .limits import StorageLimit, WriteSource, _python_read, _python_write, _run_size, probe_paths

__all__ = ["RAW_IO", "RawIo"]

RAW_IO = "raw_io"


class RawIo:
    """The best write and cold-read configurations of one storage's probe, on ``nbytes``."""

    def __init__(self, limit: StorageLimit, nbytes: int, cold_method: str | None, source: WriteSource) -> None:
        """`source`: the state-sized buffer written from, one for every storage of the run (each
        its own held three 4 GiB buffers at once in a 4 GiB run and the kernel killed it)."""
        self.limit = limit
        self.nbytes = nbytes
        self.cold_method = cold_method
        self._source = source

    def _describe(self, op: str) -> str:
        run = self.limit.write_best if op == "write" else self.limit.read_best
        return run.describe().replace("fio", "python") if run else "-"

    @property
    def description(self) -> dict[str, str]:
        return {"write": self._describe("write"), "read": self._describe("read")}

    def write(self, directory: str) -> float:
        """Seconds to write (and fsync) the state's bytes into ``directory`` (made new, removed
        after) the way the probe's best write run did."""
        run = self.limit.write_best
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        try:
            size = _run_size(self.nbytes, run.block, run.threads)
            paths = probe_paths(os.path.join(directory, "raw.bin"), run.files)
            gibps, _ = _python_write(paths, size, run.block, run.threads, run.direct, self._source)
            return size / gibps / (1 << 30) * (self.nbytes / size)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def prepare_read(self, directory: str) -> None:
        """Write (untimed) the files the best read run reads, into ``directory``."""
        run = self.limit.read_best
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        size = _run_size(self.nbytes, run.block, run.threads)
        _python_write(probe_paths(os.path.join(directory, "raw.bin"), run.files), size, run.block, run.threads,
                      False, self._source)

    def read(self, directory: str) -> float:
        """Seconds for a cold read of what :meth:`prepare_read` wrote, the way the best read run
        read (scaled to ``nbytes`` where whole blocks per thread made it slightly less)."""
        run = self.limit.read_best
        size = _run_size(self.nbytes, run.block, run.threads)
        paths = probe_paths(os.path.join(directory, "raw.bin"), run.files)
        gibps, _ = _python_read(paths, size, run.block, run.threads, run.direct, self.cold_method)
        return size / gibps / (1 << 30) * (self.nbytes / size)
