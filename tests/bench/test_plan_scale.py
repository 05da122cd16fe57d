"""The `plan_scale` scenario (fastdcp/bench/plan_scale.py, simulated_ranks.py, plan_scale_report.py):
a simulated rank's plans equal a real 2-rank gloo FSDP2 run's, the reference read plans equal
stock's, the scenario end to end at tiny N in the benchmark runner (every step of both systems in
the table and the JSON, the checks passing), the budget and validation shortcuts, the replicated
load's storage bytes without and with read-once (``--plan-replicas``), and the growth exponents and
bars of the report."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from fastdcp import FastLoadPlanner, FastSavePlanner
from fastdcp.bench.config import QUICK_SCENARIOS, config_from_args
from fastdcp.bench.plan_scale import (
    COORDINATOR,
    GLOBAL_PLAN,
    LOAD_HALF,
    LOAD_REPLICATED,
    LOAD_SAME,
    PHASES,
    OWN_LOAD,
    RANK,
    READ,
    REPEAT,
    SAVE,
    VALIDATION_ESTIMATE,
    PlanScaleSimulation,
    SimulationOutcome,
    cross_checks,
    fastdcp_system,
    growth_exponent,
    n_log_n_exponent,
    stock_system,
)
from fastdcp.bench.plan_scale_report import TOTALS, bars, plan_scale_json, plan_scale_lines, summarize
from fastdcp.bench.results import Recorder
from fastdcp.bench.process_group import exit_spawned_rank
from fastdcp.bench.runner import main
from fastdcp.bench.simulated_ranks import (
    ChunkLayout,
    ModelShape,
    SimulatedRanks,
    reference_read_items,
    sample_ranks,
    shard_rows,
)

# Uneven on 2 ranks (vocab 33, intermediate 22 over 2: 17+16 and 11+11 rows), small enough to
# build and plan in milliseconds.
SMALL = ModelShape(layers=2, hidden=16, intermediate=22, heads=2, vocab=33)
PLANNERS = {"stock": (DefaultSavePlanner, DefaultLoadPlanner), "fastdcp": (FastSavePlanner, FastLoadPlanner)}
REAL_RUN_TIMEOUT_S = 150


# --------------------------------------------------------------------------- a real FSDP2 run


def _small_fsdp_state(rank: int, world_size: int) -> dict:
    """SMALL as a real module (the parameter names of a Hugging Face Llama), sharded with FSDP2,
    one AdamW step taken, and its state dict as ``get_state_dict`` gives it."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    h, i = SMALL.hidden, SMALL.intermediate
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(SMALL.vocab, h)
    layers = []
    for _ in range(SMALL.layers):
        block = nn.Module()
        block.self_attn = nn.Module()
        for name in "qkvo":
            setattr(block.self_attn, f"{name}_proj", nn.Linear(h, h, bias=False))
        block.mlp = nn.Module()
        block.mlp.gate_proj, block.mlp.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        block.mlp.down_proj = nn.Linear(i, h, bias=False)
        block.input_layernorm, block.post_attention_layernorm = nn.RMSNorm(h), nn.RMSNorm(h)
        layers.append(block)
    model.model.layers = nn.ModuleList(layers)
    model.model.norm = nn.RMSNorm(h)
    model.lm_head = nn.Linear(h, SMALL.vocab, bias=False)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _local_pieces(state: dict) -> dict[str, tuple]:
    """Every tensor's local shape (a DTensor's local piece) and the param groups of a state dict."""
    pieces: dict[str, tuple] = {f"model.{k}": tuple(v.to_local().shape) for k, v in state["model"].items()}
    for fqn, moments in state["optim"]["state"].items():
        for key, value in moments.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            pieces[f"optim.state.{fqn}.{key}"] = (type(value).__name__, tuple(local.shape), local.dtype)
    pieces["optim.param_groups"] = tuple(tuple(sorted(group.items())) for group in state["optim"]["param_groups"])
    return pieces


