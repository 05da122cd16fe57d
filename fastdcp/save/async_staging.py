"""Overlapped staging: ``stage()`` returns a Future at once and the copies run behind training.

``FastFileSystemWriter(async_staging=True)`` (or ``FASTDCP_ASYNC_STAGING=1``) stages a state dict
as a :class:`StagingSession`:

* **In the call** (the only time training is stopped): the layout is planned, a slab leased from
  the process-wide pool, the buffers of modules registered with :func:`fastdcp.guard` are copied
  (they change in ``forward``), every device-to-host copy is enqueued on a side stream ordered
  after the current stream, and non-tensor values are deep-copied. Then ``stage()`` returns a
  :class:`StagingFuture`, and ``dcp.async_save`` returns ``AsyncSaveResponse(staging_completion,
  upload_completion)``.
* **Behind the call**: host tensors are copied into the slab on the native engine's threads (GIL
  released), driven by one short-lived Python thread, which then waits for the device copies.
* **Completion** (``future.done()``, DCP's ``staging_completion``): no byte of the checkpoint
  changes any more when the live tensors do. The save itself reads the staged copy only once the
  copies are complete (DCP's save thread calls ``result()`` first).

**Snapshot limit** (``snapshot_limit_bytes``): tensors go into the slab in traversal order while it stays
within the limit (guarded buffers always do); the rest are *streamed*: the staged state dict
holds them as aliases of the live tensors, the save writes them straight from live memory (CPU)
or through the writer's pinned ring (GPU), and the session completes only once that write is
done. For that, DCP's thread-mode save gets the staged state dict from ``result()`` as soon as the
slab part is copied, before the future is done (the one consumer this happens for: the call comes
from ``torch.distributed.checkpoint._async_thread_executor``). Every other consumer of ``result()``
(process mode, a user) gets a full snapshot: the streamed tensors are copied then, outside the
limit, with a warning. A streamed save that fails before writing completes the session when its
save thread ends (a watcher joins it), so a guard never waits forever.

No checkpoint holds a value written after the call, provided nothing changes the state before the
session completes except what the guard covers (``forward`` of registered modules, the guarded
optimizer's ``step``); see docs/GUARANTEES.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeoutError
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "StagingFuture",
    "StagingReport",
    "StagingSession",
    "in_flight_sessions",
    "staging_timeout_message",
    "storage_key",
    "wait_for_staging",
]

# The module whose ``save_wrapper`` calls ``result()`` in DCP's thread-mode async_save (torch
# 2.7-2.14). If torch moves it, streamed saves fall back to full snapshots (correct, slower).
_DCP_THREAD_SAVE_MODULE = "torch.distributed.checkpoint._async_thread_executor"

# DCP's save thread claims streamed tensors within milliseconds of the async_save call.
_CLAIM_GRACE_S = 1.0

_registry_lock = threading.Lock()
_in_flight: list["StagingSession"] = []


@dataclass
class StagingReport:
    """What one stage did. Bytes are tensor bytes; times in seconds from the ``stage()`` call.

    ``snapshot_bytes`` were copied into staging memory, ``streamed_bytes`` written by the save
    straight from the live tensors (``snapshot_limit_bytes``); ``completed_bytes`` of the snapshot
    were meant to stream but were copied after all, because the consumer could not stream them
    (process mode). ``peak_host_bytes`` is
    the host memory the stage held at once: its slab plus those late copies."""

    state_bytes: int
    snapshot_bytes: int
    streamed_bytes: int
    peak_host_bytes: int
    blocked_s: float
    staged_s: float | None = None  # until complete (None while in flight)
    completed_bytes: int = 0
    overlapped: bool = False


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's memory, for the guard: its storage's address (0 when it has none)."""
    local = getattr(tensor, "_local_tensor", tensor)  # DTensor
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class StagingFuture(Future):
    """The Future ``stage()`` returns under ``async_staging``: resolved with the staged state dict
    once staging is complete. See the module docstring for the one early ``result()``."""

    def __init__(self, session: "StagingSession") -> None:
        super().__init__()
        self._session = session

    @property
    def report(self) -> StagingReport:
        return self._session.report

    def result(self, timeout: float | None = None) -> Any:
        session = self._session
        if session.streams and not self.done():
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == _DCP_THREAD_SAVE_MODULE and session.bind_consumer():
                return session.for_streaming_save(timeout)
            session.complete_snapshot()
        try:
            return super().result(timeout)
        except FuturesTimeoutError:
            raise FuturesTimeoutError(session.timeout_message(timeout)) from None


