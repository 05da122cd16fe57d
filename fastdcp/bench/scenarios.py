"""Single-process scenarios: save, load (cold/warm), small tensors (with DCP's floor), async
save (blocked vs durable time, against a bare copy; one writer reused, or a new writer per save;
with first_save.py, the first save of a fresh process), GPU variants, loads of a user's existing
checkpoint, (training_loop.py) a training loop with an async_save every k steps, and
(concurrency.py) jobs saving into one directory while another loads it. The peers (peers.py:
torch.save, safetensors, torchsnapshot, nvidia-resiliency-ext) run in the save loop and, where
they have a load of their own, in the load loop, interleaved with the DCP systems.

Every scenario interleaves systems (A B C A B C ...) and verifies every loaded state dict
bit-exact against what was saved; a mismatch raises VerificationError. (The floor's no-I/O
"loads" load nothing by design and are the only loads not verified; see floor.py.)
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ..io.copy_engine import to_standin_device
from ..io.phases import PhaseRecorder, recording
from .config import BenchConfig, fmt_size
from .floor import FLOOR, FLOOR_PLANNERS, NullStorageReader, NullStorageWriter
from .limits import Limits, WriteSource
from .raw_io import RAW_IO, RawIo
from .pagecache import COLD_DROP, dir_bytes, fs_info, make_cold, same_device, warm_files
from .peers import Peer
from .process_group import OneRankGroup
from .results import GIB, Recorder
from .state import (EXIT_VERIFY, SCRIBBLE_BYTE, StateSpec, VerificationError, build_destination, build_state,
                    clone_state, corrupt_one_byte, destination_from_metadata, llm_like_spec, scribble,
                    small_tensor_spec, state_nbytes, verify_state)
from .systems import System, resolve_async_variants

_FIRST_SAVE_TIMEOUT_S = 600.0  # one child: imports, a state built, (process) the daemon, save, two loads


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
    peers: list[Peer] = field(default_factory=list)   # peers.py: run in save (and load)
    limits: Limits | None = None                      # the storage probes, for raw_io
    _main: tuple[StateSpec, dict, dict] | None = None
    _planners: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    _raw_io: dict[str, RawIo] = field(default_factory=dict)
    _raw_source: WriteSource = field(default_factory=WriteSource)   # shared by every RawIo

    def raw_io(self, where: str) -> RawIo | None:
        """The probe's best configuration of `where`, run in the save and load loops (raw_io.py);
        None without a probe of it or with --no-raw-io."""
        limit = self.limits.storage.get(where) if self.limits else None
        if not self.cfg.raw_io or limit is None or limit.write_best is None or limit.read_best is None:
            return None
        if where not in self._raw_io:
            self._raw_io[where] = RawIo(limit, self.main_state()[0].tensor_bytes, self.cold_method, self._raw_source)
        return self._raw_io[where]

    def close_raw_io(self) -> None:
        self._raw_io.clear()
        self._raw_source.close()

    def planner(self, system: System, kind: str, scope: str) -> Any:
        """The `kind` ("save" | "load") planner `system` uses in `scope` (a scenario/target):
        None for DCP's default; else one object per (system, kind, scope), reused, or a new one
        per call with --fresh-planners."""
        factory = system.make_save_planner if kind == "save" else system.make_load_planner
        if factory is None:
            return None
        if self.cfg.fresh_planners:
            return factory()
        key = (system.name, kind, scope)
        if key not in self._planners:
            self._planners[key] = factory()
        return self._planners[key]

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

def io_mode_of(mode: Any) -> str | None:
    """A fastdcp writer's ``last_write_mode`` / reader's ``last_read_mode`` as "O_DIRECT (why)" or
    "buffered (why)"; None for other systems."""
    if mode is None:
        return None
    return f"{'O_DIRECT' if mode.direct else 'buffered'} ({mode.reason})"


def timed_save(system: System, sd: dict[str, Any], path: str, planner: Any = None,
               writer: Any = None, mode_out: dict[str, Any] | None = None) -> float:
    """Seconds for one dcp.save (the writer is made outside the timing unless given).
    ``mode_out["io_mode"]``: how a fastdcp writer wrote its files (:func:`io_mode_of`)."""
    if path and os.path.exists(path):
        shutil.rmtree(path)
    os.sync()  # flush unrelated dirty pages (e.g. from the rmtree) outside the timed region
    gc.collect()
    writer = writer if writer is not None else system.make_writer(path)
    with recording() as recorder:
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
        elapsed = time.perf_counter() - t0
    if mode_out is not None:
        mode_out["io_mode"] = io_mode_of(getattr(writer, "last_write_mode", None))
        _record_phases(mode_out, recorder, elapsed)
    return elapsed


def _record_phases(out: dict[str, Any], recorder: PhaseRecorder, elapsed: float) -> None:
    """``out["phases"]``: the run's seconds per phase (``fastdcp.io.phases``) when the system's
    storage recorded any (stock's records none: its time is all ``outside``)."""
    phases = recorder.phases(elapsed)
    if len(phases) > 1:
        out["phases"] = phases


def phases_extra(mode: dict[str, Any]) -> dict[str, Any]:
    """The recorder extras of one timed run: its I/O mode and phases, where known."""
    return {k: mode[k] for k in ("io_mode", "phases") if mode.get(k)}


def timed_load(system: System, dest: dict[str, Any], path: str, sync_cuda: bool = False,
               reader_stats: dict[str, Any] | None = None, planner: Any = None,
               reader: Any = None, mode_out: dict[str, Any] | None = None) -> float:
    """Seconds for one dcp.load; fills ``reader_stats`` with the reader's own counters
    (fastdcp's ``last_stats``: bytes needed vs read, requests, seconds per phase) when it has any."""
    gc.collect()
    if sync_cuda:
        torch.cuda.synchronize()
    reader = reader if reader is not None else system.make_reader(path)
    with recording() as recorder:
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)
        if sync_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    if reader_stats is not None:
        reader_stats.update(getattr(reader, "last_stats", None) or {})
    if mode_out is not None:
        mode_out["io_mode"] = io_mode_of(getattr(reader, "last_read_mode", None))
        _record_phases(mode_out, recorder, elapsed)
    return elapsed


