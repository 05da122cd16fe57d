"""Rank code for tests/interop/test_scale_equivalence.py: gloo ranks (started with
``torch.multiprocessing.start_processes``, forked from a forkserver that imported this module)
that save the same state with stock DCP and with fastdcp, and load checkpoints across the two,
resharded.

One process group per world size of :data:`GROUPS`, run one after the other (largest first); each rank:

1. builds every case of its group (:func:`build_case`), writes the case's *reference* (every
   leaf of the flattened state dict as a full tensor or object, gathered on rank 0), and saves it
   with each save variant of :data:`SAVE_VARIANTS` (plus the repeat and structure-change saves);
2. loads, in the same sharding, the checkpoints it just wrote (stock reads what fastdcp wrote,
   fastdcp reads what stock wrote, stock reads stock as the control);
3. loads the checkpoints of the group before it (twice its world size) resharded: every 2-D tensor
   as ``Shard(1)`` (1-D as ``Shard(0)``) over half as many ranks.

Loads are checked bit for bit against the reference. Ranks never raise: each save or load
appends one JSON line (``ok``, ``msg`` = traceback) to ``<results_dir>/<phase>.rank<r>.jsonl``;
the test module turns the records into test results (rank 0's ``done`` record also carries a
timeline). Everything here is importable by the rank processes (tests/ is on their ``sys.path``,
inherited from the pytest process).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import dcp_cases as C
from fastdcp.bench.process_group import exit_spawned_rank

PG_TIMEOUT_S = 90

# --------------------------------------------------------------------------------------------- #
# What is saved where (shared by the ranks and by the test module)
# --------------------------------------------------------------------------------------------- #
# Save variants: name -> (planner kind, writer kind). "stock" is dir A of the brief, the others are
# compared against it.
SAVE_VARIANTS = {
    "stock": ("stock", "stock"),
    "fast": ("fast", "fast"),
    "stockplan_fastwriter": ("stock", "fast"),
}
# Extra fastdcp saves (cases listed per group in "repeat" / "grow"):
#   fast_repeat: the state saved twice into one directory, new planner and writer objects each
#                time (the second save's plans come from fastdcp's plan caches);
#   fast_grow:   the state, then the state plus new entries, saved into one directory;
#   stock_grow:  stock's save of the grown state (what fast_grow's .metadata must equal).
REPEAT_VARIANT = "fast_repeat"
GROW_VARIANT, STOCK_GROW_VARIANT = "fast_grow", "stock_grow"

# One group per world size, run largest first: each loads the previous group's checkpoints at
# half its world size. The ws=2 checkpoints are loaded at "ws=1" by the test process itself
# (no_dist, full tensors), as are all the others.
GROUPS = [
    {"ws": 8, "cases": ["dtensor", "replicated"], "repeat": [], "grow": []},
    {"ws": 4, "cases": ["dtensor", "fsdp2", "mesh2d", "replicated"], "repeat": ["dtensor", "fsdp2"],
     "grow": ["dtensor"]},
    {"ws": 2, "cases": ["dtensor", "fsdp2", "replicated"], "repeat": ["replicated"], "grow": ["replicated"]},
]


def phase_name(ws: int) -> str:
    return f"ws{ws}"


def case_dir(root: str | os.PathLike, ws: int, case: str) -> Path:
    return Path(root) / "ckpt" / f"ws{ws}" / case


def ckpt_dir(root: str | os.PathLike, ws: int, case: str, variant: str) -> Path:
    return case_dir(root, ws, case) / variant


def reference_path(root: str | os.PathLike, ws: int, case: str, grown: bool = False) -> Path:
    return case_dir(root, ws, case) / ("reference_grown.pt" if grown else "reference.pt")


def variants_of(group: dict, case: str) -> list[str]:
    """Every checkpoint directory a group writes for ``case``."""
    names = list(SAVE_VARIANTS)
    if case in group["repeat"]:
        names.append(REPEAT_VARIANT)
    if case in group["grow"]:
        names += [STOCK_GROW_VARIANT, GROW_VARIANT]
    return names


def writer_kind(variant: str) -> str:
    if variant in SAVE_VARIANTS:
        return SAVE_VARIANTS[variant][1]
    return "stock" if variant == STOCK_GROW_VARIANT else "fast"


def is_grown(variant: str) -> bool:
    return variant in (GROW_VARIANT, STOCK_GROW_VARIANT)


def loads_of(group: dict, case: str) -> list[tuple[str, str]]:
    """(checkpoint variant, reader kind) pairs loaded for ``case``: every checkpoint fastdcp's
    writer wrote is read by stock, every one stock wrote by fastdcp, and stock's own by stock
    (the control: a failure there is the test's fault)."""
    pairs = []
    for variant in variants_of(group, case):
        if writer_kind(variant) == "fast":
            pairs.append((variant, "stock"))
        else:
            pairs.append((variant, "fast"))
            if variant == "stock":
                pairs.insert(0, (variant, "stock"))
    return pairs


def previous_group(group: dict) -> dict | None:
    """The group whose checkpoints ``group`` loads resharded (twice its world size)."""
    for other in GROUPS:
        if other["ws"] == 2 * group["ws"]:
            return other
    return None


# --------------------------------------------------------------------------------------------- #
# The states
# --------------------------------------------------------------------------------------------- #
VOCAB, EMBED, HIDDEN, FFN, CLASSES = 5, 33, 11, 6, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)                  # 1-D weight and bias (11,)
        self.fc1 = nn.Linear(HIDDEN, FFN, bias=False)      # (6, 11)
        self.fc2 = nn.Linear(FFN, HIDDEN)                  # (11, 6), bias (11,)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(self.norm(h))))


