"""Tiered checkpoint scenario (`tiered`): what a tiered save costs a training loop, and how soon
its checkpoint is durable in the shared tier, against saving to the shared tier directly and to
the local tier only, in one run.

The loop is train_loop's (training_loop.py: the same model + AdamW + BatchNorm, the batch
calibrated to ``--train-step-ms``, a ``dcp.async_save`` every ``--train-every`` of
``--train-steps`` steps into a new directory through a new writer, the previous upload waited on
at the next checkpoint step, the loop ending when its last upload future resolved, the exact state
copied at each call with the loop's clock stopped; every loop, the first ``none`` too, starts with
train_loop's untimed warm-up steps, so that none is timed cold). Systems, interleaved per repeat
(none stock fastdcp fastdcp_local fastdcp_tiered none ...):

* ``none``: the loop without checkpoints, the reference of ``loop_slowdown``;
* ``stock``: ``FileSystemWriter(<shared>/ckpt<i>)``, async_save's default staging;
* ``fastdcp``: ``FastFileSystemWriter(<shared>/ckpt<i>, async_staging=True)`` with one
  ``fastdcp.guard(optimizer, model)`` per loop (overlapped staging needs it);
* ``fastdcp_local``: the same into the local tier (``--local-tier``, default /dev/shm) and nowhere
  else: the local-only reference a tiered loop is judged against;
* ``fastdcp_tiered``: ``FastTieredWriter(<shared>/ckpt<i>, local_root=<local tier>/...,
  async_staging=True)`` with the guard: ``upload_completion`` resolves at the local commit and the
  drain to the shared directory runs behind the following steps.

The shared tier is a directory under ``--dir`` (the ``dir`` target, on the disk).

Per system and repeat, one value of each :class:`TieredLoopRecord` field in the ``extra`` of the
system's result (scenario "tiered", where = the shared tier's target, seconds = the loop times):
``loop_slowdown`` (loop / the ``none`` loop of the same repeat), per checkpoint ``blocked_s`` and
``committed_local_s`` (from the call until ``upload_completion`` resolved: for the direct systems
that is the commit in the shared directory) and ``durable_shared_s`` (until the checkpoint was
committed in the shared directory: for fastdcp_tiered when ``writer.durable`` resolved, timed by a
done-callback so that measuring never blocks; None for fastdcp_local), ``shared_drain_s`` (after a
tiered loop, the wait until its last checkpoint is durable in the shared tier: not part of the loop
time, the job would go on training), host memory (peak RSS, and ``local_tier_bytes``: tmpfs pages
are host memory that no process's RSS counts).

The tiered writer keeps every local copy of a loop (``keep_local`` = the loop's checkpoints) when
the local tier has room for them, so that each one can be verified; otherwise the writer's default
applies and a note says which local copies went unverified.

Verification, after each loop: every checkpoint loaded with stock ``FileSystemReader`` from the
shared directory (fastdcp_local: its local directory), and for fastdcp_tiered also from its local
copy and through ``fastdcp.FastTieredReader`` (which tier it chose is recorded), into a fresh,
scribbled destination, compared bit-exact with the copy taken at its ``async_save`` call; a
mismatch raises VerificationError.

Judged under the table (the targets): the tiered loop within 10% of fastdcp_local's; its
median ``durable_shared_s`` no later than the faster direct system's; every load bit-exact.

Caveat: the drain of a tiered checkpoint may still run while the loop's clock is stopped for the
next verification copy (``copy_seconds``, recorded); that much drain work falls outside the loop
time. The copies go to /dev/shm when they fit, so the window is short.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from .config import fmt_size
from .pagecache import dir_bytes, same_device
from .results import Result
from .scenarios import Context, check
from .state import VerificationError
from .training_loop import BUSY_SHARE, LoopRun, LoopSystem, SnapshotStore, SyntheticTraining, flat, run_loop

__all__ = ["run_tiered", "tiered_rows", "tiered_lines", "TieredLoopRecord", "TieredRow"]

SCENARIO = "tiered"
GROUP = "tiered"                 # directory under the shared tier's target; removed by the runner afterwards
NONE = "none"                    # the loop without checkpoints
STOCK, FASTDCP, LOCAL_ONLY, TIERED = "stock", "fastdcp", "fastdcp_local", "fastdcp_tiered"
TIERED_SYSTEMS = (STOCK, FASTDCP, LOCAL_ONLY, TIERED)
DIRECT_SYSTEMS = (STOCK, FASTDCP)  # saving straight to the shared tier
LOOP_TARGET = 0.10               # target: a tiered loop within 10% of a local-only one
DRAIN_WAIT_S = 600.0             # after a loop: most seconds to wait for its shared commits
# Room the local tier needs per byte of a loop's checkpoints to keep them all (the metadata and
# the file layout add a little).
LOCAL_ROOM_FACTOR = 1.1


# --------------------------------------------------------------------------- systems

@dataclass
class TieredSystem:
    """A checkpointing system of the scenario. ``lands_in``: "shared" (straight to the shared
    directory), "local" (the local tier only) or "tiered" (local commit, then the drain)."""
    name: str
    lands_in: str
    make_writer: Callable[[str, "LoopDirs"], Any]   # (checkpoint path, this loop's directories)
    description: dict[str, Any] = field(default_factory=dict)
    guard: Callable[[Any, Any], Any] | None = None
    release_pool: Callable[[], None] | None = None
    optional: bool = False   # a failure (not a verification failure) leaves it out with a note

    def loop_system(self, dirs: "LoopDirs") -> LoopSystem:
        """train_loop's view of this system for one loop (the writer needs the loop's directories)."""
        return LoopSystem(self.name, lambda path: self.make_writer(path, dirs), self.description,
                          guard=self.guard, release_pool=self.release_pool, optional=self.optional)


@dataclass
class LoopDirs:
    """Where one loop's checkpoints go: ``root`` holds ckpt<i> (the shared directory, or the local
    tier for fastdcp_local); ``local_root`` is the tiered writer's local tier, this loop's own.
    ``writers``: the tiered writers made, in checkpoint order (their durable futures are read
    after the loop)."""
    root: str
    local_root: str | None = None
    keep_local: int | None = None
    writers: list[Any] = field(default_factory=list)


def _durable_timed_writer_class() -> type:
    """``FastTieredWriter`` that notes when its save's commit in the shared tier completed (a
    done-callback on ``writer.durable``, which ``finish`` sets). Built on first use: importing
    this module must not need fastdcp (a stand-in run has none)."""
    from fastdcp import FastTieredWriter

    class DurableTimedTieredWriter(FastTieredWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.durable_at: float | None = None    # time.perf_counter() when durable resolved
            self.durable_noted = threading.Event()  # Future.result() returns before callbacks ran

        def finish(self, metadata: Any, results: Any) -> None:
            super().finish(metadata, results)

            def note(_: Any) -> None:
                self.durable_at = time.perf_counter()
                self.durable_noted.set()

            self.durable.add_done_callback(note)

    return DurableTimedTieredWriter


def tiered_systems(ctx: Context) -> list[TieredSystem]:
    """The systems that can run here, in TIERED_SYSTEMS order; a note for each one left out."""
    names = {s.name for s in ctx.systems}
    out: list[TieredSystem] = []
    if STOCK in names:
        out.append(TieredSystem(STOCK, "shared", lambda p, _: FileSystemWriter(p),
                                {"writer": "FileSystemWriter(shared/ckpt<i>)",
                                 "staging": "async_save default (returns once copied)"}))
    if FASTDCP not in names:
        return out
    fast = next(s for s in ctx.systems if s.name == FASTDCP)
    if fast.standin:
        ctx.note(f"{SCENARIO}: the fastdcp systems not measured: fastdcp is a stand-in")
        return out
    import fastdcp

    missing = [n for n in ("guard", "FastTieredWriter", "FastTieredReader") if not hasattr(fastdcp, n)]
    if missing:
        ctx.note(f"{SCENARIO}: the fastdcp systems not measured: this fastdcp has no {', '.join(missing)}")
        return out
    common = dict(guard=fastdcp.guard, release_pool=getattr(fastdcp, "release_staging", None), optional=True)
    guarded = {"guard": "fastdcp.guard(optimizer, model) once before the loop, .remove() after"}
    out.append(TieredSystem(FASTDCP, "shared", lambda p, _: fastdcp.FastFileSystemWriter(p, async_staging=True),
                            {"writer": "FastFileSystemWriter(shared/ckpt<i>, async_staging=True)", **guarded},
                            **common))
    out.append(TieredSystem(LOCAL_ONLY, "local", lambda p, _: fastdcp.FastFileSystemWriter(p, async_staging=True),
                            {"writer": "FastFileSystemWriter(<local tier>/ckpt<i>, async_staging=True)", **guarded},
                            **common))
    timed_writer = _durable_timed_writer_class()

    def tiered_writer(path: str, dirs: LoopDirs) -> Any:
        kw = {} if dirs.keep_local is None else {"keep_local": dirs.keep_local}
        writer = timed_writer(path, local_root=dirs.local_root, async_staging=True, **kw)
        dirs.writers.append(writer)
        return writer

    out.append(TieredSystem(TIERED, "tiered", tiered_writer,
                            {"writer": "FastTieredWriter(shared/ckpt<i>, local_root=<local tier>/<loop>, "
                                       "async_staging=True)", **guarded}, **common))
    return out


# --------------------------------------------------------------------------- one loop

@dataclass
class TieredLoop:
    """One loop of one system: train_loop's LoopRun, and what the tiers add to it."""
    run: LoopRun
    durable_shared_s: list[float] | None = None   # per checkpoint, from its call
    shared_drain_s: float | None = None           # after the loop, until the last one was durable
    local_tier_bytes: int | None = None           # in the local tier when the loop ended
    verified_loads: int = 0
    local_copies_unverified: int = 0              # evicted before verification (keep_local too small)
    reader_tiers: list[str] | None = None         # FastTieredReader's choice, per checkpoint


