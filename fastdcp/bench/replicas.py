"""Peer-replica scenario (`replicas`): what replicating tiered checkpoints to peer nodes costs a
training loop, how soon a checkpoint is replicated, and how fast a job recovers from the loss of a
node without reading the shared tier.

``--replicas-ranks`` N gloo ranks on this machine (``spawn_ranks``), grouped into
``--replicas-nodes`` M simulated nodes of N/M consecutive ranks: node j's processes run with
``FASTDCP_NODE=node<j>`` and torchrun's variables of that node (``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), and share its local tier, a directory ``node<j>`` under
``--local-tier``.
The shared tier is a directory under ``--dir`` (the disk). Each rank trains its own copy of
train_loop's model + AdamW (training_loop.py: ``--replicas-size`` bytes of state per rank, its
own seed, the batch rank 0 calibrated to ``--train-step-ms``, all ranks stepping at once) and
checkpoints it under its own keys (``rank<r>.model...``), so every rank writes its own files.

Phase 1, the loops (one spawn): ``--train-steps`` steps with a ``dcp.async_save`` every
``--train-every`` into a new directory through a new writer, train_loop's loop (its untimed
warm-up steps first, the previous save waited on at the next checkpoint step, the loop ending when
its last save resolved). Systems, interleaved per repeat (none stock fastdcp_tiered
fastdcp_replicas none ...):

* ``none``: the loop without checkpoints;
* ``stock``: ``FileSystemWriter(<shared>/ckpt<i>)``, async_save's default staging;
* ``fastdcp_tiered``: ``FastTieredWriter(<shared>/ckpt<i>, local_root=<node's local tier>,
  async_staging=True)`` with ``fastdcp.guard``: k = 0, no replicas;
* ``fastdcp_replicas``: the same with ``replicas=1``: each rank's committed files go to a rank on
  another node in the background; ``writer.replicated`` resolves when they are stored there.

A loop's time is its slowest rank's. After each loop (its clock stopped) every checkpoint's
``replicated`` future and the last one's drain to the shared tier are waited on, and the exact
state at the last checkpoint's call is kept for phase 2 (train_loop's verification copies).

Phase 2, the recovery (a new spawn: the processes of phase 1 are gone): the last node's local
tier is removed and an empty one takes its place (a replacement node). Then, per repeat, each
system's last checkpoint is recovered on every rank, timed from a barrier to a barrier (the
slowest rank): ``fastdcp.tiered.newest_checkpoint(<the loop's shared directory>, local_root=...,
from_peers=True)`` + ``dcp.load`` through ``FastTieredReader(..., from_peers=True)``:

* ``fastdcp_replicas``: rebuilt from the surviving nodes' local tiers (files moved between
  nodes): reads nothing from the shared tier;
* ``fastdcp_tiered``: no replica of the lost node's files, so the checkpoint cannot be rebuilt
  from the nodes: every rank reads the shared tier (the same load from the shared tier);
* ``stock``: ``dcp.load`` with ``FileSystemReader`` from the shared directory (its path known:
  stock has no newest-checkpoint lookup).

Before the timed recoveries each rank saves and loads a small checkpoint (fastdcp's and stock's
readers: no recovery pays the process's first load) and makes fastdcp's peer group (a collective,
once per process; its time is recorded as ``peer_group_seconds``, not in the recoveries). Before
every load that reads the shared tier its page cache is made cold (``--cold``). There is
no way here to limit a directory's read bandwidth: the shared tier reads at the disk's speed (the
run's measured read limit of ``dir``); ``--replicas-shared-mib-s`` (default 512) is the bandwidth
of the shared tier the target is stated against: the whole state read at that rate is a lower
bound of a load from such a tier. Every recovered state is compared bit-exact, on every rank,
with the copy taken at its save; a mismatch raises VerificationError.

Results (scenario "replicas", where "dir"): per loop system, config ``phase: loop``, seconds =
loop times, ``extra``: ``loop_slowdown`` (vs none), ``vs_tiered`` (vs fastdcp_tiered of the same
repeat), per checkpoint ``committed_s`` (call -> local commit, or the commit in the shared dir for
stock), ``replicated_s`` (call -> ``writer.replicated`` resolved on every rank) and
``replicated_steps_after_commit``; per recovery system, config ``phase: recovery``, seconds =
``recovery_seconds`` (newest_checkpoint + load), ``shared_tier_bytes_read`` (every rank's,
summed: ``reader.shared_bytes_read``; stock: the bytes it loaded, all from the shared tier),
``tiers`` (each rank's ``reader.tier``), ``verified``.
"""

from __future__ import annotations

import inspect
import os
import pickle
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch

