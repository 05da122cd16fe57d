"""fastdcp's save path writes the ``.metadata`` stock writes, and checkpoints cross between stock
DCP and fastdcp resharded (gloo, CPU, world sizes 8, 4 and 2).

The safety net for rewriting save planning in bulk: whatever fastdcp's planners and writer do
inside, for the same state they must produce the ``.metadata`` stock's ``DefaultSavePlanner`` +
``FileSystemWriter`` produce, read back with plain ``pickle.load``:

* ``state_dict_metadata`` equal (``==``: properties, sizes, every chunk, in order);
* ``planner_data`` equal; ``version`` equal;
* ``storage_data``: the same keys as (fqn, offset) and the same ``MetadataIndex.index`` hint per
  key; every value names an existing file with its byte range inside it. *Which* file (rank)
  holds a replicated item is not compared: fastdcp deduplicates largest first, stock first-seen.

States (tests/_scale_worker.py builds them): ``dtensor`` (a small transformer-shaped model with
every parameter a DTensor ``Shard(0)``, uneven and empty trailing shards, 1-D norms, a 0-d buffer,
AdamW state after real steps, via ``get_state_dict``, plus objects), ``fsdp2`` (the same model
under ``fully_shard``, real forward/backward), ``mesh2d`` (Shard(0) x Shard(1) and Shard(0) x
Replicate over a 2x2 mesh), ``replicated`` (plain tensors every rank saves alike). Each is saved
with stock, fastdcp's planner and writer, and stock's planner with fastdcp's writer; some also
twice into one directory (plan caches) and with a new entry added between two saves.

Loads, checked bit for bit against the saved values: stock reads fastdcp's checkpoints and
fastdcp (reader and load planner) reads stock's, in the same sharding, resharded to ``Shard(1)``
over half as many ranks, and into whole tensors in this process (``no_dist``).

The ranks run as one process group per world size, one after the other (8, then 4, then 2);
they record every save and load as JSON lines, never raise, and the tests below read the records.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import multiprocessing
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

import _scale_worker as W
import dcp_cases as C

MP_TIMEOUT_S = float(os.environ.get("FASTDCP_MP_TIMEOUT", "240"))  # all process groups together
# Ranks are forked from a forkserver that imported torch, fastdcp and the worker once (spawn would
# import them again in each of the 14 rank processes: most of this file's run time on 2 cores).
START_METHOD = "forkserver"
FORKSERVER_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "fastdcp", "_scale_worker"]
BASELINE = {"fast": "stock", "stockplan_fastwriter": "stock", W.REPEAT_VARIANT: "stock",
            W.GROW_VARIANT: W.STOCK_GROW_VARIANT}


# --------------------------------------------------------------------------------------------- #
# Comparing .metadata
# --------------------------------------------------------------------------------------------- #
def read_metadata(directory: Path) -> Metadata:
    """``.metadata`` as stock reads it: plain pickle."""
    with open(Path(directory) / ".metadata", "rb") as f:
        return pickle.load(f)


def _storage_key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _describe_entry_difference(fqn: str, stock: Any, fast: Any) -> str:
    if type(stock) is not type(fast):
        return f"{fqn}: {type(stock).__name__} (stock) vs {type(fast).__name__} (fastdcp)"
    if not isinstance(stock, TensorStorageMetadata):
        return f"{fqn}: {stock!r} (stock) vs {fast!r} (fastdcp)"
    if stock.properties != fast.properties:
        return f"{fqn}: properties {stock.properties} (stock) vs {fast.properties} (fastdcp)"
    if stock.size != fast.size:
        return f"{fqn}: size {tuple(stock.size)} (stock) vs {tuple(fast.size)} (fastdcp)"
    if len(stock.chunks) != len(fast.chunks):
        return f"{fqn}: {len(stock.chunks)} chunks (stock) vs {len(fast.chunks)} (fastdcp)"
    for i, (a, b) in enumerate(zip(stock.chunks, fast.chunks)):
        if a != b:
            return (f"{fqn}: chunk {i} is offsets {tuple(a.offsets)} sizes {tuple(a.sizes)} (stock) vs "
                    f"offsets {tuple(b.offsets)} sizes {tuple(b.sizes)} (fastdcp)")
    return f"{fqn}: differs ({stock!r} vs {fast!r})"


def storage_problems(md: Metadata, directory: Path) -> list[str]:
    """``storage_data`` against the checkpoint's own ``state_dict_metadata`` and files: one key
    per chunk (hint = the chunk's position) and per object; every byte range inside an existing file."""
    problems: list[str] = []
    expected: dict[tuple[str, Any], int | None] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for position, chunk in enumerate(entry.chunks):
                expected[(fqn, tuple(chunk.offsets))] = position
        else:
            expected[(fqn, None)] = None
    got = {_storage_key(index): index.index for index in md.storage_data}
    for key in sorted(set(expected) - set(got), key=repr)[:10]:
        problems.append(f"storage_data has no entry for {key} (state_dict_metadata has it)")
    for key in sorted(set(got) - set(expected), key=repr)[:10]:
        problems.append(f"storage_data entry {key} is no chunk or object of state_dict_metadata")
    for key, position in expected.items():
        if position is not None and key in got and got[key] != position:
            problems.append(f"storage_data {key}: index hint {got[key]}, but it is chunk {position}")
    sizes: dict[str, int | None] = {}
    for index, info in md.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            path = Path(directory) / name
            sizes[name] = path.stat().st_size if path.is_file() else None
        size = sizes[name]
        if size is None:
            problems.append(f"storage_data {_storage_key(index)} names {name!r}, which does not exist")
        elif info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            problems.append(f"storage_data {_storage_key(index)}: bytes [{info.offset}, "
                            f"{info.offset + info.length}) outside {name!r} ({size} bytes)")
    return problems[:30]


def metadata_differences(stock: Metadata, fast: Metadata, fast_dir: Path) -> list[str]:
    """Everything in which fastdcp's ``.metadata`` (and the files it names) departs from stock's
    for the same state; empty when they agree. Which rank's file holds an item is not compared."""
    problems: list[str] = []
    a, b = stock.state_dict_metadata, fast.state_dict_metadata
    if a != b:
        for fqn in [k for k in a if k not in b][:10]:
            problems.append(f"state_dict_metadata: {fqn} missing in fastdcp's")
        for fqn in [k for k in b if k not in a][:10]:
            problems.append(f"state_dict_metadata: {fqn} only in fastdcp's")
        for fqn in [k for k in a if k in b and a[k] != b[k]][:10]:
            problems.append("state_dict_metadata: " + _describe_entry_difference(fqn, a[fqn], b[fqn]))
    if stock.planner_data != fast.planner_data:
        pa, pb = stock.planner_data, fast.planner_data
        if isinstance(pa, dict) and isinstance(pb, dict):
            keys = sorted({k for k in pa.keys() | pb.keys() if pa.get(k, None) != pb.get(k, None)})
            shown = [f"{k}: {pa.get(k, '<absent>')!r} vs {pb.get(k, '<absent>')!r}" for k in keys[:5]]
            problems.append(f"planner_data differs in {len(keys)} keys: " + "; ".join(shown))
        else:
            problems.append(f"planner_data: {pa!r} (stock) vs {pb!r} (fastdcp)")
    if getattr(stock, "version", None) != getattr(fast, "version", None):
        problems.append(f"version: {getattr(stock, 'version', None)!r} (stock) vs {getattr(fast, 'version', None)!r}")
    hints_a = {_storage_key(index): index.index for index in stock.storage_data}
    hints_b = {_storage_key(index): index.index for index in fast.storage_data}
    for key in sorted(set(hints_a) - set(hints_b), key=repr)[:10]:
        problems.append(f"storage_data: {key} missing in fastdcp's")
    for key in sorted(set(hints_b) - set(hints_a), key=repr)[:10]:
        problems.append(f"storage_data: {key} only in fastdcp's")
    differing = [k for k in hints_a if k in hints_b and hints_a[k] != hints_b[k]]
    for key in differing[:10]:
        problems.append(f"storage_data {key}: index hint {hints_a[key]} (stock) vs {hints_b[key]} (fastdcp)")
    problems += [f"fastdcp's checkpoint: {p}" for p in storage_problems(fast, fast_dir)]
    return problems


# --------------------------------------------------------------------------------------------- #
# Running the ranks
# --------------------------------------------------------------------------------------------- #
def _run_group(group: dict, root: Path, deadline: float) -> dict:
    """Run one group's ranks to the end (or the deadline, then kill them)."""
    t0 = time.time()
    spec = {"group": group, "root": str(root), "results_dir": str(root / "results"),
            "store": str(root / "stores" / W.phase_name(group["ws"]))}
    ctx = mp.start_processes(W.run_rank, args=(spec,), nprocs=group["ws"], join=False, start_method=START_METHOD)
    status = {"phase": W.phase_name(group["ws"]), "ws": group["ws"], "timed_out": False, "error": None}
    while True:
        try:
            if ctx.join(timeout=0.5):
                break
        except Exception as e:  # a rank died (signal / non-zero exit); join killed the others
            status["error"] = f"{type(e).__name__}: {e}"
            break
        if time.time() > deadline:
            status["timed_out"] = True
            break
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=10)
    status["exitcodes"] = [p.exitcode for p in ctx.processes]
    status["secs"] = round(time.time() - t0, 1)
    return status