def _wait_durable(dirs: LoopDirs, run: LoopRun) -> tuple[list[float], float]:
    """Wait (clock stopped) until every tiered checkpoint of the loop is committed in the shared
    tier; (seconds from each call until then, seconds waited after the loop)."""
    t0 = time.perf_counter()
    for writer in dirs.writers:
        writer.wait_durable(DRAIN_WAIT_S)  # raises the drain's error
    waited = time.perf_counter() - t0
    out = []
    for timing, writer in zip(run.checkpoints, dirs.writers, strict=True):
        if not writer.durable_noted.wait(30.0):
            raise RuntimeError(f"{SCENARIO}: no durable time for {timing.path} although its drain finished")
        out.append(writer.durable_at - timing._t0)
    return out, waited


def _load_bit_exact(ctx: Context, system: LoopSystem, reader: Any, expected: dict[str, Any], snap: Any,
                    what: str) -> None:
    dest = snap.destination()
    dcp.load(dest, storage_reader=reader, no_dist=True)
    check(ctx, system, expected, flat(dest), what)


def _verify(ctx: Context, tsystem: TieredSystem, system: LoopSystem, dirs: LoopDirs, loop: TieredLoop,
            what: str) -> None:
    """Every checkpoint of the loop, bit-exact against the copy taken at its call: with stock's
    reader from where it was committed, and for the tiered system also from its local copy and
    through FastTieredReader."""
    run = loop.run
    if tsystem.lands_in == "tiered":
        from fastdcp import FastTieredReader

        loop.reader_tiers = []
    for i, (timing, snap) in enumerate(zip(run.checkpoints, run.snapshots, strict=True)):
        expected = snap.expected()
        label = f"{what}/ckpt{timing.index}@step{timing.step}"
        _load_bit_exact(ctx, system, FileSystemReader(timing.path), expected, snap,
                        f"{label} [{'local tier' if tsystem.lands_in == 'local' else 'shared tier'}, stock reader]")
        loop.verified_loads += 1
        if tsystem.lands_in == "tiered":
            local = dirs.writers[i].local_path
            if os.path.isfile(os.path.join(local, ".metadata")):
                _load_bit_exact(ctx, system, FileSystemReader(local), expected, snap,
                                f"{label} [local copy {local}, stock reader]")
                loop.verified_loads += 1
            else:
                loop.local_copies_unverified += 1
            reader = FastTieredReader(timing.path, local_root=dirs.local_root)
            _load_bit_exact(ctx, system, reader, expected, snap, f"{label} [FastTieredReader]")
            loop.verified_loads += 1
            loop.reader_tiers.append(str(reader.tier))
        snap.discard()


