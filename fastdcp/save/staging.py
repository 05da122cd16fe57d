"""Staging a state dict for ``dcp.async_save``: copied into a pooled host slab, then handed on.

``stage(state_dict)`` returns a state dict of the same structure whose tensors are views into one
:class:`~fastdcp.io.host_memory.HostSlab` (anonymous memory, which a process-mode save moves into
shared memory once; shared and pinned from the start under CUDA), and returns only when every byte
is there: training may change its tensors the moment it returns, and the checkpoint holds the
values of the moment ``stage`` was called (no tensor of the result aliases a live one).

* **Layout.** Tensors are placed in traversal order; every tensor of at least a page starts on a
  page boundary, so the writer sends it to disk with O_DIRECT straight from the slab. The slab is
  cut into segments of at most ``SEGMENT_BYTES`` (a tensor bigger than that is a segment of its
  own), which a process-mode save moves into shared memory one by one, without holding the GIL
  for the whole slab (see :mod:`fastdcp.io.host_memory`).
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
  synchronised once. Plain contiguous CPU tensors are copied by the engine's ``box_copy`` (on
  every CPU of the rank; with streaming stores into a reused slab), other CPU tensors with
  ``Tensor.copy_``.

Non-tensor values are deep-copied (stock ``BlockingAsyncStager`` does the same). DTensor and
ShardedTensor keep their sharding metadata and get staged local tensors.
"""

from __future__ import annotations

import copy
import io
import math
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..format.blob import is_plain_dense
from ..io.boxes import Box
from ..io.host_memory import PAGE, HostSlab
from .async_staging import StagingFuture, StagingReport, StagingSession, storage_key
from ..io.copy_engine import Copier, DeviceCopier, is_device_tensor
from ..io.phases import span
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
# A process-mode save's first move holds the GIL for one segment's page reservation at a time:
# ~17 ms for 64 MiB on a 2-core VM, and no longer than stock's per-tensor moves once a
# tensor is that big (see fastdcp.io.host_memory).
SEGMENT_BYTES = 64 << 20


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
            offsets.append(_place(end, size))
            end = offsets[-1] + size
        return StagingLayout(signature, tuple(offsets), end)

    def segment_starts(self, segment_bytes: int) -> tuple[int, ...]:
        """Where the slab's segments begin: a new one before a page-aligned tensor that would take
        the current segment past ``segment_bytes``, so that no tensor spans two segments."""
        starts, start = [0], 0
        for offset, (dtype, shape) in zip(self.offsets, self.signature):
            end = offset + dtype.itemsize * math.prod(shape)
            if end - start > segment_bytes and offset > start and offset % PAGE == 0:
                starts.append(start := offset)
        return tuple(starts)