class ScaleResults:
    def __init__(self, root: Path, statuses: list[dict]) -> None:
        self.root = root
        self.statuses = statuses
        self.records: list[dict] = []
        for f in sorted((root / "results").glob("*.jsonl")):
            self.records += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]

    def summary(self) -> str:
        lines = []
        for s in self.statuses:
            done = sum(1 for r in self.records if r["phase"] == s["phase"] and r["stage"] == "done")
            line = f"{s['phase']}: {s['secs']}s, ranks done {done}/{s['ws']}, exitcodes {s['exitcodes']}"
            if s["timed_out"]:
                line += f", TIMED OUT (killed; budget {MP_TIMEOUT_S}s for all groups)"
            if s["error"]:
                line += f", error: {s['error']}"
            for r in self.records:  # where rank 0's time went (seconds since it started)
                if r["phase"] == s["phase"] and r["stage"] == "done" and r["rank"] == 0:
                    line += f"\n  rank 0 timeline: {r.get('marks')}"
            for r in self.records:
                if r["phase"] == s["phase"] and r["stage"] == "phase_error":
                    line += f"\n  rank {r['rank']} phase error:\n    " + r["msg"].strip().replace("\n", "\n    ")
            lines.append(line)
        return "\n".join(lines)

    def check(self, world_size: int, /, **match: Any) -> list[dict]:
        """The records matching ``match``: one per rank of a ``world_size``-rank group, all ok."""
        got = [r for r in self.records if all(r.get(k) == v for k, v in match.items())]
        problems = [f"rank {r['rank']}: FAILED\n{C.message_tail(r['msg'], 4000)}" for r in got if not r["ok"]]
        ranks = sorted(r["rank"] for r in got)
        if ranks != list(range(world_size)):
            problems.insert(0, f"ranks reporting: {ranks}, expected 0..{world_size - 1} once each (crash or timeout?)")
        if problems:
            raise AssertionError(f"{match}:\n" + "\n\n".join(problems[:8]) + "\n\n" + self.summary())
        return got