def _real_rank(rank: int, spec: dict) -> None:
    """A spawned rank: its local save plans (both planners), a real dcp.save, its local load plans
    against the real .metadata; written to ``rank{rank}.pkl``. Never raises."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=2)
        state = _small_fsdp_state(rank, 2)
        out["pieces"] = _local_pieces(state)
        for name, (save_planner, _) in PLANNERS.items():
            planner = save_planner()
            planner.set_up_planner(state, None, rank == 0)
            plan = planner.create_local_plan()
            out[("save", name)] = (list(plan.items), dict(plan.planner_data))
        dcp.save(state, storage_writer=FileSystemWriter(spec["checkpoint"]))
        metadata = FileSystemReader(spec["checkpoint"]).read_metadata()
        for name, (_, load_planner) in PLANNERS.items():
            planner = load_planner()
            planner.set_up_planner(state, metadata, rank == 0)
            out[("load", name)] = list(planner.create_local_plan().items)
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(spec["out"], f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    exit_spawned_rank()  # the file carries the verdict


def _run_real(tmp_path: Path) -> list[dict]:
    spec = {"store": str(tmp_path / "store"), "checkpoint": str(tmp_path / "real"), "out": str(tmp_path)}
    context = mp.start_processes(_real_rank, args=(spec,), nprocs=2, join=False, start_method="spawn")
    deadline = time.time() + REAL_RUN_TIMEOUT_S
    while not context.join(timeout=0.5):
        if time.time() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the real 2-rank gloo run did not finish in {REAL_RUN_TIMEOUT_S} s")
    results = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            result = pickle.load(f)
        assert "error" not in result, result["error"]
        results.append(result)
    return results


def test_simulated_ranks_plan_as_a_real_fsdp2_gloo_run(tmp_path):
    real = _run_real(tmp_path)
    real_metadata = FileSystemReader(str(tmp_path / "real")).read_metadata()
    ranks = SimulatedRanks(SMALL, 2)
    try:
        local_plans = []
        for rank in range(2):
            state = ranks.state_dict(rank)
            assert _local_pieces(state) == real[rank]["pieces"]
            for name, (save_planner, load_planner) in PLANNERS.items():
                planner = save_planner()
                planner.set_up_planner(state, None, rank == 0)
                plan = planner.create_local_plan()
                items, mapping = real[rank][("save", name)]
                assert len(plan.items) == len(items) == ranks.items_per_rank
                for simulated, built in zip(plan.items, items):
                    assert simulated == built
                assert dict(plan.planner_data) == mapping
                if name == "stock":
                    local_plans.append(plan)
                loader = load_planner()
                loader.set_up_planner(state, real_metadata, rank == 0)
                assert list(loader.create_local_plan().items) == real[rank][("load", name)]
        # The coordinator's metadata from the simulated ranks' plans is the real checkpoint's.
        _, metadata = DefaultSavePlanner().create_global_plan(local_plans)
        assert metadata.state_dict_metadata == real_metadata.state_dict_metadata
    finally:
        ranks.close()


def test_simulated_state_dict_shards_like_fsdp():
    assert [shard_rows(33, r, 2) for r in range(2)] == [(0, 17), (17, 16)]
    assert [shard_rows(5, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]  # an empty last piece
    assert sample_ranks(2) == [0, 1] and sample_ranks(16) == [0, 1, 8, 15]
    ranks = SimulatedRanks(SMALL, 4)
    try:
        state = ranks.state_dict(3)
        embed = state["model"]["model.embed_tokens.weight"]
        assert embed.shape == (33, 16) and embed.to_local().shape == (6, 16)
        assert tuple(embed.device_mesh.get_coordinate()) == (3,)
        moments = state["optim"]["state"]["lm_head.weight"]
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"} and moments["step"].dim() == 0
        assert state["optim"]["param_groups"][0]["params"][0] == "model.embed_tokens.weight"
        # 4 per parameter (embedding, 9 a layer, final norm, lm_head) and one per param-group key
        assert ranks.items_per_rank == 4 * (3 + 9 * SMALL.layers) + len(state["optim"]["param_groups"][0])
    finally:
        ranks.close()
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- reference read plans


def _stock_metadata(world_size: int):
    ranks = SimulatedRanks(SMALL, world_size)
    try:
        plans = []
        for rank in range(world_size):
            planner = DefaultSavePlanner()
            planner.set_up_planner(ranks.state_dict(rank), None, rank == 0)
            plans.append(planner.create_local_plan())
        return DefaultSavePlanner().create_global_plan(plans)[1]
    finally:
        ranks.close()


@pytest.mark.parametrize("saved, loaded", [(5, 5), (5, 3), (5, 2), (3, 7)])
def test_reference_read_items_are_stocks(saved, loaded):
    metadata = _stock_metadata(saved)
    layout = ChunkLayout(metadata)
    assert layout.rows  # the sharded entries are found by bisection, not by stock's code
    ranks = SimulatedRanks(SMALL, loaded)
    try:
        for rank in range(loaded):
            planner = DefaultLoadPlanner()
            planner.set_up_planner(ranks.state_dict(rank), metadata, rank == 0)
            stock = planner.create_local_plan().items
            assert reference_read_items(planner.state_dict, metadata, layout) == stock
    finally:
        ranks.close()


# --------------------------------------------------------------------------- the simulation


def test_budget_and_validation_shortcuts(tmp_path):
    """Over the budget, the unmeasured ranks' load plans come from the reference (checked equal
    on every sample rank); above the exact-validation bound, stock's validation is estimated."""
    sim = PlanScaleSimulation(stock_system(), 8, str(tmp_path / "sim"), shape=SMALL, build_budget_s=0,
                              exact_validation_max_ranks=4)
    outcome = sim.run()
    assert outcome.info["load_same_reference_plans"] == 4 and outcome.info["load_half_reference_plans"] == 0
    assert any("reference" in note for note in outcome.notes)
    references = [c for c in outcome.checks if "reference read plans" in c.name]
    assert [c.name.split(": ")[0] for c in references] == [LOAD_SAME]  # load_half: every rank is a sample
    assert references[0].name.endswith("on ranks 1, 4, 7, 0") and all(c.passed for c in outcome.checks)
    estimates = [r for r in outcome.records if r.step == VALIDATION_ESTIMATE]
    assert [r.phase for r in estimates] == [SAVE, REPEAT]
    plan = next(r for r in outcome.records if r.step == GLOBAL_PLAN and r.phase == SAVE)
    assert "estimated from" in plan.note and plan.seconds >= estimates[0].seconds
    assert set(r.phase for r in outcome.records) == set(PHASES)
    assert "replicated_load" not in outcome.info  # one replica (the default): no replicated load
    assert not dist.is_initialized()