def timed_peer_save(peer: Peer, sd: dict[str, Any], path: str) -> float:
    """Seconds for one durable save by a peer (into the new directory `path`)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.sync()
    gc.collect()
    with peer.session():  # untimed set-up (nvrx_async: a process group)
        t0 = time.perf_counter()
        peer.save(sd, path)
        return time.perf_counter() - t0


def timed_peer_load(peer: Peer, dest: dict[str, Any], path: str) -> float:
    """Seconds for one load by a peer into the preallocated `dest`."""
    gc.collect()
    t0 = time.perf_counter()
    peer.load(dest, path)
    return time.perf_counter() - t0


def prepare_cache(ctx: Context, cache: str, path: str, primer: Callable[[], None] | None = None) -> None:
    if cache == "cold":
        make_cold(ctx.cold_method, path)
        if primer is not None:
            primer()  # re-fault the loader's code pages dropped with the page cache
    else:
        warm_files(path)


def check(ctx: Context, system: System | Peer, expected: dict[str, Any], loaded: dict[str, Any], what: str) -> None:
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
    # On tmpfs too the limit is the probe's write of a new file: every saved byte lands in a page
    # the kernel must allocate and fill, which costs several times a copy into memory already
    # faulted in (the memcpy limit), so memcpy would understate how close a save gets.
    return f"write:{where}"


def load_limit(where: str, tmpfs: bool, cache: str) -> str:
    return f"read:{where}" if (cache == "cold" and not tmpfs) else "memcpy"


def _fresh(factory: Callable[[], Any] | None) -> Any:
    return factory() if factory is not None else None


def _primer(ctx: Context, system: System, where: str) -> Callable[[], None] | None:
    """A tiny checkpoint per system, loaded untimed after drop_caches (with planner objects of
    its own, so that they never share state with the timed runs' planners)."""
    if ctx.cold_method != COLD_DROP:
        return None
    path = ctx.ckpt_dir(where, "primer", system.name)
    sd = {"primer": torch.arange(1024, dtype=torch.float32)}
    if not os.path.exists(os.path.join(path, ".metadata")):
        dcp.save(sd, storage_writer=system.make_writer(path), planner=_fresh(system.make_save_planner),
                 no_dist=True)
    dest = {"primer": torch.empty(1024, dtype=torch.float32)}
    return lambda: dcp.load(dest, storage_reader=system.make_reader(path),
                            planner=_fresh(system.make_load_planner), no_dist=True)


def _peer_primer(ctx: Context, peer: Peer, where: str) -> Callable[[], None] | None:
    """_primer for a peer: its own tiny checkpoint, loaded untimed after drop_caches."""
    if ctx.cold_method != COLD_DROP:
        return None
    path = ctx.ckpt_dir(where, "primer", peer.name)
    sd = {"primer": torch.arange(1024, dtype=torch.float32)}
    if not peer.exists(path):
        peer.save(sd, path)
    dest = {"primer": torch.empty(1024, dtype=torch.float32)}
    return lambda: peer.load(dest, path)


def _ensure_checkpoint(ctx: Context, system: System, sd: dict[str, Any], path: str) -> None:
    if not os.path.exists(os.path.join(path, ".metadata")):
        ctx.progress(f"writing {path} for loads ({system.name})")
        dcp.save(sd, storage_writer=system.make_writer(path), planner=_fresh(system.make_save_planner),
                 no_dist=True)


# --------------------------------------------------------------------------- scenarios

def _drop_checkpoint(path: str) -> None:
    """Remove a save's output (untimed) so that checkpoints of every system and repeat do not pile
    up in memory: on tmpfs each is a GiB of RAM, and a memory filesystem short of free pages writes
    at the speed of page reclaim, which would slow whichever system comes last."""
    shutil.rmtree(path, ignore_errors=True)  # the next timed save syncs before its clock starts


def run_save(ctx: Context, wheres: list[str]) -> None:
    """Durable saves of the LLM-like state, systems and peers interleaved (A B C D ... A B C D).

    Only the last repeat's checkpoints are kept, and only those the load scenario reads; the others
    are verified right after their last save and removed (see :func:`_drop_checkpoint`)."""
    spec, src, dest = ctx.main_state()
    nbytes = spec.tensor_bytes
    scens = ctx.cfg.scenarios
    loads_follow = "load" in scens and (
        "save" not in scens or scens.index("load") > scens.index("save"))

    def finish_system(where: str, system: System, path: str) -> None:
        # Every checkpoint gets verified: by the load scenario when it runs, else here. fastdcp's
        # is also read back with the stock reader in full mode (format compatibility).
        if loads_follow and (not system.name.startswith("fastdcp") or ctx.cfg.quick):
            return
        ctx.progress(f"save     {where:<4} {system.name:<10} checking the checkpoint with the stock reader")
        verify_with_stock_reader(src, spec, path, f"save/{where}/{system.name}")
        if not loads_follow:
            _drop_checkpoint(path)

    def finish_peer(where: str, peer: Any, path: str) -> None:
        # verified by the load scenario when it loads this peer's checkpoint, else here
        if loads_follow and peer.in_load_scenario:
            return
        ctx.progress(f"save     {where:<4} {peer.name:<10} checking the checkpoint "
                     f"({peer.description.get('load', 'its load')})")
        peer.verify(src, dest, path, f"save/{where}")
        _drop_checkpoint(path)

    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        for rep in range(ctx.cfg.repeats):
            last = rep == ctx.cfg.repeats - 1
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "ckpt", system.name)
                mode: dict[str, Any] = {}
                dt = timed_save(system, src, path, ctx.planner(system, "save", f"save/{where}"), mode_out=mode)
                ctx.recorder.add("save", where, system.name, {"fsync": True}, nbytes, dt,
                                 save_limit(where, tmpfs), system.description, file_bytes=dir_bytes(path),
                                 **phases_extra(mode))
                _log(ctx, "save", where, system.name, "fsync", rep, dt, nbytes)
                if last:
                    finish_system(where, system, path)
                else:
                    _drop_checkpoint(path)
            raw = ctx.raw_io(where)
            if raw is not None:
                os.sync()
                dt = raw.write(ctx.ckpt_dir(where, "ckpt", RAW_IO))
                ctx.recorder.add("save", where, RAW_IO, {"fsync": True}, nbytes, dt, save_limit(where, tmpfs),
                                 raw.description)
                _log(ctx, "save", where, RAW_IO, "fsync", rep, dt, nbytes)
            for peer in ctx.peers:
                path = ctx.ckpt_dir(where, "ckpt", peer.name)
                dt = timed_peer_save(peer, src, path)
                ctx.recorder.add("save", where, peer.name, {"fsync": True}, nbytes, dt,
                                 save_limit(where, tmpfs), peer.description, file_bytes=dir_bytes(path))
                _log(ctx, "save", where, peer.name, "fsync", rep, dt, nbytes)
                for n in peer.notes:
                    ctx.note(n)
                if last:
                    finish_peer(where, peer, path)
                else:
                    _drop_checkpoint(path)


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
        peers = [p for p in ctx.peers if p.in_load_scenario]
        for peer in peers:
            path = ctx.ckpt_dir(where, "ckpt", peer.name)
            if not peer.exists(path):
                ctx.progress(f"writing {path} for loads ({peer.name})")
                peer.save(src, path)
            primers[peer.name] = _peer_primer(ctx, peer, where)
        raw = ctx.raw_io(where) if "cold" in caches and not tmpfs else None
        raw_dir = ctx.ckpt_dir(where, "ckpt", RAW_IO)
        if raw is not None:
            raw.prepare_read(raw_dir)
        for rep in range(ctx.cfg.repeats):
            if raw is not None:
                dt = raw.read(raw_dir)
                ctx.recorder.add("load", where, RAW_IO, {"cache": "cold", "ckpt_writer": RAW_IO,
                                                        "cold_method": ctx.cold_method},
                                 nbytes, dt, load_limit(where, tmpfs, "cold"), raw.description)
                _log(ctx, "load", where, RAW_IO, "cold", rep, dt, nbytes)
            for system, writer in runs:
                path = ctx.ckpt_dir(where, "ckpt", writer.name)
                for cache in caches:
                    scribble(dest)
                    prepare_cache(ctx, cache, path, primers[system.name])
                    reader_stats: dict[str, Any] = {}
                    mode: dict[str, Any] = {}
                    dt = timed_load(system, dest, path, reader_stats=reader_stats,
                                    planner=ctx.planner(system, "load", f"load/{where}"), mode_out=mode)
                    check(ctx, system, src, dest, f"load/{where}/{cache}/ckpt_writer={writer.name}")
                    cfg = {"cache": cache, "ckpt_writer": writer.name}
                    if cache == "cold":
                        cfg["cold_method"] = ctx.cold_method
                    extra = {"reader_stats": reader_stats} if reader_stats else {}
                    extra.update(phases_extra(mode))
                    ctx.recorder.add("load", where, system.name, cfg, nbytes, dt,
                                     load_limit(where, tmpfs, cache), system.description, **extra)
                    _log(ctx, "load", where, system.name, f"{cache} ckpt={writer.name}", rep, dt, nbytes)
            for peer in peers:
                path = ctx.ckpt_dir(where, "ckpt", peer.name)
                for cache in caches:
                    scribble(dest)
                    prepare_cache(ctx, cache, path, primers[peer.name])
                    dt = timed_peer_load(peer, dest, path)
                    check(ctx, peer, {k: v for k, v in src.items() if k not in peer.skipped}, dest,
                          f"load/{where}/{cache}")
                    cfg = {"cache": cache, "ckpt_writer": peer.name}
                    if cache == "cold":
                        cfg["cold_method"] = ctx.cold_method
                    ctx.recorder.add("load", where, peer.name, cfg, nbytes, dt,
                                     load_limit(where, tmpfs, cache), peer.description)
                    _log(ctx, "load", where, peer.name, cache, rep, dt, nbytes)
        shutil.rmtree(raw_dir, ignore_errors=True)


