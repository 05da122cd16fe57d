"""Copies between device memory and host memory, and which tensors count as device memory.

Every path that moves GPU tensor bytes (the save ring, async staging's device copies) uses a
:class:`Copier`: ``copy(dst, src)`` enqueues an asynchronous copy (``copy_many(pairs)`` many of them
in as few calls as the engine allows), ``record()`` returns a token for
the copies enqueued so far, ``wait(token)`` blocks the host until they have landed, and
``order_current_streams_after()`` keeps work queued next on the device from changing what the
copies read. Two engines implement it:

* :class:`CudaCopier`: copies on one side stream per device, ordered after the device's current
  stream; tokens are CUDA events. ``copy_many`` enqueues every plain byte copy of a device in one
  native call (``_C.memcpy_batch_async``: a ``cudaMemcpyAsync`` each, no Python per tensor);
  other copies, and an extension built without CUDA, use ``Tensor.copy_(non_blocking=True)``.
* :class:`StandInCopier`: the **stand-in device** for machines without a GPU. A copy is a memcpy run
  by one copy thread of its own (as a DMA engine runs beside the host), in order; tokens are
  events set by that thread. ``order_current_streams_after()`` waits for the copies so far (the host
  has no stream to order).

**Stand-in device tensors.** :func:`to_standin_device` copies a CPU tensor into memory registered as
stand-in device memory; :func:`is_device_tensor` is true for CUDA tensors and for those, so the
device branches (the ring, staging's device copies) run on a CPU machine exactly as they run on a
GPU, with the copies on the stand-in's own thread. Nothing else treats them differently: they are
ordinary CPU tensors to torch and to DCP. The benchmark's ``--device cpu-standin`` and the tests use
them; without them every CPU tensor takes the host paths.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
import weakref
from typing import Any, Protocol

import torch

from .boxes import Box

__all__ = ["Copier", "CudaCopier", "StandInCopier", "DeviceCopier", "is_device_tensor", "to_standin_device",
           "is_standin_device_tensor"]


class Copier(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
    def record(self) -> Any: ...
    def wait(self, token: Any) -> None: ...
    def order_current_streams_after(self) -> None: ...


# -- stand-in device memory ------------------------------------------------------------------ #

_standin_lock = threading.Lock()
# Stand-in device memory: the storages' [start, end) ranges, sorted by start (disjoint: live storages).
_standin_starts: list[int] = []
_standin_ends: list[int] = []


def _forget_standin_after_fork() -> None:
    global _standin_lock
    _standin_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_standin_after_fork)


def _register(start: int, end: int) -> None:
    with _standin_lock:
        i = bisect.bisect_left(_standin_starts, start)
        _standin_starts.insert(i, start)
        _standin_ends.insert(i, end)


def _unregister(start: int) -> None:
    with _standin_lock:
        i = bisect.bisect_left(_standin_starts, start)
        if i < len(_standin_starts) and _standin_starts[i] == start:
            del _standin_starts[i]
            del _standin_ends[i]


def to_standin_device(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of CPU ``tensor`` in stand-in device memory (see the module docstring): a fresh
    contiguous CPU tensor that :func:`is_device_tensor` reports, with every view of it, as device
    memory for as long as the returned tensor lives. Precondition: ``tensor`` is a dense CPU tensor."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(f"a stand-in device tensor is made from a dense CPU tensor, not {tensor.device} "
                         f"{tensor.layout}")
    copy = tensor.detach().clone(memory_format=torch.contiguous_format)
    storage = copy.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes:
        _register(start, start + nbytes)
        weakref.finalize(copy, _unregister, start)
    return copy


def is_standin_device_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie in stand-in device memory (:func:`to_standin_device`): a
    binary search of the registered ranges by the tensor's address."""
    if not _standin_starts or tensor.device.type != "cpu":
        return False
    try:
        ptr = tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    i = bisect.bisect_right(_standin_starts, ptr) - 1
    return i >= 0 and ptr < _standin_ends[i]


