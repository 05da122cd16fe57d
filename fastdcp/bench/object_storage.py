"""Object storage scenario (`s3`): checkpoints saved to and loaded from an S3-protocol server.

The server is SeaweedFS (objects on disk; ``FASTDCP_S3_SERVER=moto``: moto's, in memory), on
127.0.0.1 behind :mod:`fastdcp.bench.s3_proxy`, which counts requests by S3 operation, started by
:class:`~fastdcp.bench.s3_endpoint.S3Endpoint` for the scenario. It runs twice: with no added
latency (``where=s3``), then with ``--s3-delay-ms`` added to each direction
(``where=s3+<RTT>ms``), so that request counts and concurrency matter as on a network. The proxy
delays the bytes itself, so the latency needs neither root nor the kernel's ``netem``.

Systems, interleaved per repeat, each saving the LLM-like state to its own prefix (overwriting
its previous repeat, as a run's checkpoints to one path do):

* ``stock``: ``FsspecWriter`` / ``FsspecReader`` with stock's defaults (``thread_count=1``,
  ``sync_files=True``, which on a stream without a descriptor falls back to ``os.sync()``);
* ``stock_t4`` / ``stock_t16``: ``FsspecWriter(thread_count=4 / 16, sync_files=False)``;
  ``stock_best`` is whichever of the three has the fastest median (for loads, stock has no setting);
* ``fastdcp``: ``FastS3Writer`` / ``FastS3Reader``;
* ``s3torchconnector``: AWS's DCP classes, when installed and when they run against this server
  (left out with the reason otherwise);
* ``s3_limit``: the server's limit, measured in the same loop: the state's bytes as 8 objects put
  by concurrent multipart uploads straight from memory (``save``), and those objects fetched
  whole, concurrently (``load``; on moto a whole-object GET is the fastest read, a ranged GET
  costing it a copy of the whole object).

The state is the LLM-like one at ``--s3-size`` (default the smaller of ``--size`` and 1 GiB).

Ops: ``save``; ``load`` (the whole state, into preallocated tensors); ``reshard`` (two gloo ranks
load every 2-D matrix as DTensor ``Shard(1)``, each its column half; time = the slower rank).
Every load is checked bit-exact. Each sample records the requests the proxy counted
(``extra.requests``), so a save's PUT/LIST/COPY/DELETE/HEAD counts are in the JSON.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from .process_group import free_port, rank_records, spawn_ranks
from .results import GIB, Result
from .s3_endpoint import S3Endpoint, S3EndpointUnavailable
from .state import (StateSpec, VerificationError, build_destination, build_state, llm_like_spec, local_mismatch,
                    scribble, verify_state)

__all__ = ["run_s3", "S3_SYSTEMS"]

STOCK_VARIANTS = {"stock": (1, True), "stock_t4": (4, False), "stock_t16": (16, False)}
S3_SYSTEMS = (*STOCK_VARIANTS, "fastdcp", "s3torchconnector")
LOADERS = ("stock", "fastdcp", "s3torchconnector")


def _endpoint_url() -> str:
    return os.environ["AWS_ENDPOINT_URL"]


def _writer(system: str, url: str) -> Any:
    if system in STOCK_VARIANTS:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        threads, sync = STOCK_VARIANTS[system]
        return FsspecWriter(url, thread_count=threads, sync_files=sync, endpoint_url=_endpoint_url())
    if system == "fastdcp":
        from ..objstore.writer import FastS3Writer

        return FastS3Writer(url)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(region=os.environ["AWS_REGION"], path=url, s3client_config=S3ClientConfig(force_path_style=True))


def _reader(system: str, url: str) -> Any:
    if system == "stock":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url, endpoint_url=_endpoint_url())
    if system == "fastdcp":
        from ..objstore.reader import FastS3Reader

        return FastS3Reader(url)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(region=os.environ["AWS_REGION"], path=url, s3client_config=S3ClientConfig(force_path_style=True))


_LIMIT_OBJECTS = 8


def _limit_put(bucket: str, where: str, payload: memoryview) -> None:
    """The save limit: ``payload`` as :data:`_LIMIT_OBJECTS` objects, uploaded concurrently."""
    import obstore
    from concurrent.futures import ThreadPoolExecutor

    from ..objstore.client import S3Options, store_for
    from ..objstore.location import ObjectLocation

    options = S3Options()
    store = store_for(ObjectLocation.parse(f"s3://{bucket}"), options)
    per = -(-len(payload) // _LIMIT_OBJECTS)
    step = options.part_bytes

    def put(i: int) -> None:
        part = payload[i * per:(i + 1) * per]
        obstore.put(store, f"{where}/s3_limit/{i}", (part[j:j + step] for j in range(0, len(part), step)),
                    use_multipart=True, chunk_size=step, max_concurrency=max(2, options.concurrency // _LIMIT_OBJECTS))

    with ThreadPoolExecutor(_LIMIT_OBJECTS) as pool:
        list(pool.map(put, range(_LIMIT_OBJECTS)))


def _limit_get(bucket: str, where: str) -> int:
    import obstore
    from concurrent.futures import ThreadPoolExecutor

    from ..objstore.client import S3Options, store_for
    from ..objstore.location import ObjectLocation

    store = store_for(ObjectLocation.parse(f"s3://{bucket}"), S3Options())
    with ThreadPoolExecutor(_LIMIT_OBJECTS) as pool:
        return sum(pool.map(lambda i: len(obstore.get(store, f"{where}/s3_limit/{i}").bytes()), range(_LIMIT_OBJECTS)))


def _probe_s3torchconnector(endpoint: S3Endpoint, bucket: str) -> str | None:
    """None when AWS's DCP classes save and load a small state here; else why not."""
    try:
        import s3torchconnector.dcp  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed, or a dependency missing
        return f"not installed ({type(error).__name__}: {error}); pip install s3torchconnector"
    url = f"s3://{bucket}/probe-s3torchconnector"
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    try:
        dcp.save(state, storage_writer=_writer("s3torchconnector", url), no_dist=True)
        back = {"w": torch.zeros(1000)}
        dcp.load(back, storage_reader=_reader("s3torchconnector", url), no_dist=True)
        if not torch.equal(back["w"], state["w"]):
            return "it loaded different values than it saved"
    except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return f"it fails against this server: {lines[-1] if lines else type(error).__name__}"
    return None


