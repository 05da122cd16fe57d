"""The storage seam: what a backend provides, and the registry that finds it from a checkpoint id.

A backend serves the URL schemes it names (``s3``; ``az`` and ``abfs``; a third party's own).
It declares, as ``"module:attribute"`` strings imported on first use, its ``StorageWriter`` and
``StorageReader`` classes, the opener of ``fastdcp.open`` and the CLI, and its
:class:`FileStore` for a tiered checkpoint's shared side. A path with no registered scheme is a
local directory. Third-party packages register with :func:`register_backend`, or declare an
entry point in the ``fastdcp.backends`` group whose value is a :class:`Backend`.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Backend", "FileStore", "register_backend", "backend_for", "backends", "is_backend_url",
           "url_scheme", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "fastdcp.backends"


@runtime_checkable
class FileStore(Protocol):
    """A checkpoint's files on one storage: what a tiered checkpoint's drain stores there, and what
    a load or the CLI reads back. Every method raises an ``OSError`` naming the file on failure.

    Names are checkpoint-relative (``__0_<token>_0.distcp``, ``.metadata``). A file becomes
    visible only once complete: ``put_images`` and ``put_bytes`` never leave a partial file under
    its name, so a file that exists is whole. ``put_bytes`` is the atomic commit;
    ``create_only=True`` makes it fail where the name exists. ``delete`` is the abort."""

    def url(self, name: str | None = None) -> str:
        """The checkpoint's URL or path, or that of one of its files (for messages)."""

    def put_images(self, images: list[tuple[str, int, list[tuple]]]) -> None:
        """Store each ``(name, size, segments)`` file image (sorted ``(offset, buffer)`` or
        ``(offset, address, nbytes)`` segments, zeros in the gaps), each visible once complete and
        durable. Precondition: the segments' memory is unchanged until this returns."""

    def put_bytes(self, name: str, data: bytes, *, create_only: bool = False) -> None:
        """Store small file ``name`` whole and atomically (replacing it, unless ``create_only``)."""

    def delete(self, names: Iterable[str]) -> list[str]:
        """Remove files (a missing one counts as removed); the ones that could not be."""

    def existing(self, names: set[str]) -> set[str]:
        """Which of ``names`` exist."""

    def read_bytes(self, name: str) -> bytes:
        """File ``name`` whole."""

    def size(self, name: str) -> int:
        """File ``name``'s size in bytes."""

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset`` (an error naming the file if it is short)."""

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(name, size) of the checkpoint's files starting with ``prefix``: for tools such as the
        CLI, never on a save's path."""


