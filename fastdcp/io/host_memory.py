"""Page-aligned host memory for staging: anonymous or shared, pinned when CUDA is present (so
device-to-host copies run asynchronously at full speed).

One allocation is a :class:`HostSlab`, of one of two kinds:

* ``private``: anonymous memory (``mmap``), the default for a slab that is not pinned. Its pages
  fault in at the cost of the memory stock staging allocates (``torch.empty``), about half the cost
  of shared-memory pages (both 4 KiB here: shmem gets no transparent huge pages unless the system
  enables them): a first 1 GiB staging copy took 0.26 s into private memory, 0.56 s into shared
  memory, measured alternately in fresh processes. A process-mode ``async_save`` pickles the staged
  tensors through ``torch.multiprocessing``, which moves a private slab into shared memory once,
  in the background (the storage is replaced in place, so the slab stays shared and later saves
  send it without a copy; stock staging pays that move on every process-mode save).
* ``shared``: an unlinked POSIX shared-memory file (torch's own shared storage, the one
  ``torch.multiprocessing`` pickles as a file descriptor), used when asked for and for pinned
  slabs by default (moving a page-locked slab would drop the page-locking), and only when
  ``/dev/shm`` has room for it with a margin: a full ``/dev/shm`` turns page faults into SIGBUS,
  not into an error.

A private slab can be cut into **segments**, each its own torch storage over its part of the
mapping (:func:`allocate_slab`'s ``segment_starts``). torch moves a storage into shared memory
(``_share_fd_cpu_``) in DCP's executor thread, which starts right as ``async_save`` returns, and
holds the GIL while it reserves the new pages (0.27 s of a 0.52 s move of 1 GiB on the development
VM; the copy runs without it): with one storage the caller's thread waited for the whole slab's
reservation before it ran another line of Python (a first process-mode save blocked 0.45 s instead
of 0.2 s). Moved segment by segment, as stock's per-tensor storages are, the caller waits for one
segment's at most (about 20 ms for a 76 MiB tensor).

:attr:`HostSlab.kind` is read from the memory, so it follows such a move. A slab is not
pre-faulted here: populating the whole slab before the copy made the first staging copy slower
for both kinds (private 0.46 s with two threads vs 0.26 s faulting during the copy), and
``MADV_HUGEPAGE`` on private slabs stalled in memory compaction (1.2 to 2.8 s per GiB) where the
system defragments on demand. Instead the staging copy has the kernel populate each piece just
before it copies into it (``box_copy(prefault=True)``, see ``csrc/prefault.hpp``).

Both are page-aligned, so tensors placed at 4096-multiples inside them are written with O_DIRECT
straight from the slab. With CUDA the slab is page-locked with ``cudaHostRegister``; never across
``fork`` (a child gets a fresh, unpinned slab of its own).

**Fake-pinned mode** (``FASTDCP_TEST_FAKE_PINNED=1``, for test suites on machines without a GPU):
slabs are "pinned" as under CUDA, without CUDA: :func:`allocate_slab` pins by default, the slab is
shared memory and uncut as a pinned one is, and ``Tensor.is_pinned()`` answers true for every CPU
tensor inside such a slab, so that staging, the device ring and the code after them (DCP's own
checks of pinned tensors included) take the branches they take on a GPU machine. Nothing else
changes: no memory is page-locked, and the mode only reports memory as pinned.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["HostSlab", "allocate_slab", "slab_bytes", "fake_pinned", "PAGE"]

PAGE = mmap.PAGESIZE
_SHM_DIR = "/dev/shm"
# Leave this fraction of /dev/shm free: other processes (dataloaders, NCCL) need it too.
_SHM_HEADROOM = 0.25


def _shm_has_room(nbytes: int) -> bool:
    try:
        stats = os.statvfs(_SHM_DIR)
    except OSError:
        return False
    available = stats.f_bavail * stats.f_frsize
    return nbytes <= available - _SHM_HEADROOM * stats.f_blocks * stats.f_frsize


FAKE_PINNED_ENV = "FASTDCP_TEST_FAKE_PINNED"
_fake_lock = threading.Lock()
_fake_ranges: dict[int, int] = {}  # start -> end of the slabs "pinned" in fake-pinned mode
_real_is_pinned = torch.Tensor.is_pinned


def fake_pinned() -> bool:
    """Whether fake-pinned mode is on (see the module docstring): ``FASTDCP_TEST_FAKE_PINNED`` set
    to anything but empty or ``0``."""
    return os.environ.get(FAKE_PINNED_ENV, "") not in ("", "0")


def _reported_pinned(self: torch.Tensor, *args, **kwargs) -> bool:
    """``Tensor.is_pinned`` in fake-pinned mode: true for a CPU tensor whose bytes start inside a
    fake-pinned slab (as CUDA answers for any address in a registered range), else torch's answer."""
    if _fake_ranges and self.device.type == "cpu":
        try:
            ptr = self.data_ptr()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass: torch's answer
            ptr = None
        if ptr is not None and any(start <= ptr < end for start, end in list(_fake_ranges.items())):
            return True
    return _real_is_pinned(self, *args, **kwargs)