def _place(end: int, size: int) -> int:
    """Where a tensor of ``size`` bytes starts in a slab filled up to ``end``: on a page boundary
    from a page up (O_DIRECT writes it straight from the slab), else on 64 bytes."""
    align = PAGE if size >= PAGE else _SMALL_ALIGN
    return -(-end // align) * align


def _slab_tensors(obj: Any, path: str = "", group: int | None = None) -> Iterator[tuple[torch.Tensor, str, int | None]]:
    """Every tensor of ``obj`` that goes into the slab, in traversal order, with its path in the
    state dict (for error messages) and its group: the ``id`` of the ShardedTensor whose local
    shard it is (staged or streamed together, see :func:`_fits`), else None. Lazily, so that a
    caller wanting the first one (the writer's release, through the planner's flattened state
    dict: the same tensor objects) walks no further."""
    if DTensor is not None and isinstance(obj, DTensor):
        yield from _slab_tensors(obj._local_tensor, path, group)
    elif ShardedTensor is not None and isinstance(obj, ShardedTensor):
        for i, shard in enumerate(obj.local_shards()):
            yield from _slab_tensors(shard.tensor, f"{path}[shard {i}]", id(obj))
    elif isinstance(obj, torch.Tensor):
        if is_plain_dense(obj):
            yield obj, path, group
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


def _staged_sharded_tensor(live: Any, tensors: list[torch.Tensor]) -> Any:
    """A ShardedTensor like ``live`` whose local shards are ``tensors`` (staged copies, in the order
    of ``live.local_shards()``), with metadata that describes them: each local shard placed on its
    staged tensor's device, the other ranks' shards on the CPU where they were on a device (every
    rank stages into host memory, as stock's ``ShardedTensor.cpu()`` records it), and
    ``pin_memory`` as the staged tensors are (a pinned slab under CUDA). ShardedTensor checks each
    local shard against that metadata, so the live metadata (device placements, unpinned) does not
    fit staged shards. Precondition: the staged tensors are all pinned or all not (staging keeps a
    ShardedTensor's local shards together, see :func:`_fits`)."""
    metadata = copy.deepcopy(live.metadata())
    local = [shard.metadata for shard in live.local_shards()]
    shards = []
    for shard_metadata, tensor in zip(local, tensors):
        staged_metadata = copy.deepcopy(shard_metadata)
        staged_metadata.placement._device = tensor.device
        shards.append(_Shard(tensor, staged_metadata))
    for shard_metadata in metadata.shards_metadata:
        mine = next((i for i, m in enumerate(local) if m == shard_metadata), None)
        if mine is not None:
            shard_metadata.placement._device = tensors[mine].device
        elif shard_metadata.placement.device().type != "cpu":
            shard_metadata.placement._device = torch.device("cpu")
    pinned = {bool(t.is_pinned()) for t in tensors if t.numel()}  # an empty shard has no memory to ask
    if len(pinned) > 1:
        raise AssertionError("fastdcp: a staged ShardedTensor's local shards differ in pinned memory")
    if pinned:
        metadata.tensor_properties.pin_memory = pinned.pop()
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=live._process_group
    )


def _rebuild(obj: Any, staged: "iter[torch.Tensor]") -> Any:
    """``obj`` with every slab tensor replaced by the next of ``staged`` (same traversal order as
    :func:`_slab_tensors`), other tensors copied to the CPU, other values deep-copied."""
    if DTensor is not None and isinstance(obj, DTensor):
        return _staged_dtensor(_rebuild(obj._local_tensor, staged), obj._spec)
    if ShardedTensor is not None and isinstance(obj, ShardedTensor):
        return _staged_sharded_tensor(obj, [_rebuild(s.tensor, staged) for s in obj.local_shards()])
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


def _is_device_source(tensor: torch.Tensor) -> bool:
    """Whether a source is copied device-to-host by a copier (a CUDA or stand-in device tensor,
    ``fastdcp.io.copy_engine``). Tests replace this and :func:`_new_copier` to drive the device
    branch with any CPU tensors and a copier of their own."""
    return is_device_tensor(tensor)


def _new_copier() -> Any:
    """The copier of device sources (:class:`~fastdcp.io.copy_engine.DeviceCopier`)."""
    return DeviceCopier()


def _enqueue_copies(copies: Iterable[tuple[torch.Tensor, torch.Tensor, str]], copier: Copier | None = None) -> Copier | None:
    """Copy each ``(view, source, path)``: host sources now with ``copy_``, device sources enqueued
    together on ``copier`` (``Copier.copy_many``: side streams, one per device, ordered after the
    current stream; created when first needed). Returns the copier (None: no device source);
    nothing waits for it here. A tensor that cannot be copied (a meta tensor, say) is an error
    naming it."""
    device: list[tuple[torch.Tensor, torch.Tensor]] = []
    device_paths: list[str] = []
    for view, source, path in copies:
        source = source.detach()
        if _is_device_source(source):
            device.append((view, source))
            device_paths.append(path)
            continue
        try:
            view.copy_(source)
        except (RuntimeError, NotImplementedError) as error:
            raise RuntimeError(
                f"fastdcp: cannot stage '{path}' ({source.dtype}, shape {tuple(source.shape)}, on "
                f"{source.device}) for async_save: {error}"
            ) from error
    if device:
        copier = copier or _new_copier()
        try:
            copier.copy_many(device)
        except (RuntimeError, NotImplementedError) as error:
            named = f"'{device_paths[0]}'" + (f" ... '{device_paths[-1]}'" if len(device) > 1 else "")
            raise RuntimeError(
                f"fastdcp: cannot stage {len(device)} device tensor(s) ({named}, on {device[0][1].device}) "
                f"for async_save: {error}"
            ) from error
    return copier