def test_unmeasured_ranks_in_worker_processes(tmp_path):
    """The unmeasured ranks played by two forked workers give the coordinator what one process
    gives it (the same .metadata); each remade its local plan and checked it against the one it
    sent; above ``all_load_plans_max_ranks`` a load runs on the sample ranks only."""
    written = {}
    for workers in (1, 2):
        sim = PlanScaleSimulation(fastdcp_system(), 8, str(tmp_path / f"w{workers}"), shape=SMALL,
                                  workers=workers, all_load_plans_max_ranks=4)
        outcome = sim.run()
        assert outcome.checks and all(c.passed for c in outcome.checks), [c for c in outcome.checks if not c.passed]
        remade = [c for c in outcome.checks if "made again" in c.name]
        assert len(remade) == 1 and "the 4 unmeasured ranks" in remade[0].name
        coordinator = {r.phase for r in outcome.records if r.side == COORDINATOR}
        assert coordinator == {SAVE, REPEAT, LOAD_HALF}  # load_same (8 ranks > 4): the sample ranks only
        assert {r.rank for r in outcome.records if r.phase == LOAD_SAME} == {0, 1, 4, 7}
        assert any(note.startswith(f"{LOAD_SAME}: the sample ranks' loads only") for note in outcome.notes)
        metadata = FileSystemReader(os.path.dirname(outcome.metadata_file)).read_metadata()
        where = {index: (re.sub(r"^__(\d+)_[0-9a-f]+_", r"\1:", info.relative_path), info.offset, info.length)
                 for index, info in metadata.storage_data.items()}  # (data file names are random per save)
        written[workers] = (metadata.state_dict_metadata, where)
    assert written[1] == written[2] and len(written[1][1]) > 8
    assert not dist.is_initialized()


