"""Multi-process (gloo, CPU) resharding tests: stock DCP <-> fastdcp, bit-exact.

Checkpoints of DTensors (placements Shard(0), Shard(1), Replicate), a
ShardedTensor, a replicated plain tensor, shared and per-rank non-tensor state
are written at world size W_save by each writer kind and loaded at world size
W_load under every placement by each reader kind, for
(W_save, W_load) in (1, 2), (2, 1), (2, 3), (2, 2).

Process groups are expensive to start (a torch import per rank), so a
module-scoped fixture starts three groups at once, which order themselves
through marker files:

    X  ws=2  save every (writer, placement) checkpoint; then load the ws=1 and
             ws=2 ones                                   (1 -> 2, 2 -> 2)
    Y  ws=1  save every ws=1 checkpoint; then load the ws=2 ones   (2 -> 1)
    Z  ws=3  load the ws=2 checkpoints                             (2 -> 3)

Workers loop over all combinations, never raise, and append one JSON line per
(combination, rank) to a results file; the per-pair tests
(``test_reshard[stock-stock]``, ``[stock-fast]``, ``[fast-stock]``,
``[fast-fast]``) check the records of their pair.  Inside a phase the
stock-stock combinations run first so a crash in fast code cannot hide them.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import dcp_cases as C
from fastdcp.bench.process_group import exit_spawned_rank
from dcp_cases import KINDS, PAIR_IDS, PAIRS

PLACEMENTS = ("S0", "S1", "R")
WS_PAIRS = ((1, 2), (2, 1), (2, 3), (2, 2))
SAVE_WORLD_SIZES = (1, 2)

SHAPE_F32 = (63, 47)
SHAPE_BF16 = (37, 130)
SHAPE_ST = (63, 20)  # ShardedTensor, chunked along dim 0
SHAPE_REP = (17,)

PG_TIMEOUT_S = 90
MP_TIMEOUT_S = float(os.environ.get("FASTDCP_MP_TIMEOUT", "300"))  # all groups together


# --------------------------------------------------------------------------- #
# deterministic content (every process builds the same full tensors)
# --------------------------------------------------------------------------- #
def full_tensors() -> dict[str, torch.Tensor]:
    return {
        "w": C.random_tensor(torch.float32, SHAPE_F32, ("mp", "w")),
        "b": C.random_tensor(torch.bfloat16, SHAPE_BF16, ("mp", "b")),
        "st": C.random_tensor(torch.float32, SHAPE_ST, ("mp", "st")),
        "rep": C.random_tensor(torch.int64, SHAPE_REP, ("mp", "rep")),
    }


def shared_meta() -> dict:
    return {"step": 1234, "name": "ckpt-\u00e9", "lr": [0.1, 0.01]}


def extra_state(rank: int) -> dict:
    """Per-rank state, keyed by rank (only rank ``rank`` saves it)."""
    return {
        "rank": rank,
        "rng": bytes((rank * 37 + i) % 256 for i in range(64)),
        "t": C.random_tensor(torch.float32, (3 + rank, 5), ("mp", "extra", rank)),
        "note": f"rank {rank} was here",
    }


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[name]


def expected_local(full: torch.Tensor, placement: str, rank: int, ws: int) -> torch.Tensor:
    """The slice of ``full`` rank ``rank`` holds (torch.chunk semantics, as DTensor)."""
    if placement == "R":
        return full
    dim = {"S0": 0, "S1": 1}[placement]
    chunks = torch.chunk(full, ws, dim)
    if rank < len(chunks):
        return chunks[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def st_chunk(full: torch.Tensor, rank: int, ws: int) -> tuple[torch.Tensor, int]:
    chunks = torch.chunk(full, ws, 0)
    off = sum(c.shape[0] for c in chunks[:rank])
    return chunks[rank], off


def ckpt_dir(root: Path, ws: int, writer: str, placement: str) -> Path:
    return Path(root) / f"save_ws{ws}" / writer / placement


def combo_name(ws_save, writer, p_save, ws_load=None, reader=None, p_load=None) -> str:
    s = f"save[ws={ws_save} writer={writer} placement={p_save}]"
    if ws_load is not None:
        s += f" -> load[ws={ws_load} reader={reader} placement={p_load}]"
    return s


# --------------------------------------------------------------------------- #
# worker side
# --------------------------------------------------------------------------- #
class _Recorder:
    def __init__(self, results_dir: str, phase: str, rank: int):
        self.path = os.path.join(results_dir, f"{phase}.rank{rank}.jsonl")
        self.phase, self.rank = phase, rank

    def write(self, **rec):
        rec.update(phase=self.phase, rank=self.rank)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()


def _make_state_dict(mesh, placement: str, rank: int, ws: int) -> dict:
    from torch.distributed.tensor import DTensor

    full = full_tensors()
    sd: dict = {}
    for key in ("w", "b"):
        # Shard(1) locals are non-contiguous views with a storage offset, on purpose.
        local = expected_local(full[key], placement, rank, ws)
        sd[key] = DTensor.from_local(local, mesh, [_placement(placement)], run_check=False,
                                     shape=full[key].shape, stride=full[key].stride())
    sd["rep"] = full["rep"]
    sd["meta"] = shared_meta()
    sd[f"extra_rank{rank}"] = extra_state(rank)
    if _have_sharded_tensor():
        from torch.distributed._shard.sharded_tensor import Shard as STShard
        from torch.distributed._shard.sharded_tensor import init_from_local_shards

        chunk, off = st_chunk(full["st"], rank, ws)
        sd["st"] = init_from_local_shards([STShard.from_tensor_and_offsets(chunk, [off, 0], rank)], *SHAPE_ST)
    return sd


def _make_destination(mesh, placement: str, rank: int, ws: int, ws_save: int) -> tuple[dict, dict]:
    """(destination, expected) for a load at world size ``ws``."""
    from torch.distributed.tensor import DTensor

    full = full_tensors()
    dest: dict = {}
    exp: dict = {}
    for key in ("w", "b"):
        e = expected_local(full[key], placement, rank, ws)
        local = C.sentinel_like(e)
        dest[key] = DTensor.from_local(local, mesh, [_placement(placement)], run_check=False,
                                       shape=full[key].shape, stride=full[key].stride())
        exp[key] = e
    dest["rep"] = C.sentinel_like(full["rep"])
    exp["rep"] = full["rep"]
    dest["meta"] = C.destination_for(shared_meta())
    exp["meta"] = shared_meta()
    if rank < ws_save:  # per-rank state exists only for ranks that saved
        dest[f"extra_rank{rank}"] = C.destination_for(extra_state(rank))
        exp[f"extra_rank{rank}"] = extra_state(rank)
    if _have_sharded_tensor():
        from torch.distributed._shard.sharded_tensor import Shard as STShard
        from torch.distributed._shard.sharded_tensor import init_from_local_shards

        chunk, off = st_chunk(full["st"], rank, ws)
        dest["st"] = init_from_local_shards(
            [STShard.from_tensor_and_offsets(C.sentinel_like(chunk), [off, 0], rank)], *SHAPE_ST)
        exp["st"] = chunk
    return dest, exp


def _check_loaded(dest: dict, exp: dict, placement: str, ptrs: dict) -> None:
    from torch.distributed.tensor import DTensor

    for key in ("w", "b"):
        d = dest[key]
        assert isinstance(d, DTensor), f"{key}: destination is no longer a DTensor ({type(d)})"
        assert tuple(d.placements) == (_placement(placement),), f"{key}: placements changed to {d.placements}"
        local = d.to_local()
        assert local.data_ptr() == ptrs[key], f"{key}: local shard storage was replaced (DCP loads in place)"
        C.assert_tensor_bitexact(local, exp[key], f"{key} (local shard)", check_stride=False)
    C.assert_tensor_bitexact(dest["rep"], exp["rep"], "rep", check_stride=False)
    if "st" in exp:
        shards = dest["st"].local_shards()
        assert len(shards) == 1, f"st: {len(shards)} local shards"
        C.assert_tensor_bitexact(shards[0].tensor, exp["st"], "st (local shard)", check_stride=False)
    rest = {k: v for k, v in exp.items() if k not in ("w", "b", "rep", "st")}
    C.assert_same({k: dest[k] for k in rest}, rest, "non-tensor state", check_stride=False)


def _run_saves(rec: _Recorder, mesh, rank: int, ws: int, root: str) -> None:
    for writer in KINDS:  # stock first
        for p in PLACEMENTS:
            name = combo_name(ws, writer, p)
            t0 = time.time()
            try:
                sd = _make_state_dict(mesh, p, rank, ws)
                path = ckpt_dir(root, ws, writer, p)
                w = C.make_writer(writer, path)
                dcp.save(sd, storage_writer=w)
                ok, msg = True, ""
            except BaseException as e:  # CheckpointException is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                ok, msg = False, traceback.format_exc()
            rec.write(stage="save", combo=name, writer=writer, ws_save=ws, p_save=p,
                      ok=ok, msg=msg, secs=round(time.time() - t0, 3))


def _run_loads(rec: _Recorder, mesh, rank: int, ws: int, root: str, ws_saves: list[int]) -> None:
    for writer, reader in PAIRS:  # stock-stock first
        for ws_save in ws_saves:
            for p_save in PLACEMENTS:
                path = ckpt_dir(root, ws_save, writer, p_save)
                for p_load in PLACEMENTS:
                    name = combo_name(ws_save, writer, p_save, ws, reader, p_load)
                    t0 = time.time()
                    try:
                        # Same answer on every rank (shared file system), so all
                        # ranks skip together and collectives stay in step.
                        if not (path / ".metadata").exists():
                            raise FileNotFoundError(f"no checkpoint at {path} (its save failed)")
                        dest, exp = _make_destination(mesh, p_load, rank, ws, ws_save)
                        ptrs = {k: dest[k].to_local().data_ptr() for k in ("w", "b")}
                        r = C.make_reader(reader, path)
                        dcp.load(dest, storage_reader=r)
                        _check_loaded(dest, exp, p_load, ptrs)
                        ok, msg = True, ""
                    except BaseException as e:
                        if isinstance(e, KeyboardInterrupt):
                            raise
                        ok, msg = False, traceback.format_exc()
                    rec.write(stage="load", combo=name, writer=writer, reader=reader, ws_save=ws_save,
                              p_save=p_save, ws_load=ws, p_load=p_load, ok=ok, msg=msg,
                              secs=round(time.time() - t0, 3))


def _worker(rank: int, spec: dict) -> None:
    """Entry point of every spawned rank.  Never raises."""
    torch.set_num_threads(1)
    # fastdcp's automatic layout (thread_count unset) with its smallest-file rule shrunk: every
    # rank's few KiB spread over several data files, so each reshard combination also covers the
    # multi-file layout (checked in test_fast_checkpoints_use_several_files_per_rank).
    import fastdcp.save.file_split as file_split

    file_split.AUTO_MIN_FILE_BYTES = 1
    ws, phase = spec["ws"], spec["phase"]
    rec = _Recorder(spec["results_dir"], phase, rank)
    try:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ws,))
        markers = Path(spec["root"]) / "markers"
        if spec.get("save"):
            _run_saves(rec, mesh, rank, ws, spec["root"])
            dist.barrier()
            if rank == 0:
                (markers / f"saved_ws{ws}").write_text("done")
        if spec.get("load_from"):
            ready = [w for w in spec["load_from"] if _wait_for_marker(markers / f"saved_ws{w}", spec["deadline"])]
            # agree across ranks (a marker may appear between two ranks' checks)
            flags = torch.tensor([int(w in ready) for w in spec["load_from"]])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            ready = [w for w, f in zip(spec["load_from"], flags.tolist()) if f]
            missing = [w for w in spec["load_from"] if w not in ready]
            if missing:
                rec.write(stage="phase_error", msg=f"gave up waiting for the ws={missing} saves (marker files)")
            _run_loads(rec, mesh, rank, ws, spec["root"], ready)
        dist.barrier()
        rec.write(stage="done")
    except BaseException:
        rec.write(stage="phase_error", msg=traceback.format_exc())
    exit_spawned_rank()  # the records carry the verdict


def _wait_for_marker(path: Path, deadline: float) -> bool:
    while not path.exists():
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


def _have_sharded_tensor() -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import init_from_local_shards  # noqa: F401
    except Exception:
        return False
    return True


# --------------------------------------------------------------------------- #
# parent side
# --------------------------------------------------------------------------- #
GROUPS = [
    {"phase": "X_ws2_save_load", "ws": 2, "save": True, "load_from": [2, 1]},
    {"phase": "Y_ws1_save_load", "ws": 1, "save": True, "load_from": [2]},
    {"phase": "Z_ws3_load", "ws": 3, "save": False, "load_from": [2]},
]


def _run_groups(specs: list[dict]) -> list[dict]:
    """Spawn every group at once, wait for all with one deadline, kill leftovers."""
    t0 = time.time()
    deadline = t0 + MP_TIMEOUT_S
    running = []
    for spec in specs:
        spec = dict(spec, deadline=deadline - 15)  # waiting for markers gives up a bit earlier
        ctx = mp.start_processes(_worker, args=(spec,), nprocs=spec["ws"], join=False, start_method="spawn")
        running.append((spec, ctx, {"phase": spec["phase"], "ws": spec["ws"], "timed_out": False, "error": None}))
    pending = list(running)
    while pending:
        for item in list(pending):
            spec, ctx, status = item
            try:
                done = ctx.join(timeout=0.5)
            except Exception as e:  # a rank died (signal / non-zero exit); join killed the others
                status["error"] = f"{type(e).__name__}: {e}"
                done = True
            if done:
                status["secs"] = round(time.time() - t0, 1)
                pending.remove(item)
        if pending and time.time() > deadline:
            for spec, ctx, status in pending:
                status["timed_out"] = True
                status["secs"] = round(time.time() - t0, 1)
            break
    statuses = []
    for spec, ctx, status in running:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=10)
        status["exitcodes"] = [p.exitcode for p in ctx.processes]
        statuses.append(status)
    return statuses


class MPResults:
    def __init__(self, root: Path, statuses: list[dict]):
        self.root = root
        self.statuses = statuses
        self.records: list[dict] = []
        for f in sorted((root / "results").glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    self.records.append(json.loads(line))

    def phase_summary(self) -> str:
        lines = []
        for s in self.statuses:
            done = sum(1 for r in self.records if r["phase"] == s["phase"] and r["stage"] == "done")
            errs = [r["msg"] for r in self.records if r["phase"] == s["phase"] and r["stage"] == "phase_error"]
            line = (f"phase {s['phase']} (ws={s['ws']}): {s['secs']}s, ranks done {done}/{s['ws']}, "
                    f"exitcodes {s['exitcodes']} (all groups run concurrently)")
            if s["timed_out"]:
                line += f", TIMED OUT after {MP_TIMEOUT_S}s (killed)"
            if s["error"]:
                line += f", error: {s['error']}"
            for e in errs:
                line += "\n    phase error: " + e.strip().replace("\n", "\n    ")
            lines.append(line)
        return "\n".join(lines)

    def check_pair(self, writer: str, reader: str) -> None:
        problems: list[str] = []
        # saves of this pair's writer
        saves = [r for r in self.records if r["stage"] == "save" and r["writer"] == writer]
        for ws in SAVE_WORLD_SIZES:
            for p in PLACEMENTS:
                name = combo_name(ws, writer, p)
                got = [r for r in saves if r["combo"] == name]
                if len(got) != ws:
                    problems.append(f"{name}: {len(got)}/{ws} ranks reported (crash or timeout?)")
                for r in got:
                    if not r["ok"]:
                        problems.append(f"{name} rank {r['rank']}: FAILED\n{r['msg']}")
        # loads of this pair
        loads = [r for r in self.records
                 if r["stage"] == "load" and r["writer"] == writer and r["reader"] == reader]
        by_combo = defaultdict(list)
        for r in loads:
            by_combo[r["combo"]].append(r)
        n_checked = 0
        for ws_save, ws_load in WS_PAIRS:
            for p_save in PLACEMENTS:
                for p_load in PLACEMENTS:
                    name = combo_name(ws_save, writer, p_save, ws_load, reader, p_load)
                    got = by_combo.get(name, [])
                    if len(got) != ws_load:
                        problems.append(f"{name}: {len(got)}/{ws_load} ranks reported (crash or timeout?)")
                    for r in got:
                        n_checked += 1
                        if not r["ok"]:
                            problems.append(f"{name} rank {r['rank']}: FAILED\n{C.message_tail(r['msg'], 3000)}")
        expected = sum(ws_load for _, ws_load in WS_PAIRS) * len(PLACEMENTS) ** 2
        if problems:
            head = (f"{len(problems)} problem(s) for writer={writer} reader={reader} "
                    f"({n_checked}/{expected} rank-loads reported)\n" + self.phase_summary() + "\n\n")
            shown = problems[:25]
            more = f"\n... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
            raise AssertionError(head + "\n\n".join(shown) + more)
        assert n_checked == expected, f"only {n_checked}/{expected} rank-loads were checked"


@pytest.fixture(scope="module")
def mp_results(tmp_path_factory) -> MPResults:
    root = tmp_path_factory.mktemp("mp_reshard")
    (root / "results").mkdir()
    (root / "stores").mkdir()
    (root / "markers").mkdir()
    specs = [dict(g, root=str(root), results_dir=str(root / "results"), store=str(root / "stores" / g["phase"]))
             for g in GROUPS]
    statuses = _run_groups(specs)
    res = MPResults(root, statuses)
    print("\n" + res.phase_summary())  # visible with -s
    return res


@pytest.mark.fastdcp_timeout(0)
@pytest.mark.parametrize(("writer_kind", "reader_kind"), PAIRS, ids=PAIR_IDS)
def test_reshard(writer_kind, reader_kind, mp_results):
    """DTensor S0/S1/R, ShardedTensor, replicated tensor, shared and per-rank
    non-tensor state: every save placement x load placement x (W_save, W_load)."""
    mp_results.check_pair(writer_kind, reader_kind)


@pytest.mark.fastdcp_timeout(0)
def test_fast_checkpoints_use_several_files_per_rank(mp_results):
    """The reshard matrix above loads fastdcp checkpoints written with the automatic layout spread
    over several files per rank (the workers shrink its smallest-file rule): check it really did."""
    for ws in (1, 2):
        for placement in PLACEMENTS:
            directory = ckpt_dir(mp_results.root, ws, "fast", placement)
            names = [n for n in os.listdir(directory) if n.endswith(".distcp")]
            per_rank = defaultdict(int)
            for name in names:
                per_rank[int(name[2:].split("_", 1)[0])] += 1
            assert max(per_rank.values(), default=0) >= 2, f"ws={ws} {placement}: data files {sorted(names)}"