# --- the resharded load: two gloo ranks ------------------------------------------------------- #

@dataclass
class _ReshardJob:
    spec: StateSpec
    urls: dict[str, str]
    systems: list[str]
    repeats: int
    env: dict[str, str]
    out_path: str


def _reshard_rank(rank: int, job: _ReshardJob, port: int) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .reshard import _local_state

    warnings.filterwarnings("ignore")
    os.environ.update(job.env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=10))
    with rank_records(job.out_path, rank) as records:
        mesh = init_device_mesh("cpu", (2,))
        dest, expected = _local_state(job.spec, mesh, 1, rank, 2, fill=False)
        for rep in range(job.repeats):
            for system in job.systems:
                scribble(dest)
                dist.barrier()
                started = time.perf_counter()
                dcp.load(dest, storage_reader=_reader(system, job.urls[system]))
                dist.barrier()
                seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                error = local_mismatch(expected, dest, f"s3/reshard/{system}/rank{rank}")
                records.append({"system": system, "rep": rep, "seconds": float(seconds[0]), "error": error})


def _run_reshard(job: _ReshardJob) -> list[dict[str, Any]]:
    return spawn_ranks(_reshard_rank, (job, free_port()), 2, job.out_path)


# --- the scenario ----------------------------------------------------------------------------- #

