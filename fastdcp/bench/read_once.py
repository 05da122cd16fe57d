"""Read-once scenario (`read_once`): data-parallel replicas loading one checkpoint from storage
whose bandwidth all ranks share.

The storage is the `s3` scenario's server (SeaweedFS on 127.0.0.1) behind
:mod:`fastdcp.bench.s3_proxy` with ``--read-once-rate-mib-s`` (default 100 MiB/s): one link of that
bandwidth for every connection of every rank, both directions, so reading a byte twice costs twice
the time, as on a shared file system or object store at scale. The proxy counts the bytes it
served: ``storage_bytes_read`` (all ranks together, HTTP headers included) against
``needed_bytes`` (the state once).

Layout (HSDP-like): ``2 * R`` gloo ranks on one machine, a ``(R, 2)`` mesh of ``replicate`` x
``shard``; every 2-D matrix ``[Replicate(), Shard(0)]`` (each shard held by R replicas), the
other tensors whole on every rank. The checkpoint is saved once, by the ranks of the first R
(``FastS3Writer``), in the same layout. For each R of ``--read-once-replicas`` (default 1, 2, 4)
the ranks load it with:

* ``stock``: ``FsspecReader`` with its defaults;
* ``fastdcp``: ``FastS3Reader``;
* ``fastdcp_read_once``: ``FastS3Reader(read_once=True)``.

Time: from a barrier before the load to a barrier after it (the slowest rank). Every load is
checked bit-exact on every rank. Rows: ``where`` = ``s3@<rate>MiB/s``, config ``{op: load,
replicas: R, ranks: 2R}``; the R = 1 row of a system is its one-replica time, the baseline of
"R replicas cost how much more".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from .process_group import free_port, rank_records, spawn_ranks
from .reshard import _box
from .s3_endpoint import S3Endpoint, S3EndpointUnavailable
from .state import StateSpec, VerificationError, fill_box, llm_like_spec, local_mismatch, make_tensor, scribble

__all__ = ["run_read_once", "READ_ONCE_SYSTEMS"]

READ_ONCE_SYSTEMS = ("stock", "fastdcp", "fastdcp_read_once")
SHARDS = 2


def _reader(system: str, url: str, endpoint: str) -> Any:
    if system == "stock":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url, endpoint_url=endpoint)
    from ..objstore.reader import FastS3Reader

    return FastS3Reader(url, read_once=system == "fastdcp_read_once")


def _control(endpoint: str, what: str, method: str = "GET") -> dict:
    request = urllib.request.Request(f"{endpoint}/__proxy/{what}", method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"{}")


@dataclass
class _Job:
    spec: StateSpec
    replicas: int
    url: str
    systems: list[str]
    repeats: int
    env: dict[str, str]
    endpoint: str
    save: bool
    out_path: str


def _state(spec: StateSpec, mesh: Any, shard: int, fill: bool) -> tuple[dict, dict]:
    """(the state dict of a rank holding shard ``shard``, {name: expected local tensor})."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd: dict[str, Any] = {}
    expected: dict[str, torch.Tensor] = {}
    for t in spec.tensors:
        if t.shardable:
            shape, offs = _box(t.shape, 0, shard, SHARDS)
            local = fill_box(torch.empty(shape, dtype=t.dtype), t, offs)
            expected[t.name] = local
            if not fill:
                local = torch.empty_like(local)
            gstride = torch.empty(t.shape, dtype=t.dtype, device="meta").stride()
            sd[t.name] = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                            shape=torch.Size(t.shape), stride=gstride)
        else:
            full = make_tensor(t)
            expected[t.name] = full
            sd[t.name] = full if fill else torch.empty_like(full)
    return sd, expected


