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

:attr:`HostSlab.kind` is read from the memory, so it follows such a move. Pre-faulting was
measured and is not done: ``MADV_POPULATE_WRITE`` before the copy (one thread or two) made the
first staging copy slower for both kinds (private 0.46 s with two threads vs 0.26 s faulting
during the copy), and ``MADV_HUGEPAGE`` on private slabs stalled in memory compaction (1.2 to
2.8 s per GiB) where the system defragments on demand.

Both are page-aligned, so tensors placed at 4096-multiples inside them are written with O_DIRECT
straight from the slab. With CUDA the slab is page-locked with ``cudaHostRegister``; never across
``fork`` (a child gets a fresh, unpinned slab of its own).
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["HostSlab", "allocate_slab", "slab_bytes", "PAGE"]

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


def _pin(ptr: int, nbytes: int) -> bool:
    """Page-lock [ptr, ptr+nbytes) for CUDA; False (and the memory stays pageable) when it fails."""
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
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.unpin_memory(ptr)
    except ImportError:
        torch.cuda.cudart().cudaHostUnregister(ptr)


@dataclass
class HostSlab:
    """``nbytes`` of page-aligned host memory as a flat uint8 tensor.

    ``pinned`` says whether CUDA page-locked it. The memory lives as long as ``tensor`` (and every
    view of it) does."""

    tensor: torch.Tensor
    pinned: bool
    pid: int = field(default_factory=os.getpid)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)  # dtype -> whole-slab view

    @property
    def kind(self) -> str:
        """``"shared"`` or ``"private"``, as the memory is now (see the module docstring)."""
        return "shared" if self.tensor.is_shared() else "private"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A contiguous tensor of ``dtype``/``shape`` over ``[offset, offset+nbytes)``.
        Precondition: ``offset`` is a multiple of the dtype's element size."""
        flat = self._flat.get(dtype)
        if flat is None:
            flat = self._flat[dtype] = self.tensor.view(dtype)  # slabs are whole pages
        item = flat.element_size()
        if offset % item or nbytes != item * math.prod(shape):
            raise ValueError(f"slab view at {offset} of {nbytes} bytes does not fit {dtype} {tuple(shape)}")
        # One as_strided per tensor (a staged state has hundreds): ~4x cheaper than slice+view+view.
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        return flat.as_strided(shape, tuple(reversed(strides)), offset // item)


def slab_bytes(nbytes: int) -> int:
    """The size of the slab :func:`allocate_slab` returns for ``nbytes``: whole pages, at least one."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def allocate_slab(nbytes: int, *, prefer_shared: bool | None = None, pin: bool | None = None) -> HostSlab:
    """A new page-aligned slab of :func:`slab_bytes` (``nbytes``).

    ``pin``: page-lock for CUDA; default: when CUDA is available in this process.
    ``prefer_shared``: use shared memory when ``/dev/shm`` has room; default: when pinned (see the
    module docstring)."""
    size = slab_bytes(nbytes)
    if pin is None:
        pin = torch.cuda.is_available()
    if prefer_shared is None:
        prefer_shared = bool(pin)
    if prefer_shared and _shm_has_room(size):
        storage = torch.UntypedStorage._new_shared(size)
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        kind = "shared"
    else:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        kind = "private"
    if tensor.data_ptr() % PAGE:
        raise AssertionError(f"fastdcp: a {kind} staging slab is not page-aligned")
    pinned = bool(pin) and _pin(tensor.data_ptr(), size)
    slab = HostSlab(tensor=tensor, pinned=pinned)
    if pinned:
        # Unregistered when the slab is dropped, in the process that registered it. Views still
        # alive then (a write in flight) keep the memory mapped, merely pageable again.
        owner, ptr = os.getpid(), tensor.data_ptr()
        weakref.finalize(slab, lambda: _unpin(ptr) if os.getpid() == owner else None)
    return slab