def _stock_best(ctx: Any, where: str, op: str) -> None:
    """Record ``stock_best``: the stock configuration with the fastest median for this op."""
    candidates = [r for r in ctx.recorder.results
                  if r.scenario == "s3" and r.where == where and r.config.get("op") == op and r.system in STOCK_VARIANTS]
    if not candidates:
        return
    best = min(candidates, key=lambda r: sorted(r.seconds)[len(r.seconds) // 2])
    for seconds, requests in zip(best.seconds, best.extra.get("requests", [{}] * len(best.seconds))):
        ctx.recorder.add("s3", where, "stock_best", dict(best.config), best.bytes, seconds, None,
                         {**best.system_config, "chosen": best.system}, requests=requests)


def run_s3(ctx: Any, wheres: list[str]) -> None:
    if ctx.cfg.s3_size == ctx.cfg.size:
        spec, src, dest = ctx.main_state()
    else:
        spec = llm_like_spec(ctx.cfg.s3_size)
        ctx.progress(f"s3: building state: {spec.summary()}")
        src, dest = build_state(spec), build_destination(spec)
    nbytes = spec.tensor_bytes
    workdir = tempfile.mkdtemp(prefix="fastdcp_bench_s3_")
    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                               "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN")}
    try:
        endpoint = S3Endpoint(workdir=workdir).start()
    except S3EndpointUnavailable as error:
        ctx.note(f"s3: skipped: {error}")
        shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        os.environ.pop("AWS_PROFILE", None)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        os.environ.update(endpoint.env())
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        endpoint.create_bucket(bucket)
        systems = [s for s in S3_SYSTEMS]
        why_not = _probe_s3torchconnector(endpoint, bucket)
        if why_not is not None:
            systems.remove("s3torchconnector")
            ctx.note(f"s3: s3torchconnector left out: {why_not}")
        loaders = [s for s in LOADERS if s in systems]
        payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20))[:nbytes]
        server = {"seaweedfs": "SeaweedFS (weed mini, objects on disk)",
                  "moto": "moto's S3 server (in memory, one Python process)"}[endpoint.server_name]
        ctx.note(f"s3: {server} on 127.0.0.1 behind a counting proxy, which also adds the latency "
                 f"({ctx.cfg.s3_delay_ms:g} ms each way in the second pass); the server's own speed (s3_limit, "
                 f"same loop) caps every system, and a real S3 bucket is far faster per connection")
        for delay_ms in (0.0, float(ctx.cfg.s3_delay_ms)):
            if delay_ms != endpoint.delay_ms:
                endpoint.kill_proxy()
                endpoint.delay_ms = delay_ms
                endpoint.start_proxy(endpoint.proxy_port)
            where = "s3" if delay_ms == 0 else f"s3+{2 * delay_ms:g}ms"
            urls = {s: f"s3://{bucket}/{where}/{s}" for s in systems}
            for rep in range(ctx.cfg.repeats):
                endpoint.reset()
                started = time.perf_counter()
                _limit_put(bucket, where, payload)
                seconds = time.perf_counter() - started
                ctx.recorder.add("s3", where, "s3_limit", {"op": "save"}, nbytes, seconds, None,
                                 {"how": f"{_LIMIT_OBJECTS} concurrent multipart uploads from memory"},
                                 requests=endpoint.stats())
                ctx.progress(f"s3 {where:<9} save {'s3_limit':<16} {rep + 1}/{ctx.cfg.repeats}: {seconds:7.3f} s "
                             f"{nbytes / seconds / GIB:6.3f} GiB/s")
                for system in systems:
                    endpoint.reset()
                    started = time.perf_counter()
                    writer = _writer(system, urls[system])  # timed, as a new writer per checkpoint is
                    dcp.save(src, storage_writer=writer, no_dist=True)
                    seconds = time.perf_counter() - started
                    requests = endpoint.stats()
                    ctx.recorder.add("s3", where, system, {"op": "save"}, nbytes, seconds, "case:s3_limit",
                                     {"class": type(writer).__name__}, requests=requests)
                    ctx.progress(f"s3 {where:<9} save {system:<16} {rep + 1}/{ctx.cfg.repeats}: {seconds:7.3f} s "
                                 f"{nbytes / seconds / GIB:6.3f} GiB/s  {_short(requests)}")
                endpoint.reset()
                started = time.perf_counter()
                got = _limit_get(bucket, where)
                seconds = time.perf_counter() - started
                assert got == len(payload)
                ctx.recorder.add("s3", where, "s3_limit", {"op": "load"}, nbytes, seconds, None,
                                 {"how": f"{_LIMIT_OBJECTS} whole-object GETs, concurrent"}, requests=endpoint.stats())
                ctx.progress(f"s3 {where:<9} load {'s3_limit':<16} {rep + 1}/{ctx.cfg.repeats}: {seconds:7.3f} s "
                             f"{nbytes / seconds / GIB:6.3f} GiB/s")
                for system in loaders:
                    scribble(dest)
                    endpoint.reset()
                    started = time.perf_counter()
                    dcp.load(dest, storage_reader=_reader(system, urls[system]), no_dist=True)
                    seconds = time.perf_counter() - started
                    requests = endpoint.stats()
                    verify_state(src, dest, f"s3/{where}/load/{system}")
                    ctx.recorder.add("s3", where, system, {"op": "load"}, nbytes, seconds, "case:s3_limit", {},
                                     requests=requests)
                    ctx.progress(f"s3 {where:<9} load {system:<16} {rep + 1}/{ctx.cfg.repeats}: {seconds:7.3f} s "
                                 f"{nbytes / seconds / GIB:6.3f} GiB/s  {_short(requests)}")
            # Cross-reading, once: each side loads the other's checkpoint bit-exact.
            for reader, writer in (("stock", "fastdcp"), ("fastdcp", "stock")):
                scribble(dest)
                dcp.load(dest, storage_reader=_reader(reader, urls[writer]), no_dist=True)
                verify_state(src, dest, f"s3/{where}/{reader} reading {writer}'s checkpoint")
            _stock_best(ctx, where, "save")
            ctx.progress(f"s3 {where:<9} reshard: 2 ranks load Shard(1) ({', '.join(loaders)})")
            records = _run_reshard(_ReshardJob(spec, {s: urls[s] for s in loaders}, loaders, ctx.cfg.repeats,
                                               endpoint.env(), os.path.join(workdir, f"reshard-{where}.json")))
            errors = [r["error"] for r in records if r["error"]]
            if errors:
                raise VerificationError(f"s3/{where}/reshard: {errors[0]}")
            for r in records:
                if r["rank"] == 0:
                    ctx.recorder.add("s3", where, r["system"], {"op": "reshard", "layout": "Shard(1)@2"}, nbytes,
                                     r["seconds"], None, {})
    finally:
        endpoint.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(workdir, ignore_errors=True)


def _short(requests: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(requests.items()))


def request_lines(results: list[Result]) -> list[str]:
    """Markdown lines: each system's requests per save and load (the first sample's counts)."""
    lines = ["| where | op | system | requests (first repeat) |", "|---|---|---|---|"]
    for r in results:
        if r.scenario != "s3" or not r.extra.get("requests"):
            continue
        lines.append(f"| {r.where} | {r.config.get('op')} | {r.system} | {_short(r.extra['requests'][0])} |")
    return lines