class TinyLM(nn.Module):
    """A transformer-shaped model: 2-D weights mostly wider than tall, with first dimensions
    (5, 11, 6, 3) that 2, 4 and 8 ranks split unevenly or leave empty on the last ranks; 1-D
    norms; a 0-d buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)           # (5, 33)
        self.in_proj = nn.Linear(EMBED, HIDDEN, bias=False)  # (11, 33)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES, bias=False)  # (3, 11)
        self.register_buffer("temperature", torch.tensor(0.75))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(self.embed(tokens))
        for block in self.blocks:
            h = block(h)
        return self.head(self.final_norm(h)) * self.temperature


def extra_objects() -> dict[str, Any]:
    """Non-tensor state every rank holds alike (deduplicated as bytes items)."""
    return {"epoch": 3, "name": "run-\u00e9", "lrs": [0.1, 0.01], "blob": bytes(range(40)), "none": None}


def _new_model() -> TinyLM:
    torch.manual_seed(1234)  # every rank builds the same full model
    return TinyLM()


def _dtensor_model_and_optimizer(mesh) -> tuple[TinyLM, torch.optim.Optimizer]:
    """TinyLM with every parameter a DTensor ``Shard(0)`` over ``mesh`` (FSDP2's layout, built
    by hand) and AdamW after two steps with deterministic gradients."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _new_model()
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(sharded))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(77)
    for _ in range(2):
        for param in model.parameters():
            full_grad = torch.randn(param.shape, generator=generator)
            param.grad = distribute_tensor(full_grad, mesh, param.placements, src_data_rank=None)
        optimizer.step()
    return model, optimizer


def _fsdp2_model_and_optimizer(mesh) -> tuple[TinyLM, torch.optim.Optimizer]:
    """TinyLM under ``fully_shard`` (each block, then the root) on CPU/gloo, AdamW after two
    real forward/backward steps."""
    from torch.distributed.fsdp import fully_shard

    model = _new_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(78)
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (4, 7), generator=generator)
        model(tokens).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "extra": extra_objects()}


def _mesh2d_state(mesh2d) -> dict[str, Any]:
    """DTensors over a 2-D mesh: Shard(0) x Shard(1) and Shard(0) x Replicate (whose replicated
    shards every pair of ranks saves alike), uneven in both dimensions."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def dt(name, shape, dtype, placements):
        full = C.random_tensor(dtype, shape, ("scale-eq", "mesh2d", name))
        return distribute_tensor(full, mesh2d, placements, src_data_rank=None)

    s0s1, s0r = [Shard(0), Shard(1)], [Shard(0), Replicate()]
    return {
        "s0s1": {"a": dt("s0s1.a", (7, 10), torch.float32, s0s1), "b": dt("s0s1.b", (5, 9), torch.bfloat16, s0s1),
                 "thin": dt("s0s1.thin", (1, 13), torch.float32, s0s1)},
        "s0r": {"a": dt("s0r.a", (7, 12), torch.float32, s0r), "b": dt("s0r.b", (3, 10), torch.int64, s0r),
                "vec": dt("s0r.vec", (9,), torch.float16, s0r)},
        "extra": extra_objects(),
    }


def _replicated_state() -> dict[str, Any]:
    """Plain tensors every rank holds alike (each saved once after dedup), of many sizes so that
    largest-first placement differs from stock's first-seen placement."""
    def t(name, shape, dtype=torch.float32):
        return C.random_tensor(dtype, shape, ("scale-eq", "rep", name))

    return {
        "rep": {"small": t("small", (3,), torch.int64), "big": t("big", (300, 7)),
                "mid": t("mid", (17, 33), torch.bfloat16), "scalar": t("scalar", ()),
                "empty": t("empty", (0, 4)), "mid2": t("mid2", (33, 17)), "tiny": t("tiny", (1, 2))},
        "extra": extra_objects(),
    }