def _run_loop(ctx: Context, trainer: SyntheticTraining, tsystem: TieredSystem | None, dirs: LoopDirs,
              snapshots: SnapshotStore, what: str) -> TieredLoop:
    c = ctx.cfg
    if tsystem is None:
        return TieredLoop(run_loop(trainer, c.train_steps, c.train_every, None, dirs.root, None))
    system = tsystem.loop_system(dirs)
    if system.release_pool:
        system.release_pool()
    try:
        loop = TieredLoop(run_loop(trainer, c.train_steps, c.train_every, system, dirs.root, snapshots))
    finally:
        if system.release_pool:
            system.release_pool()
    run = loop.run
    if tsystem.lands_in == "shared":
        loop.durable_shared_s = [t.durable for t in run.checkpoints]  # the upload future is the shared commit
        loop.shared_drain_s = 0.0
    elif tsystem.lands_in == "local":
        loop.local_tier_bytes = dir_bytes(dirs.root)
    else:
        loop.local_tier_bytes = dir_bytes(dirs.local_root)
        loop.durable_shared_s, loop.shared_drain_s = _wait_durable(dirs, run)
    _verify(ctx, tsystem, system, dirs, loop, what)
    return loop


# --------------------------------------------------------------------------- records

@dataclass
class TieredLoopRecord:
    """What one loop of one system records: the ``extra`` fields of its "tiered" result, one value
    per repeat (lists: one value per checkpoint). Seconds are from each async_save call."""
    loop_slowdown: float                # loop / the none loop of the same repeat (1.0 for none)
    blocked_s: list[float]              # waited_prev + in the call + step_wait
    in_call_s: list[float]
    committed_local_s: list[float]      # until upload_completion: the commit where the writer writes
    durable_shared_s: list[float] | None  # until committed in the shared directory (None: never is)
    shared_drain_s: float | None        # after the loop until the last checkpoint was durable there
    final_wait_s: float                 # the loop's own wait for its last upload (part of the loop)
    copy_seconds: float                 # verification copies, the loop's clock stopped
    peak_host_bytes: int
    start_host_bytes: int
    peak_above_start_bytes: int
    peak_method: str
    local_tier_bytes: int | None        # tmpfs bytes the loop left in the local tier (host memory too)
    checkpoints: int
    warmup_s: float                     # the untimed warm-up steps before the loop's clock started
    verified_loads: int                 # bit-exact loads of this loop's checkpoints
    local_copies_unverified: int
    reader_tiers: list[str] | None      # fastdcp_tiered: the tier FastTieredReader loaded from
    others_cpu_share: float | None      # other processes' share of the CPUs during the loop
    batch: int
    hidden: int
    calibrated_step_seconds: float


