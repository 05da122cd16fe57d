"""The storage layers being compared: stock DCP (default and best-tuned) and fastdcp.

`fastdcp` must import for a default run; if it does not, the benchmark stops with
FastDCPUnavailable (exit code 4). For developing the harness before fastdcp exists, setting
FASTDCP_BENCH_STANDIN=1 makes the `fastdcp` system use the stock classes instead; every
result then carries `"standin": true` and the report says so in capitals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

STANDIN_ENV = "FASTDCP_BENCH_STANDIN"
SYSTEM_NAMES = ("stock", "stock_best", "fastdcp")


class FastDCPUnavailable(RuntimeError):
    """fastdcp was requested but cannot be imported."""


@dataclass
class System:
    name: str
    make_writer: Callable[[str], Any]
    make_reader: Callable[[str], Any]
    description: dict[str, Any] = field(default_factory=dict)
    standin: bool = False


def standin_requested() -> bool:
    return os.environ.get(STANDIN_ENV, "").strip().lower() in ("1", "true", "yes", "stock")


def _stock() -> System:
    return System("stock", lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p),
                  {"writer": "FileSystemWriter(thread_count=1)", "reader": "FileSystemReader()"})


def _stock_best() -> System:
    return System("stock_best", lambda p: FileSystemWriter(p, thread_count=4),
                  lambda p: FileSystemReader(p),
                  {"writer": "FileSystemWriter(thread_count=4)",
                   "reader": "FileSystemReader() (no knob)"})


def _fastdcp(standin: bool) -> System:
    if standin:
        return System("fastdcp", lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p),
                      {"writer": "STAND-IN FileSystemWriter(thread_count=1)",
                       "reader": "STAND-IN FileSystemReader()"}, standin=True)
    try:
        import fastdcp
        writer_cls = fastdcp.FastFileSystemWriter
        reader_cls = fastdcp.FastFileSystemReader
    except Exception as exc:  # ImportError, missing extension, missing attribute ...
        raise FastDCPUnavailable(
            f"cannot import fastdcp ({type(exc).__name__}: {exc}). Build/install it "
            f"(pip install --no-build-isolation -e .), or benchmark stock only with "
            f"--systems stock,stock_best, or set {STANDIN_ENV}=1 to develop the harness "
            f"with stock classes standing in for fastdcp.") from exc
    return System("fastdcp", lambda p: writer_cls(p), lambda p: reader_cls(p),
                  {"writer": "FastFileSystemWriter() defaults", "reader": "FastFileSystemReader() defaults",
                   "build_info": fastdcp_build_info()})


def fastdcp_build_info() -> dict[str, Any] | None:
    try:
        import fastdcp
        info = fastdcp.build_info()
        return dict(info) if isinstance(info, dict) else {"build_info": repr(info)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def resolve_systems(names: list[str] | tuple[str, ...], standin: bool | None = None) -> list[System]:
    """System objects for `names`, in order. Raises FastDCPUnavailable, ValueError."""
    if standin is None:
        standin = standin_requested()
    out: list[System] = []
    for n in names:
        if n == "stock":
            out.append(_stock())
        elif n == "stock_best":
            out.append(_stock_best())
        elif n == "fastdcp":
            out.append(_fastdcp(standin))
        else:
            raise ValueError(f"unknown system {n!r}; choose from {', '.join(SYSTEM_NAMES)}")
    return out