def run_label(i: int) -> str:
    """'1st' for the first save/load of a system in a case (first use of its writer/planner
    objects, per-process plan caches cleared before it: System.start_cold), '2nd+' for the later
    ones; reported separately so that one-time costs (planning, staging buffers, thread pools)
    are visible instead of folded into a median."""
    return "1st" if i == 0 else "2nd+"


def _plan_counters(planner: Any) -> tuple[int, int] | None:
    """(hits, misses) of a fastdcp planner's plan caches so far (local and, for saves, global
    plans), or None for planners without such counters."""
    if planner is None or not hasattr(planner, "local_plan_hits"):
        return None
    get = lambda n: int(getattr(planner, n, 0) or 0)  # noqa: E731
    return (get("local_plan_hits") + get("global_plan_hits"),
            get("local_plan_misses") + get("global_plan_misses"))


def _timed_with_plan_stats(fn: Callable[[Any], float], planner: Any) -> tuple[float, dict[str, Any]]:
    """Run fn(planner); extras saying whether the planner's plan caches hit ("plan_cache")."""
    before = _plan_counters(planner)
    dt = fn(planner)
    after = _plan_counters(planner)
    if before is None or after is None:
        return dt, {}
    hits, misses = after[0] - before[0], after[1] - before[1]
    return dt, {"plan_cache": "hit" if hits and not misses else "miss" if misses and not hits
                else f"{hits} hits, {misses} misses"}