def _record(ctx: Context, where: str, device: str, name: str, loop: TieredLoop, base: LoopRun | None,
            description: dict[str, Any], nbytes: int, trainer: SyntheticTraining, step_s: float) -> None:
    run = loop.run
    record = TieredLoopRecord(
        loop_slowdown=run.loop_seconds / base.loop_seconds if base is not None else 1.0,
        blocked_s=[t.blocked for t in run.checkpoints], in_call_s=[t.in_call for t in run.checkpoints],
        committed_local_s=[t.durable for t in run.checkpoints], durable_shared_s=loop.durable_shared_s,
        shared_drain_s=loop.shared_drain_s, final_wait_s=run.drain_seconds, copy_seconds=run.copy_seconds,
        peak_host_bytes=run.peak_host_bytes, start_host_bytes=run.start_host_bytes,
        peak_above_start_bytes=run.peak_host_bytes - run.start_host_bytes, peak_method=run.peak_method,
        local_tier_bytes=loop.local_tier_bytes, checkpoints=len(run.checkpoints), warmup_s=run.warmup_seconds,
        verified_loads=loop.verified_loads, local_copies_unverified=loop.local_copies_unverified,
        reader_tiers=loop.reader_tiers, others_cpu_share=run.others_cpu_share, batch=trainer.batch,
        hidden=trainer.hidden, calibrated_step_seconds=step_s)
    config = {"device": device, "local_tier": ctx.cfg.local_tier, "steps": ctx.cfg.train_steps,
              "every": ctx.cfg.train_every}
    ctx.recorder.add(SCENARIO, where, name, config, nbytes, run.loop_seconds, None, description, **asdict(record))