def _fill_slab(engine: Any, boxes: list[Box], fresh: bool) -> None:
    """Run the byte-copy ``boxes`` into slab views on ``engine``'s threads, the way the slab's
    pages want: a reused slab (``fresh`` false) is already faulted in, so it gets streaming stores
    (1 GiB in 36 ms against 48 ms for ``copy_``, on a 2-core VM); into new pages streaming
    stores are twice as slow (see ``box_copy.hpp``), so a new slab gets plain stores, each task
    first having the kernel fault in its pages in one call (``prefault``, see ``prefault.hpp``:
    1 GiB in 0.19-0.20 s against 0.26 s faulting page by page, on an Intel host). The caller keeps
    the sources and views referenced: the boxes hold raw addresses."""
    engine.box_copy(boxes, streaming=not fresh, prefault=fresh)


def _copy_into(views: list[torch.Tensor], sources: list[torch.Tensor], paths: list[str], engine: Any = None,
               fresh: bool = True) -> None:
    """Copy every source into its view and return when all are there. With ``engine``, plain
    contiguous host sources go in one batched ``box_copy`` on the engine's threads
    (:func:`_fill_slab`; ``fresh``: the views are in a new slab), while device copies, enqueued
    first, run behind it; everything else goes through :func:`_enqueue_copies`. Device copies are
    waited for once at the end."""
    entries = [(view, source.detach(), path) for view, source, path in zip(views, sources, paths)]
    if engine is None:
        device_copies, host_copies, boxes = [], entries, []
    else:
        device_copies, host_copies, boxes = _split_copies(entries)
    copier = _enqueue_copies(device_copies)  # first, so that they overlap with the host copies
    _enqueue_copies(host_copies)
    if boxes:
        _fill_slab(engine, boxes, fresh)
    if copier is not None:
        with span("d2h_wait"):
            copier.wait(copier.record())


@dataclass
class _Stage:
    """One stage of a stager: its slab's lease and, when overlapped, its session."""

    lease: StagingLease
    session: StagingSession | None = None

    def matches(self, tensor: torch.Tensor) -> bool:
        return (self.session is not None and self.session.holds(tensor)) or self.lease.holds(tensor)

    @property
    def active(self) -> bool:
        return self.lease.in_use or (self.session is not None and not self.session.future.done())


def _fits(sources: list[torch.Tensor], is_guarded: list[bool], budget: int | None,
          groups: list[int | None] | None = None) -> list[bool]:
    """Which sources go into the slab: in traversal order while the slab stays within ``budget``
    (every one without a budget); guarded buffers always (they are small and change in forward).
    Sources of one group (``groups``: the local shards of one ShardedTensor, which records one
    ``pin_memory`` for all of them) go in together or not at all."""
    if budget is None:
        return [True] * len(sources)
    groups = groups if groups is not None else [None] * len(sources)
    fits, used, i = [], 0, 0
    while i < len(sources):
        j = i + 1
        while groups[i] is not None and j < len(sources) and groups[j] == groups[i]:
            j += 1
        end = used
        for t in sources[i:j]:
            size = t.numel() * t.element_size()
            end = _place(end, size) + size
        keep = end <= budget or any(is_guarded[i:j])
        if keep:
            used = end
        fits.extend([keep] * (j - i))
        i = j
    return fits


def _split_copies(entries: list[tuple[torch.Tensor, torch.Tensor, str]]) -> tuple[list, list, list]:
    """``(view, source, path)`` entries as (device copies, other host copies for ``copy_``, byte-copy
    boxes for the engine's ``box_copy``); empty sources need no box."""
    device_copies, host_copies, boxes = [], [], []
    for entry in entries:
        view, source, _ = entry
        if _is_device_source(source):
            device_copies.append(entry)
            continue
        box = _raw_box(view, source)
        if box is None:
            host_copies.append(entry)
        elif box.shape[0] > 0:
            boxes.append(box)
    return device_copies, host_copies, boxes