def test_a_plan_made_again_that_differs_fails_the_check(tmp_path, monkeypatch):
    """The check on remade local plans can fail: a rank whose second plan differs is named."""
    import fastdcp.bench.plan_scale as plan_scale

    sent_plan = plan_scale._sent_plan
    calls = {"n": 0}

    def drifting(planner, blob):
        token, digest = sent_plan(planner, blob)
        calls["n"] += 1
        return token, digest if calls["n"] <= 4 else bytes(16)  # the first plans as sent, every remade one differs

    monkeypatch.setattr(plan_scale, "_sent_plan", drifting)
    outcome = PlanScaleSimulation(stock_system(), 8, str(tmp_path / "sim"), shape=SMALL, workers=1).run()
    failed = [c for c in outcome.checks if not c.passed]
    assert [c.name.split(": ")[0] for c in failed] == [SAVE] and "differ on ranks [2, 3, 5, 6]" in failed[0].detail


def test_cross_checks_catch_a_difference():
    """The comparison of the systems' load plans fails on a plan that differs."""
    def outcome(name: str, items: list) -> SimulationOutcome:
        return SimulationOutcome(name, 4, [], {}, [], [], "", {(LOAD_SAME, 1): items})

    same = cross_checks({"stock": outcome("stock", [1, 2]), "fastdcp": outcome("fastdcp", [1, 2])}, False)
    assert [c.passed for c in same] == [True]
    differ = cross_checks({"stock": outcome("stock", [1, 2]), "fastdcp": outcome("fastdcp", [2, 1])}, False)
    assert [c.passed for c in differ] == [False]


def test_plan_scale_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--scenarios", "plan-scale", "--plan-ranks", "2,4", "--systems", "stock,fastdcp", "--no-shm",
               "--probe-size", "32MiB", "--cold", "fadvise_dontneed", "--dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    doc = json.loads(out.read_text())["plan_scale"]
    runs = {(run["system"], run["ranks"]): run for run in doc["runs"]}
    assert set(runs) == {(s, n) for s in ("stock", "fastdcp") for n in (2, 4)}
    expected = {(step["phase"], step["side"], step["step"]) for step in runs[("stock", 4)]["steps"]}
    assert {phase for phase, _, _ in expected} == set(PHASES)
    assert {side for _, side, _ in expected} == {RANK, COORDINATOR}
    assert (READ, RANK, "read_metadata (first in the process)") in expected
    own_loads = {(LOAD_SAME, RANK, OWN_LOAD), (LOAD_HALF, RANK, OWN_LOAD)}  # fastdcp's own-process loads
    for (system, n), run in runs.items():
        steps = {(s["phase"], s["side"], s["step"]) for s in run["steps"]}
        assert steps == (expected | own_loads if system == "fastdcp" else expected), (system, n)
        assert all(s["seconds"] >= 0 for s in run["steps"])
        assert all(run["totals"][name] is not None for name, _ in TOTALS), (system, n, run["totals"])
        if n == 4:
            assert all(s["growth_exponent"] is None or math.isfinite(s["growth_exponent"]) for s in run["steps"])
        rank_steps = [s for s in run["steps"] if s["side"] == RANK and s["phase"] == LOAD_HALF]
        assert max(s["ranks_measured"] for s in rank_steps) == n // 2
        assert "replicated_load" not in run and "replicated_load" not in run["info"]  # --plan-replicas 1
    for n in (2, 4):
        reads = runs[("fastdcp", n)]["metadata_reads"]
        # a same-layout load plans from the rank's own section; N -> N/2 from a few sections
        # (a load by one process, N/2 = 1, reads the whole index: no section is its own)
        assert reads[LOAD_SAME]["from_section"] and reads[LOAD_HALF]["from_section"] == (n > 2), reads
        assert 0 < reads[LOAD_SAME]["rank_metadata_read_bytes"] <= reads[LOAD_SAME]["total_metadata_read_bytes"]
        assert reads[LOAD_SAME]["rank_metadata_peak_bytes"] is not None
    assert any("in its own process" in c["check"] for c in doc["checks"])
    assert doc["checks"] and all(c["passed"] for c in doc["checks"])
    assert any("state_dict_metadata" in c["check"] for c in doc["checks"])
    assert doc["bars_at_ranks"] == 4 and len(doc["bars"]) == 9
    assert "plan_scale N=4" in captured.out
    # a small run prints no development bars (they are set at 4,096 ranks), only where to find them
    assert "plan_scale targets" not in captured.out and "[FAIL]" not in captured.out
    assert "development targets are judged at N >= 4,096" in captured.out
    assert "replicated load" not in captured.out