def small_label(params: dict[str, Any]) -> str:
    label = f"{params['count']}x{fmt_size(params['tensor_bytes'])}"
    if params["large_count"]:
        label += f"+{params['large_count']}x{fmt_size(params['large_bytes'])}"
    return label.replace(" ", "")


def floor_systems(ctx: Context) -> list[System]:
    """DCP's floor: the same dcp.save/dcp.load with a storage that does no I/O (floor.py), with
    DCP's default planners, and with the planners of the first planner system when one runs."""
    out = [System(FLOOR, lambda p: NullStorageWriter(), lambda p: None,
                  {"writer": "NullStorageWriter (no I/O)",
                   "reader": "NullStorageReader (metadata of a real save; reads nothing)",
                   "planners": "DCP defaults"})]
    ps = next((s for s in ctx.systems if s.make_save_planner is not None), None)
    if ps is not None:
        out.append(System(FLOOR_PLANNERS, lambda p: NullStorageWriter(), lambda p: None,
                          {"writer": "NullStorageWriter (no I/O)",
                           "reader": "NullStorageReader (metadata of a real save; reads nothing)",
                           "planners": ps.description.get("planners", ps.name)},
                          standin=ps.standin, make_save_planner=ps.make_save_planner,
                          make_load_planner=ps.make_load_planner, clear_caches=ps.clear_caches))
    return out


def run_small(ctx: Context, wheres: list[str]) -> None:
    """Many tiny tensors (default 5,000 x 1 KiB, nothing else): save, then a warm load, per
    system; the first save/load of each system (`run=1st`) apart from the later ones (`2nd+`).
    With the floor on, DCP's own cost (no-I/O storage) is measured in the same interleaving."""
    c = ctx.cfg
    spec = small_tensor_spec(c.small_count, c.small_bytes, c.small_large_count, c.small_large_bytes)
    ctx.progress(f"building state: {spec.summary()}")
    src, dest = build_state(spec), build_destination(spec)
    nbytes = spec.tensor_bytes
    label = small_label(spec.params)
    repeats = c.small_repeats or c.repeats
    floors = floor_systems(ctx) if c.floor else []
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        scope = f"small/{where}"
        metadata = None
        failed: set[str] = set()
        for rep in range(repeats):
            run = run_label(rep)
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "small", system.name)
                if rep == 0:
                    system.start_cold()
                dt, stats = _timed_with_plan_stats(lambda pl: timed_save(system, src, path, pl),
                                                   ctx.planner(system, "save", scope))
                ctx.recorder.add("small", where, system.name, {"op": "save", "tensors": label, "run": run},
                                 nbytes, dt, save_limit(where, tmpfs), system.description,
                                 file_bytes=dir_bytes(path), **stats)
                _log(ctx, "small", where, system.name, f"save {run}", rep, dt, nbytes, repeats)
                scribble(dest)
                warm_files(path)
                dt, stats = _timed_with_plan_stats(lambda pl: timed_load(system, dest, path, planner=pl),
                                                   ctx.planner(system, "load", scope))
                check(ctx, system, src, dest, f"small/{where}")
                ctx.recorder.add("small", where, system.name, {"op": "load", "tensors": label, "run": run},
                                 nbytes, dt, "memcpy", system.description, **stats)
                _log(ctx, "small", where, system.name, f"load {run} (warm)", rep, dt, nbytes, repeats)
                if metadata is None and floors:  # untimed: the floor's reader replays it
                    metadata = FileSystemReader(path).read_metadata()
            for floor in floors:
                if floor.name in failed:
                    continue
                if metadata is None:
                    metadata = _capture_metadata(ctx, src, where)
                try:
                    if rep == 0:
                        floor.start_cold()
                    dt, stats = _timed_with_plan_stats(
                        lambda pl: timed_save(floor, src, "", pl, writer=NullStorageWriter()),
                        ctx.planner(floor, "save", scope))
                    ctx.recorder.add("small", where, floor.name, {"op": "save", "tensors": label, "run": run},
                                     nbytes, dt, None, floor.description, **stats)
                    _log(ctx, "small", where, floor.name, f"save {run} (no I/O)", rep, dt, nbytes, repeats)
                    dt2, stats = _timed_with_plan_stats(
                        lambda pl: timed_load(floor, dest, "", planner=pl, reader=NullStorageReader(metadata)),
                        ctx.planner(floor, "load", scope))
                    ctx.recorder.add("small", where, floor.name, {"op": "load", "tensors": label, "run": run},
                                     nbytes, dt2, None, floor.description, **stats)
                    _log(ctx, "small", where, floor.name, f"load {run} (no I/O)", rep, dt2, nbytes, repeats)
                except Exception as exc:  # e.g. planners that need a real storage layer
                    failed.add(floor.name)
                    ctx.note(f"{floor.name} not measured: dcp.save/load with a no-I/O storage and "
                             f"{floor.description.get('planners')} failed ({type(exc).__name__}: {exc})")