@dataclass(frozen=True)
class Backend:
    """One kind of storage a checkpoint id can name.

    Args:
        name: what messages and ``fastdcp.backends()`` call it.
        schemes: the URL schemes it serves (lower case, without ``://``).
        writer / reader: ``"module:attribute"`` of its ``StorageWriter`` / ``StorageReader``
            classes, constructed as ``cls(checkpoint_id)``.
        opener: ``"module:attribute"`` of ``open(url, **kwargs)`` returning a lazy checkpoint
            (``fastdcp.open``, the CLI's ``inspect`` and ``verify``); None: not offered.
        file_store: ``"module:attribute"`` of ``store(url)`` returning a :class:`FileStore`
            (a tiered checkpoint's shared side); None: not offered.
    """

    name: str
    schemes: tuple[str, ...]
    writer: str
    reader: str
    opener: str | None = None
    file_store: str | None = None

    def __post_init__(self) -> None:
        if not self.schemes or any(not s or s != s.lower() or "://" in s for s in self.schemes):
            raise ValueError(f"Backend {self.name!r}: schemes must be lower-case names without '://', "
                             f"got {self.schemes!r}")
        for field_name in ("writer", "reader", "opener", "file_store"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or value.count(":") != 1):
                raise ValueError(f"Backend {self.name!r}: {field_name} must be 'module:attribute', got {value!r}")

    def load(self, part: str) -> Any:
        """The object behind ``part`` (``"writer"``, ``"reader"``, ``"opener"``, ``"file_store"``),
        imported now; a clear error where the backend does not offer it or it cannot be imported."""
        target = getattr(self, part)
        if target is None:
            raise NotImplementedError(f"the {self.name} storage backend ({', '.join(self.schemes)}://) "
                                      f"offers no {part.replace('_', ' ')}")
        module_name, attribute = target.split(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ImportError(f"the {self.name} storage backend's {part} {target!r} cannot be loaded: {error}") from error


_BUILT_IN = (
    Backend("s3", ("s3",), writer="fastdcp.objstore.writer:FastS3Writer",
            reader="fastdcp.objstore.reader:FastS3Reader", opener="fastdcp.objstore.lazy:open_object_checkpoint",
            file_store="fastdcp.objstore.storage:object_storage"),
    Backend("azure", ("az", "abfs", "abfss"), writer="fastdcp.objstore.writer:FastAzureWriter",
            reader="fastdcp.objstore.reader:FastAzureReader", opener="fastdcp.objstore.lazy:open_object_checkpoint",
            file_store="fastdcp.objstore.storage:object_storage"),
)

_lock = threading.Lock()
_by_scheme: dict[str, Backend] = {scheme: b for b in _BUILT_IN for scheme in b.schemes}
_entry_points_loaded = False


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Serve ``backend.schemes`` with ``backend``. A scheme already served raises ValueError unless
    ``replace`` is true."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a fastdcp.Backend, got {type(backend).__name__}")
    _load_entry_points()
    with _lock:
        taken = [s for s in backend.schemes if s in _by_scheme and _by_scheme[s] != backend]
        if taken and not replace:
            owners = ", ".join(f"{s}:// ({_by_scheme[s].name})" for s in taken)
            raise ValueError(f"cannot register the {backend.name} storage backend: {owners} already served; "
                             "pass replace=True to take over")
        for scheme in backend.schemes:
            _by_scheme[scheme] = backend


def _load_entry_points() -> None:
    """Register the backends installed packages declare (once per process). A broken declaration
    raises, naming the package's entry point."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            backend = point.load()
        except Exception as error:  # noqa: BLE001 - named with the entry point
            raise ImportError(f"the storage backend entry point {point.name!r} ({point.value}) of group "
                              f"{ENTRY_POINT_GROUP!r} cannot be loaded: {error}") from error
        if not isinstance(backend, Backend):
            raise TypeError(f"the storage backend entry point {point.name!r} ({point.value}) is a "
                            f"{type(backend).__name__}, not a fastdcp.Backend")
        with _lock:
            for scheme in backend.schemes:
                _by_scheme.setdefault(scheme, backend)


def url_scheme(checkpoint_id: object) -> str | None:
    """The lower-cased scheme of a ``scheme://...`` string; None for a path (a ``pathlib.Path``
    folds ``s3://`` into ``s3:/``: it was never meant as a URL)."""
    if isinstance(checkpoint_id, os.PathLike) or not isinstance(checkpoint_id, str):
        return None
    scheme, sep, _ = checkpoint_id.partition("://")
    if not sep or not scheme or not all(c.isalnum() or c in "+-." for c in scheme):
        return None
    return scheme.lower()


def backend_for(checkpoint_id: object) -> Backend | None:
    """The registered backend serving ``checkpoint_id``'s scheme; None for a local path or an
    unregistered scheme (stock's choice stands there)."""
    scheme = url_scheme(checkpoint_id)
    if scheme is None:
        return None
    _load_entry_points()
    with _lock:
        return _by_scheme.get(scheme)


def is_backend_url(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` is a URL a registered backend serves."""
    return backend_for(checkpoint_id) is not None


def backends() -> list[Backend]:
    """Every registered backend, each once."""
    _load_entry_points()
    with _lock:
        seen: dict[str, Backend] = {}
        for backend in _by_scheme.values():
            seen.setdefault(backend.name, backend)
        return list(seen.values())