# --------------------------------------------------------------------------- replicated load


def _read_once_deal(items, planner, members, metadata, monkeypatch) -> list[int]:
    """Each member's read bytes as a read-once load deals ``items`` (``ReadOnceShare.deal`` as the
    reader calls it, ``dist.get_rank`` answering each member in turn)."""
    from fastdcp.load.read_once import ReadOnceShare, ReplicaGroup

    def where(item):
        info = metadata.storage_data[item.storage_index]
        return (info.relative_path, info.offset)

    shares = []
    for member in members:
        with monkeypatch.context() as patched:
            patched.setattr(dist, "get_rank", lambda member=member: member)
            shares.append(ReadOnceShare.deal(items, planner, ReplicaGroup(tuple(members), "t"), where).read_bytes)
    return shares


def test_replicated_load_reads_a_rth_with_read_once(tmp_path, monkeypatch):
    """16 ranks as 4 replicas of 4 shards: a rank's plan is its shard's plan in a 4-rank load
    (a load phase of its own); with read-once each member reads about 1/4 of it, its share as
    ``ReadOnceShare.deal`` deals it; the job reads every stored tensor byte once with read-once
    (plus the unsharded 0-d ``step`` tensors every shard's plan reads), 4 times without. Recorded
    in the JSON and the report."""
    from types import SimpleNamespace

    from fastdcp.bench.plan_scale import _record

    n, replicas, shards = 16, 4, 4
    outcome = PlanScaleSimulation(fastdcp_system(), n, str(tmp_path / "sim"), shape=SMALL, replicas=replicas).run()
    assert all(c.passed for c in outcome.checks), [c for c in outcome.checks if not c.passed]
    assert {r.phase for r in outcome.records} == set(PHASES) | {LOAD_REPLICATED}
    assert {r.rank for r in outcome.records if r.phase == LOAD_REPLICATED and r.side == RANK} == {0, 1, 2, 3}
    assert any(r.phase == LOAD_REPLICATED and r.side == COORDINATOR for r in outcome.records)  # every plan built
    reads = outcome.info["replicated_load"]
    assert (reads["replicas"], reads["ranks"], reads["shard_ranks"], reads["phase"]) == (replicas, n, shards,
                                                                                         LOAD_REPLICATED)
    groups = reads["groups"]
    assert [g["shard"] for g in groups] == [0, 1, 2, 3]
    assert [g["ranks"] for g in groups] == [[s, s + 4, s + 8, s + 12] for s in range(4)]  # rank r: shard r % 4

    metadata = FileSystemReader(os.path.dirname(outcome.metadata_file)).read_metadata()
    ranks = SimulatedRanks(SMALL, shards)
    try:
        for g in groups:
            assert sum(g["member_bytes"]) == g["group_read_once_bytes"] == g["plan_tensor_bytes"] > 0
            assert g["read_once_bytes"] == max(g["member_bytes"])
            assert g["read_once_bytes"] == pytest.approx(g["plan_tensor_bytes"] / replicas, rel=0.05)
            planner = DefaultLoadPlanner()
            planner.set_up_planner(ranks.state_dict(g["shard"]), metadata, g["shard"] == 0)
            items = list(planner.create_local_plan().items)
            assert _read_once_deal(items, planner, g["ranks"], metadata, monkeypatch) == g["member_bytes"]
    finally:
        ranks.close()
    assert reads["rank_plan_tensor_bytes"] == max(g["plan_tensor_bytes"] for g in groups)
    assert reads["rank_read_once_bytes"] == max(g["read_once_bytes"] for g in groups)

    # Data bytes: SMALL's 3 x its parameters in fp32, and one 0-d fp32 step per parameter, which
    # each of the 4 shards' plans reads whole.
    params = SMALL.parameters()
    steps = 4 * len(params)
    assert reads["needed_bytes"] == 3 * 4 * sum(math.prod(shape) for _, shape in params) + steps
    assert reads["storage_bytes_with_read_once"] == reads["shard_plans_tensor_bytes"]
    assert reads["storage_bytes_with_read_once"] == reads["needed_bytes"] + (shards - 1) * steps
    assert reads["storage_bytes_without_read_once"] == replicas * reads["storage_bytes_with_read_once"]

    recorder = Recorder()
    _record(SimpleNamespace(recorder=recorder, note=lambda message: None), "shm", fastdcp_system(), outcome)
    doc = plan_scale_json(recorder.results)
    (run,) = doc["runs"]
    assert run["replicated_load"] == reads
    json.dumps(doc)  # JSON-serialisable
    (line,) = [line for line in plan_scale_lines(recorder.results) if "replicated load" in line]
    assert "4 replicas x 4 shards" in line and "rank r holds shard r % (N/R)" in line and "with it" in line
    assert not dist.is_initialized()