def _capture_metadata(ctx: Context, src: dict[str, Any], where: str) -> Any:
    """Metadata of a real (stock, untimed) save of `src`, for the floor's reader."""
    path = ctx.ckpt_dir(where, "small", "floor_metadata")
    dcp.save(src, storage_writer=FileSystemWriter(path), no_dist=True)
    md = FileSystemReader(path).read_metadata()
    shutil.rmtree(path, ignore_errors=True)
    return md


# --------------------------------------------------------------------------- async

class _ProcessMode:
    """What AsyncCheckpointerType.PROCESS needs in a single process: a process group (stock
    reads rank/world size from it and broadcasts the daemon's store address over it, even with
    no_dist=True), so a 1-rank gloo group is started here when none exists, and MASTER_ADDR
    (else the daemon's store binds to the host's FQDN). The daemon is spawned once, by an
    untimed warm-up save (into ``warmup_path``, removed afterwards), so that no system's timed
    save pays for it."""

    def __init__(self, warmup_path: str, progress: Callable[[str], None] | None = None) -> None:
        self.old_addr = os.environ.get("MASTER_ADDR")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        self.group = OneRankGroup().open()
        t0 = time.perf_counter()
        fut = dcp.async_save({"warmup": torch.zeros(4)}, storage_writer=FileSystemWriter(warmup_path),
                             **_async_kwargs("process"))
        getattr(fut, "upload_completion", fut).result()
        shutil.rmtree(warmup_path, ignore_errors=True)
        self.daemon_pid = self._daemon_pid()
        if progress is not None:
            progress(f"async    process mode: checkpoint daemon (pid {self.daemon_pid}) started in "
                     f"{time.perf_counter() - t0:.1f} s (untimed warm-up save)")

    @staticmethod
    def _daemon_pid() -> int | None:
        try:
            from torch.distributed.checkpoint import _async_process_executor as ape

            return ape._CHECKPOINT_PROCESS._save_process.pid  # private: best effort
        except Exception:
            return None

    def settle(self, quiet_s: float = 0.05, max_s: float = 2.0) -> None:
        """Wait (untimed) until the daemon has stopped using the CPU after its last save (it
        keeps working for a while after answering, e.g. releasing the shared-memory state it
        received): on a machine with few cores its leftovers would otherwise slow down the next
        timed step, whichever system that is."""
        if self.daemon_pid is None:
            return
        deadline = time.perf_counter() + max_s
        last = _cpu_ticks(self.daemon_pid)
        while last is not None and time.perf_counter() < deadline:
            time.sleep(quiet_s)
            now = _cpu_ticks(self.daemon_pid)
            if now == last:
                return
            last = now

    def close(self) -> None:
        self.group.close()
        if self.old_addr is None:
            os.environ.pop("MASTER_ADDR", None)
        else:
            os.environ["MASTER_ADDR"] = self.old_addr


def _cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _async_kwargs(mode: str) -> dict[str, Any]:
    params = inspect.signature(dcp.async_save).parameters
    kw: dict[str, Any] = {"no_dist": True} if "no_dist" in params else {}
    if mode == "process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
    return kw


def _bare_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], cuda: bool, rounds: int = 3) -> float:
    """Seconds to copy every source tensor into its preallocated host buffer: what staging
    cannot go below (torch copy_; from the GPU: non_blocking D2H into pinned memory + one
    synchronize). The best of `rounds` back-to-back runs: a floor, not a typical time."""
    gc.collect()
    best = float("inf")
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, s in pairs:
            dst.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _canary_name(spec: StateSpec) -> str:
    small = [t for t in spec.tensors if t.dtype == torch.float32 and len(t.shape) == 1]
    return (small or list(spec.tensors))[-1].name


