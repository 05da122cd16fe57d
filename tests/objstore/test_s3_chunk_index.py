"""The chunk index in object storage, against the suite's real S3 server: a save planned in bulk
PUTs the index beside ``.metadata`` (before it) and stock's ``FsspecReader`` still loads the
checkpoint; ``FastS3Reader`` reads the index by ranged GETs (on several ranks, a rank fetches its
own section: two gloo ranks, same layout and resharded); a missing, damaged or foreign index falls
back to ``.metadata`` as on local disk; a failed commit leaves no index behind; an overwrite
deletes the replaced index; ``gc`` keeps the live index and lists an orphaned one; at simulated
ranks (the ``plan_scale`` simulation on S3) a resuming rank fetches a bounded number of bytes.
Every load is checked bit-exact."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from s3_cases import client, flipped, index_name, keys, section_span
from fastdcp import FastLoadPlanner, FastS3Reader, FastS3Writer, FastSavePlanner, S3Options
from fastdcp.format import index_layout as L
from fastdcp.format.index_link import metadata_facts
from fastdcp.format.index_reader import read_chunk_index
from fastdcp.format.index_sections import read_index_header
from fastdcp.format.sources import BufferSource
from fastdcp.format.table_metadata import TableMetadata

IMPATIENT = S3Options(max_retries=1, retry_timeout_s=2, connect_timeout_s=2, request_timeout_s=10)
INDEX_RE = re.compile(r"\.metadata\.[0-9a-f]{16}\.index")


def _state(seed: int) -> dict:
    return {"w": C.random_float((40, 24), (seed, "w")), "b": C.random_tensor(torch.bfloat16, (24,), (seed, "b")),
            "i": torch.arange(seed, seed + 30), "step": seed, "extra": {"lr": 0.1 * seed}}


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else ({"lr": 0.0} if k == "extra" else 0)
            for k, v in state.items()}


def _save(url: str, state: dict, **writer_options) -> None:
    dcp.save(state, storage_writer=FastS3Writer(url, **writer_options), planner=FastSavePlanner(), no_dist=True)


def _load(url: str, expected: dict) -> FastS3Reader:
    reader = FastS3Reader(url)
    dest = _zeros(expected)
    dcp.load(dest, storage_reader=reader, planner=FastLoadPlanner(), no_dist=True)
    C.assert_same(dest, expected)
    return reader


def _object(s3, bucket: str, key: str) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_the_index_goes_up_before_metadata_names_it_and_stock_still_loads(bucket, s3_env, s3, monkeypatch):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from fastdcp.objstore import commit

    url, sd = f"s3://{bucket}/ix", _state(1)
    present_at_index_put = []
    real_upload = commit.upload_image

    def upload(store, location, name, *args, **kwargs):
        present_at_index_put.append((name, keys(s3, bucket)))
        return real_upload(store, location, name, *args, **kwargs)

    monkeypatch.setattr(commit, "upload_image", upload)
    s3_env.reset()
    _save(url, sd)
    counts = s3_env.stats()
    ((name, present),) = present_at_index_put
    assert INDEX_RE.fullmatch(name), name  # the save's 64-bit token, as its data objects carry
    assert "ix/.metadata" not in present and present, present  # the data objects were up, .metadata not yet
    assert index_name(s3, bucket, "ix") == name
    stored = keys(s3, bucket)
    assert stored == present | {"ix/.metadata", f"ix/{name}"}
    assert counts.get("LIST", 0) == counts.get("COPY", 0) == counts.get("DELETE", 0) == 0, counts
    # The index records the size and edge CRCs of the .metadata committed with it.
    metadata = _object(s3, bucket, "ix/.metadata")
    index = read_chunk_index(_object(s3, bucket, f"ix/{name}"), "test")
    facts = metadata_facts(metadata, index.edge_bytes)
    assert (index.metadata_size, index.metadata_head_crc, index.metadata_tail_crc) == facts
    # .metadata stays a complete stock pickle: stock's reader loads the checkpoint.
    dest = _zeros(sd)
    dcp.load(dest, storage_reader=FsspecReader(url, endpoint_url=s3_env.endpoint), no_dist=True)
    C.assert_same(dest, sd)
    # fastdcp's reader takes the table from the index (GETs only), not from unpickling .metadata.
    s3_env.reset()
    reader = _load(url, sd)
    assert isinstance(reader._metadata_read, TableMetadata)
    assert set(s3_env.stats()) == {"GET"}
    assert reader.last_stats["metadata_requests"] >= 3 and reader.last_stats["metadata_bytes"] > 0, reader.last_stats


def test_an_overwrite_deletes_the_replaced_index(bucket, s3):
    url = f"s3://{bucket}/over"
    _save(url, _state(1))
    first = keys(s3, bucket)
    second_state = _state(2)
    _save(url, second_state)
    second = keys(s3, bucket)
    assert first & second == {"over/.metadata"}  # the old index and data objects went
    assert f"over/{index_name(s3, bucket, 'over')}" in second
    _load(url, second_state)


def test_a_refused_index_upload_fails_the_save_naming_it_and_leaves_nothing_new(bucket, s3_env, s3):
    url = f"s3://{bucket}/refused"
    previous = {"w": C.random_float((6 << 20,), ("refused", 0))}  # 24 MiB: the data goes as multipart parts
    _save(url, previous)
    before = keys(s3, bucket)
    s3_env.fault("PUT", count=100, status=500)  # the first plain PUT after the data: the index
    try:
        with pytest.raises(CheckpointException, match=r"\.metadata\.[0-9a-f]{16}\.index"):
            _save(url, {"w": torch.zeros(6 << 20)}, s3_options=IMPATIENT)
    finally:
        s3_env.reset()
    assert keys(s3, bucket) == before  # its data objects (and no index) deleted, .metadata untouched
    _load(url, previous)


def test_overwrite_false_refused_at_the_commit_deletes_its_index_too(bucket, s3, monkeypatch):
    url = f"s3://{bucket}/once"
    first = _state(1)
    _save(url, first, overwrite=False)
    before = keys(s3, bucket)
    # As when two saves race: this one passes the early check, and the conditional PUT refuses it.
    monkeypatch.setattr("fastdcp.objstore.commit.object_exists", lambda *args: False)
    with pytest.raises(CheckpointException, match="committed there while this save ran"):
        _save(url, _state(2), overwrite=False)
    assert keys(s3, bucket) == before
    _load(url, first)


@pytest.mark.parametrize("how", ["missing", "damaged", "another save's", "outside the prefix"])
def test_an_unusable_index_falls_back_to_metadata_as_on_local_disk(bucket, s3, how):
    url, sd = f"s3://{bucket}/fb", _state(3)
    _save(url, sd)
    key = f"fb/{index_name(s3, bucket, 'fb')}"
    if how == "missing":
        s3.delete_object(Bucket=bucket, Key=key)
    elif how == "damaged":
        s3.put_object(Bucket=bucket, Key=key, Body=flipped(_object(s3, bucket, key), L.HEADER_SIZE + 3))
    elif how == "outside the prefix":  # .metadata names "x/..." (same length: the pickle stays whole)
        name = key.removeprefix("fb/")
        metadata = _object(s3, bucket, "fb/.metadata").replace(name.encode(), f"x/{name[2:]}".encode(), 1)
        s3.put_object(Bucket=bucket, Key="fb/.metadata", Body=metadata)
        key = f"x/{name[2:]}"
    else:
        _save(f"s3://{bucket}/other", _state(4))
        other = _object(s3, bucket, f"other/{index_name(s3, bucket, 'other')}")
        s3.put_object(Bucket=bucket, Key=key, Body=other)
    import logging

    with C.warnings_logged_by(logging.getLogger("fastdcp")) as warned:
        reader = _load(url, sd)
    assert not isinstance(reader._metadata_read, TableMetadata)  # .metadata parsed
    expected = {"missing": None, "damaged": "ignoring a damaged chunk index",
                "another save's": "it was written for another .metadata",
                "outside the prefix": "is not an object directly under"}[how]
    if expected is None:
        assert not warned, warned  # quietly, as on local disk
    else:
        assert any(expected in w and key in w for w in warned), warned


def test_gc_keeps_the_live_index_and_lists_an_orphaned_one(bucket, s3_env, s3, monkeypatch, capsys):
    from fastdcp.cli import main
    from fastdcp.objstore import commit

    url = f"s3://{bucket}/gc"
    live = {"w": C.random_float((3 << 20,), ("gc", 1))}
    _save(url, live)
    committed = keys(s3, bucket)
    real_upload = commit.upload_image

    def upload_then_cut(*args, **kwargs):  # the index goes up, then the network fails the commit
        real_upload(*args, **kwargs)
        s3_env.fault("PUT", count=100, status=500)
        s3_env.fault("DELETE", count=100, status=500)

    monkeypatch.setattr(commit, "upload_image", upload_then_cut)
    try:
        with pytest.raises(CheckpointException, match=r"\.metadata"):
            _save(url, {"w": torch.zeros(6 << 20)}, s3_options=IMPATIENT)
    finally:
        s3_env.reset()
    left = {k.removeprefix("gc/") for k in keys(s3, bucket) - committed}
    (orphan,) = [n for n in left if n.endswith(".index")]
    assert INDEX_RE.fullmatch(orphan) and any(n.endswith(".distcp") for n in left), left
    assert main(["gc", url, "--min-age-s", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    named = {row["name"] for row in report["named"]}
    assert index_name(s3, bucket, "gc") in named  # the live index is the checkpoint's
    assert {row["name"] for row in report["leftover"]} == left, report
    assert main(["gc", url, "--min-age-s", "0", "--delete", "--json"]) == 0
    capsys.readouterr()
    assert keys(s3, bucket) == committed
    _load(url, live)


def test_an_object_source_reads_one_version_in_ranged_gets(bucket, s3_env, s3):
    """Reads after the first carry If-Match: a .metadata replaced between two of them is an error
    naming it, never bytes of two saves; a read larger than the request size goes as concurrent
    requests of that size; a small object's first response serves a later read of it."""
    import os

    from fastdcp.objstore.client import store_for
    from fastdcp.objstore.indexed_metadata import ObjectChangedError, ObjectFetches, ObjectSource
    from fastdcp.objstore.location import ObjectLocation

    location, options = ObjectLocation.parse(f"s3://{bucket}/src"), S3Options(part_bytes=5 << 20)
    data = os.urandom(12 << 20)
    s3.put_object(Bucket=bucket, Key="src/big", Body=data)
    fetches = ObjectFetches()
    source = ObjectSource(store_for(location, options), location, "big", options, fetches)
    head = bytearray(4096)
    assert source.read_into(0, memoryview(head)) == 4096 and bytes(head) == data[:4096]
    s3_env.reset()
    rest = bytearray(len(data))
    assert source.read_into(100, memoryview(rest)) == len(data) - 100 and bytes(rest[:len(data) - 100]) == data[100:]
    assert s3_env.stats() == {"GET": 3}  # 12 MiB less the kept 4 KiB, in 5 MiB requests
    assert fetches.requests == 4 and fetches.bytes == len(data)
    s3.put_object(Bucket=bucket, Key="src/big", Body=data[::-1])  # another save's object, same size
    with pytest.raises(ObjectChangedError, match=rf"s3://{bucket}/src/big.*replaced while it was read"):
        source.read_into(len(data) - 10, memoryview(head))
    small = ObjectSource(store_for(location, options), location, "small", options)
    s3.put_object(Bucket=bucket, Key="src/small", Body=data[:1000])
    s3_env.reset()
    assert small.read_into(0, memoryview(head)) == 1000 and small.read_all() == data[:1000]
    assert s3_env.stats() == {"GET": 1}