def build_case(case: str, meshes: dict[str, Any]) -> dict[str, Any]:
    """The state dict of ``case`` on this rank (collective: every rank calls it alike)."""
    if case == "dtensor":
        return _model_state(*_dtensor_model_and_optimizer(meshes["1d"]))
    if case == "fsdp2":
        return _model_state(*_fsdp2_model_and_optimizer(meshes["1d"]))
    if case == "mesh2d":
        return _mesh2d_state(meshes["2d"])
    if case == "replicated":
        return _replicated_state()
    raise ValueError(f"unknown case {case!r}")


def grow(case: str, state: dict[str, Any], meshes: dict[str, Any]) -> dict[str, Any]:
    """``state`` plus new entries (a structure change between two saves)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    grown = dict(state)
    new = {"plain": C.random_tensor(torch.float32, (4,), ("scale-eq", "grown", "plain")), "note": "grown"}
    if case != "replicated":
        full = C.random_tensor(torch.float32, (9, 20), ("scale-eq", "grown", "dtensor"))
        new["dtensor"] = distribute_tensor(full, meshes["1d"], [Shard(0)], src_data_rank=None)
    grown["grown"] = new
    return grown


# --------------------------------------------------------------------------------------------- #
# Reference values and destinations
# --------------------------------------------------------------------------------------------- #
def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def write_reference(state: dict[str, Any], path: Path, rank: int) -> None:
    """Every leaf of the flattened ``state`` (DCP's own flattening, so keys are the checkpoint's
    keys) as a full tensor or the object itself, saved by rank 0 (collective: gathers DTensors)."""
    flat, _ = flatten_state_dict(state)
    values: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, value in flat.items():
        if _is_dtensor(value):
            values[key], kinds[key] = value.full_tensor(), "dtensor"
        elif isinstance(value, torch.Tensor):
            values[key], kinds[key] = value.detach().clone(), "tensor"
        else:
            values[key], kinds[key] = value, "object"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"values": values, "kinds": kinds}, path)


def read_reference(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def expected_local(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """The part of ``full`` this rank holds as a DTensor with ``placements`` over ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    out = full
    for dim, (start, length) in enumerate(zip(offset, shape)):
        out = out.narrow(dim, start, length)
    return out


def _sentinel_dtensor(like_local: torch.Tensor, mesh, placements, shape, stride):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(C.sentinel_like(like_local), mesh, placements, run_check=False,
                              shape=shape, stride=stride)


def same_sharding_destination(state: dict[str, Any]) -> dict[str, Any]:
    """A destination with ``state``'s nesting and sharding: sentinel-filled tensors, DTensors
    with the same mesh and placements, placeholder objects."""
    flat, mappings = flatten_state_dict(state)
    dest: dict[str, Any] = {}
    for key, value in flat.items():
        if _is_dtensor(value):
            dest[key] = _sentinel_dtensor(value.to_local(), value.device_mesh, value.placements, value.shape,
                                          value.stride())
        elif isinstance(value, torch.Tensor):
            dest[key] = C.sentinel_like(value)
        else:
            dest[key] = "<placeholder>"
    return unflatten_state_dict(dest, mappings)


def resharded_destination(reference: dict[str, Any], mesh) -> dict[str, Any]:
    """A flat destination over ``mesh`` (1-D) for a checkpoint with ``reference``: saved DTensors
    as ``Shard(1)`` (1-D ones ``Shard(0)``, 0-d ones plain), plain tensors plain, objects as
    placeholders."""
    from torch.distributed.tensor import Shard

    dest: dict[str, Any] = {}
    for key, full in reference["values"].items():
        kind = reference["kinds"][key]
        if kind == "object":
            dest[key] = "<placeholder>"
        elif kind == "dtensor" and full.dim() >= 1:
            placements = [Shard(1) if full.dim() >= 2 else Shard(0)]
            like = expected_local(full, mesh, placements)
            dest[key] = _sentinel_dtensor(like, mesh, placements, full.shape, full.stride())
        else:
            dest[key] = C.sentinel_like(full)
    return dest