def _run_async(ctx: Context, wheres: list[str], scenario: str, device: str,
               new_writer: bool = False) -> None:
    """dcp.async_save into new directories through checkpoint_id=, with ONE writer object per
    system reused for every save (staging buffers may be reused), or, with `new_writer`, a NEW
    writer object per save, built inside the timing (`dcp.async_save(sd, checkpoint_id=path,
    storage_writer=FastFileSystemWriter(path))`, the common pattern). Per save: `blocked` =
    until the caller may modify the state again (async_save returned, plus its staging future
    when it returns one); `durable` = until the upload future's result (files and .metadata
    written). Per save, interleaved: the bare copy of the same tensors into preallocated host
    buffers (`bare_copy`, the floor of `blocked`). One tensor (the canary) and the `step` entry
    change before every save and are overwritten right after `blocked`; every checkpoint is
    then loaded and verified bit-exact (it must hold the values from before the overwrite)."""
    cuda = device == "cuda"
    spec, src_cpu, dest = ctx.main_state()
    nbytes = spec.tensor_bytes
    src = {k: to_device(v, device) for k, v in src_cpu.items()} if device in ("cuda", STANDIN) else src_cpu
    canary_name = _canary_name(spec)
    canary = src[canary_name]
    canary_orig = canary.clone()
    step_orig = src.get("step")
    pin = torch.cuda.is_available()
    pairs = [(torch.empty(v.shape, dtype=v.dtype, pin_memory=pin).fill_(0), v)
             for v in src.values() if isinstance(v, torch.Tensor)]
    _bare_copy(pairs, cuda, rounds=1)  # untimed: first touch of both sides, allocator warm
    saves = ctx.cfg.async_saves or ctx.cfg.repeats + 1
    bare_descr = {"what": "copy_ of every tensor into preallocated " + ("pinned " if pin else "")
                          + "host tensors" + (" (non_blocking D2H + synchronize)" if cuda else "")}
    blocked_limit = "d2h" if cuda else "memcpy"
    if device == STANDIN:
        bare_descr["what"] += " (the stand-in device's tensors: a memcpy each)"
    standin = ctx.cfg.standin or any(s.standin for s in ctx.systems)
    systems = list(ctx.systems) + resolve_async_variants(ctx.cfg.async_variants, standin, ctx.notes)
    try:
        for mode in ctx.cfg.async_modes:
            proc = None
            if mode == "process":
                try:
                    proc = _ProcessMode(os.path.join(ctx.targets[next(iter(ctx.targets))], "async", "process_warmup"),
                                        ctx.progress)
                except Exception as exc:
                    ctx.note(f"{scenario} process mode not measured: {type(exc).__name__}: {exc}")
                    continue
            try:
                for where in wheres:
                    _async_where(ctx, scenario, where, mode, systems, src, src_cpu, dest, canary_name,
                                 canary_orig, step_orig, pairs, saves, cuda, nbytes, bare_descr, blocked_limit,
                                 proc.settle if proc is not None else (lambda: None), new_writer)
            finally:
                if proc is not None:
                    proc.close()
    finally:
        canary.copy_(canary_orig)
        if step_orig is not None:
            src["step"] = step_orig
        if device != "cpu":
            del src, pairs
        if cuda:
            torch.cuda.empty_cache()


