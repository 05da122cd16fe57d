"""Object storage scenarios: checkpoints saved to and loaded from an S3-protocol server (`s3`) or an
Azure Blob Storage server (`azure`), one loop for both.

`s3`: the server is SeaweedFS (objects on disk; ``FASTDCP_S3_SERVER=moto``: moto's, in memory),
started by :class:`~fastdcp.bench.s3_endpoint.S3Endpoint`. `azure`: Azurite (Microsoft's Azure
Storage emulator, a Node.js process, blobs on disk), started by
:class:`~fastdcp.bench.azure_endpoint.AzureEndpoint`; every system is given the same
``abfs://container/prefix`` URLs (stock's fsspec path reaches them through adlfs). Either server is
on 127.0.0.1 behind :mod:`fastdcp.bench.s3_proxy`, which counts requests by operation (Azure's under
S3's names: Put Block is ``PUT_PART``). A scenario runs twice: with no added latency
(``where=s3`` / ``azure``), then with ``--s3-delay-ms`` / ``--azure-delay-ms`` added to each
direction (``where=s3+<RTT>ms`` / ``azure+<RTT>ms``), so that request counts and concurrency matter
as on a network. The proxy delays the bytes itself, so the latency needs neither root nor the
kernel's ``netem``.

Systems, interleaved per repeat, each saving the LLM-like state to its own prefix (overwriting
its previous repeat, as a run's checkpoints to one path do):

* ``stock``: ``FsspecWriter`` / ``FsspecReader`` with stock's defaults (``thread_count=1``,
  ``sync_files=True``, which on a stream without a descriptor falls back to ``os.sync()``);
* ``stock_t4`` / ``stock_t16``: ``FsspecWriter(thread_count=4 / 16, sync_files=False)``;
  ``stock_best`` is whichever of the three has the fastest median (for loads, stock has no setting);
* ``fastdcp``: ``FastS3Writer`` / ``FastS3Reader`` (``azure``: ``FastAzureWriter`` / ``FastAzureReader``);
* ``s3torchconnector`` (`s3` only): AWS's DCP classes, when installed and when they run against
  this server (left out with the reason otherwise);
* ``s3_limit`` / ``azure_limit``: the server's limit, measured in the same loop with the client
  fastdcp uses (obstore) and its concurrency (16 requests in flight): the state's bytes as 8
  objects put by concurrent multipart (on Azure: block) uploads straight from memory (``save``),
  and those objects fetched whole, concurrently (``load``; on moto a whole-object GET is the
  fastest read, a ranged GET costing it a copy of the whole object).

The state is the LLM-like one at ``--s3-size`` / ``--azure-size`` (default the smaller of
``--size`` and 1 GiB).

Ops: ``save``; ``load`` (the whole state, into preallocated tensors); ``reshard`` (two gloo ranks
load every 2-D matrix as DTensor ``Shard(1)``, each its column half; time = the slower rank).
Every load is checked bit-exact (``--corrupt-after-load SYSTEM``, a test hook, flips a byte after
that system's loads first), and each side loads the other's checkpoint once (stock reads
fastdcp's, fastdcp stock's). Each sample records the requests the proxy counted
(``extra.requests``), so a save's PUT/LIST/COPY/DELETE/HEAD counts are in the JSON.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from .process_group import free_port, rank_records, spawn_ranks
from .azure_endpoint import AzureEndpoint, AzureEndpointUnavailable
from .results import GIB, Result
from .s3_endpoint import S3Endpoint, S3EndpointUnavailable
from .state import (StateSpec, VerificationError, build_destination, build_state, corrupt_one_byte, llm_like_spec,
                    local_mismatch, scribble, verify_state)

__all__ = ["run_s3", "run_azure", "S3_SYSTEMS", "AZURE_SYSTEMS", "OBJECT_STORE_SCENARIOS"]

STOCK_VARIANTS = {"stock": (1, True), "stock_t4": (4, False), "stock_t16": (16, False)}
S3_SYSTEMS = (*STOCK_VARIANTS, "fastdcp", "s3torchconnector")
AZURE_SYSTEMS = (*STOCK_VARIANTS, "fastdcp")
LOADERS = ("stock", "fastdcp", "s3torchconnector")
OBJECT_STORE_SCENARIOS = ("s3", "azure")


def _is_azure(url: str) -> bool:
    return url.split("://", 1)[0] in ("az", "abfs", "abfss")


def _stock_kwargs(url: str) -> dict[str, Any]:
    """What stock's fsspec classes are given besides the URL: s3fs the endpoint (it does not read
    ``AWS_ENDPOINT_URL``); adlfs nothing (it reads ``AZURE_STORAGE_CONNECTION_STRING``)."""
    return {} if _is_azure(url) else {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}


def _writer(system: str, url: str) -> Any:
    if system in STOCK_VARIANTS:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        threads, sync = STOCK_VARIANTS[system]
        return FsspecWriter(url, thread_count=threads, sync_files=sync, **_stock_kwargs(url))
    if system == "fastdcp":
        from ..objstore.writer import FastAzureWriter, FastS3Writer

        return FastAzureWriter(url) if _is_azure(url) else FastS3Writer(url)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(region=os.environ["AWS_REGION"], path=url, s3client_config=S3ClientConfig(force_path_style=True))


def _reader(system: str, url: str) -> Any:
    if system == "stock":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url, **_stock_kwargs(url))
    if system == "fastdcp":
        from ..objstore.reader import FastAzureReader, FastS3Reader

        return FastAzureReader(url) if _is_azure(url) else FastS3Reader(url)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(region=os.environ["AWS_REGION"], path=url, s3client_config=S3ClientConfig(force_path_style=True))


_LIMIT_OBJECTS = 8


def _limit_store(root: str) -> tuple[Any, Any]:
    """The obstore store of ``root`` (``s3://bucket``, ``az://container``) and its options, as
    fastdcp's own client makes them from the environment."""
    from ..objstore.client import default_options, store_for
    from ..objstore.location import ObjectLocation

    location = ObjectLocation.parse(root)
    options = default_options(location)
    return store_for(location, options), options


def _limit_put(root: str, key: str, payload: memoryview) -> None:
    """The save limit: ``payload`` as :data:`_LIMIT_OBJECTS` objects under ``key``, uploaded
    concurrently (multipart; on Azure, blocks and a block list), 16 requests in flight in all."""
    import obstore
    from concurrent.futures import ThreadPoolExecutor

    store, options = _limit_store(root)
    per = -(-len(payload) // _LIMIT_OBJECTS)
    step = options.part_bytes

    def put(i: int) -> None:
        part = payload[i * per:(i + 1) * per]
        obstore.put(store, f"{key}/{i}", (part[j:j + step] for j in range(0, len(part), step)),
                    use_multipart=True, chunk_size=step, max_concurrency=max(2, options.concurrency // _LIMIT_OBJECTS))

    with ThreadPoolExecutor(_LIMIT_OBJECTS) as pool:
        list(pool.map(put, range(_LIMIT_OBJECTS)))


def _limit_get(root: str, key: str) -> int:
    import obstore
    from concurrent.futures import ThreadPoolExecutor

    store, _ = _limit_store(root)
    with ThreadPoolExecutor(_LIMIT_OBJECTS) as pool:
        return sum(pool.map(lambda i: len(obstore.get(store, f"{key}/{i}").bytes()), range(_LIMIT_OBJECTS)))


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
    scenario: str = "s3"


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
                error = local_mismatch(expected, dest, f"{job.scenario}/reshard/{system}/rank{rank}")
                records.append({"system": system, "rep": rep, "seconds": float(seconds[0]), "error": error})


def _run_reshard(job: _ReshardJob) -> list[dict[str, Any]]:
    return spawn_ranks(_reshard_rank, (job, free_port()), 2, job.out_path)


# --- the two stores --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class _Store:
    """What differs between the object-store scenarios; the loop (:func:`_run_object_store`) is one."""
    scenario: str                    # the scenario, its `where` names and its options' prefix (s3_size, ...)
    scheme: str                      # the URL scheme every system is given
    systems: tuple[str, ...]
    env_names: tuple[str, ...]       # saved before and restored after the run
    env_cleared: tuple[str, ...]     # removed while it runs (settings of another store that would win)
    unavailable: type[Exception]     # the endpoint's "not installed / did not start"
    start: Callable[[str], Any]      # workdir -> a started endpoint (proxy in front)
    create: Callable[[Any, str], None]            # (endpoint, name): a bucket / container
    server: Callable[[Any], str]                  # endpoint -> what the server is, for the note
    real: str                                     # the real service, for the note
    limit_save: str                               # how the limit's save is made, for system_config
    limit_load: str
    probes: Callable[[Any, str], dict[str, str]] = lambda endpoint, bucket: {}  # peer -> why left out

    @property
    def limit(self) -> str:
        return f"{self.scenario}_limit"


def _s3_probes(endpoint: Any, bucket: str) -> dict[str, str]:
    why_not = _probe_s3torchconnector(endpoint, bucket)
    return {} if why_not is None else {"s3torchconnector": why_not}


def _azurite(endpoint: Any) -> str:
    version = endpoint.version()
    return (f"Azurite {version or '(version unknown)'} (Microsoft's Azure Storage emulator: one Node.js process, "
            f"blobs on disk)")


S3_STORE = _Store(
    scenario="s3", scheme="s3", systems=S3_SYSTEMS,
    env_names=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_PROFILE",
               "AWS_SESSION_TOKEN"),
    env_cleared=("AWS_PROFILE", "AWS_SESSION_TOKEN"), unavailable=S3EndpointUnavailable,
    start=lambda workdir: S3Endpoint(workdir=workdir).start(),
    create=lambda endpoint, name: endpoint.create_bucket(name),
    server=lambda endpoint: {"seaweedfs": "SeaweedFS (weed mini, objects on disk)",
                             "moto": "moto's S3 server (in memory, one Python process)"}[endpoint.server_name],
    real="S3 bucket", limit_save=f"{_LIMIT_OBJECTS} concurrent multipart uploads from memory",
    limit_load=f"{_LIMIT_OBJECTS} whole-object GETs, concurrent", probes=_s3_probes)

_AZURE_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
              "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")
AZURE_STORE = _Store(
    scenario="azure", scheme="abfs", systems=AZURE_SYSTEMS, env_names=_AZURE_ENV, env_cleared=_AZURE_ENV,
    unavailable=AzureEndpointUnavailable, start=lambda workdir: AzureEndpoint(workdir=workdir).start(),
    create=lambda endpoint, name: endpoint.create_container(name), server=_azurite,
    real="Azure storage account",
    limit_save=f"{_LIMIT_OBJECTS} concurrent block uploads (Put Block, Put Block List) from memory",
    limit_load=f"{_LIMIT_OBJECTS} whole-blob GETs, concurrent")


# --- the scenario ----------------------------------------------------------------------------- #

def _stock_best(ctx: Any, where: str, op: str, scenario: str = "s3") -> None:
    """Record ``stock_best``: the stock configuration with the fastest median for this op."""
    candidates = [r for r in ctx.recorder.results
                  if r.scenario == scenario and r.where == where and r.config.get("op") == op
                  and r.system in STOCK_VARIANTS]
    if not candidates:
        return
    best = min(candidates, key=lambda r: statistics.median(r.seconds))  # the median the table shows
    for seconds, requests in zip(best.seconds, best.extra.get("requests", [{}] * len(best.seconds))):
        ctx.recorder.add(scenario, where, "stock_best", dict(best.config), best.bytes, seconds, None,
                         {**best.system_config, "chosen": best.system}, requests=requests)


def run_s3(ctx: Any, wheres: list[str]) -> None:
    _run_object_store(ctx, S3_STORE)


def run_azure(ctx: Any, wheres: list[str]) -> None:
    _run_object_store(ctx, AZURE_STORE)


def _run_object_store(ctx: Any, store: _Store) -> None:
    name, limit = store.scenario, store.limit
    size = getattr(ctx.cfg, f"{name}_size")
    delay = float(getattr(ctx.cfg, f"{name}_delay_ms"))
    if size == ctx.cfg.size:
        spec, src, dest = ctx.main_state()
    else:
        spec = llm_like_spec(size)
        ctx.progress(f"{name}: building state: {spec.summary()}")
        src, dest = build_state(spec), build_destination(spec)
    nbytes = spec.tensor_bytes
    workdir = tempfile.mkdtemp(prefix=f"fastdcp_bench_{name}_")
    saved_env = {k: os.environ.get(k) for k in store.env_names}
    try:
        endpoint = store.start(workdir)
    except store.unavailable as error:
        ctx.note(f"{name}: skipped: {error}")
        shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        for k in store.env_cleared:
            os.environ.pop(k, None)
        os.environ.update(endpoint.env())
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        store.create(endpoint, bucket)
        systems = list(store.systems)
        for peer, why_not in store.probes(endpoint, bucket).items():
            systems.remove(peer)
            ctx.note(f"{name}: {peer} left out: {why_not}")
        loaders = [s for s in LOADERS if s in systems]
        payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20))[:nbytes]
        ctx.note(f"{name}: {store.server(endpoint)} on 127.0.0.1 behind a counting proxy, which also adds the latency "
                 f"({delay:g} ms each way in the second pass); the server's own speed ({limit}, "
                 f"same loop) caps every system, and a real {store.real} is far faster per connection")
        root = f"{store.scheme}://{bucket}"
        width = max(9, len(f"{name}+{2 * delay:g}ms"))
        for delay_ms in (0.0, delay):
            if delay_ms != endpoint.delay_ms:
                endpoint.kill_proxy()
                endpoint.delay_ms = delay_ms
                endpoint.start_proxy(endpoint.proxy_port)
            where = name if delay_ms == 0 else f"{name}+{2 * delay_ms:g}ms"
            urls = {s: f"{root}/{where}/{s}" for s in systems}
            limit_key = f"{where}/{limit}"

            def show(op: str, system: str, rep: int, seconds: float, requests: dict[str, int] | None = None) -> None:
                ctx.progress(f"{name} {where:<{width}} {op} {system:<16} {rep + 1}/{ctx.cfg.repeats}: {seconds:7.3f} s "
                             f"{nbytes / seconds / GIB:6.3f} GiB/s" + (f"  {_short(requests)}" if requests is not None
                                                                      else ""))

            for rep in range(ctx.cfg.repeats):
                endpoint.reset()
                started = time.perf_counter()
                _limit_put(root, limit_key, payload)
                seconds = time.perf_counter() - started
                ctx.recorder.add(name, where, limit, {"op": "save"}, nbytes, seconds, None,
                                 {"how": store.limit_save}, requests=endpoint.stats())
                show("save", limit, rep, seconds)
                for system in systems:
                    endpoint.reset()
                    started = time.perf_counter()
                    writer = _writer(system, urls[system])  # timed, as a new writer per checkpoint is
                    dcp.save(src, storage_writer=writer, no_dist=True)
                    seconds = time.perf_counter() - started
                    requests = endpoint.stats()
                    ctx.recorder.add(name, where, system, {"op": "save"}, nbytes, seconds, f"case:{limit}",
                                     {"class": type(writer).__name__}, requests=requests)
                    show("save", system, rep, seconds, requests)
                endpoint.reset()
                started = time.perf_counter()
                got = _limit_get(root, limit_key)
                seconds = time.perf_counter() - started
                assert got == len(payload)
                ctx.recorder.add(name, where, limit, {"op": "load"}, nbytes, seconds, None,
                                 {"how": store.limit_load}, requests=endpoint.stats())
                show("load", limit, rep, seconds)
                for system in loaders:
                    scribble(dest)
                    endpoint.reset()
                    started = time.perf_counter()
                    dcp.load(dest, storage_reader=_reader(system, urls[system]), no_dist=True)
                    seconds = time.perf_counter() - started
                    requests = endpoint.stats()
                    if ctx.cfg.corrupt_after_load in (system, "all"):
                        key = corrupt_one_byte(dest)
                        ctx.progress(f"TEST HOOK: flipped one byte of {key!r} after {system}'s load")
                    verify_state(src, dest, f"{name}/{where}/load/{system}")
                    ctx.recorder.add(name, where, system, {"op": "load"}, nbytes, seconds, f"case:{limit}", {},
                                     requests=requests)
                    show("load", system, rep, seconds, requests)
            # Cross-reading, once: each side loads the other's checkpoint bit-exact.
            for reader, writer in (("stock", "fastdcp"), ("fastdcp", "stock")):
                scribble(dest)
                dcp.load(dest, storage_reader=_reader(reader, urls[writer]), no_dist=True)
                verify_state(src, dest, f"{name}/{where}/{reader} reading {writer}'s checkpoint")
            _stock_best(ctx, where, "save", name)
            ctx.progress(f"{name} {where:<{width}} reshard: 2 ranks load Shard(1) ({', '.join(loaders)})")
            records = _run_reshard(_ReshardJob(spec, {s: urls[s] for s in loaders}, loaders, ctx.cfg.repeats,
                                               endpoint.env(), os.path.join(workdir, f"reshard-{where}.json"), name))
            errors = [r["error"] for r in records if r["error"]]
            if errors:
                raise VerificationError(f"{name}/{where}/reshard: {errors[0]}")
            for r in records:
                if r["rank"] == 0:
                    ctx.recorder.add(name, where, r["system"], {"op": "reshard", "layout": "Shard(1)@2"}, nbytes,
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


def request_lines(results: list[Result], scenarios: tuple[str, ...] = OBJECT_STORE_SCENARIOS) -> list[str]:
    """Markdown lines: each system's requests per save and load (the first sample's counts)."""
    lines = ["| where | op | system | requests (first repeat) |", "|---|---|---|---|"]
    for r in results:
        if r.scenario not in scenarios or not r.extra.get("requests"):
            continue
        lines.append(f"| {r.where} | {r.config.get('op')} | {r.system} | {_short(r.extra['requests'][0])} |")
    return lines