def full_destination(reference: dict[str, Any]) -> dict[str, Any]:
    """A flat, single-process destination: every tensor whole, objects as placeholders."""
    return {key: ("<placeholder>" if reference["kinds"][key] == "object" else C.sentinel_like(full))
            for key, full in reference["values"].items()}


def local_storage(dest: dict[str, Any]) -> dict[str, int]:
    """data_ptr of every destination tensor's local storage (DCP must load in place)."""
    flat, _ = flatten_state_dict(dest)
    out = {}
    for key, value in flat.items():
        if _is_dtensor(value):
            out[key] = value.to_local().data_ptr()
        elif isinstance(value, torch.Tensor):
            out[key] = value.data_ptr()
    return out


def check_loaded(dest: dict[str, Any], reference: dict[str, Any], pointers: dict[str, int]) -> None:
    """Every leaf of ``dest`` (nested or flat) equals the reference bit for bit, in place."""
    flat, _ = flatten_state_dict(dest)
    expected_keys, got_keys = set(reference["values"]), set(flat)
    assert got_keys == expected_keys, (
        f"keys differ: missing {sorted(expected_keys - got_keys)}, extra {sorted(got_keys - expected_keys)}")
    for key, want in reference["values"].items():
        got = flat[key]
        if reference["kinds"][key] == "object":
            C.assert_same(got, want, key)
            continue
        if key in pointers:
            local = got.to_local() if _is_dtensor(got) else got
            assert local.data_ptr() == pointers[key], f"{key}: destination storage was replaced"
        if _is_dtensor(got):
            C.assert_tensor_bitexact(got.to_local(), expected_local(want, got.device_mesh, got.placements),
                                     f"{key} (local shard, {tuple(got.placements)})", check_stride=False,
                                     check_type=False)
        else:
            C.assert_tensor_bitexact(got, want, key, check_stride=False, check_type=False)


# --------------------------------------------------------------------------------------------- #
# Saving and loading
# --------------------------------------------------------------------------------------------- #
def save(state: dict[str, Any], directory: Path, planner_kind: str, writer: str, *, no_dist: bool = False) -> dict:
    """One ``dcp.save`` with new planner and writer objects; returns the fast planner's cache
    counters (empty for stock's planner)."""
    import fastdcp

    planner = fastdcp.FastSavePlanner() if planner_kind == "fast" else DefaultSavePlanner()
    # overwrite=True: stock's default, said out loud (repeat saves into one directory warn otherwise)
    writer_class = fastdcp.FastFileSystemWriter if writer == "fast" else FileSystemWriter
    storage_writer = writer_class(directory, overwrite=True)
    dcp.save(state, storage_writer=storage_writer, planner=planner, no_dist=no_dist)
    if planner_kind != "fast":
        return {}
    return {name: getattr(planner, name) for name in
            ("local_plan_hits", "local_plan_misses", "global_plan_hits", "global_plan_misses")}


def load(dest: dict[str, Any], directory: Path, reader: str, *, no_dist: bool = False) -> None:
    """``dcp.load`` with stock's reader and planner, or fastdcp's."""
    import fastdcp

    if reader == "fast":
        storage_reader, planner = fastdcp.FastFileSystemReader(directory), fastdcp.FastLoadPlanner()
    else:
        storage_reader, planner = FileSystemReader(directory), DefaultLoadPlanner()
    dcp.load(dest, storage_reader=storage_reader, planner=planner, no_dist=no_dist)


class Recorder:
    """Appends one JSON line per event to this rank's results file."""

    def __init__(self, results_dir: str, phase: str, rank: int) -> None:
        self.path = os.path.join(results_dir, f"{phase}.rank{rank}.jsonl")
        self.phase, self.rank = phase, rank

    def write(self, **record: Any) -> None:
        record.update(phase=self.phase, rank=self.rank)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _attempt(rec: Recorder, record: dict, action) -> bool:
    """Run ``action``; record its outcome (never raises, except KeyboardInterrupt)."""
    t0 = time.time()
    try:
        extra = action() or {}
        ok, msg = True, ""
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - CheckpointException is a BaseException
        extra, ok, msg = {}, False, traceback.format_exc()
    rec.write(**record, **extra, ok=ok, msg=msg, secs=round(time.time() - t0, 3))
    return ok