def _async_where(ctx: Context, scenario: str, where: str, mode: str, systems: list[System], src: dict[str, Any],
                 src_cpu: dict[str, Any], dest: dict[str, Any], canary_name: str,
                 canary_orig: torch.Tensor, step_orig: Any, pairs: list, saves: int, cuda: bool,
                 nbytes: int, bare_descr: dict[str, Any], blocked_limit: str,
                 settle: Callable[[], None], new_writer: bool = False) -> None:
    tmpfs = ctx.tmpfs(where)
    durable_limit = f"min(d2h,{save_limit(where, tmpfs)})" if cuda else save_limit(where, tmpfs)
    root = os.path.join(ctx.targets[where], "async", scenario, mode)
    canary = src[canary_name]
    writers: dict[str, Any] = {}
    stagers: dict[str, Any] = {}
    failed: set[str] = set()
    kwargs = _async_kwargs(mode)
    try:
        for i in range(saves):
            run = run_label(i)
            settle()
            dt = _bare_copy(pairs, cuda)
            ctx.recorder.add(scenario, where, "bare_copy", {"mode": mode, "run": run, "phase": "blocked"}, nbytes,
                             dt, blocked_limit, bare_descr)
            _log(ctx, scenario, where, "bare_copy", f"{mode} {run}", i, dt, nbytes, saves)
            for si, system in enumerate(systems):
                if system.name in failed:
                    continue
                path = os.path.join(root, system.name, f"save{i}")
                if not new_writer and system.name not in writers:
                    writers[system.name] = system.async_writer(path)
                if i == 0:
                    system.start_cold()
                # the values this checkpoint must hold
                key = ((i * 64 + si + 1) * 0x01000193) & 0x7FFFFFFF
                canary.copy_(canary_orig)
                canary.view(torch.int32).bitwise_xor_(key)
                expected = dict(src_cpu)
                expected[canary_name] = canary.cpu().clone() if cuda else canary.clone()
                if step_orig is not None:
                    src["step"] = expected["step"] = int(step_orig) * 1000 + i
                os.sync()
                gc.collect()
                settle()
                if cuda:
                    torch.cuda.synchronize()
                try:
                    planner = ctx.planner(system, "save", f"{scenario}/{where}/{mode}")
                    call_kwargs = dict(kwargs)
                    if system.make_stager is not None:
                        if system.name not in stagers:
                            stagers[system.name] = system.make_stager()
                        call_kwargs["async_stager"] = stagers[system.name]
                    with recording() as recorder:
                        t0 = time.perf_counter()
                        writer = system.async_writer(path) if new_writer else writers[system.name]
                        resp = dcp.async_save(src, checkpoint_id=path, storage_writer=writer, planner=planner,
                                              **call_kwargs)
                        t_call = time.perf_counter() - t0
                        phases_call = recorder.phases(t_call)
                        staging = getattr(resp, "staging_completion", None)  # AsyncSaveResponse (newer torch)
                        if staging is not None:
                            staging.result()
                        t_staged = time.perf_counter() - t0
                        phases_staged = recorder.phases(t_staged)
                        # an overlapped system's caller is free once the call returns; here it waits for
                        # staging first (what the guard or stock's protocol does in a loop)
                        t_blocked = t_call if system.overlapped else t_staged
                        # the caller modifies the state at once (the checkpoint must not see it)
                        canary.view(torch.uint8).fill_(SCRIBBLE_BYTE)
                        if step_orig is not None:
                            src["step"] = -1
                        getattr(resp, "upload_completion", resp).result()
                        t_durable = time.perf_counter() - t0
                    # Phases up to each point (spans of the background save still running at
                    # `blocked` count from the point they end, in `durable`).
                    phases_at = {"blocked": phases_call if system.overlapped else phases_staged,
                                 "staged": phases_staged, "durable": recorder.phases(t_durable)}
                except Exception as exc:
                    if mode != "process" and not system.overlapped:
                        raise
                    failed.add(system.name)
                    ctx.note(f"{scenario} {mode} mode: {system.name} failed ({type(exc).__name__}: {exc}); "
                             f"left out of that mode")
                    continue
                base = {"mode": mode, "run": run}
                phases = [("blocked", t_blocked, blocked_limit)]
                if system.overlapped:
                    phases.append(("staged", t_staged, blocked_limit))
                phases.append(("durable", t_durable, durable_limit))
                for phase, seconds, limit in phases:
                    extra = {"phases": phases_at[phase]} if len(phases_at["durable"]) > 1 else {}
                    ctx.recorder.add(scenario, where, system.name, {**base, "phase": phase}, nbytes, seconds, limit,
                                     system.description, **extra)
                    _log(ctx, scenario, where, system.name, f"{mode} {run} {phase}", i, seconds, nbytes, saves)
                scribble(dest)
                dcp.load(dest, storage_reader=system.make_reader(path), no_dist=True)
                check(ctx, system, expected, dest, f"{scenario}/{where}/{mode}/save{i}")
                shutil.rmtree(path, ignore_errors=True)
    finally:
        for stager in stagers.values():
            try:
                stager.close()
            except Exception as exc:  # a stager that failed to start has nothing to close
                ctx.note(f"{scenario}: closing a stager failed ({type(exc).__name__}: {exc})")


def run_async(ctx: Context, wheres: list[str]) -> None:
    _run_async(ctx, wheres, "async", "cpu")


def run_async_new_writer(ctx: Context, wheres: list[str]) -> None:
    _run_async(ctx, wheres, "async_new_writer", "cpu", new_writer=True)


def run_async_first(ctx: Context, wheres: list[str]) -> None:
    """Each system's first ``dcp.async_save`` of a process, in a fresh child process per save
    (:mod:`fastdcp.bench.first_save`, which says why), ``repeats`` rounds, interleaved over the
    modes, targets and systems; every checkpoint verified bit-exact in the child."""
    spec = llm_like_spec(ctx.cfg.size)
    nbytes = spec.tensor_bytes
    for i in range(ctx.cfg.repeats):
        for mode in ctx.cfg.async_modes:
            for where in wheres:
                root = os.path.join(ctx.targets[where], "async", "first", mode)
                os.makedirs(root, exist_ok=True)
                for system in ctx.systems:
                    path = os.path.join(root, system.name)
                    shutil.rmtree(path, ignore_errors=True)
                    out = os.path.join(root, f"{system.name}.json")
                    os.sync()
                    corrupt = ctx.cfg.corrupt_after_load in (system.name, "all")
                    result = _first_save_child(system.name, mode, path, ctx.cfg.size, out, corrupt)
                    shutil.rmtree(path, ignore_errors=True)
                    base = {"mode": mode, "run": "1st"}
                    for phase, limit in (("blocked", "memcpy"), ("durable", save_limit(where, ctx.tmpfs(where)))):
                        seconds = result[f"{phase}_s"]
                        ctx.recorder.add("async_first", where, system.name, {**base, "phase": phase}, nbytes, seconds,
                                         limit, {**system.description, "process": "fresh, one save"})
                        _log(ctx, "async_first", where, system.name, f"{mode} {phase}", i, seconds, nbytes)