# --------------------------------------------------------------------------- #
# Two gloo ranks: each fetches its own section; resharded; fallbacks
# --------------------------------------------------------------------------- #

WORLD = 2
SHAPES = {"w": (10, 6), "v": (9, 3), "wide": (5, 12)}  # 2-D: loaded as Shard(1) too


def _full(name: str) -> torch.Tensor:
    return C.random_tensor(torch.float32 if name != "wide" else torch.bfloat16, SHAPES[name], ("s3ix", name))


def _dtensors(mesh, placement) -> dict:
    from torch.distributed.tensor import distribute_tensor

    state = {name: distribute_tensor(_full(name), mesh, [placement]) for name in SHAPES}
    state["replicated"] = C.random_float((7,), ("s3ix", "replicated"))
    state["step"] = 17
    return state


def _load_ranks(url: str, mesh, placement, planner) -> tuple[FastS3Reader, object]:
    reader = FastS3Reader(url)
    dest = _dtensors(mesh, placement)
    expected = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in dest.items()}
    for k, v in dest.items():
        if isinstance(v, torch.Tensor):
            (v.to_local() if hasattr(v, "to_local") else v).zero_()
    dest["step"] = 0
    dcp.load(dest, storage_reader=reader, planner=planner)
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in dest.items()}
    C.assert_same(got, expected)
    return reader, reader._metadata_read