@pytest.fixture(scope="module")
def scale_results(tmp_path_factory) -> ScaleResults:
    root = tmp_path_factory.mktemp("scale_eq")
    for name in ("results", "stores", "ckpt"):
        (root / name).mkdir()
    # Only takes effect if this process has not started a forkserver yet (else ranks import more).
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    deadline = time.time() + MP_TIMEOUT_S
    statuses = [_run_group(group, root, deadline) for group in W.GROUPS]  # largest first: each loads the one before
    results = ScaleResults(root, statuses)
    print("\n" + results.summary())  # visible with -s
    return results


# --------------------------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------------------------- #
SAVES = [(g["ws"], case, variant) for g in W.GROUPS for case in g["cases"] for variant in W.variants_of(g, case)]
COMPARED = [(ws, case, variant) for ws, case, variant in SAVES if variant in BASELINE]
RANK_LOADS = (
    [("same", g["ws"], g["ws"], case, variant, reader)
     for g in W.GROUPS for case in g["cases"] for variant, reader in W.loads_of(g, case)]
    + [("reshard", W.previous_group(g)["ws"], g["ws"], case, variant, reader)
       for g in W.GROUPS if W.previous_group(g) is not None
       for case in W.previous_group(g)["cases"] for variant, reader in W.loads_of(W.previous_group(g), case)]
)
FULL_LOADS = [(g["ws"], case, variant, reader)
              for g in W.GROUPS for case in g["cases"] for variant, reader in W.loads_of(g, case)]


@pytest.mark.parametrize(("ws", "case", "variant"), SAVES, ids=[f"ws{w}-{c}-{v}" for w, c, v in SAVES])
def test_save_succeeds(scale_results, ws, case, variant):
    steps = 2 if variant in (W.REPEAT_VARIANT, W.GROW_VARIANT) else 1
    for step in range(steps):
        scale_results.check(ws, stage="save", ws=ws, case=case, variant=variant, step=step)