def _first_save_child(system: str, mode: str, path: str, size: int, out: str,
                      corrupt_after_load: bool = False) -> dict[str, float]:
    """Run :mod:`fastdcp.bench.first_save` in a fresh interpreter and return its result; a
    failure (verification included) raises with the child's last output."""
    cmd = [sys.executable, "-m", "fastdcp.bench.first_save", "--system", system, "--mode", mode, "--path", path,
           "--size", str(size), "--out", out] + (["--corrupt-after-load"] if corrupt_after_load else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_FIRST_SAVE_TIMEOUT_S)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        if proc.returncode == EXIT_VERIFY:
            raise VerificationError(f"async_first/{mode} [{system}]: the child's checkpoint did not verify:\n{tail}")
        raise RuntimeError(f"async_first/{mode} [{system}]: the child exited with {proc.returncode}:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def run_gpu_async(ctx: Context, wheres: list[str]) -> None:
    kind = device_kind(ctx)
    if kind is None:
        ctx.note("gpu_async skipped: CUDA is not available (--device cpu-standin runs it on the stand-in device)")
        return
    _run_async(ctx, wheres, "gpu_async", kind)


def run_gpu_async_new_writer(ctx: Context, wheres: list[str]) -> None:
    kind = device_kind(ctx)
    if kind is None:
        ctx.note("gpu_async_new_writer skipped: CUDA is not available (--device cpu-standin runs it on the "
                 "stand-in device)")
        return
    _run_async(ctx, wheres, "gpu_async_new_writer", kind, new_writer=True)


STANDIN = "cpu-standin"


def device_kind(ctx: Context) -> str | None:
    """The device of the gpu_* scenarios: ``"cuda"``, ``"cpu-standin"`` (``--device cpu-standin``:
    stand-in device tensors, see ``fastdcp.io.copy_engine``), or None (no CUDA: skipped)."""
    if ctx.cfg.device == STANDIN:
        return STANDIN
    return "cuda" if torch.cuda.is_available() else None


def to_device(value: Any, kind: str) -> Any:
    """``value`` on the scenario's device (tensors only)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.cuda() if kind == "cuda" else to_standin_device(value)


def _sync(kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()


def device_limit(kind: str, direction: str) -> str:
    """The transfer limit of ``direction`` (``d2h``/``h2d``) on ``kind``: the probe of that copy on
    a GPU; the memcpy probe on the stand-in (its copies are memcpys)."""
    return direction if kind == "cuda" else "memcpy"


def run_gpu_save(ctx: Context, wheres: list[str]) -> None:
    kind = device_kind(ctx)
    if kind is None:
        ctx.note("gpu_save skipped: CUDA is not available (--device cpu-standin runs it on the stand-in device)")
        return
    spec, src, _ = ctx.main_state()
    src_dev = {k: to_device(v, kind) for k, v in src.items()}
    nbytes = spec.tensor_bytes
    for where in wheres:
        # tmpfs too: a new file's pages are allocated and filled (save_limit says why)
        limit = f"min({device_limit(kind, 'd2h')},write:{where})"
        for rep in range(ctx.cfg.repeats):
            for system in ctx.systems:
                path = ctx.ckpt_dir(where, "gpu", system.name)
                _sync(kind)
                mode: dict[str, Any] = {}
                dt = timed_save(system, src_dev, path, ctx.planner(system, "save", f"gpu_save/{where}"), mode_out=mode)
                ctx.recorder.add("gpu_save", where, system.name, {"device": kind}, nbytes, dt, limit,
                                 system.description, **phases_extra(mode))
                _log(ctx, "gpu_save", where, system.name, kind, rep, dt, nbytes)
        for system in ctx.systems:
            verify_with_stock_reader(src, spec, ctx.ckpt_dir(where, "gpu", system.name),
                                     f"gpu_save/{where}/{system.name}")
    del src_dev
    if kind == "cuda":
        torch.cuda.empty_cache()


def run_gpu_load(ctx: Context, wheres: list[str]) -> None:
    kind = device_kind(ctx)
    if kind is None:
        ctx.note("gpu_load skipped: CUDA is not available (--device cpu-standin runs it on the stand-in device)")
        return
    spec, src, _ = ctx.main_state()
    dest = build_destination(spec, device="cuda") if kind == "cuda" else {
        k: to_device(v, kind) for k, v in build_destination(spec).items()}
    nbytes = spec.tensor_bytes
    for where in wheres:
        for system in ctx.systems:
            _ensure_checkpoint(ctx, system, src, ctx.ckpt_dir(where, "ckpt", system.name))
        tmpfs = ctx.tmpfs(where)
        for rep in range(ctx.cfg.repeats):
            for cache in ctx.caches(where):
                for system in ctx.systems:
                    path = ctx.ckpt_dir(where, "ckpt", system.name)
                    scribble(dest)
                    if cache == "cold":
                        make_cold(ctx.cold_method, path)
                    else:
                        warm_files(path)
                    mode: dict[str, Any] = {}
                    dt = timed_load(system, dest, path, sync_cuda=kind == "cuda",
                                    planner=ctx.planner(system, "load", f"gpu_load/{where}"), mode_out=mode)
                    check(ctx, system, src, dest, f"gpu_load/{where}/{cache}")
                    ctx.recorder.add("gpu_load", where, system.name, {"device": kind, "cache": cache}, nbytes,
                                     dt, f"min({device_limit(kind, 'h2d')},{load_limit(where, tmpfs, cache)})",
                                     system.description, **phases_extra(mode))
                    _log(ctx, "gpu_load", where, system.name, f"{kind} {cache}", rep, dt, nbytes)
    del dest
    if kind == "cuda":
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
                dt = timed_load(system, dest, checkpoint, planner=ctx.planner(system, "load", "checkpoint"))
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
    "async_new_writer": run_async_new_writer,
    "async_first": run_async_first,
    "gpu_save": run_gpu_save,
    "gpu_load": run_gpu_load,
    "gpu_async": run_gpu_async,
    "gpu_async_new_writer": run_gpu_async_new_writer,
}  # runner.py adds training_loop.py's and concurrency.py's, which build on this module
