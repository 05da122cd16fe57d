"""Command line and run configuration."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

import torch

from .peers import PEER_NAMES
from .storages import MOUNTED_STORAGES
from .systems import ASYNC_VARIANT_NAMES, SYSTEM_NAMES, standin_requested

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

CPU_SCENARIOS = ("save", "load", "reshard", "small", "async", "async_new_writer", "async_first", "train_loop",
                 "tiered", "concurrency", "convert", "plan_scale", "s3", "azure", "read_once", "replicas")
GPU_SCENARIOS = ("gpu_save", "gpu_load", "gpu_async", "gpu_async_new_writer")
# In no default list: the box copy alone (GPU kernel, or the CPU engine where there is no GPU).
EXTRA_SCENARIOS = ("box_copy",)
ALL_SCENARIOS = CPU_SCENARIOS + GPU_SCENARIOS + EXTRA_SCENARIOS
QUICK_SCENARIOS = ("save", "load", "reshard", "small", "async", "async_new_writer", "plan_scale")
ASYNC_SCENARIOS = ("async", "async_new_writer", "async_first", "gpu_async", "gpu_async_new_writer")
ASYNC_MODES = ("thread", "process")
RESHARD_STAGES = ("ws2", "ws1", "ws4")     # reshard.py: world size of each stage's loading ranks

_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
          "g": GiB, "gb": GiB, "gib": GiB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'2GiB', '256MiB', '1.5G', '4096' -> bytes (binary units; 'GB' is treated as GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 256MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f:
            return f"{n / f:.4g} {unit}"
    return f"{n} B"


@dataclass
class BenchConfig:
    quick: bool = False
    size: int = 2 * GiB
    dir: str | None = None                  # parent for the temp target dir (default ./bench_out)
    shm: bool = True                        # also benchmark /dev/shm when present
    storages: list[str] = field(default_factory=list)   # + mounted for the run: xfs, fuse (storages.py)
    raw_io: bool = True                     # the probe's best configuration in the save/load loops (raw_io.py)
    scenarios: list[str] = field(default_factory=lambda: list(CPU_SCENARIOS))
    systems: list[str] = field(default_factory=lambda: list(SYSTEM_NAMES))
    peers: list[str] = field(default_factory=lambda: list(PEER_NAMES))   # run when importable
    repeats: int = 3
    json_path: str | None = None
    plot_path: str | None = None
    checkpoint: str | None = None           # existing checkpoint: load scenarios only
    small_count: int = 5000
    small_bytes: int = 1 * KiB
    small_large_count: int = 0              # the target's case: 5,000 x 1 KiB and nothing else
    small_large_bytes: int = 64 * MiB
    floor: bool = True                      # measure DCP's floor (no-I/O storage) in `small`
    fresh_planners: bool = False            # a new planner object per call instead of one reused
    async_modes: list[str] = field(default_factory=lambda: list(ASYNC_MODES))
    async_saves: int | None = None          # saves per system and mode (None: repeats + 1)
    async_variants: list[str] = field(default_factory=list)   # + stock_zoc / fastdcp_overlap (systems.py)
    train_devices: list[str] | None = None  # train_loop: devices to run on (None: cpu, + cuda when there)
    reshard_device: str = "cpu"             # reshard: where the loading ranks' target tensors live
    device: str = "cuda"                    # gpu_* scenarios: cuda, or cpu-standin (fastdcp.io.copy_engine)
    reshard_stages: list[str] = field(default_factory=lambda: ["ws2", "ws4"])
    reshard_size: int = 2 * GiB
    reshard_norms: int = 300                # replicated norm vectors in the reshard state
    small_repeats: int | None = None        # None: --repeats
    reshard_wheres: list[str] = field(default_factory=lambda: ["dir", "shm"])
    small_wheres: list[str] = field(default_factory=lambda: ["dir", "shm"])
    async_wheres: list[str] = field(default_factory=lambda: ["dir", "shm"])
    train_steps: int = 24                   # train_loop: steps per loop
    train_every: int = 4                    # train_loop: an async_save every this many steps
    train_step_ms: float = 100.0            # train_loop: the batch is calibrated to this step time
    train_batch: int | None = None          # train_loop: fixed batch instead of calibrating
    train_wheres: list[str] = field(default_factory=lambda: ["dir"])
    local_tier: str = "/dev/shm"            # tiered: where the local tier's directories go (node-local)
    plan_ranks: list[int] = field(default_factory=lambda: [256, 1024, 4096])   # plan_scale: simulated N
    plan_budget_s: float = 600.0            # plan_scale: most seconds to build every rank's load plan
    plan_systems: list[str] | None = None   # plan_scale: which of stock, fastdcp (None: both)
    plan_all_load_ranks: int = 4096         # plan_scale: above this N, only the sample ranks' loads
    plan_workers: int = field(default_factory=lambda: os.cpu_count() or 1)  # plan_scale: unmeasured ranks' processes
    plan_storage: str = "local"             # plan_scale: where the checkpoints go: local (a directory) or s3
    plan_replicas: int = 1                  # plan_scale: R, the load's replication (N/R shards x R replicas)
    s3_delay_ms: float = 10.0               # s3: one-way delay of the second run (a 20 ms round trip)
    s3_size: int = 1 * GiB                  # s3: state size (moto takes ~0.1 GiB/s: 1 GiB is ~25 min)
    azure_delay_ms: float = 10.0            # azure: one-way delay of the second run (a 20 ms round trip)
    azure_size: int = 1 * GiB               # azure: state size
    read_once_size: int = 128 * MiB         # read_once: state size
    read_once_rate_mib_s: float = 100.0     # read_once: the storage's bandwidth, shared by every rank
    read_once_replicas: tuple[int, ...] = (1, 2, 4)  # read_once: replica counts R (2 x R ranks)
    replicas_ranks: int = 4                 # replicas: gloo ranks on this machine
    replicas_nodes: int = 2                 # replicas: simulated nodes they are grouped into
    replicas_size: int = 128 * MiB          # replicas: model + AdamW state per rank
    replicas_shared_mib_s: float = 512.0    # replicas: the shared tier's bandwidth the target is stated against
    probe_bytes: int = 1 * GiB
    probe_configs: list[tuple[int, int]] = field(
        default_factory=lambda: [(1 * MiB, 1), (1 * MiB, 4), (8 * MiB, 1), (8 * MiB, 4)])
    probe_method: str = "auto"              # auto (fio if installed) | fio | python
    memcpy_bytes: int = 1 * GiB
    cold_method: str = "auto"               # auto | drop_caches | fadvise_dontneed | none
    keep: bool = False
    standin: bool = False
    corrupt_after_load: str | None = None   # test hook: flip a byte after this system's loads


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastdcp.bench",
        description="fastdcp vs stock torch.distributed.checkpoint storage benchmarks. "
                    "Every load is verified bit-exact; a mismatch exits with status 3.")
    p.add_argument("--quick", action="store_true",
                   help="scenarios save,load,reshard,small,async,async_new_writer,plan_scale (+gpu_* with "
                        "CUDA) at 256MiB, 2 repeats, reshard on /dev/shm only at 64MiB, small and async* on "
                        "--dir only, async* in thread mode only, plan_scale at N=4,16 (~3.5 min on 2 cores)")
    p.add_argument("--size", type=parse_size, help="state dict size (default 2GiB, quick 256MiB)")
    p.add_argument("--dir", help="directory on the storage to test; a temp dir is made inside it "
                                 "and removed afterwards (default ./bench_out)")
    p.add_argument("--no-shm", action="store_true", help="do not benchmark /dev/shm as well")
    p.add_argument("--no-raw-io", action="store_true",
                   help="do not run the storage probe's best configuration (raw_io) inside the save and load "
                        "loops (it measures the limit at the same time as the systems)")
    p.add_argument("--storages", type=_csv,
                   help=f"also mount and benchmark these storages: comma list from {','.join(MOUNTED_STORAGES)} "
                        f"(xfs: a loop-mounted image in the --dir parent; fuse: a bindfs passthrough there; "
                        f"each needs root and its tool, else it is skipped with a note). Default none")
    p.add_argument("--scenarios", type=_csv,
                   help=f"comma list from {','.join(ALL_SCENARIOS)} (gpu_* need CUDA)")
    p.add_argument("--systems", type=_csv,
                   help=f"comma list from {','.join(SYSTEM_NAMES)} (default all); peer names "
                        f"({','.join(PEER_NAMES)}) may be listed here too. With --systems and no "
                        f"--peers, only the peers listed here run")
    p.add_argument("--peers", type=_csv,
                   help=f"peers in the save (and load) scenarios: comma list from {','.join(PEER_NAMES)}, "
                        f"or 'none' (default: all, each run when importable, else a note says how to "
                        f"install it; pip install -e .[bench] installs them)")
    p.add_argument("--repeats", type=int, help="runs per system and case, interleaved (default 3, quick 2)")
    p.add_argument("--json", dest="json_path", help="write results as JSON here")
    p.add_argument("--plot", dest="plot_path", help="write a bar chart (PNG) here; needs matplotlib")
    p.add_argument("--checkpoint", help="an existing DCP checkpoint directory: run load scenarios "
                                        "on it only (verified against the stock reader)")
    p.add_argument("--small-count", type=int, help="number of tiny tensors in `small` (default 5000; "
                                                   "e.g. 10000)")
    p.add_argument("--small-bytes", type=parse_size, help="bytes per tiny tensor (default 1KiB)")
    p.add_argument("--small-large-count", type=int,
                   help="large bf16 matrices added to `small` (default 0: tiny tensors only)")
    p.add_argument("--small-large-size", type=parse_size,
                   help="bytes per large matrix in `small` (default --size/16 clamped to 64KiB..64MiB)")
    p.add_argument("--no-floor", action="store_true",
                   help="do not measure DCP's floor (dcp.save/load with a storage that does no I/O) "
                        "in `small`")
    p.add_argument("--fresh-planners", action="store_true",
                   help="a new planner object for every save/load (default: one per system and "
                        "scenario, reused, as a training loop keeps one)")
    p.add_argument("--async-modes", type=_csv,
                   help="async_save executors: thread,process (default both; quick: thread). "
                        "process mode needs a process group: a 1-rank gloo group is started")
    p.add_argument("--async-saves", type=int,
                   help="async saves per system and mode: `async` reuses one writer object, "
                        "`async_new_writer` makes a new one per save "
                        "(default --repeats + 1; the first is reported separately)")
    p.add_argument("--async-variants", type=_csv,
                   help="async scenarios: also stock_zoc (DefaultStager(StagingOptions(True, True, True, True))) "
                        "and/or fastdcp_overlap (FastFileSystemWriter(async_staging=True)); default none")
    p.add_argument("--async-wheres", type=_csv, help="targets of the async scenarios (default dir,shm; quick dir)")
    p.add_argument("--train-devices", type=_csv,
                   help="train_loop and tiered: cpu and/or cuda (default cpu, and cuda when available)")
    p.add_argument("--device", choices=("cuda", "cpu-standin"),
                   help="the device of the gpu_* scenarios: cuda (default; skipped without "
                        "CUDA) or cpu-standin: CPU tensors in stand-in device memory, copied to the host by "
                        "the stand-in copy engine (a memcpy on a thread of its own), so the device pipeline "
                        "runs on a machine without a GPU; limits d2h/h2d are then the memcpy probe")
    p.add_argument("--reshard-device", choices=("cpu", "cuda"),
                   help="reshard: where the loading ranks' DTensors live (default cpu; cuda: one GPU "
                        "shared by the ranks when there is only one)")
    p.add_argument("--reshard-stages", type=_csv,
                   help="reshard stages from ws2 (save Shard(0)@2, load Shard(1)@2), ws1 (load whole at "
                        "world size 1), ws4 (load Shard(0)@4); default ws2,ws4")
    p.add_argument("--train-steps", type=int,
                   help="train_loop, tiered and replicas: training steps per loop (default 24, quick 12)")
    p.add_argument("--train-every", type=int,
                   help="train_loop, tiered and replicas: an async_save every N steps (default 4, quick 3)")
    p.add_argument("--train-step-ms", type=float,
                   help="train_loop, tiered and replicas: step time the batch is calibrated to (default 100)")
    p.add_argument("--train-batch", type=int,
                   help="train_loop, tiered and replicas: this batch instead of calibrating one (min 2)")
    p.add_argument("--local-tier",
                   help="tiered and replicas: the node-local directory the local tier goes in (default /dev/shm; "
                        "replicas: a directory per simulated node in it); the shared tier is a directory under --dir")
    p.add_argument("--plan-ranks", type=lambda text: [int(t) for t in _csv(text)],
                   help="plan_scale: simulated rank counts N, each >= 2 (default 256,1024,4096; quick 4,16)")
    p.add_argument("--plan-budget", type=float,
                   help="plan_scale: seconds allowed for building every rank's local load plan with the "
                        "planner; above it (estimated from sample ranks) the others are built by a reference "
                        "(default 600)")
    p.add_argument("--plan-systems", type=_csv,
                   help="plan_scale: which systems to simulate, of stock,fastdcp (default both; stock's 4,096-rank run "
                        "takes over half an hour, so larger N are run with fastdcp alone)")
    p.add_argument("--plan-all-load-ranks", type=int,
                   help="plan_scale: the largest load (rank count) whose every local load plan and coordinator round "
                        "are simulated; above it only the sample ranks load (default 4096)")
    p.add_argument("--plan-workers", type=int,
                   help="plan_scale: processes that play the unmeasured ranks (untimed; nothing is measured while "
                        "they run; default the CPU count)")
    p.add_argument("--plan-storage", choices=("local", "s3"),
                   help="plan_scale: where the simulated job's checkpoint goes: local (a directory, default) or s3 "
                        "(fastdcp alone, FastS3Writer/FastS3Reader on a local S3 server: what a resuming rank "
                        "fetches by ranged GETs)")
    p.add_argument("--plan-replicas", type=int, metavar="R",
                   help="plan_scale: also load the checkpoint HSDP-like, its state sharded over N/R ranks and "
                        "replicated R times (rank r holds shard r %% (N/R); the save stays N-way sharded), and "
                        "report the tensor bytes each rank reads from storage without and with read-once; each N "
                        "must be a multiple of R (default 1: no replicated load)")
    p.add_argument("--s3-size", type=parse_size,
                   help="s3: state size (default the smaller of --size and 1GiB: the test server takes ~0.1 GiB/s)")
    p.add_argument("--azure-size", type=parse_size,
                   help="azure: state size (default the smaller of --size and 1GiB: the test server, Azurite, "
                        "is one Node.js process)")
    p.add_argument("--read-once-size", type=parse_size,
                   help="read_once: state size (default the smaller of --size and 128MiB)")
    p.add_argument("--read-once-rate-mib-s", type=float,
                   help="read_once: the storage bandwidth all ranks share, MiB/s (default 100)")
    p.add_argument("--read-once-replicas", type=str,
                   help="read_once: comma list of replica counts R, each run on 2 x R ranks (default 1,2,4)")
    p.add_argument("--replicas-ranks", type=int,
                   help="replicas: gloo ranks on this machine (default 4)")
    p.add_argument("--replicas-nodes", type=int,
                   help="replicas: simulated nodes of consecutive ranks, each with its own local tier; >= 2, "
                        "dividing --replicas-ranks (default 2)")
    p.add_argument("--replicas-size", type=parse_size,
                   help="replicas: model + AdamW state per rank (default 128MiB)")
    p.add_argument("--replicas-shared-mib-s", type=float,
                   help="replicas: the shared tier's read bandwidth, MiB/s, that the recovery target is stated "
                        "against (default 512; the shared tier here is a directory on the disk, read at its speed)")
    p.add_argument("--s3-delay-ms", type=float,
                   help="s3: one-way delay the proxy adds in the scenario's second run (default 10: a 20 ms "
                        "round trip)")
    p.add_argument("--azure-delay-ms", type=float,
                   help="azure: one-way delay the proxy adds in the scenario's second run (default 10: a 20 ms "
                        "round trip)")
    p.add_argument("--reshard-size", type=parse_size,
                   help="state size for `reshard` (default --size; quick: --size/4 with 32 instead "
                        "of 300 norm vectors)")
    p.add_argument("--probe-size", type=parse_size,
                   help="bytes per raw storage probe run (default --size clamped to 256MiB..1GiB; quick 256MiB)")
    p.add_argument("--probe", dest="probe_method", choices=("auto", "fio", "python"), default="auto",
                   help="raw storage probe: fio when installed (auto), or the python O_DIRECT probe")
    p.add_argument("--cold", dest="cold_method", default="auto",
                   choices=("auto", "drop_caches", "fadvise_dontneed", "none"),
                   help="how to make the page cache cold for cold loads (auto: drop_caches when "
                        "permitted, else posix_fadvise DONTNEED per file)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--corrupt-after-load", help=argparse.SUPPRESS)  # test hook
    return p


def config_from_args(argv: list[str] | None = None) -> BenchConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    c = BenchConfig(quick=a.quick)
    if a.quick:
        c.size = 256 * MiB
        c.repeats = 2
        c.scenarios = list(QUICK_SCENARIOS)
        c.reshard_wheres = ["shm"]
        c.reshard_norms = 32
        c.small_repeats = 2
        c.small_wheres = ["dir"]
        c.async_wheres = ["dir"]
        c.async_modes = ["thread"]
        c.probe_bytes = 256 * MiB
        c.probe_configs = [(8 * MiB, 1), (1 * MiB, 4)]
        c.memcpy_bytes = 256 * MiB
        c.train_steps, c.train_every = 12, 3
        c.plan_ranks = [4, 16]
        if torch.cuda.is_available():
            c.scenarios += list(GPU_SCENARIOS)
    elif torch.cuda.is_available():
        c.scenarios = list(CPU_SCENARIOS + GPU_SCENARIOS)
    if a.size is not None:
        c.size = a.size
    c.reshard_size = a.reshard_size if a.reshard_size else (c.size // 4 if a.quick else c.size)
    c.s3_size = a.s3_size if a.s3_size else min(c.size, 1 * GiB)
    c.azure_size = a.azure_size if a.azure_size else min(c.size, 1 * GiB)
    c.read_once_size = a.read_once_size if a.read_once_size else min(c.size, 128 * MiB)
    if a.read_once_rate_mib_s is not None:
        if a.read_once_rate_mib_s <= 0:
            parser.error("--read-once-rate-mib-s must be > 0")
        c.read_once_rate_mib_s = a.read_once_rate_mib_s
    if a.read_once_replicas:
        try:
            replicas = tuple(int(x) for x in a.read_once_replicas.split(",") if x.strip())
        except ValueError:
            replicas = ()
        if not replicas or any(r < 1 for r in replicas):
            parser.error("--read-once-replicas must be a comma list of positive integers")
        c.read_once_replicas = replicas
    for flag, name, least in (("--replicas-ranks", "replicas_ranks", 2), ("--replicas-nodes", "replicas_nodes", 2)):
        value = getattr(a, name)
        if value is not None:
            if value < least:
                parser.error(f"{flag} must be >= {least}")
            setattr(c, name, value)
    if c.replicas_ranks % c.replicas_nodes:
        parser.error(f"--replicas-nodes {c.replicas_nodes} must divide --replicas-ranks {c.replicas_ranks}")
    if a.replicas_size is not None:
        if a.replicas_size <= 0:
            parser.error("--replicas-size must be > 0")
        c.replicas_size = a.replicas_size
    if a.replicas_shared_mib_s is not None:
        if a.replicas_shared_mib_s <= 0:
            parser.error("--replicas-shared-mib-s must be > 0")
        c.replicas_shared_mib_s = a.replicas_shared_mib_s
    c.small_large_bytes = max(64 * KiB, min(64 * MiB, c.size // 16))
    c.probe_bytes = max(64 * MiB, min(c.probe_bytes, max(c.size, 256 * MiB)))
    c.memcpy_bytes = max(16 * MiB, min(c.memcpy_bytes, c.size))
    if a.probe_size is not None:
        c.probe_bytes = a.probe_size
    if a.scenarios:
        a.scenarios = [s.replace("-", "_") for s in a.scenarios]  # plan-scale = plan_scale
        bad = [s for s in a.scenarios if s not in ALL_SCENARIOS]
        if bad:
            parser.error(f"unknown scenario(s) {bad}; choose from {','.join(ALL_SCENARIOS)}")
        c.scenarios = a.scenarios
    if a.systems:
        bad = [s for s in a.systems if s not in SYSTEM_NAMES and s not in PEER_NAMES]
        if bad:
            parser.error(f"unknown system(s) {bad}; choose from {','.join(SYSTEM_NAMES + PEER_NAMES)}")
        c.systems = [s for s in a.systems if s in SYSTEM_NAMES]
        c.peers = [s for s in a.systems if s in PEER_NAMES]
    if a.peers:
        wanted = [] if [p.lower() for p in a.peers] == ["none"] else a.peers
        bad = [s for s in wanted if s not in PEER_NAMES]
        if bad:
            parser.error(f"unknown peer(s) {bad}; choose from {','.join(PEER_NAMES)} or 'none'")
        c.peers = [] if not wanted else list(dict.fromkeys((c.peers if a.systems else []) + wanted))
    if a.repeats is not None:
        if a.repeats < 1:
            parser.error("--repeats must be >= 1")
        c.repeats = a.repeats
        c.small_repeats = None
    if a.small_count is not None:
        c.small_count = a.small_count
    if a.small_bytes is not None:
        c.small_bytes = a.small_bytes
    if a.small_count is not None and a.small_count < 0:
        parser.error("--small-count must be >= 0")
    if a.small_large_count is not None:
        if a.small_large_count < 0:
            parser.error("--small-large-count must be >= 0")
        c.small_large_count = a.small_large_count
    if a.small_large_size is not None:
        c.small_large_bytes = a.small_large_size
    c.floor = not a.no_floor
    c.raw_io = not a.no_raw_io
    c.fresh_planners = a.fresh_planners
    # Lists of names given on the command line: (attribute, allowed names), one check.
    for name, allowed in (("async_modes", ASYNC_MODES), ("async_variants", ASYNC_VARIANT_NAMES),
                          ("train_devices", ("cpu", "cuda")), ("storages", tuple(MOUNTED_STORAGES))):
        given = getattr(a, name)
        if not given:
            continue
        bad = [v for v in given if v not in allowed]
        if bad:
            parser.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {','.join(allowed)}")
        setattr(c, name, given)
    if a.async_wheres:
        c.async_wheres = a.async_wheres
    if a.reshard_device:
        c.reshard_device = a.reshard_device
    if a.device:
        c.device = a.device
    if a.local_tier:
        c.local_tier = a.local_tier
    if a.reshard_stages:
        bad = [st for st in a.reshard_stages if st not in RESHARD_STAGES]
        if bad or (any(st != "ws2" for st in a.reshard_stages) and a.reshard_stages[0] != "ws2"):
            parser.error(f"--reshard-stages: choose from {','.join(RESHARD_STAGES)}, ws2 first (it saves the "
                         f"checkpoints the others load)")
        c.reshard_stages = a.reshard_stages
    # Counts and sizes given on the command line: (attribute, smallest allowed, why), one check.
    for name, least, why in (("async_saves", 1, ""), ("train_steps", 1, ""), ("train_every", 1, ""),
                             ("train_step_ms", None, ""), ("train_batch", 2, " (BatchNorm1d in training mode)")):
        value = getattr(a, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if least is None and value <= 0:
            parser.error(f"{flag} must be > 0{why}")
        if least is not None and value < least:
            parser.error(f"{flag} must be >= {least}{why}")
        setattr(c, name, value)
    if a.plan_ranks is not None:
        if not a.plan_ranks or min(a.plan_ranks) < 2:
            parser.error("--plan-ranks needs rank counts >= 2")
        c.plan_ranks = a.plan_ranks
    if a.plan_systems is not None:
        unknown = sorted(set(a.plan_systems) - {"stock", "fastdcp"})
        if unknown or not a.plan_systems:
            parser.error(f"--plan-systems takes stock and/or fastdcp, not {unknown or 'nothing'}")
        c.plan_systems = a.plan_systems
    for flag, name, value in (("--plan-all-load-ranks", "plan_all_load_ranks", a.plan_all_load_ranks),
                              ("--plan-workers", "plan_workers", a.plan_workers)):
        if value is not None:
            if value < 1:
                parser.error(f"{flag} must be >= 1")
            setattr(c, name, value)
    if a.plan_storage is not None:
        c.plan_storage = a.plan_storage
    if a.plan_replicas is not None:
        if a.plan_replicas < 1:
            parser.error("--plan-replicas must be >= 1")
        c.plan_replicas = a.plan_replicas
    if c.plan_replicas > 1 and any(n % c.plan_replicas for n in c.plan_ranks):
        parser.error(f"--plan-replicas {c.plan_replicas}: every --plan-ranks count must be a multiple of it, not "
                     f"{[n for n in c.plan_ranks if n % c.plan_replicas]}")
    if a.plan_budget is not None:
        if a.plan_budget < 0:
            parser.error("--plan-budget must be >= 0")
        c.plan_budget_s = a.plan_budget
    for flag, name in (("--s3-delay-ms", "s3_delay_ms"), ("--azure-delay-ms", "azure_delay_ms")):
        value = getattr(a, name)
        if value is not None:
            if value <= 0:
                parser.error(f"{flag} must be > 0")
            setattr(c, name, value)
    c.dir, c.shm = a.dir, not a.no_shm
    c.json_path, c.plot_path, c.checkpoint = a.json_path, a.plot_path, a.checkpoint
    c.probe_method, c.cold_method, c.keep = a.probe_method, a.cold_method, a.keep
    c.corrupt_after_load = a.corrupt_after_load
    c.standin = standin_requested()
    if c.checkpoint:
        if a.scenarios and a.scenarios != ["load"]:
            parser.error("--checkpoint runs the load scenario only")
        c.scenarios = ["load"]
        c.peers = []    # a user's DCP checkpoint: the DCP readers only
        c.shm = False  # nothing is written; /dev/shm would only be probed
        c.storages = []
    return c