def _raw_box(view: torch.Tensor, source: torch.Tensor) -> Box | None:
    """A byte-copy descriptor for the engine's ``box_copy`` when ``source`` is a plain contiguous
    host tensor (else None: torch copies it)."""
    if source.device.type != "cpu" or not source.is_contiguous() or source.is_conj() or source.is_neg():
        return None
    nbytes = source.numel() * source.element_size()
    return Box.of_bytes(source.data_ptr(), view.data_ptr(), nbytes)


class StateDictStager:
    """A writer's stager: stages into slabs of the process-wide pool and keeps the leases of its
    own stages, so that its ``write_data`` releases exactly the slab its save read (see the module
    docstring). Never pickled (the writer leaves it out)."""

    def __init__(self, prefer_shared: bool | None = None) -> None:
        self.prefer_shared = prefer_shared  # allocate_slab's: None = shared memory only when pinned
        self._lock = threading.Lock()
        self._stages: list[_Stage] = []  # this stager's stages whose slab may still be read
        self._last_slab: weakref.ref | None = None
        self.last_report: StagingReport | None = None
        self.slabs_allocated = 0  # for tests: how many of this stager's stages needed a new slab

    @property
    def _slab(self) -> HostSlab | None:
        """The slab of the latest stage, while the pool keeps it (tests, diagnostics)."""
        return self._last_slab() if self._last_slab is not None else None

    def _lease_views(self, fit_sources: list[torch.Tensor]) -> tuple[StagingLease, list[torch.Tensor]]:
        layout = StagingLayout.for_tensors(fit_sources)
        starts = layout.segment_starts(SEGMENT_BYTES)
        with self._lock:
            self._prune()
        lease = staging_pool().acquire(
            layout.nbytes, (layout.signature, starts, self.prefer_shared), prefer_shared=self.prefer_shared,
            segment_starts=starts,
        )
        slab = lease.slab
        views = [
            slab.view(offset, t.numel() * t.element_size(), t.dtype, t.shape)
            for offset, t in zip(layout.offsets, fit_sources)
        ]
        return lease, views

    def _remember(self, stage: _Stage, report: StagingReport) -> None:
        with self._lock:
            self._stages.append(stage)
            self._last_slab = weakref.ref(stage.lease.slab)
            self.slabs_allocated += stage.lease.fresh
            self.last_report = report

    def stage(self, state_dict: Any, engine: Any = None) -> Any:
        """Copy ``state_dict`` into a slab and return the staged copy, complete. ``engine``: the
        engine whose threads copy plain contiguous host tensors (the caller is blocked anyway, so
        the writer passes one with a thread per CPU of this rank); without it, ``copy_``."""
        t0 = time.perf_counter()
        found = list(_slab_tensors(state_dict))
        sources = [tensor for tensor, _, _ in found]
        paths = [path for _, path, _ in found]
        with span("pin"):
            lease, views = self._lease_views(sources)
        try:
            with torch.no_grad():
                _copy_into(views, sources, paths, engine, fresh=lease.fresh)
                staged = _rebuild(state_dict, iter(views))
        except BaseException:
            lease.release()
            raise
        lease.hold(views)
        nbytes = sum(t.numel() * t.element_size() for t in sources)
        elapsed = time.perf_counter() - t0
        report = StagingReport(nbytes, nbytes, 0, lease.slab.nbytes, elapsed, elapsed)
        self._remember(_Stage(lease), report)
        return staged

    def stage_overlapped(
        self, state_dict: Any, engine: Any, budget: int | None = None, guarded: frozenset[int] = frozenset(),
        where: str = "(unnamed)",
    ) -> StagingFuture:
        """Start staging ``state_dict`` and return its Future at once (see
        :mod:`fastdcp.save.async_staging`): guarded buffers are copied and device copies enqueued
        in the call, host copies run on ``engine``'s threads behind it; with ``budget``, tensors
        beyond it are streamed by the save from live memory. ``where``: the checkpoint's directory
        or URL, named by a timeout's message."""
        t0 = time.perf_counter()
        found = list(_slab_tensors(state_dict))
        sources = [tensor.detach() for tensor, _, _ in found]
        paths = [path for _, path, _ in found]
        keys = [storage_key(s) for s in sources]
        is_guarded = [key in guarded for key in keys] if guarded else [False] * len(sources)
        fits = _fits(sources, is_guarded, budget, [group for _, _, group in found])
        with span("pin"):
            lease, views = self._lease_views([s for s, keep in zip(sources, fits) if keep])
        try:
            with torch.no_grad():
                pending = iter(views)
                tensors = [next(pending) if keep else source for source, keep in zip(sources, fits)]
                now, later = [], []
                for view, source, path, keep, guard in zip(tensors, sources, paths, fits, is_guarded):
                    if keep:  # guarded: forward changes it next, so copied in the call
                        (now if guard else later).append((view, source, path))
                device_copies, host_copies, host_boxes = _split_copies(later)
                copier = _enqueue_copies(now)
                if copier is not None:
                    # Guarded device buffers: the current streams wait for their copies before
                    # forward changes them (the host does not wait).
                    copier.order_current_streams_after()
                copier = _enqueue_copies(device_copies, copier)
                token = copier.record() if copier is not None else None
                staged = _rebuild(state_dict, iter(tensors))
        except BaseException:
            lease.release()
            raise
        lease.hold(views)
        streamed = [i for i, keep in enumerate(fits) if not keep]
        sizes = [t.numel() * t.element_size() for t in sources]
        streamed_bytes = sum(sizes[i] for i in streamed)
        report = StagingReport(
            state_bytes=sum(sizes),
            snapshot_bytes=sum(sizes) - streamed_bytes,
            streamed_bytes=streamed_bytes,
            peak_host_bytes=lease.slab.nbytes,
            blocked_s=time.perf_counter() - t0,
            overlapped=True,
        )
        session = StagingSession(staged, tensors, streamed, frozenset(keys) - {0}, report, _rebuild, where)
        self._remember(_Stage(lease, session), report)

        def copy(keep_alive: tuple = (sources, views)) -> None:
            # host_boxes hold raw addresses: the sources and the slab views must outlive the copy
            # even if the caller drops its state dict meanwhile (keep_alive holds them).
            if host_boxes:
                _fill_slab(engine, host_boxes, lease.fresh)
            with torch.no_grad():
                _enqueue_copies(host_copies)  # host sources only: copied here and now
            if copier is not None:
                with span("d2h_wait"):
                    copier.wait(token)

        session.run_copies(copy)
        report.blocked_s = time.perf_counter() - t0
        return session.future

    def release(self, staged: Any = None) -> None:
        """A save that read a staged state dict has finished reading it (called by the writer's
        ``write_data``). ``staged``: that save's state dict (the planner's), which names the stage
        to release: the one whose slab (or session) holds its tensors, none if they are not from
        this stager. Without it, the only stage still in use is released (none when there are
        several: their views going away frees them). An overlapped stage's streamed tensors count
        as written from then on."""
        with self._lock:
            self._prune()
            found = None
            if staged is not None:
                first = next(_slab_tensors(staged), None)
                if first is not None:
                    found = next((stage for stage in self._stages if stage.matches(first[0])), None)
            elif len(self._stages) == 1:
                found = self._stages[0]
            if found is not None:
                self._stages.remove(found)
        if found is not None:
            found.lease.release()
            if found.session is not None:
                found.session.streamed_written()

    def latest_session(self) -> StagingSession | None:
        """This stager's latest overlapped stage still tracked (None: none)."""
        with self._lock:
            for stage in reversed(self._stages):
                if stage.session is not None:
                    return stage.session
        return None

    def close(self) -> None:
        """Forget this stager's leases without releasing them: a save still in flight keeps its
        slab until its views go away; the pool keeps idle slabs for the next writer."""
        with self._lock:
            self._stages = []
            self._last_slab = None

    def held_ranges(self) -> list[tuple[int, int]]:
        """The ``[start, end)`` address ranges of the slabs of this stager's stages still in use (what a
        writer that reads staged bytes after ``write_data`` checks its images against)."""
        with self._lock:
            slabs = [stage.lease.slab for stage in self._stages if stage.lease.in_use]
        return [(segment.data_ptr(), segment.data_ptr() + segment.numel())
                for slab in slabs if slab is not None for segment in slab.segments]

    def _prune(self) -> None:
        self._stages = [stage for stage in self._stages if stage.active]