from .config import fmt_size
from .process_group import free_port, rank_records, spawn_ranks
from .results import Result
from .state import VerificationError, local_mismatch

__all__ = ["run_replicas", "replicas_rows", "replicas_lines", "ReplicasRow", "node_of", "nodes_layout",
           "LOOP_SYSTEMS", "RECOVERY_SYSTEMS"]

SCENARIO = "replicas"
GROUP = "replicas"               # directory under the shared tier's target; removed by the runner afterwards
NONE, STOCK, TIERED, REPLICAS = "none", "stock", "fastdcp_tiered", "fastdcp_replicas"
LOOP_SYSTEMS = (NONE, STOCK, TIERED, REPLICAS)
RECOVERY_SYSTEMS = (REPLICAS, TIERED, STOCK)   # in the order they run
FASTDCP_SYSTEMS = (TIERED, REPLICAS)
LOOP_TARGET = 0.05               # target: a loop with replicas within 5% of one without
REPLICATED_STEPS_TARGET = 2.0    # target: replicated within 2 steps of the local commit
RECOVERY_TARGET = 1 / 3          # target: recovery in <= 1/3 of the load from a limited shared tier
WAIT_S = 600.0                   # after a loop: most seconds to wait for replicas and drains


# --------------------------------------------------------------------------- nodes

def node_of(rank: int, ranks: int, nodes: int) -> int:
    """The simulated node of ``rank``: nodes of ``ranks // nodes`` consecutive ranks."""
    return rank // (ranks // nodes)


def nodes_layout(ranks: int, nodes: int) -> list[list[int]]:
    """The ranks of each node, node 0 first."""
    return [[r for r in range(ranks) if node_of(r, ranks, nodes) == j] for j in range(nodes)]


def node_name(j: int) -> str:
    return f"node{j}"


# --------------------------------------------------------------------------- what fastdcp offers

def replica_support() -> str | None:
    """Why this fastdcp cannot run the replica systems (its FastTieredWriter has no ``replicas``,
    its FastTieredReader or newest_checkpoint no ``from_peers``), or None when it can."""
    try:
        import fastdcp
    except Exception as exc:  # noqa: BLE001 - the reason is the note
        return f"fastdcp is not importable ({type(exc).__name__}: {exc})"
    newest = _newest_checkpoint()
    missing = []
    for what, fn, arg in (("FastTieredWriter(replicas=)", getattr(fastdcp, "FastTieredWriter", None), "replicas"),
                          ("FastTieredReader(from_peers=)", getattr(fastdcp, "FastTieredReader", None), "from_peers"),
                          ("newest_checkpoint(from_peers=)", newest, "from_peers")):
        if fn is None or arg not in inspect.signature(fn).parameters:
            missing.append(what)
    return f"this fastdcp has no {', '.join(missing)}" if missing else None


def _newest_checkpoint() -> Callable[..., Any] | None:
    try:
        import fastdcp
    except Exception:  # noqa: BLE001
        return None
    fn = getattr(fastdcp, "newest_checkpoint", None)
    if fn is None:
        try:
            from fastdcp.tiered import newest_checkpoint as fn
        except Exception:  # noqa: BLE001
            return None
    return fn


def _node_env() -> str | None:
    """The environment variable fastdcp reads a process's node name from (None: no peers here)."""
    try:
        from fastdcp.tiered.peers import NODE_ENV
    except Exception:  # noqa: BLE001 - a fastdcp without peer replicas
        return None
    return NODE_ENV


# --------------------------------------------------------------------------- the job

@dataclass
class _Job:
    phase: str                   # "loops" or "recovery"
    ranks: int
    nodes: int
    state_bytes: int             # per rank
    steps: int
    every: int
    step_ms: float
    batch: int | None
    repeats: int
    systems: list[str]
    shared: str                  # <shared>/<system>/rep<r>/ckpt<i>
    local: str                   # <local>/node<j>/<system>/rep<r>: node j's local tier
    keep: str                    # the expected states of the last checkpoints, per rank
    out_path: str
    cold_method: str | None = None
    corrupt: str | None = None   # test hook: flip a byte after this system's recovery
    last: dict[str, str] = field(default_factory=dict)   # "<system>/rep<r>": the loop's last checkpoint

    def shared_dir(self, system: str, rep: int) -> str:
        return os.path.join(self.shared, system, f"rep{rep}")

    def local_root(self, node: int, system: str, rep: int) -> str:
        return os.path.join(self.local, node_name(node), system, f"rep{rep}")

    def expected_path(self, system: str, rep: int, rank: int) -> str:
        return os.path.join(self.keep, f"{system}-rep{rep}-rank{rank}")