def test_two_replicas_are_the_half_load(tmp_path):
    """With R = 2 the replicated layout's plans are the N/2 load's: no load of their own; above
    ``all_load_plans_max_ranks`` only the sample groups are counted (the job's totals: None, noted)."""
    outcome = PlanScaleSimulation(stock_system(), 16, str(tmp_path / "sim"), shape=SMALL, replicas=2,
                                  all_load_plans_max_ranks=4).run()
    assert {r.phase for r in outcome.records} == set(PHASES)
    reads = outcome.info["replicated_load"]
    assert reads["phase"] == LOAD_HALF and [g["shard"] for g in reads["groups"]] == [0, 1, 4, 7]
    assert [g["ranks"] for g in reads["groups"]] == [[0, 8], [1, 9], [4, 12], [7, 15]]
    assert reads["rank_read_once_bytes"] == pytest.approx(reads["rank_plan_tensor_bytes"] / 2, rel=0.05)
    assert reads["storage_bytes_with_read_once"] is None and reads["storage_bytes_without_read_once"] is None
    assert any("totals are not counted" in note for note in outcome.notes)
    with pytest.raises(ValueError, match="not 3 replicas"):
        PlanScaleSimulation(stock_system(), 8, str(tmp_path / "bad"), shape=SMALL, replicas=3)


# --------------------------------------------------------------------------- report


def _recorded(times: dict[tuple[str, int], float]) -> Recorder:
    """A Recorder holding one coordinator step, the save's gather, per (system, N)."""
    recorder = Recorder()
    for (system, n), seconds in times.items():
        recorder.add("plan_scale", "shm", system, {"ranks": n, "phase": SAVE, "side": COORDINATOR,
                                                   "step": "gather: receive (unpickle N)"},
                     0, seconds, None, peak_bytes=1 << 20, held_bytes=0, received_bytes=0, rank=None, note="")
        recorder.add("plan_scale", "shm", system, {"ranks": n, "phase": "info", "side": "-", "step": "info"},
                     0, 0.0, None, info={"items_per_rank": 10, "chunks": 10 * n}, notes=[])
    recorder.add("plan_scale", "shm", "checks", {"ranks": 4, "phase": "check", "side": "-", "step": "a check"},
                 0, 0.0, None, passed=True, detail="")
    return recorder


def test_growth_exponent():
    assert growth_exponent(1.0, 4.0, 256, 1024) == pytest.approx(1.0)
    assert growth_exponent(1.0, 16.0, 1024, 4096) == pytest.approx(2.0)
    assert growth_exponent(2.0, 2.0, 16, 64) == pytest.approx(0.0)
    assert growth_exponent(None, 1.0, 2, 4) is None and growth_exponent(0.0, 1.0, 2, 4) is None
    assert growth_exponent(1.0, 2.0, 4, 4) is None
    # N log N from 1,024 to 4,096 grows as N^1.13: the bar for the coordinator's growth
    assert n_log_n_exponent(1024, 4096) == pytest.approx(math.log(4 * 12 / 10) / math.log(4))
    doc = plan_scale_json(_recorded({("stock", 2): 1.0, ("stock", 8): 16.0, ("fastdcp", 2): 0.5,
                                     ("fastdcp", 8): 1.0}).results)
    growth = {(run["system"], run["ranks"]): run["steps"][0]["growth_exponent"] for run in doc["runs"]}
    assert growth[("stock", 8)] == pytest.approx(2.0) and growth[("fastdcp", 8)] == pytest.approx(0.5)
    assert growth[("stock", 2)] is None
    lines = plan_scale_lines(_recorded({("stock", 2): 1.0, ("stock", 8): 16.0}).results)
    assert any("2.00" in line and "gather: receive" in line for line in lines)