def _log(ctx: Context, where: str, name: str, loop: TieredLoop, base: LoopRun | None, rep: int) -> None:
    run = loop.run
    msg = f"{SCENARIO} {where:<4} {name:<15} {rep + 1}/{ctx.cfg.repeats}: loop {run.loop_seconds:7.3f} s"
    if base is not None and run.checkpoints:
        msg += (f" ({100 * (run.loop_seconds / base.loop_seconds - 1):+6.1f}%), blocked max "
                f"{1e3 * max(t.blocked for t in run.checkpoints):7.1f} ms, committed "
                f"{statistics.median(t.durable for t in run.checkpoints):6.3f} s")
        if loop.durable_shared_s:
            msg += f", durable in shared {statistics.median(loop.durable_shared_s):6.3f} s"
        if loop.shared_drain_s:
            msg += f" (drained {loop.shared_drain_s:.3f} s after the loop)"
    msg += f", peak host {run.peak_host_bytes / 2**30:.2f} GiB"
    if loop.local_tier_bytes is not None:
        msg += f", local tier {fmt_size(loop.local_tier_bytes)}"
    if loop.verified_loads:
        msg += f"; {loop.verified_loads} loads bit-exact"
    ctx.progress(msg)


# --------------------------------------------------------------------------- the scenario

def _local_tier_unusable(path: str) -> str | None:
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return None


def _keep_local(ctx: Context, local_base: str, snapshots: SnapshotStore, loop_bytes: int) -> int | None:
    """keep_local for the tiered writer: every checkpoint of a loop when the local tier has room for
    them (next to the verification copies when those share its file system), else None (the
    writer's default) with a note."""
    per_loop = ctx.cfg.train_steps // ctx.cfg.train_every
    st = os.statvfs(local_base)
    free = st.f_bavail * st.f_frsize
    need = loop_bytes * (2 if snapshots.root and same_device(snapshots.root, local_base) else 1)
    if free >= LOCAL_ROOM_FACTOR * need:
        return max(1, per_loop)
    ctx.note(f"{SCENARIO}: the local tier {ctx.cfg.local_tier} has {fmt_size(free)} free, too little to keep a "
             f"loop's {per_loop} checkpoints ({fmt_size(loop_bytes)}): the tiered writer evicts with its default "
             f"keep_local, and the local copies it evicted are verified through the shared tier only")
    return None