class _Notes:
    """train_loop's SnapshotStore reports through a context's ``note``: in a rank, a list."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def _timed_writer_class() -> type:
    """``FastTieredWriter`` that notes when its save's ``replicated`` future resolved (a
    done-callback: measuring never blocks). Built on first use, in the rank."""
    from fastdcp import FastTieredWriter

    class ReplicaTimedWriter(FastTieredWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.replicated_at: float | None = None
            self.replicated_noted = threading.Event()

        def write_data(self, plan: Any, planner: Any) -> Any:
            result = super().write_data(plan, planner)
            future = getattr(self, "replicated", None)
            if future is None:
                self.replicated_noted.set()
            else:
                def note(_: Any) -> None:
                    self.replicated_at = time.perf_counter()
                    self.replicated_noted.set()

                future.add_done_callback(note)
            return result

    return ReplicaTimedWriter


def _loop_system(name: str, job: _Job, node: int, rep: int, writers: list[Any]) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    from .training_loop import LoopSystem

    if name == NONE:
        return None
    if name == STOCK:
        return LoopSystem(STOCK, lambda p: FileSystemWriter(p), save_kwargs={})
    import fastdcp

    cls = _timed_writer_class()
    root = job.local_root(node, name, rep)
    extra = {"replicas": 1} if name == REPLICAS else {}

    def make(path: str) -> Any:
        writer = cls(path, local_root=root, async_staging=True, **extra)
        writers.append(writer)
        return writer

    return LoopSystem(name, make, guard=fastdcp.guard, release_pool=getattr(fastdcp, "release_staging", None),
                      save_kwargs={})


def _max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _keep_expected(snap: Any, path: str) -> None:
    """Keep a verification copy for the recovery phase: its bytes moved to ``path``.bin, the rest
    pickled to ``path``.pkl."""
    if snap.file is None:  # in-process clones: write them out
        with open(path + ".clones", "wb") as f:
            pickle.dump({k: v.clone() for k, v in snap.clones.items()}, f)
        snap.clones = None
    else:
        shutil.move(snap.file, path + ".bin")
        snap.file = path + ".bin"
    with open(path + ".pkl", "wb") as f:
        pickle.dump(snap, f)


def _load_expected(path: str) -> Any:
    with open(path + ".pkl", "rb") as f:
        snap = pickle.load(f)
    if snap.file is None:
        with open(path + ".clones", "rb") as f:
            snap.clones = pickle.load(f)
    return snap


def _loops(rank: int, job: _Job, records: list[dict[str, Any]]) -> None:
    import torch.distributed as dist

    from .training_loop import SnapshotStore, SyntheticTraining, run_loop

    node = node_of(rank, job.ranks, job.nodes)
    trainer = SyntheticTraining(job.state_bytes, "cpu", seed=rank + 1)
    # Every rank calibrates at once (they compete for the cores as in the loop); rank 0's batch for all.
    step_s = trainer.calibrate(job.step_ms / 1e3, job.batch)
    batch = torch.tensor([trainer.batch])
    dist.broadcast(batch, 0)
    if int(batch[0]) != trainer.batch:
        step_s = trainer.calibrate(job.step_ms / 1e3, int(batch[0]))
    nbytes = trainer.state_bytes()
    per_loop = job.steps // job.every
    snapshots = SnapshotStore(_Notes(), max(1, per_loop) * nbytes, job.keep)
    # Each rank checkpoints its state under keys of its own, so that it writes files of its own.
    own_state = trainer.state_dict
    trainer.state_dict = lambda: {f"rank{rank}": own_state()}  # type: ignore[method-assign]
    try:
        for rep in range(job.repeats):
            for name in job.systems:
                writers: list[Any] = []
                system = _loop_system(name, job, node, rep, writers)
                root = job.shared_dir(name, rep)
                release = system.release_pool if system is not None else None
                if release:  # every loop starts with fastdcp's staging pool empty, as in tiered
                    release()
                dist.barrier()
                try:
                    run = run_loop(trainer, job.steps, job.every, system, root, snapshots if system else None)
                finally:
                    if release:
                        release()
                loop_s = _max(run.loop_seconds)
                replicated: list[float | None] = []
                for writer in writers:  # the clock is stopped: wait for every replica and every drain
                    future = getattr(writer, "replicated", None)
                    if future is not None:
                        future.result(WAIT_S)
                    if not writer.replicated_noted.wait(30.0):
                        raise RuntimeError(f"{SCENARIO}: no replicated time for {writer.shared_path}")
                    writer.wait_durable(WAIT_S)
                if writers:
                    replicated = [None if w.replicated_at is None else w.replicated_at - t._t0
                                  for w, t in zip(writers, run.checkpoints, strict=True)]
                if run.checkpoints:  # the last checkpoint's exact state, for the recovery
                    for snap in run.snapshots[:-1]:
                        snap.discard()
                    _keep_expected(run.snapshots[-1], job.expected_path(name, rep, rank))
                    records.append({"system": name, "rep": rep, "kind": "checkpoint",
                                    "path": run.checkpoints[-1].path, "seconds": 0.0, "error": None})
                dist.barrier()
                records.append({
                    "system": name, "rep": rep, "kind": "loop", "seconds": loop_s, "error": None,
                    "own_loop_seconds": run.loop_seconds, "state_bytes": nbytes, "batch": trainer.batch,
                    "calibrated_step_seconds": step_s, "warmup_seconds": run.warmup_seconds,
                    "step_seconds": statistics.median(run.step_seconds) if run.step_seconds else None,
                    "blocked": [t.blocked for t in run.checkpoints],
                    "committed": [t.durable for t in run.checkpoints],
                    "replicated": replicated, "steps": [t.step for t in run.checkpoints],
                    "peak_host_bytes": run.peak_host_bytes, "others_cpu_share": run.others_cpu_share})
    finally:
        snapshots.close()


def _mismatch(snap: Any, loaded: dict[str, Any], where: str) -> str | None:
    expected = snap.expected()
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    error = local_mismatch(tensors, loaded, where)
    if error:
        return error
    for k, v in expected.items():
        if not isinstance(v, torch.Tensor) and loaded.get(k) != v:
            return f"{where}: object {k!r} loaded as {loaded.get(k)!r}, saved {v!r}"
    return None


def _recovery(rank: int, job: _Job, records: list[dict[str, Any]]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from .pagecache import make_cold
    from .state import corrupt_one_byte
    from .training_loop import flat

    node = node_of(rank, job.ranks, job.nodes)
    newest = _newest_checkpoint()
    group_s = _warm_up_recovery(rank, job)
    for rep in range(job.repeats):
        for name in job.systems:
            snap = _load_expected(job.expected_path(name, rep, rank))
            want = job.last[f"{name}/rep{rep}"]
            dest = snap.destination()
            parent = job.shared_dir(name, rep)
            root = job.local_root(node, name, rep)
            dist.barrier()
            if rank == 0 and name in (TIERED, STOCK) and job.cold_method:
                make_cold(job.cold_method, parent)
            dist.barrier()
            t0 = time.perf_counter()
            tier, shared_bytes = "shared", None
            if name == STOCK:
                path = want
                t1 = time.perf_counter()
                dcp.load(dest, storage_reader=FileSystemReader(path))
            else:
                from fastdcp import FastTieredReader

                path = newest(parent, local_root=root, from_peers=True)
                t1 = time.perf_counter()
                reader = FastTieredReader(path, local_root=root, from_peers=True)
                dcp.load(dest, storage_reader=reader)
                tier, shared_bytes = str(reader.tier), int(reader.shared_bytes_read)
            t2 = time.perf_counter()
            dist.barrier()
            seconds = _max(time.perf_counter() - t0)
            newest_s, load_s = _max(t1 - t0), _max(t2 - t1)
            loaded = flat(dest)
            if job.corrupt in (name, "all"):
                corrupt_one_byte(loaded)
            where = f"{SCENARIO}/{name}/rep{rep}/rank{rank}"
            error = (f"{where}: newest_checkpoint chose {path}, not the last checkpoint {want}" if path != want
                     else _mismatch(snap, loaded, where))
            if shared_bytes is None:  # stock: every byte it loaded came from the shared directory
                shared_bytes = sum(v.numel() * v.element_size() for v in loaded.values() if isinstance(v, torch.Tensor))
            records.append({"system": name, "rep": rep, "kind": "recovery", "seconds": seconds, "error": error,
                            "verification": error is not None,
                            "newest_seconds": newest_s, "load_seconds": load_s, "tier": tier,
                            "shared_bytes_read": shared_bytes, "node": node, "peer_group_seconds": group_s})
            del dest, loaded


def _warm_up_recovery(rank: int, job: _Job) -> float | None:
    """Untimed, before the recoveries: a small checkpoint saved and loaded through fastdcp's and
    stock's readers, so that no recovery pays the process's first load (imports, thread pools);
    then fastdcp's peer group made (a collective, once per process). Returns the group's seconds,
    the slowest rank's (None without fastdcp systems)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(job.shared, "warm_up")
    state = {f"rank{rank}": torch.arange(1024, dtype=torch.float32) + rank}
    if any(s in FASTDCP_SYSTEMS for s in job.systems):
        from fastdcp import FastFileSystemReader, FastFileSystemWriter
        from fastdcp.tiered.peers import peer_group

        dcp.save(state, storage_writer=FastFileSystemWriter(path))
        dcp.load(state, storage_reader=FastFileSystemReader(path))
    else:
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(state, storage_writer=FileSystemWriter(path))
    dcp.load(state, storage_reader=FileSystemReader(path))
    dist.barrier()
    if not any(s in FASTDCP_SYSTEMS for s in job.systems):
        return None
    t0 = time.perf_counter()
    peer_group()
    return _max(time.perf_counter() - t0)


