"""Single-process scenarios: save, load (cold/warm), small tensors, async save, GPU variants,
and loads of a user's existing checkpoint.

Every scenario interleaves systems (A B C A B C ...) and verifies every loaded state dict
bit-exact against what was saved; a mismatch raises VerificationError.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from .config import BenchConfig, fmt_size
from .pagecache import COLD_DROP, dir_bytes, fs_info, make_cold, same_device, warm_files
from .results import GIB, Recorder
from .state import (StateSpec, build_destination, build_state, clone_state, corrupt_one_byte,
                    destination_from_metadata, llm_like_spec, scribble, small_tensor_spec,
                    state_nbytes, verify_state)
from .systems import System


class Progress:
    """One line per step on stderr: `[  12.3s] message`."""

    def __init__(self, stream=sys.stderr) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=self.stream, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@dataclass
class Context:
    cfg: BenchConfig
    systems: list[System]
    targets: dict[str, str]                # where -> directory we own (created by the runner)
    recorder: Recorder
    progress: Progress
    cold_method: str | None
    notes: list[str] = field(default_factory=list)
    _main: tuple[StateSpec, dict, dict] | None = None

    def main_state(self) -> tuple[StateSpec, dict[str, Any], dict[str, Any]]:
        """(spec, source, preallocated destination) of the LLM-like state; built once."""
        if self._main is None:
            spec = llm_like_spec(self.cfg.size)
            self.progress(f"building state: {spec.summary()}")
            self._main = (spec, build_state(spec), build_destination(spec))
        return self._main

    def release_main_state(self) -> None:
        self._main = None

    def tmpfs(self, where: str) -> bool:
        return fs_info(self.targets[where]).is_tmpfs

    def caches(self, where: str) -> list[str]:
        """cold + warm on real storage when a cold method exists; warm only on tmpfs."""
        if self.tmpfs(where):
            return ["warm"]
        return ["cold", "warm"] if self.cold_method else ["warm"]

    def ckpt_dir(self, where: str, group: str, system: str) -> str:
        return os.path.join(self.targets[where], group, system)

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)
            self.progress(f"NOTE: {msg}")


# --------------------------------------------------------------------------- primitives

def timed_save(system: System, sd: dict[str, Any], path: str) -> float:
    if os.path.exists(path):
        shutil.rmtree(path)
    os.sync()  # flush unrelated dirty pages (e.g. from the rmtree) outside the timed region
    gc.collect()
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=system.make_writer(path), no_dist=True)
    return time.perf_counter() - t0


def timed_load(system: System, dest: dict[str, Any], path: str, sync_cuda: bool = False,
               reader_stats: dict[str, Any] | None = None) -> float:
    """Seconds for one dcp.load; fills ``reader_stats`` with the reader's own counters
    (fastdcp's ``last_stats``: bytes needed vs read, requests, seconds per phase) when it has any."""
    gc.collect()
    if sync_cuda:
        torch.cuda.synchronize()
    reader = system.make_reader(path)
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=reader, no_dist=True)
    if sync_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if reader_stats is not None:
        reader_stats.update(getattr(reader, "last_stats", None) or {})
    return elapsed


def prepare_cache(ctx: Context, cache: str, path: str, primer: Callable[[], None] | None = None) -> None:
    if cache == "cold":
        make_cold(ctx.cold_method, path)
        if primer is not None:
            primer()  # re-fault the loader's code pages dropped with the page cache
    else:
        warm_files(path)


def check(ctx: Context, system: System, expected: dict[str, Any], loaded: dict[str, Any], what: str) -> None:
    hook = ctx.cfg.corrupt_after_load
    if hook and hook in (system.name, "all"):
        key = corrupt_one_byte(loaded)
        ctx.progress(f"TEST HOOK: flipped one byte of {key!r} after {system.name}'s load")
    verify_state(expected, loaded, f"{what} [{system.name}]")