def is_device_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes live on a device (a CUDA tensor, or a stand-in device tensor):
    saves move them to the host through a :class:`Copier`."""
    return tensor.device.type == "cuda" or is_standin_device_tensor(tensor)


# -- the engines ------------------------------------------------------------------------------ #


class CudaCopier:
    """Device-to-host copies on one side stream per device, ordered after the current streams."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.batched = 0  # copies enqueued through the native batch

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._streams[device] = stream
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(src.device)):
            dst.copy_(src, non_blocking=True)

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue every ``dst.copy_(src)``: per device, the plain byte copies in one native call,
        the rest with ``copy_`` (see the module docstring)."""
        native = _native_batch()
        if native is None:
            from .cuda_build import warn_if_slow_gpu_path

            warn_if_slow_gpu_path(bool(pairs))
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            by_device.setdefault(src.device, []).append((dst, src))
        for device, items in by_device.items():
            stream = self._stream(device)
            jobs, rest = batch_jobs(items) if native is not None else ([], items)
            if jobs:
                table = torch.tensor(jobs, dtype=torch.int64)
                native(table.data_ptr(), len(jobs), stream.cuda_stream)
                self.batched += len(jobs)
            if rest:
                with torch.cuda.stream(stream):
                    for dst, src in rest:
                        dst.copy_(src, non_blocking=True)

    def record(self) -> list[torch.cuda.Event]:
        events = []
        for stream in self._streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def order_current_streams_after(self) -> None:
        """Make each device's current stream wait (on the device, not the host) for the copies
        enqueued so far: kernels queued next cannot change what those copies read."""
        for device, stream in self._streams.items():
            event = torch.cuda.Event()
            event.record(stream)
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self, token: list[torch.cuda.Event]) -> None:
        for event in token:
            event.synchronize()


class StandInCopier:
    """The stand-in device's copy engine: copies run in order on one thread of their own.

    The copies enqueued between two tokens go to the native engine's batched byte copy in one call
    (on ``threads`` engine threads), as a device's copy engine takes a batch of transfers; copies
    that are not plain contiguous byte copies run with ``copy_``. The thread starts with the first
    copy and ends when the copier is garbage (or :meth:`close`). A copy that fails makes every later
    :meth:`wait` raise that error.

    Args:
        threads: native engine threads for the batched copies (default: the copy threads of
            ``fastdcp.io.engine.default_copy_threads``, at least 2).
    """

    def __init__(self, threads: int | None = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._threads = threads
        self.copies = 0
        self.batches = 0

    def _start(self) -> None:
        if self._thread is None:
            from .engine import default_copy_threads

            threads = self._threads or max(2, default_copy_threads())
            self._thread = threading.Thread(target=_run_copies, args=(self._queue, weakref.ref(self), threads),
                                            name="fastdcp-standin-copy", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._start()
        self.copies += 1
        self._queue.put((dst, src))

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            self.copy(dst, src)

    def record(self) -> threading.Event:
        self._start()
        event = threading.Event()
        self._queue.put(event)
        return event

    def order_current_streams_after(self) -> None:
        """No stream to order on the host: wait for the copies so far instead."""
        self.wait(self.record())

    def wait(self, token: threading.Event) -> None:
        token.wait()
        if self._error is not None:
            raise RuntimeError(f"fastdcp: a stand-in device copy failed: {self._error}") from self._error

    def close(self) -> None:
        """Stop the copy thread after the copies already enqueued."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _native_batch() -> Any:
    """``_C.memcpy_batch_async`` when the extension was built with CUDA, else None."""
    from .._native import _C

    return getattr(_C, "memcpy_batch_async", None)


def batch_jobs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[tuple[int, int, int]], list]:
    """``(jobs, rest)``: ``(dst address, src address, bytes)`` of each pair that is a plain byte copy
    (same dtype and shape, both contiguous, no conj/neg bit), and the other pairs."""
    jobs, rest = [], []
    for dst, src in pairs:
        if (src.dtype == dst.dtype and src.shape == dst.shape and src.is_contiguous() and dst.is_contiguous()
                and not src.is_conj() and not src.is_neg()):
            nbytes = src.numel() * src.element_size()
            if nbytes:
                jobs.append((dst.data_ptr(), src.data_ptr(), nbytes))
        else:
            rest.append((dst, src))
    return jobs, rest


def _byte_box(dst: torch.Tensor, src: torch.Tensor) -> Box | None:
    """A byte-copy descriptor of the native ``box_copy`` for ``dst.copy_(src)`` when both are
    contiguous CPU tensors of one dtype and shape (else None)."""
    if (src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype or src.shape != dst.shape
            or not src.is_contiguous() or not dst.is_contiguous() or src.is_conj() or src.is_neg()):
        return None
    nbytes = src.numel() * src.element_size()
    return Box.of_bytes(src.data_ptr(), dst.data_ptr(), nbytes) if nbytes else None