def _rank(rank: int, job: _Job, port: int) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    node = node_of(rank, job.ranks, job.nodes)
    env = _node_env()
    if env:  # every process of a simulated node runs with its node's name
        os.environ[env] = node_name(node)
    # ... and with what torchrun would tell it on that node (a tiered writer without replicas learns
    # which ranks share its node, and so its local tier, from these alone)
    per_node = job.ranks // job.nodes
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      GROUP_RANK=str(node), WORLD_SIZE=str(job.ranks))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=job.ranks, timeout=timedelta(minutes=10))
    with rank_records(job.out_path, rank) as records:
        if job.phase == "loops":
            _loops(rank, job, records)
        else:
            _recovery(rank, job, records)


def _spawn(job: _Job) -> list[dict[str, Any]]:
    records = spawn_ranks(_rank, (job, free_port()), job.ranks, job.out_path)
    wrong = [r["error"] for r in records if r.get("verification")]
    if wrong:
        raise VerificationError(wrong[0])
    errors = [f"rank {r['rank']}: {r['error']}" for r in records if r.get("error")]
    if errors:  # every rank's (the first may be the echo of another rank's failure)
        raise RuntimeError(f"{SCENARIO} {job.phase}: " + "\n".join(errors))
    return records


# --------------------------------------------------------------------------- the scenario