def verify_with_stock_reader(expected: dict[str, Any], spec: StateSpec, path: str, what: str) -> None:
    """Untimed format check: a checkpoint must load bit-exact with stock FileSystemReader."""
    dest = build_destination(spec)
    dcp.load(dest, storage_reader=FileSystemReader(path), no_dist=True)
    verify_state(expected, dest, f"{what} [read back with stock FileSystemReader]")


def _log(ctx: Context, scenario: str, where: str, system: str, label: str, rep: int,
         seconds: float, nbytes: int, repeats: int | None = None) -> None:
    ctx.progress(f"{scenario:<8} {where:<4} {system:<10} {label:<24} {rep + 1}/{repeats or ctx.cfg.repeats}: "
                 f"{seconds:7.3f} s  {nbytes / seconds / GIB:6.2f} GiB/s")


def save_limit(where: str, tmpfs: bool) -> str:
    return "memcpy" if tmpfs else f"write:{where}"


def load_limit(where: str, tmpfs: bool, cache: str) -> str:
    return f"read:{where}" if (cache == "cold" and not tmpfs) else "memcpy"


def _primer(ctx: Context, system: System, where: str) -> Callable[[], None] | None:
    """A tiny checkpoint per system, loaded untimed after drop_caches."""
    if ctx.cold_method != COLD_DROP:
        return None
    path = ctx.ckpt_dir(where, "primer", system.name)
    sd = {"primer": torch.arange(1024, dtype=torch.float32)}
    if not os.path.exists(os.path.join(path, ".metadata")):
        dcp.save(sd, storage_writer=system.make_writer(path), no_dist=True)
    dest = {"primer": torch.empty(1024, dtype=torch.float32)}
    return lambda: dcp.load(dest, storage_reader=system.make_reader(path), no_dist=True)


def _ensure_checkpoint(ctx: Context, system: System, sd: dict[str, Any], path: str) -> None:
    if not os.path.exists(os.path.join(path, ".metadata")):
        ctx.progress(f"writing {path} for loads ({system.name})")
        dcp.save(sd, storage_writer=system.make_writer(path), no_dist=True)


# --------------------------------------------------------------------------- scenarios

def run_save(ctx: Context, wheres: list[str]) -> None:
    spec, src, _ = ctx.main_state()
    nbytes = spec.tensor_bytes
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        for rep in range(ctx.cfg.repeats):
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "ckpt", system.name)
                dt = timed_save(system, src, path)
                ctx.recorder.add("save", where, system.name, {"fsync": True}, nbytes, dt,
                                 save_limit(where, tmpfs), system.description, file_bytes=dir_bytes(path))
                _log(ctx, "save", where, system.name, "fsync", rep, dt, nbytes)
        for system in ctx.systems:
            # Every checkpoint gets verified: by the load scenario when it runs, else here. fastdcp's
            # is also read back with the stock reader in full mode (format compatibility).
            loads_follow = "load" in ctx.cfg.scenarios
            if loads_follow and (system.name != "fastdcp" or ctx.cfg.quick):
                continue
            ctx.progress(f"save     {where:<4} {system.name:<10} checking the checkpoint with the stock reader")
            verify_with_stock_reader(src, spec, ctx.ckpt_dir(where, "ckpt", system.name),
                                     f"save/{where}/{system.name}")