def _run_copies(work: queue.SimpleQueue, owner: "weakref.ref[StandInCopier]", threads: int) -> None:
    from .._native import _C

    engine = _C.Engine(threads, 8 << 20)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    written = _Intervals()  # destinations of the pending copies: a batch runs them in any order

    def flush() -> None:
        copier = owner()
        failed = copier is not None and copier._error is not None
        try:
            if not failed and pending:
                boxes, others = [], []
                for dst, src in pending:
                    box = _byte_box(dst, src)
                    if box is not None:
                        boxes.append(box)
                    else:
                        others.append((dst, src))
                if boxes:
                    engine.box_copy(boxes, streaming=True)  # as a DMA write: no cache fill
                with torch.no_grad():
                    for dst, src in others:
                        dst.copy_(src)
                if copier is not None:
                    copier.batches += 1
        except BaseException as error:  # reported by the next wait
            if copier is not None:
                copier._error = error
        pending.clear()
        written.clear()

    while True:
        item = work.get()
        if item is None:
            flush()
            return
        if isinstance(item, threading.Event):
            flush()
            item.set()
            continue
        dst, src = item
        dst_span, src_span = _span(dst), _span(src)
        if written.overlaps(dst_span) or written.overlaps(src_span):
            flush()  # in order: this copy writes or reads what an earlier pending copy writes
        pending.append(item)
        written.add(dst_span)
        del item, dst, src


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` that ``tensor``'s elements lie in (from its strides)."""
    try:
        start = tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0, 1 << 64
    if tensor.numel() == 0:
        return start, start
    if any(stride < 0 for stride in tensor.stride()):
        return 0, 1 << 64
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * tensor.element_size()


class _Intervals:
    """Disjoint-or-not byte intervals with an overlap test in O(log n) for the common case of
    disjoint ones (sorted by start; the longest interval bounds the search)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._longest = 0

    def add(self, span: tuple[int, int]) -> None:
        import bisect

        i = bisect.bisect_left(self._starts, span[0])
        self._starts.insert(i, span[0])
        self._ends.insert(i, span[1])
        self._longest = max(self._longest, span[1] - span[0])

    def overlaps(self, span: tuple[int, int]) -> bool:
        import bisect

        lo, hi = span
        # Any interval starting before `hi` and ending after `lo`: starts lie in (lo - longest, hi).
        i = bisect.bisect_right(self._starts, lo - self._longest)
        while i < len(self._starts) and self._starts[i] < hi:
            if self._ends[i] > lo:
                return True
            i += 1
        return False


class DeviceCopier:
    """The copier for a mix of sources: CUDA sources through a :class:`CudaCopier`, stand-in
    device sources through a :class:`StandInCopier`, each created on first use. Tokens are the
    pair of the two engines' tokens."""

    def __init__(self) -> None:
        self._cuda: CudaCopier | None = None
        self._standin: StandInCopier | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type == "cuda":
            self._cuda = self._cuda or CudaCopier()
            self._cuda.copy(dst, src)
        else:
            self._standin = self._standin or StandInCopier()
            self._standin.copy(dst, src)

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [(d, s) for d, s in pairs if s.device.type == "cuda"]
        if cuda:
            self._cuda = self._cuda or CudaCopier()
            self._cuda.copy_many(cuda)
        if len(cuda) < len(pairs):
            self._standin = self._standin or StandInCopier()
            self._standin.copy_many([(d, s) for d, s in pairs if s.device.type != "cuda"])

    def record(self) -> tuple[Any, Any]:
        return (self._cuda.record() if self._cuda is not None else None,
                self._standin.record() if self._standin is not None else None)

    def order_current_streams_after(self) -> None:
        if self._cuda is not None:
            self._cuda.order_current_streams_after()
        if self._standin is not None:
            self._standin.order_current_streams_after()

    def wait(self, token: tuple[Any, Any]) -> None:
        cuda_token, standin_token = token
        if cuda_token is not None:
            self._cuda.wait(cuda_token)  # type: ignore[union-attr]
        if standin_token is not None:
            self._standin.wait(standin_token)  # type: ignore[union-attr]
