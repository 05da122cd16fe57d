"""fastdcp as DCP's default storage: ``fastdcp.enable()`` / ``fastdcp.disable()``.

Code that calls ``dcp.save(state_dict, checkpoint_id=path)`` (torchtitan, Lightning's
``ModelParallelStrategy``, ...) passes no storage writer: DCP picks one itself in
``torch.distributed.checkpoint._storage_utils._storage_setup``, ``FileSystemWriter`` /
``FileSystemReader`` for a local path, fsspec's classes for a URL. ``enable()`` replaces that choice
for local paths with ``FastFileSystemWriter`` / ``FastFileSystemReader``, and for a URL whose scheme
a storage backend serves (:mod:`fastdcp.io.backends`: ``s3://``, ``az://``, ``abfs://``, a
registered one) with that backend's classes (``FastS3Writer`` / ``FastS3Reader``, ...; default arguments; the
``FASTDCP_*`` environment variables still apply); every other case goes to stock's function
unchanged. What is replaced, exactly (the objects torch's own modules look up at call time):

* ``_storage_setup`` in ``torch.distributed.checkpoint._storage_utils`` and in every loaded
  ``torch.distributed.checkpoint`` module that imported it by name (``state_dict_saver``: ``save``;
  ``state_dict_loader``: ``load`` and ``_load_state_dict_from_keys``). A storage object passed
  explicitly (``storage_writer=`` / ``storage_reader=``) is handed to stock's function, which only
  calls its ``reset(checkpoint_id)``, as always.
* ``async_save`` in ``torch.distributed.checkpoint`` and ``state_dict_saver``: given a local
  ``checkpoint_id`` and no ``storage_writer``, it builds the ``FastFileSystemWriter`` in the calling
  process and passes it as ``storage_writer``, which is what the explicit form does. Without this,
  stock would stage with its ``DefaultStager`` and, in process mode, choose the writer inside its
  spawned checkpoint process, where nothing has enabled fastdcp: a stock checkpoint, silently.

The switch is process-global (other threads' saves see it at once; ``enable`` and ``disable`` are
serialised by a lock) and not inherited by other processes: a process-mode ``async_save`` child
receives the writer already built. ``disable()`` puts stock's function objects back wherever
``enable()`` put its own (also in ``torch.distributed.checkpoint`` modules imported since); a
reference someone copied meanwhile (``from torch.distributed.checkpoint import async_save``)
behaves as stock once disabled.

If this torch does not have the hook where fastdcp expects it (a moved or renamed function, a new
signature, a caller that no longer uses it), ``enable()`` raises :class:`HookNotFoundError` naming
the torch version and what is missing, and changes nothing. ``FASTDCP_ENABLE=1`` calls ``enable()``
when fastdcp is imported (only in processes that import it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from .compat.stock_stager import mend_default_stager
from .io.engine import env_flag
from .load.reader import FastFileSystemReader
from .io.backends import backend_for
from .save.writer import FastFileSystemWriter

__all__ = [
    "enable", "disable", "is_enabled", "RestoreOnExit", "HookNotFoundError", "fast_storage_class", "ENVIRONMENT_SWITCH",
]

ENVIRONMENT_SWITCH = "FASTDCP_ENABLE"

_DCP = "torch.distributed.checkpoint"
_STORAGE_UTILS = f"{_DCP}._storage_utils"
_SAVER = f"{_DCP}.state_dict_saver"
_LOADER = f"{_DCP}.state_dict_loader"
_HOOK = "_storage_setup"
_HOOK_PARAMETERS = ("storage", "checkpoint_id", "reader")  # stock calls (storage, checkpoint_id, reader=...)
_ASYNC_SAVE = "async_save"
_ASYNC_SAVE_PARAMETERS = ("checkpoint_id", "storage_writer")


class HookNotFoundError(RuntimeError):
    """This torch does not choose DCP's default storage where fastdcp expects it."""


StorageSetup = Callable[..., Any]


@dataclass(frozen=True)
class _Hooks:
    """The stock objects ``enable()`` replaces, found and checked in this torch."""

    storage_setup: StorageSetup
    async_save: Callable[..., Any]


@dataclass(frozen=True)
class _Replaced:
    """One module attribute ``enable()`` set: what it was and what it is now."""

    module: ModuleType
    attribute: str
    stock: Any
    replacement: Any