def run_load(ctx: Context, wheres: list[str]) -> None:
    spec, src, dest = ctx.main_state()
    nbytes = spec.tensor_bytes
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        caches = ctx.caches(where)
        if not tmpfs and "cold" not in caches:
            ctx.note(f"cold loads skipped on {where}: neither drop_caches nor posix_fadvise is available")
        # (system, checkpoint writer): every system loads what its own writer wrote; in full mode
        # fastdcp also loads the stock-written checkpoint (users' existing checkpoints).
        runs: list[tuple[System, System]] = [(s, s) for s in ctx.systems]
        stock = next((s for s in ctx.systems if s.name == "stock"), None)
        if not ctx.cfg.quick and stock is not None:
            runs += [(s, stock) for s in ctx.systems if s.name == "fastdcp"]
        for _, writer in runs:
            _ensure_checkpoint(ctx, writer, src, ctx.ckpt_dir(where, "ckpt", writer.name))
        primers = {s.name: _primer(ctx, s, where) for s in ctx.systems}
        for rep in range(ctx.cfg.repeats):
            for system, writer in runs:
                path = ctx.ckpt_dir(where, "ckpt", writer.name)
                for cache in caches:
                    scribble(dest)
                    prepare_cache(ctx, cache, path, primers[system.name])
                    reader_stats: dict[str, Any] = {}
                    dt = timed_load(system, dest, path, reader_stats=reader_stats)
                    check(ctx, system, src, dest, f"load/{where}/{cache}/ckpt_writer={writer.name}")
                    cfg = {"cache": cache, "ckpt_writer": writer.name}
                    if cache == "cold":
                        cfg["cold_method"] = ctx.cold_method
                    extra = {"reader_stats": reader_stats} if reader_stats else {}
                    ctx.recorder.add("load", where, system.name, cfg, nbytes, dt,
                                     load_limit(where, tmpfs, cache), system.description, **extra)
                    _log(ctx, "load", where, system.name, f"{cache} ckpt={writer.name}", rep, dt, nbytes)


def run_small(ctx: Context, wheres: list[str]) -> None:
    c = ctx.cfg
    spec = small_tensor_spec(c.small_count, c.small_bytes, c.small_large_count, c.small_large_bytes)
    ctx.progress(f"building state: {spec.summary()}")
    src, dest = build_state(spec), build_destination(spec)
    nbytes = spec.tensor_bytes
    p = spec.params
    label = f"{p['count']}x{fmt_size(p['tensor_bytes'])}+{p['large_count']}x{fmt_size(p['large_bytes'])}"
    label = label.replace(" ", "")
    repeats = c.small_repeats or c.repeats
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        for rep in range(repeats):
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "small", system.name)
                dt = timed_save(system, src, path)
                ctx.recorder.add("small", where, system.name, {"op": "save", "tensors": label}, nbytes, dt,
                                 save_limit(where, tmpfs), system.description, file_bytes=dir_bytes(path))
                _log(ctx, "small", where, system.name, "save", rep, dt, nbytes, repeats)
                scribble(dest)
                warm_files(path)
                dt = timed_load(system, dest, path)
                check(ctx, system, src, dest, f"small/{where}")
                ctx.recorder.add("small", where, system.name, {"op": "load", "tensors": label}, nbytes, dt,
                                 "memcpy", system.description)
                _log(ctx, "small", where, system.name, "load (warm)", rep, dt, nbytes, repeats)


def run_async(ctx: Context, wheres: list[str]) -> None:
    spec, src, dest = ctx.main_state()
    nbytes = spec.tensor_bytes
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        for rep in range(ctx.cfg.repeats):
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "async", system.name)
                if os.path.exists(path):
                    shutil.rmtree(path)
                os.sync()
                gc.collect()
                t0 = time.perf_counter()
                fut = dcp.async_save(src, storage_writer=system.make_writer(path), no_dist=True)
                t_ret = time.perf_counter() - t0
                upload = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (newer torch)
                upload.result()
                t_done = time.perf_counter() - t0
                ctx.recorder.add("async", where, system.name, {"phase": "call returned"}, nbytes, t_ret,
                                 "memcpy", system.description)
                ctx.recorder.add("async", where, system.name, {"phase": "durable"}, nbytes, t_done,
                                 save_limit(where, tmpfs), system.description)
                _log(ctx, "async", where, system.name, "call returned", rep, t_ret, nbytes)
                _log(ctx, "async", where, system.name, "durable (.result())", rep, t_done, nbytes)
        for system in ctx.systems:
            path = ctx.ckpt_dir(where, "async", system.name)
            scribble(dest)
            dcp.load(dest, storage_reader=system.make_reader(path), no_dist=True)
            check(ctx, system, src, dest, f"async/{where}")