def test_bars_are_marked():
    systems, _ = summarize(_recorded({("stock", 4): 1.0, ("fastdcp", 4): 0.05}).results)
    for summary in systems.values():  # coordinator totals as if every save step had been measured
        summary.totals[TOTALS[0][0]] = summary.steps[(SAVE, COORDINATOR, "gather: receive (unpickle N)")].seconds
    n, marked = bars(systems)
    assert n == 4
    first = marked[0]
    assert first.passed is True and "5.0%" in first.value
    systems[("fastdcp", 4)].totals[TOTALS[0][0]] = 0.2
    marked = bars(systems)[1]
    assert marked[0].passed is False
    # the coordinator's peak (1 MiB) is known from the step; nothing else was measured
    assert marked[-1].name.startswith("coordinator peak") and marked[-1].passed is True
    assert all(b.passed is None for b in marked[1:-1])


def test_bars_print_at_the_scale_they_were_set_at(monkeypatch):
    import fastdcp.bench.plan_scale_report as report

    recorded = _recorded({("stock", 4): 1.0, ("fastdcp", 4): 0.05}).results
    assert not any("plan_scale targets" in line for line in plan_scale_lines(recorded))
    monkeypatch.setattr(report, "BARS_AT_RANKS", 4)
    lines = plan_scale_lines(recorded)
    assert any(line.startswith("plan_scale targets") for line in lines)
    assert any(line.strip().startswith("[PASS]") for line in lines)


def test_on_object_storage_fastdcp_alone_is_simulated_with_its_s3_classes():
    from types import SimpleNamespace

    from fastdcp import FastS3Reader, FastS3Writer
    from fastdcp.bench.plan_scale import _systems

    notes: list[str] = []
    systems = [SimpleNamespace(name=name, standin=False) for name in ("stock", "fastdcp")]
    ctx = SimpleNamespace(cfg=config_from_args(["--plan-storage", "s3"]), note=notes.append, systems=systems)
    (system,) = _systems(ctx)
    assert system.name == "fastdcp" and system.object_storage
    assert system.writer is FastS3Writer and system.reader is FastS3Reader
    assert any("fastdcp only" in note for note in notes), notes
    with pytest.raises(ValueError, match="needs s3:// location"):
        from fastdcp.bench.plan_scale import PlanScaleSimulation

        PlanScaleSimulation(system, 4, "/tmp/unused")


def test_plan_scale_options():
    quick = config_from_args(["--quick"])
    assert "plan_scale" in QUICK_SCENARIOS and quick.plan_ranks == [4, 16]
    assert config_from_args([]).plan_ranks == [256, 1024, 4096]
    c = config_from_args(["--scenarios", "plan-scale", "--plan-ranks", "16,64", "--plan-budget", "5"])
    assert c.scenarios == ["plan_scale"] and c.plan_ranks == [16, 64] and c.plan_budget_s == 5
    c = config_from_args(["--plan-workers", "3", "--plan-all-load-ranks", "64"])
    assert c.plan_workers == 3 and c.plan_all_load_ranks == 64
    assert config_from_args([]).plan_all_load_ranks == 4096 and config_from_args([]).plan_workers >= 1
    assert config_from_args([]).plan_storage == "local"
    assert config_from_args(["--plan-storage", "s3"]).plan_storage == "s3"
    assert config_from_args([]).plan_replicas == 1
    assert config_from_args(["--plan-ranks", "16,64", "--plan-replicas", "8"]).plan_replicas == 8
    assert config_from_args(["--quick", "--plan-replicas", "4"]).plan_replicas == 4  # N = 4, 16
    for bad in (["--plan-ranks", "1,4"], ["--plan-budget", "-1"], ["--plan-workers", "0"],
                ["--plan-all-load-ranks", "0"], ["--plan-storage", "gcs"], ["--plan-replicas", "0"],
                ["--plan-ranks", "16,24", "--plan-replicas", "16"]):
        with pytest.raises(SystemExit):
            config_from_args(bad)
