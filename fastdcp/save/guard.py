"""``fastdcp.guard(optimizer, *modules)``: the wait of overlapped staging, placed for the user.

With ``async_staging`` the ``async_save`` call returns while its copies still run, so something
must keep training from changing a tensor before its copy is taken. One call sets it up:

* **The optimizer's step** gets a step pre-hook that waits until every overlapped stage in flight
  that reads one of the step's tensors (its parameters and its state, e.g. AdamW's ``exp_avg``)
  is complete. Usually the copies finished during forward and backward, and the hook returns at
  once; with a ``snapshot_limit_bytes`` smaller than the state it waits for the streamed part to be
  written.
* **The modules' buffers** (BatchNorm running statistics, any ``register_buffer``), which change
  in ``forward``, are staged inside the ``async_save`` call itself (they are small): on the GPU,
  the current stream then waits for their copies on the device, never the host.

Not guarded, so a user must wait (``response.staging_completion.result()``,
``writer.synchronize_staging()`` or :func:`fastdcp.wait_for_staging`) before changing them: tensors
changed outside ``forward`` of a registered module and ``step`` of the guarded optimizer (an EMA
copy updated by hand, a GradScaler's scale, a parameter written in place by user code, a second
optimizer not passed here). Values that are not tensors are copied in the call.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .async_staging import in_flight_sessions, storage_key

__all__ = ["StagingGuard", "guard", "guarded_storage_keys"]

_guards_lock = threading.Lock()
_guards: "weakref.WeakSet[StagingGuard]" = weakref.WeakSet()


class StagingGuard:
    """The hooks of one :func:`guard` call; :meth:`remove` (or leaving its ``with`` block) undoes
    them. Keep a reference: a guard that is garbage guards nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, modules: tuple[torch.nn.Module, ...]) -> None:
        for module in modules:
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"fastdcp.guard: expected torch.nn.Module objects after the optimizer, got {type(module).__name__}")
        if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(
                f"fastdcp.guard: {type(optimizer).__name__} has no register_step_pre_hook (a torch.optim.Optimizer has)"
            )
        self._modules = [weakref.ref(m) for m in modules]
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._handle = optimizer.register_step_pre_hook(_before_step) if optimizer is not None else None
        with _guards_lock:
            _guards.add(self)

    def buffer_keys(self) -> set[int]:
        keys: set[int] = set()
        for ref in self._modules:
            module = ref()
            if module is not None:
                keys.update(storage_key(b) for b in module.buffers())
        keys.discard(0)
        return keys

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        with _guards_lock:
            _guards.discard(self)

    def __enter__(self) -> "StagingGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def guard(optimizer: torch.optim.Optimizer | None, *modules: torch.nn.Module) -> StagingGuard:
    """Make training safe to continue right after an overlapped ``async_save``: ``optimizer.step``
    waits for staging in flight of the tensors it changes, and ``modules``' buffers are staged in
    the call (see the module docstring for what is and is not covered). ``optimizer`` may be None
    (buffers only). Returns a handle: ``.remove()``, or use it as a context manager."""
    return StagingGuard(optimizer, modules)


def guarded_storage_keys() -> frozenset[int]:
    """Storages of every buffer of every registered module (stage() copies them in the call)."""
    with _guards_lock:
        guards = list(_guards)
    keys: set[int] = set()
    for g in guards:
        keys |= g.buffer_keys()
    return frozenset(keys)


def _optimizer_keys(optimizer: torch.optim.Optimizer) -> set[int]:
    keys = {storage_key(p) for group in optimizer.param_groups for p in group["params"]}
    for state in optimizer.state.values():
        if isinstance(state, dict):
            keys.update(storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
    keys.discard(0)
    return keys


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    sessions = in_flight_sessions()
    if not sessions:
        return
    keys = _optimizer_keys(optimizer)
    for session in sessions:
        if session.source_keys & keys:
            session.wait()