@pytest.mark.parametrize(("ws", "case", "variant"), COMPARED, ids=[f"ws{w}-{c}-{v}" for w, c, v in COMPARED])
def test_metadata_equals_stock(scale_results, ws, case, variant):
    """fastdcp's .metadata == stock's for the same state (see the module docstring for what counts)."""
    baseline_dir = W.ckpt_dir(scale_results.root, ws, case, BASELINE[variant])
    directory = W.ckpt_dir(scale_results.root, ws, case, variant)
    for d in (baseline_dir, directory):
        assert (d / ".metadata").is_file(), f"no checkpoint at {d}\n{scale_results.summary()}"
    stock = read_metadata(baseline_dir)
    assert storage_problems(stock, baseline_dir) == [], "stock's own checkpoint fails the storage checks"
    problems = metadata_differences(stock, read_metadata(directory), directory)
    assert not problems, f"{variant} vs {BASELINE[variant]} (ws={ws}, {case}):\n" + "\n".join(problems)


@pytest.mark.parametrize(("mode", "ws_save", "ws_load", "case", "variant", "reader"), RANK_LOADS,
                         ids=[f"{m}-ws{s}to{l}-{c}-{v}-read_by_{r}" for m, s, l, c, v, r in RANK_LOADS])
def test_load_across_ranks(scale_results, mode, ws_save, ws_load, case, variant, reader):
    """Same sharding (mode ``same``), or every DTensor as Shard(1) over half the ranks (``reshard``)."""
    scale_results.check(ws_load, stage="load", mode=mode, ws_save=ws_save, ws_load=ws_load, case=case,
                        variant=variant, reader=reader)


@pytest.mark.parametrize(("ws", "case", "variant", "reader"), FULL_LOADS,
                         ids=[f"ws{w}to1-{c}-{v}-read_by_{r}" for w, c, v, r in FULL_LOADS])
def test_load_whole_tensors_in_one_process(scale_results, ws, case, variant, reader):
    directory = W.ckpt_dir(scale_results.root, ws, case, variant)
    assert (directory / ".metadata").is_file(), f"no checkpoint at {directory}\n{scale_results.summary()}"
    reference = W.read_reference(W.reference_path(scale_results.root, ws, case, W.is_grown(variant)))
    dest = W.full_destination(reference)
    pointers = W.local_storage(dest)
    W.load(dest, directory, reader, no_dist=True)
    W.check_loaded(dest, reference, pointers)


def _cache_counters(results: ScaleResults, ws: int, case: str, variant: str, step: int) -> list[dict]:
    records = results.check(ws, stage="save", ws=ws, case=case, variant=variant, step=step)
    return sorted(records, key=lambda r: r["rank"])


REPEATS = [(g["ws"], case) for g in W.GROUPS for case in g["repeat"]]
GROWS = [(g["ws"], case) for g in W.GROUPS for case in g["grow"]]


@pytest.mark.parametrize(("ws", "case"), REPEATS, ids=[f"ws{w}-{c}" for w, c in REPEATS])
def test_repeat_save_reuses_cached_plans(scale_results, ws, case):
    """The repeat save's .metadata is compared above; here: it really came from the plan caches
    (new planner objects, same structure: local hit on every rank, global hit on the coordinator)."""
    for r in _cache_counters(scale_results, ws, case, W.REPEAT_VARIANT, 1):
        cache = r["cache"]
        assert cache["local_plan_hits"] == 1 and cache["local_plan_misses"] == 0, f"rank {r['rank']}: {cache}"
        coordinator = r["rank"] == 0
        assert cache["global_plan_hits"] == int(coordinator) and cache["global_plan_misses"] == 0, \
            f"rank {r['rank']}: {cache}"


@pytest.mark.parametrize(("ws", "case"), GROWS, ids=[f"ws{w}-{c}" for w, c in GROWS])
def test_structure_change_replans(scale_results, ws, case):
    """A new entry between two saves into one directory: every rank plans afresh (its .metadata
    is compared with stock's save of the grown state above)."""
    for r in _cache_counters(scale_results, ws, case, W.GROW_VARIANT, 1):
        cache = r["cache"]
        assert cache["local_plan_misses"] == 1 and cache["local_plan_hits"] == 0, f"rank {r['rank']}: {cache}"
        coordinator = r["rank"] == 0
        assert cache["global_plan_misses"] == int(coordinator) and cache["global_plan_hits"] == 0, \
            f"rank {r['rank']}: {cache}"
    grown = read_metadata(W.ckpt_dir(scale_results.root, ws, case, W.GROW_VARIANT))
    assert "grown.plain" in grown.state_dict_metadata


def test_every_rank_finished(scale_results):
    for s in scale_results.statuses:
        done = sum(1 for r in scale_results.records if r["phase"] == s["phase"] and r["stage"] == "done")
        assert done == s["ws"] and not s["timed_out"] and s["error"] is None, scale_results.summary()