def _lose_node(job: _Job, node: int) -> None:
    """The node is gone: its local tier removed; a replacement node's local tier is empty."""
    path = os.path.join(job.local, node_name(node))
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def _record(ctx: Any, job: _Job, loop_systems: list[str], loops: list[dict[str, Any]],
            recoveries: list[dict[str, Any]]) -> None:
    rec = ctx.recorder
    cfg = {"ranks": job.ranks, "nodes": job.nodes, "local_tier": ctx.cfg.local_tier}
    by_rep: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in loops:
        by_rep.setdefault((r["system"], r["rep"]), []).append(r)
    total_bytes = sum(r["state_bytes"] for r in loops if r["system"] == NONE and r["rep"] == 0)
    for rep in range(job.repeats):
        base = by_rep.get((NONE, rep), [None])[0]
        tiered = by_rep.get((TIERED, rep), [None])[0]
        for name in loop_systems:
            ranks = by_rep.get((name, rep))
            if not ranks:
                continue
            r0 = ranks[0]
            step_s = statistics.median(r["step_seconds"] for r in ranks if r["step_seconds"])
            n = len(r0["committed"])
            committed = [max(r["committed"][i] for r in ranks) for i in range(n)]
            replicated = ([max(r["replicated"][i] for r in ranks) for i in range(n)]
                          if r0["replicated"] and all(x is not None for r in ranks for x in r["replicated"]) else None)
            rec.add(SCENARIO, "dir", name, {**cfg, "phase": "loop"}, total_bytes, r0["seconds"], None,
                    {"steps": job.steps, "every": job.every},
                    loop_slowdown=r0["seconds"] / base["seconds"] if base else None,
                    vs_tiered=r0["seconds"] / tiered["seconds"] if tiered and name == REPLICAS else None,
                    step_s=step_s, warmup_s=max(r["warmup_seconds"] for r in ranks),
                    blocked_s=[max(r["blocked"][i] for r in ranks) for i in range(n)],
                    committed_s=committed, replicated_s=replicated,
                    replicated_steps_after_commit=None if replicated is None else
                    [(a - c) / step_s for a, c in zip(replicated, committed)],
                    peak_host_bytes=max(r["peak_host_bytes"] for r in ranks), checkpoints=n,
                    batch=r0["batch"], calibrated_step_seconds=r0["calibrated_step_seconds"])
    by_rec: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in recoveries:
        by_rec.setdefault((r["system"], r["rep"]), []).append(r)
    for (name, rep), ranks in by_rec.items():
        r0 = ranks[0]
        rec.add(SCENARIO, "dir", name, {**cfg, "phase": "recovery"}, total_bytes, r0["seconds"], None,
                {"lost_node": node_name(job.nodes - 1)},
                recovery_seconds=r0["seconds"], newest_seconds=r0["newest_seconds"], load_seconds=r0["load_seconds"],
                peer_group_seconds=r0["peer_group_seconds"] if name in FASTDCP_SYSTEMS else None,
                shared_tier_bytes_read=sum(r["shared_bytes_read"] for r in ranks),
                tiers=[r["tier"] for r in sorted(ranks, key=lambda r: r["rank"])], verified=True)


