"""Where a save's data files go: the writer plans them (file images, names), a :class:`FileSink`
names, stores and claims them.

:class:`FastFileSystemWriter <fastdcp.save.writer.FastFileSystemWriter>` holds one sink
(``writer.sink``): :class:`LocalFileSink` writes the images into the checkpoint directory with
the native engine (GPU bytes through the pinned ring). A storage that keeps the writer's planning
and commit but stores files elsewhere (object stores, a tier) supplies its own sink instead of
overriding the writer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Protocol

from .._native import _C
from ..io.copy_engine import DeviceCopier
from ..io.engine import DIRECT_ALIGN, IoOptions, get_engine
from ..io.phases import span
from ..io.pinned_pool import lease_pinned
from ..io.staging_pipeline import StagingPipeline
from ..io.write_mode import record_write, write_mode_for
from .commit import claim_token
from .crash_points import crash_point
from .device_ring import cut_ranges, write_device_images
from .file_image import FilePlan
from .options import RING_SLOTS

__all__ = ["FileSink", "LocalFileSink", "ring_shape", "make_copier"]

_MIN_SLOT_BYTES = 4 << 20  # a ring batches fewer files rather than use smaller slots
# Engine calls of the ring in flight at once: the engine's threads go on to the next batch's tasks
# while the last tasks of a batch finish, so the storage queue does not drain at batch boundaries.
_WRITES_IN_FLIGHT = 2

def make_copier() -> Any:
    """The device-to-host copier of the ring pipeline (tests replace it with a CPU one)."""
    return DeviceCopier()


def ring_shape(budget: int, files: int, threads: int) -> tuple[int, int, int, int]:
    """``(slot_bytes, slots, batch, writes_in_flight)`` of the ring for a save of ``files`` files
    with device bytes written by ``threads`` engine threads within ``budget`` bytes: batches of up
    to ``threads`` files (fewer when slots would fall under 4 MiB), :data:`_WRITES_IN_FLIGHT`
    batches being written while the next one is copied, at least :data:`RING_SLOTS` slots."""
    sets = _WRITES_IN_FLIGHT + 1
    batch = max(1, min(files, threads, budget // (sets * _MIN_SLOT_BYTES)))
    slots = max(RING_SLOTS, sets * batch)
    slot_bytes = max(DIRECT_ALIGN, budget // slots // DIRECT_ALIGN * DIRECT_ALIGN)
    return slot_bytes, slots, batch, _WRITES_IN_FLIGHT




class FileSink(Protocol):
    """What a writer's storage does with a save's data files."""

    def claim_token(self) -> str:
        """A save-unique token for the checkpoint's file names (and whatever marks it in use)."""

    def storage_prefix(self, rank: int, token: str) -> str:
        """What the names of rank ``rank``'s data files in the save with ``token`` start with."""

    def data_file_path(self, storage_key: str) -> str:
        """Where data file ``storage_key`` is stored (``FilePlan.path``)."""

    def write_threads(self) -> int:
        """Writers for this save's files (with the automatic split, one file each)."""

    def write_files(self, files: list[FilePlan], options: IoOptions) -> Future | None:
        """Store every file image, each complete and durable on return. Returns a future when the
        sink still reads the images' memory after returning (the writer then keeps the staged
        state until it is done), else None."""

    def files_written_here(self, new_files: set[str]) -> set[str]:
        """Which of a committed save's data files the commit checks for in this storage."""


class LocalFileSink:
    """The checkpoint directory: O_DIRECT or buffered writes by the native engine (the mode
    learnt per filesystem, :mod:`fastdcp.io.write_mode`), an fsync per file with ``sync_files``.

    Args:
        writer: the writer whose ``path``, ``io_options``, ``sync_files`` and
            ``pinned_ring_limit_bytes`` it uses; it sets ``writer.last_write_mode``.
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def claim_token(self) -> str:
        """A save-unique token for this directory, with its in-flight marker."""
        token = claim_token(str(self.writer.path))
        self.writer._claimed_tokens.add(token)
        return token

    def storage_prefix(self, rank: int, token: str) -> str:
        return f"__{rank}_{token}_"

    def data_file_path(self, storage_key: str) -> str:
        return str(self.writer.fs.concat_path(self.writer.path, storage_key))

    def write_threads(self) -> int:
        return self.writer.io_options.write_threads_for(str(self.writer.path))

    def files_written_here(self, new_files: set[str]) -> set[str]:
        """All of them: every rank writes the one checkpoint directory."""
        return set(new_files)

    def write_files(self, files: list[FilePlan], options: IoOptions) -> None:
        writer = self.writer
        engine = get_engine(options)
        handles: list[_C.File] = []
        total_bytes = sum(f.size for f in files)
        mode = writer.last_write_mode = write_mode_for(str(writer.path), options, total_bytes)
        direct = mode.direct
        try:
            t_open = time.perf_counter()
            jobs = []
            with span("open"):
                for f in files:
                    handle = _C.File(f.path, "w", direct)
                    handles.append(handle)
                    if handle.direct:
                        # Allocate up to the padded end so no O_DIRECT write extends the file (ext4
                        # serialises extending direct writes). Buffered writes need no help, and on
                        # tmpfs preallocation would zero every page before it is written.
                        handle.allocate(-(-f.size // DIRECT_ALIGN) * DIRECT_ALIGN)
                    if not f.device_segments:
                        jobs.append((handle, 0, f.size, f.segments))
            crash_point("open")
            with span("write"):
                engine.write(jobs)
            device_files = [i for i, f in enumerate(files) if f.device_segments]
            if device_files:
                self._write_through_ring(engine, handles, [(i, files[i]) for i in device_files])
            with span("write"):
                for f, handle in zip(files, handles):
                    handle.truncate(f.size)  # drop the O_DIRECT padding of the last block
            crash_point("write")
            with span("fsync"):
                if writer.sync_files:
                    engine.sync(handles, False)
                    # Without fsync a buffered write times only the page-cache copy: not comparable.
                    record_write(str(writer.path), mode, total_bytes, time.perf_counter() - t_open,
                                 all(h.direct for h in handles))
                for handle in handles:
                    handle.close()
            crash_point("sync")
        finally:
            for handle in handles:
                if not handle.closed:
                    try:
                        handle.close()
                    except OSError:
                        pass  # the original error is the one to report
        return None

    def _write_through_ring(self, engine: Any, handles: list[Any], files: list[tuple[int, FilePlan]]) -> None:
        """Files holding device tensor bytes: device-to-host copies into a pinned ring leased for
        this save, overlapped with the writes of the slots before, several files per engine call
        (:mod:`fastdcp.save.device_ring`)."""
        slot_bytes, slots, batch, in_flight = ring_shape(self.writer.pinned_ring_limit_bytes, len(files),
                                                         self.write_threads())
        ranges = [job for index, f in files for job in cut_ranges(index, f.size, f.segments, f.device_segments,
                                                                    slot_bytes)]
        with span("pin"):
            lease = lease_pinned(slot_bytes * slots)
        with StagingPipeline.from_lease(lease, slot_bytes, slots) as ring:
            write_device_images(engine, handles, ranges, ring, make_copier(), batch=batch, writes_in_flight=in_flight)