def _fake_pin(ptr: int, nbytes: int) -> bool:
    """Register ``[ptr, ptr+nbytes)`` as pinned in fake-pinned mode; installs the reporting
    ``Tensor.is_pinned`` on first use."""
    with _fake_lock:
        _fake_ranges[ptr] = ptr + nbytes
        if torch.Tensor.is_pinned is not _reported_pinned:
            torch.Tensor.is_pinned = _reported_pinned  # type: ignore[method-assign]
    return True


def _forget_fake_pins_after_fork() -> None:
    """A forked child inherits no page-locking: its copies of fake-pinned slabs are not pinned."""
    global _fake_lock
    _fake_lock = threading.Lock()
    _fake_ranges.clear()


os.register_at_fork(after_in_child=_forget_fake_pins_after_fork)


def _pin(ptr: int, nbytes: int) -> bool:
    """Page-lock [ptr, ptr+nbytes) for CUDA; False (and the memory stays pageable) when it fails.
    In fake-pinned mode the range is only registered as pinned (no CUDA call)."""
    if fake_pinned():
        return _fake_pin(ptr, nbytes)
    try:
        from torch.cuda import _pin_memory_utils  # torch >= 2.5

        _pin_memory_utils.pin_memory(ptr, nbytes)
        return True
    except ImportError:
        pass
    except RuntimeError:
        return False
    cudart = torch.cuda.cudart()
    return int(cudart.cudaHostRegister(ptr, nbytes, 0)) == 0


def _unpin(ptr: int) -> None:
    if _fake_ranges.pop(ptr, None) is not None:
        return
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.unpin_memory(ptr)
    except ImportError:
        torch.cuda.cudart().cudaHostUnregister(ptr)