def run_replicas(ctx: Any, wheres: list[str]) -> None:
    """The scenario, its shared tier a directory on the ``dir`` target."""
    c = ctx.cfg
    names = {s.name for s in ctx.systems}
    systems = [NONE] + ([STOCK] if STOCK in names else [])
    if "fastdcp" in names:
        fast = next(s for s in ctx.systems if s.name == "fastdcp")
        why = "fastdcp is a stand-in" if fast.standin else replica_support()
        if why is None:
            systems += list(FASTDCP_SYSTEMS)
        else:
            ctx.note(f"{SCENARIO}: {TIERED} and {REPLICAS} not measured: {why}")
    if len(systems) == 1:
        ctx.note(f"{SCENARIO}: no system to measure (stock runs with --systems stock, the fastdcp ones with fastdcp)")
        return
    if not (os.path.isdir(c.local_tier) and os.access(c.local_tier, os.W_OK)):
        ctx.note(f"{SCENARIO}: not measured: --local-tier {c.local_tier} is not a writable directory")
        return
    ranks, nodes = c.replicas_ranks, c.replicas_nodes
    work = tempfile.mkdtemp(prefix="fastdcp_bench_replicas_", dir=c.local_tier)
    shared = os.path.join(ctx.targets[wheres[0]], GROUP)
    try:
        keep = os.path.join(work, "expected")
        os.makedirs(keep)
        job = _Job("loops", ranks, nodes, c.replicas_size, c.train_steps, c.train_every, c.train_step_ms,
                   c.train_batch, c.repeats, systems, shared, work, keep, os.path.join(work, "loops.json"),
                   ctx.cold_method, c.corrupt_after_load)
        layout = ", ".join(f"{node_name(j)}: ranks {r[0]}-{r[-1]}" for j, r in enumerate(nodes_layout(ranks, nodes)))
        ctx.progress(f"{SCENARIO}: {ranks} ranks on {nodes} simulated nodes ({layout}), {fmt_size(c.replicas_size)} "
                     f"of model + AdamW per rank; {c.train_steps} steps, async_save every {c.train_every}; loops: "
                     f"{' '.join(systems)} x {c.repeats}")
        records = _spawn(job)
        loops = [r for r in records if r["kind"] == "loop"]
        _log_loops(ctx, job, loops)
        # each loop's last checkpoint: the one its recovery must find
        job.last = {f"{r['system']}/rep{r['rep']}": r["path"] for r in records if r["kind"] == "checkpoint"}
        lost = nodes - 1
        _lose_node(job, lost)
        recovery = [s for s in RECOVERY_SYSTEMS if s in systems]
        job.phase, job.systems, job.out_path = "recovery", recovery, os.path.join(work, "recovery.json")
        ctx.progress(f"{SCENARIO}: {node_name(lost)} lost (its local tier removed, an empty one in its place); "
                     f"recovering with {' '.join(recovery)}")
        recoveries = _spawn(job)
        _record(ctx, job, systems, loops, recoveries)
        _log_recoveries(ctx, recoveries)
        ctx.note(f"{SCENARIO}: the shared tier is a directory on the disk, read at the disk's speed (this run's read "
                 f"limit of dir); there is no way here to limit a directory's bandwidth, so the "
                 f"{c.replicas_shared_mib_s:g} MiB/s shared tier of the target is the state read at that rate (a "
                 f"lower bound of a load from such a tier)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


def _log_loops(ctx: Any, job: _Job, loops: list[dict[str, Any]]) -> None:
    for r in sorted((r for r in loops if r["rank"] == 0), key=lambda r: (r["rep"], job.systems.index(r["system"]))):
        msg = f"{SCENARIO} loop {r['system']:<17} {r['rep'] + 1}/{job.repeats}: {r['seconds']:7.3f} s"
        replicated = [x for x in r["replicated"] if x is not None]
        if replicated:
            msg += f", replicated (rank 0) {statistics.median(replicated):.3f} s from the call (median)"
        ctx.progress(msg)


def _log_recoveries(ctx: Any, recoveries: list[dict[str, Any]]) -> None:
    for r in (r for r in recoveries if r["rank"] == 0):
        shared = sum(x["shared_bytes_read"] for x in recoveries if (x["system"], x["rep"]) == (r["system"], r["rep"]))
        ctx.progress(f"{SCENARIO} recovery {r['system']:<17} rep {r['rep'] + 1}: {r['seconds']:7.3f} s (newest "
                     f"{r['newest_seconds']:.3f} s), shared tier read {fmt_size(shared)}, bit-exact")


# --------------------------------------------------------------------------- report

@dataclass
class ReplicasRow:
    """One system of one phase: medians over repeats (and over every checkpoint of every repeat
    for the times from the call), maxima of the per-checkpoint worst cases."""
    phase: str                               # "loop" or "recovery"
    system: str
    ranks: int
    nodes: int
    repeats: int
    state_bytes: int                         # every rank's together
    seconds: float                           # loop time, or recovery_seconds
    slowdown_pct: float | None = None        # loop vs none
    vs_tiered_pct: float | None = None       # fastdcp_replicas' loop vs fastdcp_tiered's of the same repeat
    blocked_ms_max: float | None = None
    committed_s: float | None = None
    replicated_s: float | None = None        # call -> replicated on every rank, median
    replicated_s_max: float | None = None
    replicated_steps_after_commit_max: float | None = None
    recovery_seconds: float | None = None
    newest_seconds: float | None = None
    load_seconds: float | None = None
    peer_group_seconds: float | None = None     # made once per process, before the timed recoveries
    shared_tier_bytes_read: int | None = None   # the most of any repeat, every rank's together
    tiers: list[str] = field(default_factory=list)
    verified: bool | None = None


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _flat(values: list[list[float] | None]) -> list[float]:
    return [x for per_loop in values if per_loop for x in per_loop if x is not None]


def replicas_rows(results: list[Result]) -> list[ReplicasRow]:
    order = {n: i for i, n in enumerate(LOOP_SYSTEMS)}
    mine = sorted((r for r in results if r.scenario == SCENARIO),
                  key=lambda r: (r.config.get("phase") != "loop", order.get(r.system, 99)))
    rows = []
    for r in mine:
        ex, phase = r.extra, r.config.get("phase")
        row = ReplicasRow(phase=phase, system=r.system, ranks=r.config.get("ranks", 0), nodes=r.config.get("nodes", 0),
                          repeats=len(r.seconds), state_bytes=r.bytes, seconds=statistics.median(r.seconds))
        if phase == "loop":
            slow = _median(ex.get("loop_slowdown", []))
            row.slowdown_pct = None if r.system == NONE or slow is None else 100 * (slow - 1)
            vs = _median(ex.get("vs_tiered", []))
            row.vs_tiered_pct = None if vs is None else 100 * (vs - 1)
            blocked = _flat(ex.get("blocked_s", []))
            row.blocked_ms_max = 1e3 * max(blocked) if blocked else None
            row.committed_s = _median(_flat(ex.get("committed_s", [])))
            replicated = _flat(ex.get("replicated_s", []))
            if replicated:
                row.replicated_s, row.replicated_s_max = statistics.median(replicated), max(replicated)
            steps = _flat(ex.get("replicated_steps_after_commit", []))
            row.replicated_steps_after_commit_max = max(steps) if steps else None
        else:
            row.recovery_seconds = row.seconds
            row.newest_seconds = _median(ex.get("newest_seconds", []))
            row.load_seconds = _median(ex.get("load_seconds", []))
            row.peer_group_seconds = _median(ex.get("peer_group_seconds", []))
            row.shared_tier_bytes_read = max(ex.get("shared_tier_bytes_read", [0]))
            row.tiers = sorted({t for per_rep in ex.get("tiers", []) for t in per_rep})
            row.verified = all(ex.get("verified", [False]))
        rows.append(row)
    return rows


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _table(cols: list[str], cells: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(cols), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells)]