def run_gpu_save(ctx: Context, wheres: list[str]) -> None:
    if not torch.cuda.is_available():
        ctx.note("gpu_save skipped: CUDA is not available")
        return
    spec, src, _ = ctx.main_state()
    src_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in src.items()}
    nbytes = spec.tensor_bytes
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        limit = "d2h" if tmpfs else f"min(d2h,write:{where})"
        for rep in range(ctx.cfg.repeats):
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "gpu", system.name)
                torch.cuda.synchronize()
                dt = timed_save(system, src_gpu, path)
                ctx.recorder.add("gpu_save", where, system.name, {"device": "cuda"}, nbytes, dt, limit,
                                 system.description)
                _log(ctx, "gpu_save", where, system.name, "cuda", rep, dt, nbytes)
        for system in ctx.systems:
            verify_with_stock_reader(src, spec, ctx.ckpt_dir(where, "gpu", system.name),
                                     f"gpu_save/{where}/{system.name}")
    del src_gpu
    torch.cuda.empty_cache()


def run_gpu_load(ctx: Context, wheres: list[str]) -> None:
    if not torch.cuda.is_available():
        ctx.note("gpu_load skipped: CUDA is not available")
        return
    spec, src, _ = ctx.main_state()
    dest = build_destination(spec, device="cuda")
    nbytes = spec.tensor_bytes
    for where in wheres:
        for system in ctx.systems:
            _ensure_checkpoint(ctx, system, src, ctx.ckpt_dir(where, "ckpt", system.name))
        for rep in range(ctx.cfg.repeats):
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "ckpt", system.name)
                scribble(dest)
                warm_files(path)
                dt = timed_load(system, dest, path, sync_cuda=True)
                check(ctx, system, src, dest, f"gpu_load/{where}")
                ctx.recorder.add("gpu_load", where, system.name, {"device": "cuda", "cache": "warm"}, nbytes,
                                 dt, "min(h2d,memcpy)", system.description)
                _log(ctx, "gpu_load", where, system.name, "cuda warm", rep, dt, nbytes)
    del dest
    torch.cuda.empty_cache()


def run_checkpoint_load(ctx: Context, checkpoint: str, dir_where: str | None) -> None:
    """Loads of a user's checkpoint into a state dict preallocated from its metadata, verified
    against an untimed load by the stock reader."""
    md = FileSystemReader(checkpoint).read_metadata()
    dest = destination_from_metadata(md)
    ctx.progress(f"checkpoint {checkpoint}: {len(dest)} entries, {fmt_size(state_nbytes(dest))} of tensors; "
                 f"reference load with the stock reader")
    dcp.load(dest, storage_reader=FileSystemReader(checkpoint), no_dist=True)
    reference = clone_state(dest)
    nbytes = state_nbytes(dest)
    info = fs_info(checkpoint)
    caches = ["warm"] if info.is_tmpfs or not ctx.cold_method else ["cold", "warm"]
    read_limit = (f"read:{dir_where}" if dir_where and same_device(checkpoint, ctx.targets[dir_where])
                  else None)
    if read_limit is None and "cold" in caches:
        ctx.note("the checkpoint is not on --dir's filesystem: cold loads have no measured read limit")
    primers = {s.name: _primer(ctx, s, dir_where) if dir_where else None for s in ctx.systems}
    for rep in range(ctx.cfg.repeats):
        for system in ctx.systems:
            for cache in caches:
                scribble(dest)
                prepare_cache(ctx, cache, checkpoint, primers[system.name])
                dt = timed_load(system, dest, checkpoint)
                check(ctx, system, reference, dest, f"checkpoint/{cache}")
                cfg = {"cache": cache, "source": "user checkpoint"}
                if cache == "cold":
                    cfg["cold_method"] = ctx.cold_method
                ctx.recorder.add("load", "checkpoint", system.name, cfg, nbytes, dt,
                                 read_limit if cache == "cold" else "memcpy", system.description)
                _log(ctx, "load", "ckpt", system.name, cache, rep, dt, nbytes)


SINGLE_PROCESS = {
    "save": run_save,
    "load": run_load,
    "small": run_small,
    "async": run_async,
    "gpu_save": run_gpu_save,
    "gpu_load": run_gpu_load,
}