@dataclass
class HostSlab:
    """``nbytes`` of page-aligned host memory, as flat uint8 tensors: one per segment, each with its
    own storage, ``segment_starts[i]`` the offset in the slab where segment ``i`` begins (the first
    at 0). Until a segment is moved into shared memory the segments are adjacent, so ``ptr`` and
    ``nbytes`` describe the whole slab.

    ``pinned`` says whether CUDA page-locked it. The memory lives as long as the segments (and
    every view of them) do."""

    segments: tuple[torch.Tensor, ...]
    segment_starts: tuple[int, ...]
    pinned: bool
    pid: int = field(default_factory=os.getpid)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)  # (segment, dtype) -> view

    @property
    def kind(self) -> str:
        """``"shared"`` or ``"private"``, as the memory is now (see the module docstring): shared
        once every segment is."""
        return "shared" if all(segment.is_shared() for segment in self.segments) else "private"

    @property
    def tensor(self) -> torch.Tensor:
        """The whole slab as one tensor. Precondition: one segment (a segmented slab has none)."""
        if len(self.segments) != 1:
            raise ValueError(f"a slab of {len(self.segments)} segments has no single tensor")
        return self.segments[0]

    @property
    def nbytes(self) -> int:
        return sum(segment.numel() for segment in self.segments)

    @property
    def ptr(self) -> int:
        """The address of the slab's first byte (its first segment's)."""
        return self.segments[0].data_ptr()

    def holds_storage_of(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of one of this slab's segments."""
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return False
        return any(segment.untyped_storage().data_ptr() == ptr for segment in self.segments)

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A contiguous tensor of ``dtype``/``shape`` over ``[offset, offset+nbytes)``.
        Preconditions: ``offset`` is a multiple of the dtype's element size, and the range lies
        inside one segment."""
        index = bisect.bisect_right(self.segment_starts, offset) - 1
        start = self.segment_starts[index]
        flat = self._flat.get((index, dtype))
        if flat is None:  # segments are whole pages
            flat = self._flat[(index, dtype)] = self.segments[index].view(dtype)
        item = flat.element_size()
        if offset % item or nbytes != item * math.prod(shape) or offset + nbytes > start + flat.numel() * item:
            raise ValueError(f"slab view at {offset} of {nbytes} bytes does not fit {dtype} {tuple(shape)} "
                             f"inside segment {index} at {start}")
        # One as_strided per tensor (a staged state has hundreds): ~4x cheaper than slice+view+view.
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        return flat.as_strided(shape, tuple(reversed(strides)), (offset - start) // item)


def slab_bytes(nbytes: int) -> int:
    """The size of the slab :func:`allocate_slab` returns for ``nbytes``: whole pages, at least one."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def allocate_slab(nbytes: int, *, prefer_shared: bool | None = None, pin: bool | None = None,
                  segment_starts: Sequence[int] = ()) -> HostSlab:
    """A new page-aligned slab of :func:`slab_bytes` (``nbytes``).

    ``pin``: page-lock for CUDA; default: when CUDA is available in this process (or in
    fake-pinned mode, see the module docstring).
    ``prefer_shared``: use shared memory when ``/dev/shm`` has room; default: when pinned (see the
    module docstring).
    ``segment_starts``: offsets, page multiples inside the slab, where a new segment begins (see the
    module docstring). Only a private, unpinned slab is cut: shared memory is never moved, and
    moving a pinned slab would drop its page-locking anyway."""
    size = slab_bytes(nbytes)
    if pin is None:
        pin = torch.cuda.is_available() or fake_pinned()
    if prefer_shared is None:
        prefer_shared = bool(pin)
    cuts = sorted(set(segment_starts) - {0})
    if any(cut % PAGE or not 0 < cut < size for cut in cuts):
        raise ValueError(f"segment starts must be page multiples inside a slab of {size} bytes, got {cuts}")
    if prefer_shared and _shm_has_room(size):
        storage = torch.UntypedStorage._new_shared(size)
        segments = (torch.empty(0, dtype=torch.uint8).set_(storage),)
        starts, kind = (0,), "shared"
    else:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        starts = (0, *cuts) if not pin else (0,)
        ends = (*starts[1:], size)
        # Each segment is a storage of its own over the mapping (which lives while any does).
        segments = tuple(torch.frombuffer(mapping, dtype=torch.uint8, count=end - start, offset=start)
                         for start, end in zip(starts, ends))
        kind = "private"
    ptr = segments[0].data_ptr()
    if ptr % PAGE:
        raise AssertionError(f"fastdcp: a {kind} staging slab is not page-aligned")
    pinned = bool(pin) and _pin(ptr, size)
    slab = HostSlab(segments=segments, segment_starts=starts, pinned=pinned)
    if pinned:
        # Unregistered when the slab is dropped, in the process that registered it. Views still
        # alive then (a write in flight) keep the memory mapped, merely pageable again.
        owner = os.getpid()
        weakref.finalize(slab, lambda: _unpin(ptr) if os.getpid() == owner else None)
    return slab
