"""Old names of renamed arguments and environment variables, still accepted (docs/api.md, "Renamed").

Every memory limit of fastdcp is named ``<which memory>_limit_bytes`` (environment
``FASTDCP_<WHICH MEMORY>_LIMIT_BYTES``). The names they had before keep working: an old keyword
argument is passed on under its new name and an old environment variable is read when the new one
is unset, each with one ``FutureWarning`` per process naming the new name.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Any, Callable, TypeVar

__all__ = ["RENAMED_ARGUMENTS", "RENAMED_ENVIRONMENT", "renamed_arguments", "environ_get"]

F = TypeVar("F", bound=Callable[..., Any])

# Old keyword -> new keyword, by the callables that take them (docs/api.md lists the same).
READER_RENAMES = {"memory_budget_bytes": "read_buffer_limit_bytes"}
WRITER_RENAMES = {"memory_budget_bytes": "pinned_ring_limit_bytes", "staging_budget_bytes": "snapshot_limit_bytes"}
S3_WRITER_RENAMES = {"staging_budget_bytes": "snapshot_limit_bytes"}
RENAMED_ARGUMENTS: dict[str, dict[str, str]] = {}  # callable's qualified name -> {old: new}, filled by the decorator

# New variable -> old variable.
RENAMED_ENVIRONMENT = {
    "FASTDCP_READ_BUFFER_LIMIT_BYTES": "FASTDCP_READ_BUDGET_BYTES",
    "FASTDCP_SNAPSHOT_LIMIT_BYTES": "FASTDCP_STAGING_BUDGET_BYTES",
    "FASTDCP_STAGING_POOL_LIMIT_BYTES": "FASTDCP_STAGING_POOL_BYTES",
    "FASTDCP_PINNED_POOL_LIMIT_BYTES": "FASTDCP_PINNED_POOL_BYTES",
}

_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _warn_once(key: tuple[str, str], message: str, stacklevel: int) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, FutureWarning, stacklevel=stacklevel + 1)


def renamed_arguments(renames: dict[str, str], name: str | None = None) -> Callable[[F], F]:
    """Accept each old keyword of ``renames`` ({old: new}) as its new one, warning once per process.
    Passing both is a ``TypeError``. The signature (``inspect.signature``) stays the new one.
    ``name``: what the warning calls the callable (default: its qualified name, less ``.__init__``)."""

    def decorate(fn: F) -> F:
        owner = name or fn.__qualname__.removesuffix(".__init__")
        RENAMED_ARGUMENTS[owner] = dict(renames)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{owner}() got both {old}= and {new}= ({old} is the old name of {new})")
                    _warn_once((owner, old), f"fastdcp: {owner}'s argument {old}= is renamed {new}=; "
                                             f"the old name still works for now", stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def environ_get(name: str) -> tuple[str, str | None]:
    """(the variable read, its value): ``name``, else the old name it had, with one FutureWarning
    when only the old one is set. The variable is returned so that errors name what was set."""
    value = os.environ.get(name)
    old = RENAMED_ENVIRONMENT.get(name)
    if (value is None or not value.strip()) and old is not None:
        old_value = os.environ.get(old)
        if old_value is not None and old_value.strip():
            _warn_once(("environment", old), f"fastdcp: the environment variable {old} is renamed {name}; "
                                             f"the old name still works for now", stacklevel=3)
            return old, old_value
    return name, value
