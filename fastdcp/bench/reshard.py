"""Resharding scenario (multi-process, gloo on CPU).

Stage 1, world size 2: every system saves the state with its 2-D matrices as DTensor Shard(0)
(timed once: `op=save`), then loads it as Shard(1) at world size 2 (`Shard(0)@2 -> Shard(1)@2`).
Stage 2, world size 4: loads each system's checkpoint as Shard(0) (`Shard(0)@2 -> Shard(0)@4`).
Norm vectors stay plain (replicated) tensors; the 2 non-tensor entries are kept.

Times are taken inside the ranks between barriers; the reported time is the max over ranks
(all_reduce MAX). Every rank verifies its local shards bit-exact against contents generated
for exactly its box (see state.fill_box); `bytes_read` (sum over ranks of /proc/self/io
rchar deltas) shows read amplification.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..io.phases import recording
from .pagecache import COLD_DROP, make_cold, warm_files
from .process_group import exit_spawned_rank, free_port
from .state import (StateSpec, VerificationError, compare_tensor, corrupt_one_byte, fill_box,
                    make_tensor, scribble)


@dataclass
class ReshardJob:
    stage: str                    # "ws2" (save + load Shard(1)) | "ws4" (load Shard(0))
    root: str                     # where the checkpoints live: <root>/<system>
    where: str
    systems: list[str]
    standin: bool
    spec: StateSpec
    repeats: int
    caches: list[str]
    cold_method: str | None
    corrupt_after_load: str | None
    out_path: str
    fresh_planners: bool = False
    load_device: str = "cpu"      # where the load targets live ("cuda": every rank on GPU rank % count)


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _box(shape: tuple[int, ...], dim: int, rank: int, ws: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of `rank`'s Shard(dim) piece (even split)."""
    n = shape[dim]
    assert n % ws == 0, f"dimension {dim} of {shape} does not divide by {ws}"
    local = list(shape)
    local[dim] = n // ws
    offs = [0] * len(shape)
    offs[dim] = rank * (n // ws)
    return tuple(local), tuple(offs)


def _local_state(spec: StateSpec, mesh, dim: int, rank: int, ws: int, fill: bool,
                 device: str = "cpu") -> tuple[dict, dict]:
    """(state dict with DTensors, {name: expected local tensor}) for a Shard(dim) layout; at world
    size 1 plain whole tensors (a rank alone loads whole tensors). The expected tensors are on the
    CPU; a load target (`fill=False`) lives on `device` (the mesh's device type)."""
    from torch.distributed.tensor import DTensor, Shard

    sd: dict[str, Any] = {}
    expected: dict[str, torch.Tensor] = {}
    for t in spec.tensors:
        if t.shardable:
            shape, offs = _box(t.shape, dim, rank, ws)
            local = fill_box(torch.empty(shape, dtype=t.dtype), t, offs)
            expected[t.name] = local
            if not fill:
                local = torch.empty_like(local, device=device)
            if ws == 1:
                sd[t.name] = local
                continue
            gstride = torch.empty(t.shape, dtype=t.dtype, device="meta").stride()
            sd[t.name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                            shape=torch.Size(t.shape), stride=gstride)
        else:
            full = make_tensor(t)
            expected[t.name] = full
            sd[t.name] = full if fill else torch.empty_like(full, device=device)
    for k, v in spec.objects:
        sd[k] = v if fill else None
    return sd, expected


def _verify(job: ReshardJob, system: str, spec: StateSpec, expected: dict, loaded: dict, what: str) -> str | None:
    if job.corrupt_after_load in (system, "all"):
        corrupt_one_byte(loaded)
    try:
        for name, exp in expected.items():
            compare_tensor(name, exp, loaded[name], what)
        for k, v in spec.objects:
            if loaded[k] != v:
                raise VerificationError(f"{what}: object {k!r} loaded as {loaded[k]!r}, saved {v!r}")
    except VerificationError as e:
        return str(e)
    return None


def _rank_main(rank: int, job: ReshardJob, ws: int, port: int, t_launch: float) -> None:
    t_start = time.time()
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from .systems import resolve_systems

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(minutes=10))
    records: list[dict[str, Any]] = []
    failure: str | None = None
    try:
        mesh = init_device_mesh("cpu", (ws,))
        load_mesh = mesh
        if job.load_device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: every rank shares it
            load_mesh = init_device_mesh("cuda", (ws,))
        t_ready = time.time()
        systems = resolve_systems(job.systems, job.standin)
        spec = job.spec
        planners: dict[tuple[str, str], Any] = {}

        def planner(s, kind: str) -> Any:
            """As in the parent: one planner object per system and kind, reused (or a new one
            per call with --fresh-planners); None: DCP's default planners."""
            factory = s.make_save_planner if kind == "save" else s.make_load_planner
            if factory is None:
                return None
            if job.fresh_planners:
                return factory()
            if (s.name, kind) not in planners:
                planners[(s.name, kind)] = factory()
            return planners[(s.name, kind)]

        def timed(fn) -> tuple[float, int]:
            dist.barrier()
            r0, t0 = _rchar(), time.perf_counter()
            fn()
            dist.barrier()
            dt, nread = time.perf_counter() - t0, _rchar() - r0
            v = torch.tensor([dt, float(nread)], dtype=torch.float64)
            mx = v.clone()
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            dist.all_reduce(v, op=dist.ReduceOp.SUM)
            return float(mx[0]), int(v[1])

        if job.stage == "ws2":
            src = _local_state(spec, mesh, 0, rank, ws, fill=True)[0]
            for s in systems:
                path = os.path.join(job.root, s.name)
                if rank == 0 and os.path.exists(path):
                    shutil.rmtree(path)
                os.sync()
                dt, _ = timed(lambda: dcp.save(src, storage_writer=s.make_writer(path),
                                               planner=planner(s, "save")))
                records.append({"system": s.name, "op": "save", "layout": "Shard(0)@2",
                                "seconds": dt, "bytes_read": None})
            del src
            dest, expected = _local_state(spec, load_mesh, 1, rank, ws, fill=False, device=job.load_device)
            layout = "Shard(0)@2->Shard(1)@2"
        elif job.stage == "ws1":
            dest, expected = _local_state(spec, load_mesh, 0, rank, ws, fill=False, device=job.load_device)
            layout = "Shard(0)@2->whole@1"
        else:
            dest, expected = _local_state(spec, load_mesh, 0, rank, ws, fill=False, device=job.load_device)
            layout = "Shard(0)@2->Shard(0)@4"
        primers: dict[str, Any] = {}
        for rep in range(job.repeats):
            for s in systems:
                path = os.path.join(job.root, s.name)
                for cache in job.caches:
                    scribble(dest)
                    if rank == 0 and cache == "cold":
                        make_cold(job.cold_method, path)
                    elif rank == 0:
                        warm_files(path)
                    dist.barrier()
                    if cache == "cold" and job.cold_method == COLD_DROP:
                        # re-fault the loader's code pages: load one small replicated tensor
                        if s.name not in primers:
                            name = next(t.name for t in spec.tensors if not t.shardable)
                            primers[s.name] = {name: torch.empty_like(expected[name])}
                        primer_planner = s.make_load_planner() if s.make_load_planner else None
                        dcp.load(primers[s.name], storage_reader=s.make_reader(path), planner=primer_planner)
                    def load() -> None:
                        dcp.load(dest, storage_reader=s.make_reader(path), planner=planner(s, "load"))
                        if job.load_device == "cuda":
                            torch.cuda.synchronize()  # the data is in place, not only queued

                    with recording() as recorder:  # rank 0's phases (fastdcp.io.phases)
                        dt, nread = timed(load)
                    err = _verify(job, s.name, spec, expected, dest,
                                  f"reshard/{job.where}/{layout}/{cache} rank {rank}")
                    flag = torch.tensor([0 if err is None else 1])
                    dist.all_reduce(flag)
                    if err is not None:
                        failure = err
                    if int(flag) and failure is None:
                        failure = f"reshard/{job.where}/{layout}: verification failed on another rank"
                    phases = recorder.phases(recorder.wall)
                    records.append({"system": s.name, "op": "load", "layout": layout, "cache": cache,
                                    "seconds": dt, "bytes_read": nread, "rep": rep,
                                    **({"phases": phases} if len(phases) > 1 else {})})
                    if int(flag):
                        raise VerificationError(failure)
        records.append({"op": "timing", "start_s": t_start - t_launch, "init_s": t_ready - t_start,
                        "run_s": time.time() - t_ready})
    except VerificationError:
        pass
    finally:
        if rank == 0 or failure is not None:
            out = job.out_path if rank == 0 else f"{job.out_path}.rank{rank}"
            with open(out, "w") as f:
                json.dump({"records": records, "failure": failure}, f)
        dist.destroy_process_group()
    exit_spawned_rank(0)  # reported above; an exception other than VerificationError propagates instead