def replicas_verdicts(rows: list[ReplicasRow], shared_mib_s: float | None,
                      disk_read_gibps: float | None = None) -> list[str]:
    """The targets, for what was measured."""
    out = []
    loops = {r.system: r for r in rows if r.phase == "loop"}
    recov = {r.system: r for r in rows if r.phase == "recovery"}
    k1 = loops.get(REPLICAS)
    if k1 is not None and k1.vs_tiered_pct is not None:
        met = k1.vs_tiered_pct <= 100 * LOOP_TARGET
        out.append(f"  loop with replicas=1 {k1.vs_tiered_pct:+.1f}% vs {TIERED} (target <= +{100 * LOOP_TARGET:.0f}%): "
                   f"{'met' if met else 'NOT met'}")
    if k1 is not None and k1.replicated_steps_after_commit_max is not None:
        met = k1.replicated_steps_after_commit_max <= REPLICATED_STEPS_TARGET
        out.append(f"  replicated {k1.replicated_s:.3f} s after the call (median; max {k1.replicated_s_max:.3f} s), at "
                   f"most {k1.replicated_steps_after_commit_max:.2f} steps after the local commit (target <= "
                   f"{REPLICATED_STEPS_TARGET:g}): {'met' if met else 'NOT met'}")
    rk1 = recov.get(REPLICAS)
    if rk1 is not None:
        shared = recov.get(TIERED)
        parts = []
        bound = None
        if shared_mib_s:
            bound = rk1.state_bytes / (shared_mib_s * (1 << 20))
            parts.append(f"at {shared_mib_s:g} MiB/s at least {bound:.3f} s")
        if shared is not None:
            parts.append(f"{TIERED} (replicas=0) measured {shared.recovery_seconds:.3f} s from the disk"
                         + (f" (read limit {disk_read_gibps:.2f} GiB/s)" if disk_read_gibps else ""))
        reference = max([x for x in (bound, shared.recovery_seconds if shared else None) if x is not None],
                        default=None)
        zero = rk1.shared_tier_bytes_read == 0
        fast = reference is not None and rk1.recovery_seconds <= RECOVERY_TARGET * reference
        out.append(f"  recovery with replicas=1: {rk1.recovery_seconds:.3f} s, shared tier read "
                   f"{fmt_size(rk1.shared_tier_bytes_read or 0)}, {'bit-exact' if rk1.verified else 'NOT verified'}; "
                   f"the same load from the shared tier: {'; '.join(parts) or 'not measured'} (target: 0 bytes, "
                   f"bit-exact, <= 1/3 of it"
                   + (f", <= {RECOVERY_TARGET * reference:.3f} s" if reference is not None else "")
                   + f"): {'met' if zero and fast and rk1.verified else 'NOT met'}")
    return out