def _save_case(rec: Recorder, group: dict, case: str, state: dict, meshes: dict, root: str, rank: int) -> dict:
    ws = group["ws"]
    base = dict(stage="save", ws=ws, case=case)
    for variant, (planner_kind, writer) in SAVE_VARIANTS.items():
        _attempt(rec, dict(base, variant=variant, step=0),
                 lambda: save(state, ckpt_dir(root, ws, case, variant), planner_kind, writer))
    if case in group["repeat"]:
        directory = ckpt_dir(root, ws, case, REPEAT_VARIANT)
        for step in (0, 1):
            _attempt(rec, dict(base, variant=REPEAT_VARIANT, step=step),
                     lambda: {"cache": save(state, directory, "fast", "fast")})
    states = {"base": state}
    if case in group["grow"]:
        grown = grow(case, state, meshes)
        write_reference(grown, reference_path(root, ws, case, grown=True), rank)
        states["grown"] = grown
        _attempt(rec, dict(base, variant=STOCK_GROW_VARIANT, step=0),
                 lambda: save(grown, ckpt_dir(root, ws, case, STOCK_GROW_VARIANT), "stock", "stock"))
        directory = ckpt_dir(root, ws, case, GROW_VARIANT)
        for step, which in ((0, state), (1, grown)):
            _attempt(rec, dict(base, variant=GROW_VARIANT, step=step),
                     lambda: {"cache": save(which, directory, "fast", "fast")})
    return states


def _load_same_sharding(rec: Recorder, group: dict, case: str, states: dict, root: str) -> None:
    ws = group["ws"]
    for variant, reader in loads_of(group, case):
        grown = is_grown(variant)
        state = states["grown" if grown else "base"]

        def action():
            directory = ckpt_dir(root, ws, case, variant)
            if not (directory / ".metadata").exists():  # the same on every rank: all skip together
                raise FileNotFoundError(f"no checkpoint at {directory} (its save failed)")
            reference = read_reference(reference_path(root, ws, case, grown))
            dest = same_sharding_destination(state)
            pointers = local_storage(dest)
            load(dest, directory, reader)
            check_loaded(dest, reference, pointers)

        _attempt(rec, dict(stage="load", mode="same", ws_save=ws, ws_load=ws, case=case, variant=variant,
                           reader=reader), action)


def _load_resharded(rec: Recorder, group: dict, mesh, root: str) -> None:
    previous = previous_group(group)
    if previous is None:
        return
    for case in previous["cases"]:
        for variant, reader in loads_of(previous, case):
            def action():
                directory = ckpt_dir(root, previous["ws"], case, variant)
                if not (directory / ".metadata").exists():
                    raise FileNotFoundError(f"no checkpoint at {directory} (its save failed)")
                reference = read_reference(reference_path(root, previous["ws"], case, is_grown(variant)))
                dest = resharded_destination(reference, mesh)
                pointers = local_storage(dest)
                load(dest, directory, reader)
                check_loaded(dest, reference, pointers)

            _attempt(rec, dict(stage="load", mode="reshard", ws_save=previous["ws"], ws_load=group["ws"],
                               case=case, variant=variant, reader=reader), action)


def run_rank(rank: int, spec: dict) -> None:
    """Entry point of every rank process (``spec``: group, root, results_dir, store). Never raises."""
    torch.set_num_threads(1)
    group, root = spec["group"], spec["root"]
    ws = group["ws"]
    rec = Recorder(spec["results_dir"], phase_name(ws), rank)
    started = time.time()
    marks: dict[str, float] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        from torch.distributed.device_mesh import init_device_mesh

        marks["init"] = time.time() - started
        meshes = {"1d": init_device_mesh("cpu", (ws,))}
        if "mesh2d" in group["cases"]:
            meshes["2d"] = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("outer", "inner"))
        all_states = {}
        for case in group["cases"]:
            state = build_case(case, meshes)
            write_reference(state, reference_path(root, ws, case), rank)
            dist.barrier()  # rank 0's reference file is there before anyone reads it
            marks[f"built {case}"] = time.time() - started
            all_states[case] = _save_case(rec, group, case, state, meshes, root, rank)
            dist.barrier()
            marks[f"saved {case}"] = time.time() - started
        for case in group["cases"]:
            _load_same_sharding(rec, group, case, all_states[case], root)
        marks["loaded same sharding"] = time.time() - started
        _load_resharded(rec, group, meshes["1d"], root)
        dist.barrier()
        marks["loaded resharded"] = time.time() - started
        rec.write(stage="done", marks={k: round(v, 2) for k, v in marks.items()})
    except BaseException:  # noqa: BLE001 - recorded for the test to report
        rec.write(stage="phase_error", msg=traceback.format_exc())
    exit_spawned_rank()  # the records carry the verdict