# Ranks are forked from a forkserver that imported these once: with plain spawn, every rank
# re-imports torch and DCP (4 ranks on 2 busy cores: ~18 s per stage instead of ~0.2 s).
# A forkserver never runs OpenMP regions itself, so forking from it is safe, unlike a fork
# of the benchmark process.
# torch._dynamo is imported lazily by the first DTensor.from_local (~1.5 s per rank).
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor",
            "torch.distributed.device_mesh", "fastdcp.bench.reshard"]


def _start_method() -> str:
    import multiprocessing

    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def method_note() -> str:
    return _start_method()


def run_stage(job: ReshardJob, ws: int) -> list[dict[str, Any]]:
    """Start `ws` ranks for one stage; return rank 0's records. Raises VerificationError."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = _start_method()
    if method == "forkserver":
        # fastdcp itself is not preloaded: a native thread pool created at import would not
        # survive the fork. The ranks import it (cheap once torch is loaded).
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    mp.start_processes(_rank_main, args=(job, ws, free_port(), time.time()), nprocs=ws, join=True,
                       start_method=method)
    outs = [job.out_path] + [f"{job.out_path}.rank{r}" for r in range(1, ws)]
    failure = None
    records: list[dict[str, Any]] = []
    for i, p in enumerate(outs):
        if os.path.exists(p):
            with open(p) as f:
                data = json.load(f)
            os.unlink(p)
            failure = failure or data.get("failure")
            if i == 0:
                records = data["records"]
    if failure:
        raise VerificationError(failure)
    return records


def make_job(stage: str, root: str, where: str, systems: list[str], standin: bool, spec: StateSpec,
             repeats: int, caches: list[str], cold_method: str | None, corrupt: str | None,
             fresh_planners: bool = False, load_device: str = "cpu") -> ReshardJob:
    fd, out = tempfile.mkstemp(prefix=f"reshard_{stage}_", suffix=".json")
    os.close(fd)
    return ReshardJob(stage=stage, root=root, where=where, systems=systems, standin=standin, spec=spec,
                      repeats=repeats, caches=caches, cold_method=cold_method,
                      corrupt_after_load=corrupt, out_path=out, fresh_planners=fresh_planners,
                      load_device=load_device)


STAGE_WORLD_SIZES = {"ws2": 2, "ws1": 1, "ws4": 4}


def run_reshard(ctx, wheres: list[str]) -> None:
    """Driver (parent process): both stages per target, results into ctx.recorder."""
    from .scenarios import load_limit, save_limit
    from .state import llm_like_spec

    spec = llm_like_spec(ctx.cfg.reshard_size, norms=ctx.cfg.reshard_norms)
    nbytes = spec.tensor_bytes
    names = [s.name for s in ctx.systems]
    descr = {s.name: s.description for s in ctx.systems}
    for where in wheres:
        tmpfs = ctx.tmpfs(where)
        caches = ctx.caches(where)
        root = os.path.join(ctx.targets[where], "reshard")
        device = ctx.cfg.reshard_device
        if device == "cuda" and not torch.cuda.is_available():
            ctx.note("reshard: --reshard-device cuda but CUDA is not available: the ranks load into CPU tensors")
            device = "cpu"
        for stage in ctx.cfg.reshard_stages:
            ws = STAGE_WORLD_SIZES[stage]
            ctx.progress(f"reshard  {where:<4} stage {stage}: spawning {ws} ranks ({spec.summary()}), "
                         f"loading into {device} tensors")
            job = make_job(stage, root, where, names, ctx.cfg.standin or any(s.standin for s in ctx.systems),
                           spec, ctx.cfg.repeats, caches, ctx.cold_method, ctx.cfg.corrupt_after_load,
                           ctx.cfg.fresh_planners, device)
            for r in run_stage(job, ws):
                if r["op"] == "timing":
                    ctx.progress(f"reshard  {where:<4} stage {stage}: rank 0 started after {r['start_s']:.1f} s "
                                 f"({method_note()}), init {r['init_s']:.1f} s, ran {r['run_s']:.1f} s")
                    continue
                if r["op"] == "save":
                    cfg = {"op": "save", "layout": r["layout"]}
                    limit = save_limit(where, tmpfs)
                else:
                    cfg = {"op": "load", "layout": r["layout"], "cache": r["cache"]}
                    limit = load_limit(where, tmpfs, r["cache"])
                    if device == "cuda":
                        cfg["device"] = "cuda"
                        limit = f"min(h2d,{limit})"
                extra = {} if r["bytes_read"] is None else {"bytes_read": r["bytes_read"]}
                if r.get("phases"):
                    extra["phases"] = r["phases"]
                ctx.recorder.add("reshard", where, r["system"], cfg, nbytes, r["seconds"], limit,
                                 descr[r["system"]], **extra)
                amp = f" read {r['bytes_read'] / nbytes:4.2f}x" if r["bytes_read"] else ""
                ctx.progress(f"reshard  {where:<4} {r['system']:<10} {r['layout']} {cfg.get('cache', '')}: "
                             f"{r['seconds']:7.3f} s  {nbytes / r['seconds'] / (1 << 30):6.2f} GiB/s{amp}")