def replicas_lines(results: list[Result], shared_mib_s: float | None = None,
                   disk_read_gibps: float | None = None) -> list[str]:
    """The replicas tables: the loops (slowdown, replication times), the recoveries after a lost
    node (time, bytes read from the shared tier); then the targets."""
    rows = replicas_rows(results)
    if not rows:
        return []
    r0 = rows[0]
    head = [f"replicas: {r0.ranks} ranks on {r0.nodes} simulated nodes, {fmt_size(r0.state_bytes)} of state in all, "
            f"{r0.repeats} repeat(s) interleaved; shared tier: a directory on the disk, local tiers: a directory "
            f"per node under --local-tier; the last node lost before the recovery.",
            "  slowdown = median of loop / none loop of the same repeat - 1; vs tiered = the same against "
            f"{TIERED} (replicas=0); committed = call -> upload_completion (slowest rank); replicated = call -> "
            "writer.replicated resolved on every rank; steps after commit = (replicated - committed) / step time.",
            "  recovery = newest_checkpoint + dcp.load (stock: the load alone), barrier to barrier; peer group = "
            "fastdcp's peer group made before the recoveries (once per process, not in them); shared read = "
            "bytes every rank read from the shared tier; tiers = what FastTieredReader chose on the ranks."]
    loop_cells = [[r.system, f"{r.seconds:.3f}", _cell(r.slowdown_pct, "{:+.1f}%"), _cell(r.vs_tiered_pct, "{:+.1f}%"),
                   _cell(r.blocked_ms_max, "{:.1f}"), _cell(r.committed_s, "{:.3f}"),
                   "-" if r.replicated_s is None else f"{r.replicated_s:.3f} / {r.replicated_s_max:.3f}",
                   _cell(r.replicated_steps_after_commit_max, "{:.2f}")] for r in rows if r.phase == "loop"]
    rec_cells = [[r.system, f"{r.recovery_seconds:.3f}", _cell(r.newest_seconds, "{:.3f}"),
                  _cell(r.load_seconds, "{:.3f}"), _cell(r.peer_group_seconds, "{:.3f}"),
                  fmt_size(r.shared_tier_bytes_read or 0), ",".join(r.tiers),
                  "yes" if r.verified else "NO"] for r in rows if r.phase == "recovery"]
    out = [*head]
    if loop_cells:
        out += _table(["system", "loop s", "slowdown", "vs tiered", "blocked ms max", "committed s",
                       "replicated s med/max", "steps after commit max"], loop_cells)
    if rec_cells:
        out += ["", *_table(["recovery", "seconds", "newest s", "load s", "peer group s (apart)", "shared read", "tiers",
                             "bit-exact"],
                            rec_cells)]
    verdicts = replicas_verdicts(rows, shared_mib_s, disk_read_gibps)
    return out + (["targets:", *verdicts] if verdicts else [])
