"""Staging a state dict for ``dcp.async_save``: one reused host slab, copied into, then handed on.

``stage(state_dict)`` returns a state dict of the same structure whose tensors are views into one
:class:`~fastdcp.io.host_memory.HostSlab` (shared memory, pinned under CUDA), and returns only when
every byte is there: training may change its tensors the moment it returns, and the checkpoint
holds the values of the moment ``stage`` was called (no tensor of the result aliases a live one).

* **Layout.** Tensors are placed in traversal order; every tensor of at least a page starts on a
  page boundary, so the writer sends it to disk with O_DIRECT straight from the slab.
* **Reuse.** The slab is kept for the next ``stage`` while the tensors' dtypes and sizes stay the
  same (the usual case: the same model, step after step), so steady-state staging is a copy into
  memory that is already faulted in (and, under CUDA, already page-locked).
* **No tearing.** A slab is refilled only after the save that used it stopped reading it: the
  writer calls :meth:`StateDictStager.release` when its ``write_data`` is done, and independently
  the stager watches the views it handed out (weak references): in process mode the views go away
  when the background process has answered. If the previous save still holds the slab after
  ``_WAIT_BEFORE_NEW_SLAB_S``, a new slab is allocated rather than blocking training longer.
* **Devices.** CUDA tensors are copied device-to-host with ``non_blocking`` copies on a side stream
  (ordered after the work already queued on the tensor's current stream), then the side stream is
  synchronised once. CPU tensors are copied with ``Tensor.copy_``.

Non-tensor values are deep-copied (stock ``BlockingAsyncStager`` does the same). DTensor and
ShardedTensor keep their sharding metadata and get staged local tensors.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..format.blob import is_plain_dense
from ..io.host_memory import PAGE, HostSlab, allocate_slab
from .device_ring import CudaCopier

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
_WAIT_BEFORE_NEW_SLAB_S = 60.0
_GC_EVERY_S = 0.5


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


def _collect(obj: Any, out: list[torch.Tensor], paths: list[str], path: str = "") -> None:
    """Append, in traversal order, every tensor of ``obj`` that goes into the slab (and its path
    in the state dict to ``paths``, for error messages)."""
    if DTensor is not None and isinstance(obj, DTensor):
        _collect(obj._local_tensor, out, paths, path)
    elif ShardedTensor is not None and isinstance(obj, ShardedTensor):
        for i, shard in enumerate(obj.local_shards()):
            _collect(shard.tensor, out, paths, f"{path}[shard {i}]")
    elif isinstance(obj, torch.Tensor):
        if is_plain_dense(obj):
            out.append(obj)
            paths.append(path)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, out, paths, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _collect(value, out, paths, f"{path}[{i}]")


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
    :func:`_collect`), other tensors copied to the CPU, other values deep-copied."""
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
    """Stages state dicts into one reused slab (see the module docstring)."""

    def __init__(self, prefer_shared: bool = True) -> None:
        self.prefer_shared = prefer_shared
        self._condition = threading.Condition()
        self._slab: HostSlab | None = None
        self._layout: StagingLayout | None = None
        self._views: list[weakref.ref] = []  # the views of the last stage()
        # Stages whose save has not released yet. A count, not a flag: when the structure changes
        # while a save still reads the old slab, a new slab is staged, and the old save's release
        # must not mark the new slab free.
        self._unreleased = 0
        self.slabs_allocated = 0  # for tests and benchmarks: how often a new slab was needed

    def stage(self, state_dict: Any) -> Any:
        sources: list[torch.Tensor] = []
        paths: list[str] = []
        _collect(state_dict, sources, paths)
        layout = StagingLayout.for_tensors(sources)
        with torch.no_grad():
            slab = self._acquire(layout)
            try:
                views = [
                    slab.view(offset, t.numel() * t.element_size(), t.dtype, t.shape)
                    for offset, t in zip(layout.offsets, sources)
                ]
                _copy_into(views, sources, paths)
                staged = _rebuild(state_dict, iter(views))
            except BaseException:
                self.release()
                raise
        with self._condition:
            self._views = [weakref.ref(v) for v in views]
        return staged

    def release(self) -> None:
        """A save that used a slab has finished reading it (called by the writer's write_data)."""
        with self._condition:
            self._unreleased = max(0, self._unreleased - 1)
            self._condition.notify_all()

    def close(self) -> None:
        """Drop the slab (tensors handed out keep their memory alive until they go)."""
        with self._condition:
            self._slab = None
            self._layout = None
            self._views = []
            self._unreleased = 0

    # ----------------------------------------------------------------------------------------- #

    def _views_alive(self) -> bool:
        return any(ref() is not None for ref in self._views)

    def _acquire(self, layout: StagingLayout) -> HostSlab:
        """The slab to fill for ``layout``, marked in use: the cached one once no save reads it,
        else a new one."""
        with self._condition:
            slab = self._slab
            reusable = (
                slab is not None
                and self._layout is not None
                and self._layout.signature == layout.signature
                and slab.pid == _current_pid()
            )
            if reusable and self._unreleased:
                reusable = self._wait_until_free()
            if not reusable:
                # Views of the old slab (if any save still holds them) keep their memory; it is
                # only forgotten here.
                self._slab = allocate_slab(layout.nbytes, prefer_shared=self.prefer_shared)
                self._layout = layout
                self.slabs_allocated += 1
            self._unreleased += 1
            self._views = []
            return self._slab  # type: ignore[return-value]

    def _wait_until_free(self) -> bool:
        """Wait (condition held) until every earlier save released its slab or the slab's views are
        all gone; False when that takes more than ``_WAIT_BEFORE_NEW_SLAB_S``."""
        start = last_gc = time.monotonic()
        if self._views_alive():
            gc.collect()  # views kept only by reference cycles of the finished save
        while self._unreleased and self._views_alive():
            now = time.monotonic()
            if now - start > _WAIT_BEFORE_NEW_SLAB_S:
                warnings.warn(
                    f"fastdcp: the previous async save still holds its staging memory after "
                    f"{_WAIT_BEFORE_NEW_SLAB_S:.0f} s; staging into a new slab ({self._layout.nbytes} bytes) "
                    "instead of waiting longer. Wait for the previous save's future before the next save "
                    "to keep one slab.",
                    stacklevel=4,
                )
                return False
            if now - last_gc > _GC_EVERY_S:
                gc.collect()
                last_gc = now
            self._condition.wait(timeout=0.02)
        return True


def _current_pid() -> int:
    return os.getpid()