# The switch. The replacements read ``_active`` on every call, so a copied reference to one
# behaves as stock after disable(); ``_replaced`` is what disable() puts back.
_lock = threading.Lock()
_active = False
_replaced: list[_Replaced] = []


def is_enabled() -> bool:
    """Whether DCP's default storage for local paths is fastdcp's in this process."""
    return _active


class RestoreOnExit:
    """Returned by :func:`enable` and :func:`disable`: used as a context manager, it restores the
    state from before that call on exit (so ``with`` blocks nest); otherwise it does nothing."""

    def __init__(self, previously_enabled: bool) -> None:
        self.previously_enabled = previously_enabled

    def __enter__(self) -> RestoreOnExit:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.previously_enabled:
            enable()
        else:
            disable()

    def __repr__(self) -> str:
        return f"RestoreOnExit(previously_enabled={self.previously_enabled})"


def enable() -> RestoreOnExit:
    """Make DCP's own storage choice for local paths ``FastFileSystemWriter`` /
    ``FastFileSystemReader`` (``dcp.save`` / ``dcp.load`` / ``dcp.async_save`` with
    ``checkpoint_id=`` and no storage object). Raises :class:`HookNotFoundError`, changing nothing,
    if this torch has no hook where fastdcp expects it."""
    global _active
    with _lock:
        previously_enabled = _active
        if not _active:
            hooks = _find_hooks()
            _install(hooks)
            _active = True
        mend_default_stager()  # stock's DefaultStager, if the job passes one, works past its first save
        return RestoreOnExit(previously_enabled)


def disable() -> RestoreOnExit:
    """Give DCP its stock storage choice back (stock's function objects, where enable() put its own)."""
    global _active
    with _lock:
        previously_enabled = _active
        _active = False
        _uninstall()
        return RestoreOnExit(previously_enabled)


# --------------------------------------------------------------------------------------------- #
# The decision and the replacements.


def fast_storage_class(checkpoint_id: str | os.PathLike, reader: bool) -> type | None:
    """The fastdcp class for ``checkpoint_id`` where stock would choose its file-system class or,
    for an ``s3://`` URL, fsspec's; else None (stock's choice stands: fsspec for other URLs, or a
    local directory that is not writable)."""
    backend = backend_for(checkpoint_id)  # s3://, az://, a registered scheme: stock would choose fsspec's
    if backend is not None:
        return backend.load("reader" if reader else "writer")
    stock_class = FileSystemReader if reader else FileSystemWriter
    # Stock tries its file-system class first and takes it when it accepts the id.
    if not stock_class.validate_checkpoint_id(checkpoint_id):
        return None
    return FastFileSystemReader if reader else FastFileSystemWriter


def _fast_storage_setup_over(stock: StorageSetup) -> StorageSetup:
    @functools.wraps(stock)
    def fast_storage_setup(storage: Any, checkpoint_id: str | os.PathLike | None, reader: bool = False) -> Any:
        # An explicit storage object (stock resets it) and a missing id (stock's error) stay stock's.
        if not _active or storage or not checkpoint_id:
            return stock(storage, checkpoint_id, reader=reader)
        fast_class = fast_storage_class(checkpoint_id, reader)
        if fast_class is None:
            return stock(storage, checkpoint_id, reader=reader)
        created = fast_class(checkpoint_id)
        created.reset(checkpoint_id)  # as stock does with the object it creates
        return created

    return fast_storage_setup