def _run_device(ctx: Context, wheres: list[str], device: str, systems: list[TieredSystem],
                local_base: str | None) -> None:
    c = ctx.cfg
    trainer = SyntheticTraining(c.size, device)
    step_s = trainer.calibrate(c.train_step_ms / 1e3, c.train_batch)
    nbytes = trainer.state_bytes()
    per_loop = c.train_steps // c.train_every
    ctx.progress(f"{SCENARIO} {device}: hidden {trainer.hidden}, state {fmt_size(nbytes)} (model + AdamW), batch "
                 f"{trainer.batch}, step {1e3 * step_s:.1f} ms; {c.train_steps} steps, async_save every "
                 f"{c.train_every} ({per_loop} checkpoints) per loop; local tier {c.local_tier}")
    if per_loop < 1:
        ctx.note(f"{SCENARIO}: --train-steps {c.train_steps} < --train-every {c.train_every}: the loops take "
                 f"no checkpoint")
    snapshots = SnapshotStore(ctx, per_loop * nbytes, ctx.targets[wheres[0]])
    keep_local = _keep_local(ctx, local_base, snapshots, per_loop * nbytes) if local_base else None
    live = list(systems)
    try:
        for where in wheres:
            shared_base = os.path.join(ctx.targets[where], GROUP, device)
            for rep in range(c.repeats):
                base: LoopRun | None = None
                for tsystem in [None, *list(live)]:
                    name = tsystem.name if tsystem else NONE
                    loop_id = f"{name}-{device}-rep{rep}"
                    dirs = LoopDirs(root=os.path.join(shared_base, name, f"rep{rep}"))
                    if tsystem is not None and tsystem.lands_in == "local":
                        dirs.root = os.path.join(local_base, loop_id)
                    elif tsystem is not None and tsystem.lands_in == "tiered":
                        dirs.local_root, dirs.keep_local = os.path.join(local_base, loop_id), keep_local
                    os.sync()  # flush the last loop's writeback and deletions outside this loop
                    try:
                        loop = _run_loop(ctx, trainer, tsystem, dirs, snapshots,
                                         f"{SCENARIO}/{where}/{device}/{name}/rep{rep}")
                    except VerificationError:
                        raise
                    except Exception as exc:
                        if tsystem is None or not tsystem.optional:
                            raise
                        live.remove(tsystem)
                        ctx.note(f"{SCENARIO}: {name} failed ({type(exc).__name__}: {exc}); left out")
                        continue
                    finally:
                        for path in (dirs.root, dirs.local_root):
                            if path:
                                shutil.rmtree(path, ignore_errors=True)
                    _record(ctx, where, device, name, loop, base, tsystem.description if tsystem else
                            {"what": "the same loop without checkpoints"}, nbytes, trainer, step_s)
                    _log(ctx, where, name, loop, base, rep)
                    if tsystem is None:
                        base = loop.run
    finally:
        snapshots.close()
        del trainer
        if device == "cuda":
            torch.cuda.empty_cache()


def run_tiered(ctx: Context, wheres: list[str]) -> None:
    """The scenario on each shared-tier target of ``wheres`` (the runner passes ``dir``)."""
    systems = tiered_systems(ctx)
    local_base = None
    why = _local_tier_unusable(ctx.cfg.local_tier)
    if why is not None:
        ctx.note(f"{SCENARIO}: {LOCAL_ONLY} and {TIERED} not measured: --local-tier {why}")
        systems = [s for s in systems if s.lands_in == "shared"]
    if not systems:
        ctx.note(f"{SCENARIO}: no system to measure (stock runs with --systems stock, the fastdcp ones with fastdcp)")
        return
    if why is None and any(s.lands_in != "shared" for s in systems):
        local_base = tempfile.mkdtemp(prefix="fastdcp_bench_tiered_", dir=ctx.cfg.local_tier)
    devices = ctx.cfg.train_devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if "cuda" in devices and not torch.cuda.is_available():
        ctx.note(f"{SCENARIO}: cuda left out: CUDA is not available")
        devices = [d for d in devices if d != "cuda"]
    try:
        for device in devices:
            _run_device(ctx, wheres, device, systems, local_base)
    finally:
        if local_base:
            shutil.rmtree(local_base, ignore_errors=True)


# --------------------------------------------------------------------------- report