def _rank(rank: int, job: _Job, port: int) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    os.environ.update(job.env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = SHARDS * job.replicas
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    with rank_records(job.out_path, rank) as records:
        mesh = init_device_mesh("cpu", (job.replicas, SHARDS), mesh_dim_names=("replicate", "shard"))
        shard = rank % SHARDS
        if job.save:
            from ..objstore.writer import FastS3Writer

            state, _ = _state(job.spec, mesh, shard, fill=True)
            dcp.save(state, storage_writer=FastS3Writer(job.url))
            del state
        dest, expected = _state(job.spec, mesh, shard, fill=False)
        for rep in range(job.repeats):
            for system in job.systems:
                scribble(dest)
                dist.barrier()
                if rank == 0:
                    _control(job.endpoint, "reset", "POST")
                dist.barrier()
                started = time.perf_counter()
                reader = _reader(system, job.url, job.endpoint)
                dcp.load(dest, storage_reader=reader)
                dist.barrier()
                seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                served = _control(job.endpoint, "stats")["bytes_down"] if rank == 0 else 0
                error = local_mismatch(expected, dest, f"read_once/{system}/R{job.replicas}/rank{rank}")
                stats = getattr(reader, "last_stats", {}) or {}
                records.append({"system": system, "rep": rep, "seconds": float(seconds[0]), "error": error,
                                "served": served, "read_once_replicas": stats.get("read_once_replicas")})


def _run(job: _Job) -> list[dict[str, Any]]:
    return spawn_ranks(_rank, (job, free_port()), SHARDS * job.replicas, job.out_path)


def run_read_once(ctx: Any, wheres: list[str]) -> None:
    spec = llm_like_spec(ctx.cfg.read_once_size)
    nbytes = spec.tensor_bytes
    rate = float(ctx.cfg.read_once_rate_mib_s)
    workdir = tempfile.mkdtemp(prefix="fastdcp_bench_read_once_")
    try:
        endpoint = S3Endpoint(workdir=workdir, rate_mib_s=rate).start()
    except S3EndpointUnavailable as error:
        ctx.note(f"read_once: skipped: {error}")
        shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        endpoint.create_bucket(bucket)
        url = f"s3://{bucket}/read_once"
        where = f"s3@{rate:g}MiB/s"
        ctx.note(f"read_once: {endpoint.server_name} on 127.0.0.1 behind a proxy passing {rate:g} MiB/s for every "
                 f"connection of every rank together; {spec.summary()}; HSDP-like: 2 shards x R replicas, "
                 f"gloo ranks on this machine; storage_bytes_read = bytes the proxy served (HTTP headers included)")
        replica_counts = list(ctx.cfg.read_once_replicas)
        for replicas in replica_counts:
            ctx.progress(f"read_once {where} R={replicas}: {SHARDS * replicas} ranks load ({', '.join(READ_ONCE_SYSTEMS)})")
            job = _Job(spec, replicas, url, list(READ_ONCE_SYSTEMS), ctx.cfg.repeats, endpoint.env(),
                       endpoint.endpoint, save=replicas == replica_counts[0],
                       out_path=os.path.join(workdir, f"read_once-{replicas}.json"))
            records = _run(job)
            errors = [r["error"] for r in records if r["error"]]
            if errors:
                raise VerificationError(f"read_once/R{replicas}: {errors[0]}")
            for r in records:
                if r["rank"] != 0:
                    continue
                ctx.recorder.add("read_once", where, r["system"],
                                 {"op": "load", "replicas": replicas, "ranks": SHARDS * replicas}, nbytes,
                                 r["seconds"], None, {"rate_mib_s": rate},
                                 storage_bytes_read=r["served"], needed_bytes=nbytes)
                ctx.progress(f"read_once {where} R={replicas} {r['system']:<18} {r['rep'] + 1}/{ctx.cfg.repeats}: "
                             f"{r['seconds']:7.3f} s, storage read {r['served'] / nbytes:5.2f}x the state")
    finally:
        endpoint.stop()
        shutil.rmtree(workdir, ignore_errors=True)
