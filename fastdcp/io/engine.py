"""I/O options and the per-process native engine.

The native engine owns threads and aligned buffers, so it is created lazily, once per process and
option set, and never pickled: writers and readers carry only :class:`IoOptions` (``dcp.async_save``
in process mode pickles the writer into another process).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass

from .._native import _C
from ..compat.renamed import environ_get

__all__ = ["IoOptions", "get_engine", "env_flag", "env_bytes", "default_copy_threads", "DIRECT_ALIGN"]

DIRECT_ALIGN: int = int(_C.build_info()["direct_align"])

_DEFAULT_WRITE_TASK_BYTES = 8 << 20
# Reads gain from larger requests: cold sequential reads measured ~12% faster at 32 MiB than at
# 8 MiB on a virtio disk (more readahead per request), warm reads are unaffected.
_DEFAULT_READ_TASK_BYTES = 32 << 20
_DEFAULT_READ_BUFFER_LIMIT = 512 << 20
# O_DIRECT reads get no kernel readahead: the requests in flight are the device's whole queue.
# Measured cold on a 2-core VM's virtio disk (ext4, 1 GiB, 32 MiB requests, 4 interleaved
# loads each): 4 threads 1.43 GiB/s, 8 threads 1.67, 16 threads 1.60; buffered 1.35 at any count.
_DIRECT_READ_MIN_THREADS = 8


def env_flag(name: str) -> bool | None:
    name, value = environ_get(name)
    if value is None or value.strip() == "":
        return None
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 0/1, true/false, yes/no or on/off")


def env_int(name: str) -> int | None:
    name, value = environ_get(name)
    if value is None or value.strip() == "":
        return None
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None
    if parsed <= 0:
        raise ValueError(f"{name}={value!r}: must be positive")
    return parsed


def env_bytes(name: str) -> int | None:
    """A byte count from the environment: None when unset or empty, else an int >= 0 (0 is a
    meaningful limit for some settings); anything else is a ValueError naming the variable."""
    name, raw = environ_get(name)
    text = (raw or "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a number of bytes (an int >= 0)")
    return value


def default_io_threads() -> int:
    """Enough requests in flight to keep a device queue busy (workers mostly wait on I/O, so even a
    2-core host wants 4), without oversubscribing large hosts."""
    return max(4, min(8, os.cpu_count() or 4))


def default_copy_threads() -> int:
    """Threads for host copies that run behind training (overlapped staging): half the cores, at
    most 4. Memory copies saturate bandwidth with few threads, and every thread more takes a core
    from the training loop the copy overlaps with (on 2 cores, 4 copy threads starved the
    ``async_save`` call itself)."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class IoOptions:
    """How a writer or reader drives the engine.

    ``direct_io``: open files with O_DIRECT (per-file fallback to buffered I/O where the
    filesystem refuses it). Environment ``FASTDCP_DIRECT_IO`` overrides the constructor default.
    ``io_threads`` / ``task_bytes``: engine workers and the unit large requests are split into
    (``FASTDCP_IO_THREADS`` / ``FASTDCP_TASK_BYTES``). ``read_buffer_limit_bytes``: the most memory a
    reader's read buffers hold at once (``FASTDCP_READ_BUFFER_LIMIT_BYTES``).
    """

    direct_io: bool
    io_threads: int
    task_bytes: int
    read_buffer_limit_bytes: int
    # Whether io_threads was asked for (constructor or FASTDCP_IO_THREADS), not the default.
    io_threads_chosen: bool = False
    # Whether direct_io was asked for (constructor or FASTDCP_DIRECT_IO). A writer left at the
    # default measures the filesystem instead (fastdcp.io.write_mode).
    direct_io_chosen: bool = False

    @staticmethod
    def resolve(
        *,
        direct_io: bool | None,
        default_direct_io: bool,
        io_threads: int | None,
        task_bytes: int | None,
        read_buffer_limit_bytes: int | None = None,
        for_reading: bool = False,
    ) -> "IoOptions":
        """Constructor arguments first, then the environment, then defaults; validates each."""
        env_direct = env_flag("FASTDCP_DIRECT_IO")
        direct_chosen = direct_io is not None or env_direct is not None
        if direct_io is None:
            direct_io = default_direct_io if env_direct is None else env_direct
        def first_given(*values: int | None) -> int | None:
            return next((v for v in values if v is not None), None)

        threads = first_given(io_threads, env_int("FASTDCP_IO_THREADS"), default_io_threads())
        default_task = _DEFAULT_READ_TASK_BYTES if for_reading else _DEFAULT_WRITE_TASK_BYTES
        task = first_given(task_bytes, env_int("FASTDCP_TASK_BYTES"), default_task)
        budget = first_given(read_buffer_limit_bytes, env_int("FASTDCP_READ_BUFFER_LIMIT_BYTES"), _DEFAULT_READ_BUFFER_LIMIT)
        for name, value in (("io_threads", threads), ("task_bytes", task), ("read_buffer_limit_bytes", budget)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if threads > 256:
            raise ValueError(f"io_threads={threads} is unreasonably large (at most 256)")
        chosen = io_threads is not None or env_int("FASTDCP_IO_THREADS") is not None
        return IoOptions(bool(direct_io), threads, task, budget, chosen, direct_chosen)

    def direct_for(self, directory: str) -> bool:
        """Whether to ask for O_DIRECT under ``directory``: never on memory-backed filesystems,
        where it only adds a bounce copy (tmpfs accepts O_DIRECT since Linux 6.6)."""
        return self.direct_io and not _C.on_memory_filesystem(directory)

    def write_threads_for(self, directory: str) -> int:
        """Engine threads (and so, with the automatic file split, files) for writing under
        ``directory``: ``io_threads``, except with the default thread count on a memory-backed
        filesystem, where it is at most this rank's share of the CPUs it may run on
        (:func:`cpu_share`). There a write is a page allocation and a memory copy, CPU work that
        threads beyond the CPUs only time-slice."""
        if self.io_threads_chosen or not _C.on_memory_filesystem(directory):
            return self.io_threads
        return max(1, min(self.io_threads, cpu_share()))

    def read_with(self, direct: bool) -> "IoOptions":
        """These options for one load's reads in the chosen mode: O_DIRECT reads with the default
        thread count keep at least :data:`_DIRECT_READ_MIN_THREADS` requests in flight (without
        readahead, the requests in flight are the device's queue depth; the workers only wait on
        I/O, so a small host needs no more cores for them). Buffered reads, and an explicit
        ``io_threads``, keep ``io_threads``."""
        if not direct or self.io_threads_chosen or self.io_threads >= _DIRECT_READ_MIN_THREADS:
            return self
        return dataclasses.replace(self, io_threads=_DIRECT_READ_MIN_THREADS)


def local_world_size() -> int:
    """The ranks of this node (torchrun's ``LOCAL_WORLD_SIZE``); 1 without it or when unreadable."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def cpu_share() -> int:
    """The CPUs this process may run on (its affinity), divided among the ranks of this node
    (:func:`local_world_size`); at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_world_size())


_engines: dict[tuple[int, int, int], "_C.Engine"] = {}
_engines_lock = threading.Lock()


def get_engine(options: IoOptions) -> "_C.Engine":
    """The engine for these options in this process (threads do not survive fork, hence the pid)."""
    key = (os.getpid(), options.io_threads, options.task_bytes)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _C.Engine(options.io_threads, options.task_bytes)
            _engines[key] = engine
        return engine