@dataclass
class TieredRow:
    """One system of a tiered case (shared target x device): medians over repeats (loops) or
    over every checkpoint of every repeat (times from the call), maxima of memory."""
    where: str
    device: str
    system: str
    repeats: int
    checkpoints_per_loop: int
    loop_s: float
    slowdown_pct: float | None            # median loop_slowdown - 1
    vs_local_pct: float | None            # median of loop / fastdcp_local's loop of the same repeat - 1
    blocked_ms_mean: float | None
    blocked_ms_max: float | None
    committed_local_s: float | None
    durable_shared_s: float | None
    durable_shared_s_max: float | None
    shared_drain_s: float | None
    peak_host_gib: float
    peak_above_start_gib: float
    local_tier_mib: float | None
    verified_loads: int
    local_copies_unverified: int
    others_cpu_pct_max: float | None      # other processes' share of the CPUs, worst loop


def _flat(values: list[list[float] | None]) -> list[float]:
    return [x for per_loop in values if per_loop for x in per_loop]


def tiered_rows(results: list[Result]) -> list[TieredRow]:
    order = {n: i for i, n in enumerate((NONE, *TIERED_SYSTEMS))}
    mine = sorted((r for r in results if r.scenario == SCENARIO),
                  key=lambda r: (r.where, r.config.get("device", ""), order.get(r.system, 99)))
    local_loops = {(r.where, r.config.get("device")): r.seconds for r in mine if r.system == LOCAL_ONLY}
    rows = []
    for r in mine:
        ex = r.extra
        blocked = _flat(ex["blocked_s"])
        committed = _flat(ex["committed_local_s"])
        durable = _flat(ex["durable_shared_s"])
        drains = [x for x in ex["shared_drain_s"] if x is not None]
        local_bytes = [x for x in ex["local_tier_bytes"] if x is not None]
        shares = [x for x in ex["others_cpu_share"] if x is not None]
        local = local_loops.get((r.where, r.config.get("device")))
        vs_local = None
        if local and r.system != NONE and len(local) == len(r.seconds):
            vs_local = 100 * (statistics.median(a / b for a, b in zip(r.seconds, local)) - 1)
        rows.append(TieredRow(
            where=r.where, device=r.config.get("device", "cpu"), system=r.system, repeats=len(r.seconds),
            checkpoints_per_loop=max(ex["checkpoints"]), loop_s=statistics.median(r.seconds),
            slowdown_pct=None if r.system == NONE else 100 * (statistics.median(ex["loop_slowdown"]) - 1),
            vs_local_pct=vs_local,
            blocked_ms_mean=1e3 * statistics.mean(blocked) if blocked else None,
            blocked_ms_max=1e3 * max(blocked) if blocked else None,
            committed_local_s=statistics.median(committed) if committed else None,
            durable_shared_s=statistics.median(durable) if durable else None,
            durable_shared_s_max=max(durable) if durable else None,
            shared_drain_s=statistics.median(drains) if drains else None,
            peak_host_gib=max(ex["peak_host_bytes"]) / 2**30,
            peak_above_start_gib=max(ex["peak_above_start_bytes"]) / 2**30,
            local_tier_mib=max(local_bytes) / 2**20 if local_bytes else None,
            verified_loads=sum(ex["verified_loads"]), local_copies_unverified=sum(ex["local_copies_unverified"]),
            others_cpu_pct_max=100 * max(shares) if shares else None))
    return rows


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _verdicts(rows: list[TieredRow]) -> list[str]:
    """The targets, per case, for the tiered system measured."""
    out = []
    for tiered in (r for r in rows if r.system == TIERED):
        case = [r for r in rows if (r.where, r.device) == (tiered.where, tiered.device)]
        head = f"  {tiered.where}/{tiered.device}:"
        busy = [r.others_cpu_pct_max for r in case if r.others_cpu_pct_max is not None]
        disturbed = (f" (disturbed: other processes took up to {max(busy):.0f}% of the CPUs during a loop)"
                     if busy and max(busy) > 100 * BUSY_SHARE else "")
        if tiered.vs_local_pct is not None:
            met = tiered.vs_local_pct <= 100 * LOOP_TARGET
            out.append(f"{head} loop {tiered.vs_local_pct:+.1f}% vs {LOCAL_ONLY} (target <= "
                       f"+{100 * LOOP_TARGET:.0f}%): {'met' if met else 'NOT met'}{disturbed}")
        direct = [r for r in case if r.system in DIRECT_SYSTEMS and r.durable_shared_s is not None]
        if direct and tiered.durable_shared_s is not None:
            best = min(direct, key=lambda r: r.durable_shared_s)
            met = tiered.durable_shared_s <= best.durable_shared_s
            others = ", ".join(f"{r.system} {r.durable_shared_s:.3f} s" for r in direct)
            out.append(f"{head} durable in the shared tier {tiered.durable_shared_s:.3f} s from the call (median) vs "
                       f"direct {others} (target: no later than the faster): {'met' if met else 'NOT met'}{disturbed}")
        loads = sum(r.verified_loads for r in case)
        unverified = tiered.local_copies_unverified
        out.append(f"{head} {loads} loads of this case's checkpoints bit-exact with the state at their call"
                   + (f"; {unverified} evicted local copies verified through the shared tier only" if unverified
                      else " (every checkpoint in every tier)"))
    return out