def _fast_async_save_over(stock: Callable[..., Any], storage_setup: StorageSetup) -> Callable[..., Any]:
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def fast_async_save(*args: Any, **kwargs: Any) -> Any:
        if not _active:
            return stock(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return stock(*args, **kwargs)  # stock's own error for a wrong call
        checkpoint_id = bound.arguments.get("checkpoint_id")
        if bound.arguments.get("storage_writer") is None and checkpoint_id:
            # Built here, in the caller's process, as the explicit form would be: the writer is
            # then the stager, and process mode sends it to its checkpoint process.
            bound.arguments["storage_writer"] = storage_setup(None, checkpoint_id, reader=False)
        return stock(*bound.args, **bound.kwargs)

    return fast_async_save


# --------------------------------------------------------------------------------------------- #
# Finding torch's hooks, and putting the replacements in place.


def _find_hooks() -> _Hooks:
    """Import and check what enable() replaces; every problem found goes into one error."""
    problems: list[str] = []
    modules: dict[str, ModuleType] = {}
    for name in (_DCP, _STORAGE_UTILS, _SAVER, _LOADER):
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as error:
            problems.append(f"module {name} ({error})")

    storage_setup = getattr(modules.get(_STORAGE_UTILS), _HOOK, None)
    if _STORAGE_UTILS in modules:
        if not callable(storage_setup):
            problems.append(f"function {_STORAGE_UTILS}.{_HOOK}")
        elif _parameter_names(storage_setup)[:3] != _HOOK_PARAMETERS:
            problems.append(
                f"{_STORAGE_UTILS}.{_HOOK} with parameters {_HOOK_PARAMETERS} "
                f"(found {_parameter_names(storage_setup)})"
            )
    for module_name, caller in ((_SAVER, "save"), (_LOADER, "load")):
        module = modules.get(module_name)
        if module is None or not callable(storage_setup):
            continue
        if module.__dict__.get(_HOOK) is not storage_setup:
            problems.append(f"{module_name} importing {_STORAGE_UTILS}.{_HOOK}")
        elif not _calls_by_name(getattr(module, caller, None), _HOOK):
            problems.append(f"{module_name}.{caller} calling {_HOOK}")

    async_save = getattr(modules.get(_SAVER), _ASYNC_SAVE, None)
    if _SAVER in modules:
        if not callable(async_save):
            problems.append(f"function {_SAVER}.{_ASYNC_SAVE}")
        elif not set(_ASYNC_SAVE_PARAMETERS) <= set(_parameter_names(async_save)):
            problems.append(
                f"{_SAVER}.{_ASYNC_SAVE} with parameters {_ASYNC_SAVE_PARAMETERS} "
                f"(found {_parameter_names(async_save)})"
            )
        elif _DCP in modules and getattr(modules[_DCP], _ASYNC_SAVE, None) is not async_save:
            problems.append(f"{_DCP}.{_ASYNC_SAVE} being {_SAVER}.{_ASYNC_SAVE}")

    if problems:
        raise HookNotFoundError(
            f"fastdcp.enable(): torch {torch.__version__} does not choose DCP's default storage where "
            f"fastdcp expects it; not found: {'; '.join(problems)}. Nothing was changed. Pass "
            "storage_writer=fastdcp.FastFileSystemWriter(path) / storage_reader=fastdcp.FastFileSystemReader(path) "
            "explicitly, or use a fastdcp release that supports this torch."
        )
    return _Hooks(storage_setup=storage_setup, async_save=async_save)


def _parameter_names(function: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _calls_by_name(function: Any, name: str) -> bool:
    """Whether ``function``'s own code (under its decorators) looks ``name`` up."""
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    return code is not None and name in code.co_names


def _dcp_modules() -> list[ModuleType]:
    """The loaded torch.distributed.checkpoint modules (list() first: imports may add to sys.modules)."""
    return [
        module for name, module in list(sys.modules.items())
        if isinstance(module, ModuleType) and (name == _DCP or name.startswith(_DCP + "."))
    ]


def _install(hooks: _Hooks) -> None:
    storage_setup = _fast_storage_setup_over(hooks.storage_setup)
    async_save = _fast_async_save_over(hooks.async_save, storage_setup)
    for stock, replacement, attribute in (
        (hooks.storage_setup, storage_setup, _HOOK),
        (hooks.async_save, async_save, _ASYNC_SAVE),
    ):
        for module in _dcp_modules():
            if module.__dict__.get(attribute) is stock:
                setattr(module, attribute, replacement)
                _replaced.append(_Replaced(module, attribute, stock, replacement))


def _uninstall() -> None:
    stock_of = {id(r.replacement): r.stock for r in _replaced}  # by identity; _replaced keeps them alive
    for module in _dcp_modules():
        for attribute in (_HOOK, _ASYNC_SAVE):
            current = module.__dict__.get(attribute)
            # Also modules imported while enabled, which copied a replacement by name; an object
            # someone else has put there since is theirs and stays.
            if current is not None and id(current) in stock_of:
                setattr(module, attribute, stock_of[id(current)])
    _replaced.clear()


def _apply_environment_switch() -> None:
    """``FASTDCP_ENABLE=1`` (or true/yes/on) enables at import; 0/false/no/off or unset leaves
    stock; anything else is an error."""
    if env_flag(ENVIRONMENT_SWITCH):
        enable()


_apply_environment_switch()