def staging_timeout_message(where: str, timeout: float | None, report: StagingReport, copied: bool) -> str:
    """The message of a stage that did not complete within ``timeout`` seconds: the checkpoint,
    the timeout and who set it, what was still running, and what to do."""
    if not copied:
        pending = f"the copy of {report.snapshot_bytes} bytes into staging memory was still running"
    else:
        pending = (f"the save had not yet written the {report.streamed_bytes} bytes streamed from the live "
                   f"tensors (snapshot_limit_bytes)")
    limit = "the time given" if timeout is None else f"{timeout:g} s"
    return (f"fastdcp: staging {report.state_bytes} bytes for the checkpoint at {where} did not complete "
            f"within {limit}, the timeout passed to StagingFuture.result(timeout): {pending}. "
            f"Wait longer (result() with a larger timeout or none, or fastdcp.wait_for_staging()), and "
            f"change the saved state only once the future is done.")


class StagingSession:
    """One overlapped stage (see the module docstring). Built and started by
    :meth:`fastdcp.save.staging.StateDictStager.stage`; completed by its copy thread, and with
    streamed tensors, by the save's ``write_data`` (:meth:`release`) or its save thread's end."""

    def __init__(
        self,
        staged: Any,
        tensors: list[torch.Tensor],
        streamed: list[int],
        source_keys: frozenset[int],
        report: StagingReport,
        rebuild: Callable[[Any, Any], Any],
        where: str = "(unnamed)",
    ) -> None:
        self.where = where  # the checkpoint being staged (its directory or URL), for messages
        self.staged = staged  # the staged state dict (slab views and, streamed, live aliases)
        self.tensors = tensors  # its slab tensors in traversal order
        self._streamed = streamed  # indices into tensors of the live aliases
        self.source_keys = source_keys  # storages of the live tensors it reads (guard)
        self.report = report
        self._rebuild = rebuild
        self._t0 = time.perf_counter() - report.blocked_s
        self._lock = threading.Lock()
        self._copied = threading.Event()  # the slab part is complete
        self._copy_error: BaseException | None = None
        self._streamed_done = not streamed
        self._snapshot_claimed = False  # complete_snapshot() took the streamed tensors over
        self._consumer: threading.Thread | None = None
        self._ids = {id(t) for t in tensors}
        self.future = StagingFuture(self)

    @property
    def streams(self) -> bool:
        return bool(self._streamed)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (an object of a staged state dict) is one this staging session handed out."""
        return id(tensor) in self._ids

    # -- the copy thread ------------------------------------------------------------------------ #

    def run_copies(self, copy: Callable[[], None]) -> None:
        """Run ``copy`` (the slab part) on a new thread, then complete that part."""
        with _registry_lock:
            _in_flight.append(self)
        thread = threading.Thread(target=self._copy_thread, args=(copy,), name="fastdcp-staging", daemon=True)
        thread.start()

    def _copy_thread(self, copy: Callable[[], None]) -> None:
        try:
            copy()
        except BaseException as error:  # reported through the future
            self._copy_error = error
        self._copied.set()
        self._maybe_finish()

    # -- streamed tensors ----------------------------------------------------------------------- #

    def bind_consumer(self) -> bool:
        """Claim the streamed tensors for the calling thread's save (False: a full snapshot was
        already claimed). A save that fails before its write_data never releases them: the
        thread's end does (a watcher joins it)."""
        consumer = threading.current_thread()
        with self._lock:
            if self._streamed_done or self._snapshot_claimed or self._consumer is not None:
                return False
            self._consumer = consumer
        threading.Thread(target=self._await_consumer, args=(consumer,), name="fastdcp-staging-watch", daemon=True).start()
        return True

    def for_streaming_save(self, timeout: float | None) -> Any:
        """The bound save asks for the staged state dict: hand it over once the slab part is
        copied; the session completes when the save has written the streamed tensors."""
        if not self._copied.wait(timeout):
            raise FuturesTimeoutError(self.timeout_message(timeout))
        if self._copy_error is not None:
            self.streamed_written()
            raise self._copy_error
        return self.staged

    def timeout_message(self, timeout: float | None) -> str:
        """What :func:`staging_timeout_message` says of this staging session now."""
        return staging_timeout_message(self.where, timeout, self.report, self._copied.is_set())

    def _await_consumer(self, consumer: threading.Thread) -> None:
        consumer.join()
        self.streamed_written()

    def streamed_written(self) -> None:
        """The save has written the streamed tensors (or ended without writing them)."""
        with self._lock:
            if self._streamed_done:
                return
            self._streamed_done = True
        self._maybe_finish()

    def complete_snapshot(self) -> None:
        """A consumer that cannot stream (process mode, a user's ``result()``): copy the streamed
        tensors now, outside the snapshot limit, so that the staged state dict is a full snapshot."""
        with self._lock:
            if self._streamed_done or self._snapshot_claimed or self._consumer is not None:
                return
            self._snapshot_claimed = True  # from here on nobody streams
        self._copied.wait(None)
        if self._copy_error is not None:
            self.streamed_written()
            return
        streamed = set(self._streamed)
        copies = []
        with torch.no_grad():
            for i, tensor in enumerate(self.tensors):
                if i in streamed:
                    copies.append(tensor.detach().to("cpu", copy=True))
                else:
                    copies.append(tensor)
        late = sum(t.numel() * t.element_size() for i, t in enumerate(copies) if i in streamed)
        self.staged = self._rebuild(self.staged, iter(copies))
        self.report.completed_bytes = late
        self.report.snapshot_bytes += late
        self.report.streamed_bytes -= late
        self.report.peak_host_bytes += late
        warnings.warn(
            f"fastdcp: snapshot_limit_bytes is honoured by thread-mode async_save only; this save's "
            f"consumer needed a full snapshot, so {late} bytes beyond the snapshot limit were copied",
            stacklevel=3,
        )
        self.streamed_written()  # the staged state dict is a full snapshot now

    # -- completion ----------------------------------------------------------------------------- #

    def _maybe_finish(self) -> None:
        with self._lock:
            if not (self._copied.is_set() and self._streamed_done) or self.future.done():
                return
            self.report.staged_s = time.perf_counter() - self._t0
        with _registry_lock:
            if self in _in_flight:
                _in_flight.remove(self)
        if self._copy_error is not None:
            self.future.set_exception(self._copy_error)
        else:
            self.future.set_result(self.staged)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until complete; errors stay with the future (the save reports them). Streamed
        tensors that no save has claimed after ``_CLAIM_GRACE_S`` (a ``stage()`` nobody saves) are
        copied here, so that nothing waits forever."""
        try:
            if self.streams:
                try:
                    self.future.exception(_CLAIM_GRACE_S if timeout is None else min(timeout, _CLAIM_GRACE_S))
                    return True
                except TimeoutError:
                    self.complete_snapshot()
            self.future.exception(timeout)
        except TimeoutError:
            return False
        return True


def in_flight_sessions() -> list[StagingSession]:
    """The overlapped stages of this process not complete yet."""
    with _registry_lock:
        return list(_in_flight)


def wait_for_staging(timeout: float | None = None) -> bool:
    """Wait until every overlapped stage of this process is complete (``True``), or ``timeout``
    seconds passed (``False``). After it returns ``True`` the state may be changed freely."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for session in in_flight_sessions():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not session.wait(left):
            return False
    return True


def _forget_all_after_fork() -> None:
    """A forked child inherits no copy thread: its sessions can never complete there."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _in_flight.clear()


os.register_at_fork(after_in_child=_forget_all_after_fork)
