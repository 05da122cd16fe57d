"""The storage layers being compared: stock DCP (default and best-tuned), fastdcp's storage
layer with DCP's default planners (`fastdcp`), and with fastdcp's planners (`fastdcp_planners`:
`fastdcp.FastSavePlanner()` / `fastdcp.FastLoadPlanner()`).

`fastdcp` must import for a default run; if it does not, the benchmark stops with
FastDCPUnavailable (exit code 4). When fastdcp imports but has no usable planners,
`fastdcp_planners` is left out of the run with a note saying why (never silently).
For developing the harness before fastdcp exists, setting FASTDCP_BENCH_STANDIN=1 makes the
`fastdcp` systems use the stock classes (and DCP's default planners) instead; every result then
carries `"standin": true` and the report says so in capitals.

Planner objects: by default one per system and scenario, reused for its saves/loads (as a
training loop would keep one); `--fresh-planners` makes a new one for every call.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

STANDIN_ENV = "FASTDCP_BENCH_STANDIN"
SYSTEM_NAMES = ("stock", "stock_best", "fastdcp", "fastdcp_planners")
PLANNER_SYSTEMS = ("fastdcp_planners",)
# Extra systems of the async scenarios (--async-variants): stock's "zero-overhead" staging and
# fastdcp's overlapped staging, both returning from async_save before the copies are done.
ASYNC_VARIANT_NAMES = ("stock_zoc", "fastdcp_overlap")


class FastDCPUnavailable(RuntimeError):
    """fastdcp was requested but cannot be imported."""


class SystemUnavailable(RuntimeError):
    """An optional system (fastdcp_planners) cannot be built; the message says why."""


@dataclass
class System:
    name: str
    make_writer: Callable[[str], Any]
    make_reader: Callable[[str], Any]
    description: dict[str, Any] = field(default_factory=dict)
    standin: bool = False
    # Planner factories (no arguments); None: DCP's default planners (a new one per call).
    make_save_planner: Callable[[], Any] | None = None
    make_load_planner: Callable[[], Any] | None = None
    # Writer for dcp.async_save (reused across saves); None: make_writer.
    make_async_writer: Callable[[str], Any] | None = None
    # Forgets per-process caches (fastdcp.clear_plan_caches: the planners' plan caches are per
    # process, keyed by state structure, shared by every planner object); called before a
    # system's first (`run=1st`) save so that it starts cold whatever ran before it.
    clear_caches: Callable[[], None] | None = None
    # async_save variants (ASYNC_VARIANT_NAMES, async scenarios only): a stager for
    # ``async_stager=`` (one per target and mode, closed after it), and whether ``async_save``
    # returns before staging completes (then ``blocked`` is the time in the call and ``staged``
    # the time until ``staging_completion`` resolved)
    make_stager: Callable[[], Any] | None = None
    overlapped: bool = False

    def start_cold(self) -> None:
        if self.clear_caches is not None:
            self.clear_caches()

    def async_writer(self, path: str) -> Any:
        return (self.make_async_writer or self.make_writer)(path)


def standin_requested() -> bool:
    return os.environ.get(STANDIN_ENV, "").strip().lower() in ("1", "true", "yes", "stock")


def _stock() -> System:
    return System("stock", lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p),
                  {"writer": "FileSystemWriter(thread_count=1)", "reader": "FileSystemReader()"})


def _stock_best() -> System:
    # For async_save, stock's own staging reuse (cache_staged_state_dict=True: pinned buffers kept
    # by the writer) is its best setting; it needs an accelerator (pin_memory), so CUDA only.
    cached = torch.cuda.is_available()
    return System("stock_best", lambda p: FileSystemWriter(p, thread_count=4),
                  lambda p: FileSystemReader(p),
                  {"writer": "FileSystemWriter(thread_count=4)",
                   "async_writer": "FileSystemWriter(thread_count=4"
                                   + (", cache_staged_state_dict=True)" if cached else
                                      ") (cache_staged_state_dict needs CUDA for pinned memory)"),
                   "reader": "FileSystemReader() (no knob)"},
                  make_async_writer=lambda p: FileSystemWriter(p, thread_count=4,
                                                               cache_staged_state_dict=cached))


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
    # The process-wide staging pool outlives writers: emptied before a case's first (run=1st) save
    # so that "1st" pays for new staging memory whatever ran before it.
    release = getattr(fastdcp, "release_staging", None)
    return System("fastdcp", lambda p: writer_cls(p), lambda p: reader_cls(p),
                  {"writer": "FastFileSystemWriter() defaults", "reader": "FastFileSystemReader() defaults",
                   "staging_pool": "fastdcp.release_staging() before run=1st" if release else "none",
                   "build_info": fastdcp_build_info()},
                  clear_caches=(lambda: release()) if release else None)


def _fastdcp_planners(standin: bool) -> System:
    if standin:
        from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

        return System("fastdcp_planners", lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p),
                      {"writer": "STAND-IN FileSystemWriter(thread_count=1)",
                       "reader": "STAND-IN FileSystemReader()",
                       "planners": "STAND-IN DefaultSavePlanner() / DefaultLoadPlanner()"},
                      standin=True, make_save_planner=DefaultSavePlanner, make_load_planner=DefaultLoadPlanner)
    base = _fastdcp(False)  # raises FastDCPUnavailable when fastdcp itself does not import
    import fastdcp

    missing = [n for n in ("FastSavePlanner", "FastLoadPlanner") if not hasattr(fastdcp, n)]
    if missing:
        raise SystemUnavailable(f"fastdcp_planners not run: fastdcp has no {' / '.join(missing)}")
    save_cls, load_cls = fastdcp.FastSavePlanner, fastdcp.FastLoadPlanner
    try:  # the no-argument constructors the benchmark uses
        save_cls()
        load_cls()
    except Exception as exc:
        raise SystemUnavailable(f"fastdcp_planners not run: fastdcp.FastSavePlanner() / "
                                f"FastLoadPlanner() failed ({type(exc).__name__}: {exc})") from exc
    descr = dict(base.description)
    descr["planners"] = "fastdcp.FastSavePlanner() / fastdcp.FastLoadPlanner()"
    # the planners' per-process plan caches: cleared before each case's first (run=1st) save
    clear = getattr(fastdcp, "clear_plan_caches", None) or \
        getattr(sys.modules.get(save_cls.__module__), "clear_plan_caches", None)
    descr["plan_caches"] = (f"{save_cls.__module__}.clear_plan_caches() before run=1st" if clear else
                            "no clear_plan_caches(): run=1st may reuse plans cached by earlier runs")
    clear_plans = clear

    def clear_all() -> None:
        if base.clear_caches is not None:
            base.clear_caches()
        if clear_plans is not None:
            clear_plans()

    return System("fastdcp_planners", base.make_writer, base.make_reader, descr,
                  make_save_planner=save_cls, make_load_planner=load_cls, clear_caches=clear_all)


def fastdcp_build_info() -> dict[str, Any] | None:
    try:
        import fastdcp
        info = fastdcp.build_info()
        return dict(info) if isinstance(info, dict) else {"build_info": repr(info)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def resolve_systems(names: list[str] | tuple[str, ...], standin: bool | None = None,
                    notes: list[str] | None = None) -> list[System]:
    """System objects for `names`, in order. Raises FastDCPUnavailable, ValueError.

    An optional system that cannot be built (fastdcp_planners without usable planners) is left
    out with a note appended to `notes`; without a `notes` list it raises SystemUnavailable."""
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
        elif n == "fastdcp_planners":
            try:
                out.append(_fastdcp_planners(standin))
            except SystemUnavailable as exc:
                if notes is None:
                    raise
                notes.append(str(exc))
        else:
            raise ValueError(f"unknown system {n!r}; choose from {', '.join(SYSTEM_NAMES)}")
    return out


def resolve_async_variants(names: list[str] | tuple[str, ...], standin: bool,
                           notes: list[str]) -> list[System]:
    """System objects for the async variants in `names` (ASYNC_VARIANT_NAMES); one that cannot
    run here is left out with a note. Raises ValueError for an unknown name.

    * ``stock_zoc``: ``FileSystemWriter(path)`` + ``async_stager=DefaultStager(StagingOptions(True,
      True, True, True))`` (pinned, shared-memory-free, non-blocking copies on a side stream);
    * ``fastdcp_overlap``: ``FastFileSystemWriter(path, async_staging=True)``.
    The scenario waits on ``staging_completion`` before it changes the state (what the guard or
    stock's protocol does in a training loop)."""
    out: list[System] = []
    for n in names:
        if n == "stock_zoc":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            out.append(System("stock_zoc", lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p),
                              {"writer": "FileSystemWriter(path)",
                               "stager": "DefaultStager(StagingOptions(True, True, True, True)), one per target and mode",
                               "blocked": "time in async_save; staged: until staging_completion"},
                              make_stager=lambda: DefaultStager(StagingOptions(True, True, True, True)),
                              overlapped=True))
        elif n == "fastdcp_overlap":
            if standin:
                notes.append("fastdcp_overlap not run: fastdcp is a stand-in")
                continue
            import inspect

            import fastdcp

            if "async_staging" not in inspect.signature(fastdcp.FastFileSystemWriter).parameters:
                notes.append("fastdcp_overlap not run: this fastdcp has no FastFileSystemWriter(async_staging=)")
                continue
            release = getattr(fastdcp, "release_staging", None)
            out.append(System("fastdcp_overlap", lambda p: fastdcp.FastFileSystemWriter(p, async_staging=True),
                              lambda p: fastdcp.FastFileSystemReader(p),
                              {"writer": "FastFileSystemWriter(path, async_staging=True)",
                               "blocked": "time in async_save; staged: until staging_completion",
                               "build_info": fastdcp_build_info()},
                              clear_caches=(lambda: release()) if release else None, overlapped=True))
        else:
            raise ValueError(f"unknown async variant {n!r}; choose from {', '.join(ASYNC_VARIANT_NAMES)}")
    return out