def _rank_main(rank: int, store: str, url: str, server: str, out: str) -> None:
    import logging

    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.tensor import Shard

    from fastdcp.load.sectioned_metadata import SectionedTableMetadata

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = client(server)
    report: dict = {}
    with C.gloo_rank_mesh(rank, store, WORLD) as mesh, C.warnings_logged_by(logging.getLogger("fastdcp")) as warned:
        dcp.save(_dtensors(mesh, Shard(0)), storage_writer=FastS3Writer(url), planner=FastSavePlanner())
        dist.barrier()
        key = f"{prefix}/{index_name(s3, bucket, prefix)}"
        index = _object(s3, bucket, key)
        report["sizes"] = {"metadata": s3.head_object(Bucket=bucket, Key=f"{prefix}/.metadata")["ContentLength"],
                           "index": len(index), "section": section_span(index, rank)[1],
                           "shared": read_index_header(BufferSource(index), "test").v2.common_length}
        reader, md = _load_ranks(url, mesh, Shard(0), FastLoadPlanner())
        report["same"] = {"sectioned": isinstance(md, SectionedTableMetadata), "table_read": md.table_loaded,
                          "stats": reader.last_stats}
        reader, md = _load_ranks(url, mesh, Shard(1), FastLoadPlanner())
        report["resharded"] = {"table_read": md.table_loaded, "stats": reader.last_stats}
        reader, md = _load_ranks(url, mesh, Shard(0), DefaultLoadPlanner())  # stock's planner: the whole table
        report["stock_planner"] = {"table_read": md.table_loaded}
        report["warnings"] = list(warned)
        intact = index
        for how in ("section", "another save's", "missing"):
            dist.barrier()
            if rank == 0:
                if how == "section":
                    offset, length = section_span(intact, 1)
                    s3.put_object(Bucket=bucket, Key=key, Body=flipped(intact, offset + length // 2))
                elif how == "another save's":
                    dcp.save({"x": torch.ones(3)}, storage_writer=FastS3Writer(f"{url}-other"),
                             planner=FastSavePlanner(), no_dist=True)
                    other = _object(s3, bucket, f"{prefix}-other/{index_name(s3, bucket, prefix + '-other')}")
                    s3.put_object(Bucket=bucket, Key=key, Body=other)
                else:
                    s3.delete_object(Bucket=bucket, Key=key)
            dist.barrier()
            warned.clear()
            reader, md = _load_ranks(url, mesh, Shard(0), FastLoadPlanner())
            report[how] = {"sectioned": isinstance(md, SectionedTableMetadata),
                           "table_read": bool(getattr(md, "table_loaded", True)), "warnings": list(warned)}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(report, f)


@pytest.mark.fastdcp_timeout(240)
def test_two_ranks_each_fetch_their_own_section_and_fall_back_when_the_index_is_unusable(tmp_path, bucket, s3_env):
    url, out = f"s3://{bucket}/ranks", str(tmp_path / "report")
    mp.spawn(_rank_main, args=(str(tmp_path / "pg"), url, s3_env.server_endpoint, out), nprocs=WORLD, join=True)
    reports = [json.load(open(f"{out}.{rank}")) for rank in range(WORLD)]
    for rank, r in enumerate(reports):
        sizes, same = r["sizes"], r["same"]
        # Same layout: planned from its own section, fetched by ranged GETs: .metadata's first
        # bytes (and its tail edge when they do not hold it), the index header, the shared
        # objects, the directory entry, the section.
        assert same["sectioned"] and not same["table_read"], r
        stats = same["stats"]
        md = sizes["metadata"]
        fetched = (min(md, 4096) + (min(md, L.SECTION_EDGE_BYTES) if md > 4096 else 0) + L.HEADER_SIZE
                   + sizes["shared"] + L.DIRECTORY_ENTRY.size + sizes["section"])
        assert stats["metadata_bytes"] == fetched < md + sizes["index"], (stats, sizes)
        assert stats["metadata_requests"] == (6 if md > 4096 else 5), stats
        # Resharded (rows -> columns): the other sections that cover it, not the whole table.
        assert not r["resharded"]["table_read"], r
        assert r["stock_planner"]["table_read"], r
        assert not r["warnings"], r
        # A foreign index: every rank warns and parses .metadata.
        foreign = r["another save's"]
        assert not foreign["sectioned"] and any("written for another .metadata" in w for w in foreign["warnings"]), r
        # No index: .metadata parsed, quietly (as on local disk).
        assert not r["missing"]["sectioned"] and not r["missing"]["warnings"], r
    # Rank 1's section damaged: rank 1 warns and reads the whole table; rank 0 is unaffected.
    assert reports[1]["section"]["table_read"], reports[1]
    assert any("damaged section" in w for w in reports[1]["section"]["warnings"]), reports[1]
    assert not reports[0]["section"]["table_read"] and not reports[0]["section"]["warnings"], reports[0]


# --------------------------------------------------------------------------- #
# Simulated ranks: what a resuming rank fetches
# --------------------------------------------------------------------------- #

SIMULATED_RANKS = 16
RESUME_BOUND = 1 << 20  # a resuming rank fetches at most this much metadata (also at 1,024 ranks)


@pytest.mark.fastdcp_timeout(120)
def test_a_resuming_rank_fetches_its_section_of_a_simulated_job(tmp_path, bucket, s3_env):
    """The ``plan_scale`` simulation on S3 (``--plan-storage s3``) at 16 ranks of a 4-layer model
    as wide as Llama-7B: each sample rank's own load fetches its section, a small share of the
    metadata, in a few ranged GETs."""
    from fastdcp.bench.plan_scale import LOAD_HALF, LOAD_SAME, PlanScaleSimulation, fastdcp_s3_system
    from fastdcp.bench.simulated_ranks import ModelShape

    shape = ModelShape(layers=4, hidden=4096, intermediate=11008, heads=32, vocab=32000)
    sim = PlanScaleSimulation(fastdcp_s3_system(), SIMULATED_RANKS, str(tmp_path / "sim"), shape=shape,
                              location=f"s3://{bucket}/job")
    outcome = sim.run()
    assert all(check.passed for check in outcome.checks), [c for c in outcome.checks if not c.passed]
    info = outcome.info
    whole = info["metadata_file_bytes"]
    assert info["chunk_index_bytes"], info
    for rank, read in info[f"{LOAD_SAME}_metadata_reads"].items():
        assert read["from_section"] and read["requests"] <= 6, (rank, read)
        assert read["read_bytes"] <= min(RESUME_BOUND, whole // 4), (rank, read, whole)
    for rank, read in info[f"{LOAD_HALF}_metadata_reads"].items():  # resharded to 8 ranks: a few sections
        assert read["from_section"] and read["read_bytes"] <= min(RESUME_BOUND, whole // 2), (rank, read, whole)



def test_the_commit_objects_are_bytes_with_no_buffer_view_exported(bucket, monkeypatch):
    """A view of an ``io.BytesIO`` buffer kept in a failed upload's traceback, collected in one
    reference cycle with its buffer, crashed the interpreter in CPython 3.12.1's garbage collector:
    the objects a commit PUTs are plain bytes."""
    from fastdcp.objstore import commit

    made = []
    real = commit.metadata_objects

    def record(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(commit, "metadata_objects", record)
    _save(f"s3://{bucket}/bytes", _state(5))
    ((body, (name, index)),) = made  # planned in bulk: .metadata and its chunk index
    assert INDEX_RE.fullmatch(name) and type(body) is bytes and type(index) is bytes