def tiered_lines(results: list[Result]) -> list[str]:
    """The tiered table: per system, the loop's slowdown (against no checkpoints, and against the
    local-only save), blocked time, when each checkpoint was committed where its writer writes and
    when it was durable in the shared tier, host memory, the loads verified; then the targets."""
    rows = tiered_rows(results)
    if not rows:
        return []
    cols = ["target", "system", "loop s", "slowdown", f"vs {LOCAL_ONLY}", "blocked ms mean/max", "committed s",
            "durable shared s med/max", "drain after s", "peak host GiB (+start)", "local tier MiB", "loads ok",
            "others CPU%"]
    cells = [[f"{r.where}/{r.device}", r.system, f"{r.loop_s:.3f}", _cell(r.slowdown_pct, "{:+.1f}%"),
              _cell(r.vs_local_pct, "{:+.1f}%"),
              "-" if r.blocked_ms_mean is None else f"{r.blocked_ms_mean:.1f} / {r.blocked_ms_max:.1f}",
              _cell(r.committed_local_s, "{:.3f}"),
              "-" if r.durable_shared_s is None else f"{r.durable_shared_s:.3f} / {r.durable_shared_s_max:.3f}",
              _cell(r.shared_drain_s, "{:.3f}"), f"{r.peak_host_gib:.2f} (+{r.peak_above_start_gib:.2f})",
              _cell(r.local_tier_mib, "{:.1f}"), str(r.verified_loads), _cell(r.others_cpu_pct_max, "{:.0f}")]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    r0 = next((r for r in rows if r.system == NONE), rows[0])
    head = [
        f"tiered: train_loop's loop, {max(r.checkpoints_per_loop for r in rows)} async_saves per loop, "
        f"{r0.repeats} repeat(s) interleaved with none (the same loop without checkpoints); the shared tier is a "
        f"directory on the target, the local tier --local-tier.",
        "  slowdown = median of loop / none loop of the same repeat - 1; vs fastdcp_local = the same against the "
        "local-only loop; blocked = waited_prev + in the call + step_wait, per checkpoint.",
        "  committed = call -> upload_completion (where the writer commits: the shared dir for stock/fastdcp, the "
        "local tier for fastdcp_local/fastdcp_tiered); durable shared = call -> committed in the shared dir; drain "
        "after = the wait after the loop for the last shared commit (not in the loop time).",
        "  peak host = highest VmHWM (+ above the loop's start); local tier = tmpfs bytes the loop left there (host "
        "memory no RSS counts; the tiered writer keeps a loop's local copies to verify them); others CPU = user "
        "CPU of other processes during a loop, as a share of all CPUs (worst loop): above a few %, loop times are "
        "disturbed.",
    ]
    verdicts = _verdicts(rows)
    return [*head, fmt(cols), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells),
            *(["targets:", *verdicts] if verdicts else [])]
