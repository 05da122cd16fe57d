"""Staging a state dict for ``dcp.async_save``: copied into a pooled host slab, then handed on.

``stage(state_dict)`` returns a state dict of the same structure whose tensors are views into one
:class:`~fastdcp.io.host_memory.HostSlab` (anonymous memory, which a process-mode save moves into
shared memory once; shared and pinned from the start under CUDA), and returns only when every byte
is there: training may change its tensors the moment it returns, and the checkpoint holds the
values of the moment ``stage`` was called (no tensor of the result aliases a live one).

* **Layout.** Tensors are placed in traversal order; every tensor of at least a page starts on a
  page boundary, so the writer sends it to disk with O_DIRECT straight from the slab.
* **Reuse.** Slabs come from the process-wide pool (:mod:`fastdcp.save.staging_pool`), keyed by the
  tensors' dtypes and shapes: the next save of the same state reuses a slab that is already faulted
  in (and, under CUDA, already page-locked), whether it goes through the same writer or a new one.
* **No tearing.** A slab is refilled only after the save that used it stopped reading it: the
  writer's ``write_data`` calls :meth:`StateDictStager.release` with its planner's state dict, which
  releases exactly the lease of the stage that produced it, and independently the pool watches the
  views it handed out (weak references): in process mode the views go away when the background
  process has answered. Stages while a save is in flight get another slab (within the pool's
  memory cap; over it they wait, see :mod:`fastdcp.save.staging_pool`).
* **Devices.** CUDA tensors are copied device-to-host with ``non_blocking`` copies on a side stream
  (ordered after the work already queued on the tensor's current stream), then the side stream is
  synchronised once. CPU tensors are copied with ``Tensor.copy_``.

Non-tensor values are deep-copied (stock ``BlockingAsyncStager`` does the same). DTensor and
ShardedTensor keep their sharding metadata and get staged local tensors.
"""

from __future__ import annotations

import copy
import io
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..format.blob import is_plain_dense
from ..io.host_memory import PAGE, HostSlab
from .device_ring import CudaCopier
from .staging_pool import StagingLease, staging_pool

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - very old torch
    DTensor = None  # type: ignore[assignment,misc]
try:
    from torch.distributed._shard.sharded_tensor import Shard as _Shard
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover
    ShardedTensor = None  # type: ignore[assignment,misc]

__all__ = ["StateDictStager", "StagingLayout"]

_SMALL_ALIGN = 64