# --------------------------------------------------------------------------------------------- #
# The comparison itself must see what it is meant to see
# --------------------------------------------------------------------------------------------- #
def _first_multi_chunk(md: Metadata) -> str:
    return next(fqn for fqn, e in md.state_dict_metadata.items()
                if isinstance(e, TensorStorageMetadata) and len(e.chunks) >= 2)


def _replace_entry(md: Metadata, fqn: str, **changes: Any) -> None:
    md.state_dict_metadata[fqn] = dataclasses.replace(md.state_dict_metadata[fqn], **changes)


def _drop_chunk(md: Metadata, directory: Path) -> None:
    fqn = _first_multi_chunk(md)
    _replace_entry(md, fqn, chunks=md.state_dict_metadata[fqn].chunks[:-1])


def _drop_chunk_and_its_storage(md: Metadata, directory: Path) -> None:
    fqn = _first_multi_chunk(md)
    chunks = md.state_dict_metadata[fqn].chunks
    _replace_entry(md, fqn, chunks=chunks[:-1])
    del md.storage_data[MetadataIndex(fqn, chunks[-1].offsets)]


def _swap_chunks(md: Metadata, directory: Path) -> None:
    fqn = _first_multi_chunk(md)
    chunks = list(md.state_dict_metadata[fqn].chunks)
    chunks[0], chunks[1] = chunks[1], chunks[0]
    _replace_entry(md, fqn, chunks=chunks)


def _other_dtype(md: Metadata, directory: Path) -> None:
    import torch

    fqn = _first_multi_chunk(md)
    props = md.state_dict_metadata[fqn].properties
    _replace_entry(md, fqn, properties=dataclasses.replace(props, dtype=torch.float64))


def _wrong_hint(md: Metadata, directory: Path) -> None:
    index = next(i for i in md.storage_data if i.index not in (None, 0))
    info = md.storage_data.pop(index)
    md.storage_data[dataclasses.replace(index, index=0)] = info


def _drop_storage_entry(md: Metadata, directory: Path) -> None:
    md.storage_data.pop(next(iter(md.storage_data)))


def _past_end_of_file(md: Metadata, directory: Path) -> None:
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    size = (directory / info.relative_path).stat().st_size
    md.storage_data[index] = dataclasses.replace(info, offset=size - info.length + 1)


def _missing_file(md: Metadata, directory: Path) -> None:
    index = next(iter(md.storage_data))
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="__9_gone.distcp")


def _planner_data(md: Metadata, directory: Path) -> None:
    key = next(iter(md.planner_data))
    md.planner_data[key] = ("elsewhere",)


TAMPERING = {
    "drop_chunk": _drop_chunk,
    "drop_chunk_and_its_storage": _drop_chunk_and_its_storage,
    "swap_chunks": _swap_chunks,
    "other_dtype": _other_dtype,
    "wrong_index_hint": _wrong_hint,
    "drop_storage_entry": _drop_storage_entry,
    "byte_range_past_end_of_file": _past_end_of_file,
    "missing_file": _missing_file,
    "planner_data": _planner_data,
}


@pytest.mark.parametrize("tampering", list(TAMPERING))
def test_comparison_catches_tampering(scale_results, tampering):
    """A .metadata changed by hand (in memory) no longer compares equal to the original. (Stock's
    own checkpoint is the one changed, so that this says something about the comparison whatever
    fastdcp writes today.)"""
    stock_dir = W.ckpt_dir(scale_results.root, 4, "dtensor", "stock")
    stock = read_metadata(stock_dir)
    assert metadata_differences(stock, read_metadata(stock_dir), stock_dir) == []
    tampered = copy.deepcopy(stock)
    TAMPERING[tampering](tampered, stock_dir)
    assert metadata_differences(stock, tampered, stock_dir), f"{tampering} went unnoticed"


def test_comparison_catches_dropped_chunk_on_disk(scale_results, tmp_path):
    """The same, through the file: a checkpoint whose .metadata lost a chunk (rewritten by hand)."""
    fast_dir = W.ckpt_dir(scale_results.root, 4, "dtensor", "fast")
    copied = tmp_path / "fast"
    shutil.copytree(fast_dir, copied)
    md = read_metadata(copied)
    _drop_chunk_and_its_storage(md, copied)
    with open(copied / ".metadata", "wb") as f:
        pickle.dump(md, f)
    stock = read_metadata(W.ckpt_dir(scale_results.root, 4, "dtensor", "stock"))
    problems = metadata_differences(stock, read_metadata(copied), copied)
    assert any("chunks" in p for p in problems) and any("missing in fastdcp's" in p for p in problems), problems