@dataclass(frozen=True)
class StagingLayout:
    """Where each staged tensor lives in the slab: ``offsets[i]`` for the i-th tensor in traversal
    order; ``signature`` is what must match for a slab to be reused."""

    signature: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @staticmethod
    def for_tensors(tensors: list[torch.Tensor]) -> "StagingLayout":
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        offsets, end = [], 0
        for t in tensors:
            size = t.numel() * t.element_size()
            align = PAGE if size >= PAGE else _SMALL_ALIGN
            end = -(-end // align) * align
            offsets.append(end)
            end += size
        return StagingLayout(signature, tuple(offsets), end)


def _slab_tensors(obj: Any, path: str = "") -> Iterator[tuple[torch.Tensor, str]]:
    """Every tensor of ``obj`` that goes into the slab, in traversal order, with its path in the
    state dict (for error messages); lazily, so that a caller wanting the first one (the writer's
    release, through the planner's flattened state dict: the same tensor objects) walks no further."""
    if DTensor is not None and isinstance(obj, DTensor):
        yield from _slab_tensors(obj._local_tensor, path)
    elif ShardedTensor is not None and isinstance(obj, ShardedTensor):
        for i, shard in enumerate(obj.local_shards()):
            yield from _slab_tensors(shard.tensor, f"{path}[shard {i}]")
    elif isinstance(obj, torch.Tensor):
        if is_plain_dense(obj):
            yield obj, path
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _slab_tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _slab_tensors(value, f"{path}[{i}]")


def _staged_dtensor(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor of ``spec`` over ``local`` (a slab view).

    The wrapper is built over a storage-offset-0 alias of the same shape, then given the real
    local tensor (as stock's staging does): a DTensor wrapper inherits its local tensor's storage
    offset, and torch pickles a wrapper with a non-zero offset as if it owned real storage, which
    crashes the process-mode ``async_save`` (torch 2.13)."""
    if local.storage_offset() == 0 or local.numel() == 0:
        return DTensor(local, spec, requires_grad=False)
    stand_in = local.as_strided(local.shape, local.stride(), 0)
    wrapper = DTensor(stand_in, spec, requires_grad=False)
    wrapper._local_tensor = local
    return wrapper


def _rebuild(obj: Any, staged: "iter[torch.Tensor]") -> Any:
    """``obj`` with every slab tensor replaced by the next of ``staged`` (same traversal order as
    :func:`_slab_tensors`), other tensors copied to the CPU, other values deep-copied."""
    if DTensor is not None and isinstance(obj, DTensor):
        return _staged_dtensor(_rebuild(obj._local_tensor, staged), obj._spec)
    if ShardedTensor is not None and isinstance(obj, ShardedTensor):
        shards = [_Shard(_rebuild(s.tensor, staged), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group
        )
    if isinstance(obj, torch.Tensor):
        if is_plain_dense(obj):  # into the slab; anything else gets its own CPU copy
            return next(staged)
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        items = [(key, _rebuild(value, staged)) for key, value in obj.items()]
        return dict(items) if type(obj) is dict else type(obj)(items)
    if isinstance(obj, tuple):
        values = [_rebuild(value, staged) for value in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    if isinstance(obj, list):
        return [_rebuild(value, staged) for value in obj]
    if obj is None or isinstance(obj, (int, float, str, bytes, bool)):
        return obj
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)


def _copy_into(views: list[torch.Tensor], sources: list[torch.Tensor], paths: list[str]) -> None:
    """Copy every source into its view; device sources with the save ring's copier (a side stream
    per device, ordered after the current stream), waited for once at the end. A tensor that
    cannot be copied (a meta tensor, say) is an error naming it."""
    copier: CudaCopier | None = None
    for view, source, path in zip(views, sources, paths):
        source = source.detach()
        try:
            if source.device.type == "cuda":
                copier = copier or CudaCopier()
                copier.copy(view, source)
            else:
                view.copy_(source)
        except (RuntimeError, NotImplementedError) as error:
            raise RuntimeError(
                f"fastdcp: cannot stage '{path}' ({source.dtype}, shape {tuple(source.shape)}, on "
                f"{source.device}) for async_save: {error}"
            ) from error
    if copier is not None:
        copier.wait(copier.record())


class StateDictStager:
    """A writer's stager: stages into slabs of the process-wide pool and keeps the leases of its
    own stages, so that its ``write_data`` releases exactly the slab its save read (see the module
    docstring). Never pickled (the writer leaves it out)."""

    def __init__(self, prefer_shared: bool | None = None) -> None:
        self.prefer_shared = prefer_shared  # allocate_slab's: None = shared memory only when pinned
        self._lock = threading.Lock()
        self._leases: list[StagingLease] = []  # this stager's stages whose slab may still be read
        self._last_slab: weakref.ref | None = None
        self.slabs_allocated = 0  # for tests: how many of this stager's stages needed a new slab

    @property
    def _slab(self) -> HostSlab | None:
        """The slab of the latest stage, while the pool keeps it (tests, diagnostics)."""
        return self._last_slab() if self._last_slab is not None else None

    def stage(self, state_dict: Any) -> Any:
        found = list(_slab_tensors(state_dict))
        sources = [tensor for tensor, _ in found]
        paths = [path for _, path in found]
        layout = StagingLayout.for_tensors(sources)
        with self._lock:
            self._prune()
        lease = staging_pool().acquire(
            layout.nbytes, (layout.signature, self.prefer_shared), prefer_shared=self.prefer_shared
        )
        try:
            slab = lease.slab
            with torch.no_grad():
                views = [
                    slab.view(offset, t.numel() * t.element_size(), t.dtype, t.shape)
                    for offset, t in zip(layout.offsets, sources)
                ]
                _copy_into(views, sources, paths)
                staged = _rebuild(state_dict, iter(views))
        except BaseException:
            lease.release()
            raise
        lease.hold(views)
        with self._lock:
            self._leases.append(lease)
            self._last_slab = weakref.ref(slab)
            self.slabs_allocated += lease.fresh
        return staged

    def release(self, staged: Any = None) -> None:
        """A save that read a staged state dict has finished reading it (called by the writer's
        ``write_data``). ``staged``: that save's state dict (the planner's), which names the lease
        to release: the one whose slab holds its tensors, none if they are not from this stager.
        Without it, the only lease still in use is released (none when there are several: their
        views going away frees them)."""
        with self._lock:
            self._prune()
            lease = None
            if staged is not None:
                first = next(_slab_tensors(staged), None)
                if first is not None:
                    lease = next((candidate for candidate in self._leases if candidate.holds(first[0])), None)
            elif len(self._leases) == 1:
                lease = self._leases[0]
            if lease is not None:
                self._leases.remove(lease)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        """Forget this stager's leases without releasing them: a save still in flight keeps its
        slab until its views go away; the pool keeps idle slabs for the next writer."""
        with self._lock:
            self._leases = []
            self._last_slab = None

    def _prune(self) -> None:
        self._leases = [lease for lease in self._leases if lease.in_use]
