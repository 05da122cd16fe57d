"""Loads that read one rank's section of the chunk index (format version 2), on real gloo ranks
with real files: a same-layout load reads only its own section (a fraction of the index) and
loads bit-exactly; a resharded load, stock's planner, and stock's reader read the whole table or
``.metadata`` and load bit-exactly too; a damaged section, a damaged table and a missing index
each fall back with a warning and still load bit-exactly. Unit tests: sections written for a
bulk-planned table round-trip, and the planner's section plan equals its whole-table plan."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcp_cases as C
from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner, FastSavePlanner
from fastdcp.format import index_layout as L
from fastdcp.format.checksums import crc32c
from fastdcp.format.index_link import find_chunk_index_name
from fastdcp.format.index_reader import read_chunk_index
from fastdcp.format.index_sections import read_index_header, read_rank_section
from fastdcp.format.index_writer import fits_narrow_records, inner_empty_entries, write_chunk_index
from fastdcp.io.positional import open_source

WORLD = 4
SHAPES = {"w": (10, 6), "tiny": (2, 3), "wide": (5, 12)}  # 10 rows on 4 ranks: 3,3,3,1; tiny: 1,1,0,0


def _full(name: str) -> torch.Tensor:
    shape = SHAPES.get(name, (7,))
    return C.random_tensor(torch.float32 if name != "wide" else torch.bfloat16, shape, ("sections", name))


def _state(mesh, placement) -> dict:
    from torch.distributed.tensor import distribute_tensor

    state = {name: distribute_tensor(_full(name), mesh, [placement]) for name in SHAPES}
    state["replicated"] = _full("replicated")
    state["step"] = torch.tensor(17.0)
    state["extra"] = {"lr": 0.5, "note": "bytes entry"}
    return state


def _zeros_like(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = {"lr": 0.0, "note": ""} if k == "extra" else torch.zeros_like(v)
    return out


def _check(loaded: dict, mesh, placement) -> None:
    expected = _state(mesh, placement)
    for k, v in expected.items():
        got = loaded[k]
        if k == "extra":
            assert got == v, k
            continue
        a = got.to_local() if hasattr(got, "to_local") else got
        b = v.to_local() if hasattr(v, "to_local") else v
        assert a.shape == b.shape and a.dtype == b.dtype, k
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k  # bits, NaNs too


def _load(path: str, mesh, placement, reader, planner) -> tuple[dict, object]:
    target = _zeros_like(_state(mesh, placement))
    dcp.load(target, storage_reader=reader, planner=planner)
    return target, reader


def _index_path(path) -> str:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        name = find_chunk_index_name(f.read(4096))
    assert name is not None
    return os.path.join(path, name)


def _section_span(index_path: str, rank: int) -> tuple[int, int]:
    with open_source(index_path) as source:
        header = read_index_header(source, "test")
        entry = os.pread(source.fd, L.DIRECTORY_ENTRY.size, header.v2.directory_offset + rank * L.DIRECTORY_ENTRY.size)
    offset, length, _, _ = L.DIRECTORY_ENTRY.unpack(entry)
    return offset, length


def _section_magic(index_path: str, rank: int) -> bytes:
    offset, _ = _section_span(index_path, rank)
    with open(index_path, "rb") as f:
        f.seek(offset)
        return f.read(4)


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def _damage(path: str, how: str) -> None:
    """On rank 0, between two loads: the index damaged in one place, or removed."""
    index_path = _index_path(path)
    if how == "section":
        offset, length = _section_span(index_path, 1)
        _flip(index_path, offset + length // 2)
    elif how == "table":
        _flip(index_path, L.HEADER_SIZE + 3)
    else:
        os.remove(index_path)


def _worker(rank: int, store: str, root: str) -> None:
    """Save, then the loads, then loads after each damage (rank 0 damages between barriers)."""
    import logging

    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from fastdcp.load.metadata_cache import clear_metadata_cache
    from fastdcp.load.sectioned_metadata import SectionedTableMetadata, metadata_bytes_read

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("fastdcp").addHandler(Keep())
    path = os.path.join(root, "ckpt")
    report: dict = {"rank": rank}
    with C.gloo_rank_mesh(rank, store, WORLD) as mesh:
        dcp.save(_state(mesh, Shard(0)), storage_writer=FastFileSystemWriter(path), planner=FastSavePlanner())
        dist.barrier()
        report["index_size"] = os.path.getsize(_index_path(path))
        before = metadata_bytes_read()
        loaded, reader = _load(path, mesh, Shard(0), FastFileSystemReader(path), FastLoadPlanner())
        _check(loaded, mesh, Shard(0))
        md = reader._metadata_read
        report["same_layout"] = {"sectioned": isinstance(md, SectionedTableMetadata),
                                 "table_read": bool(getattr(md, "table_loaded", True)),
                                 "bytes": metadata_bytes_read() - before}
        loaded, reader = _load(path, mesh, Shard(1), FastFileSystemReader(path), FastLoadPlanner())
        _check(loaded, mesh, Shard(1))
        report["resharded_table_read"] = bool(reader._metadata_read.table_loaded)
        for reader, planner in ((FileSystemReader(path), DefaultLoadPlanner()),
                                (FastFileSystemReader(path), DefaultLoadPlanner())):
            loaded, _ = _load(path, mesh, Shard(0), reader, planner)
            _check(loaded, mesh, Shard(0))
        report["warnings"] = list(warnings)
        dist.barrier()
        if rank == 0:  # an intact copy for the checks after the run
            shutil.copytree(path, os.path.join(root, "intact"))
        for how in ("section", "table", "missing"):
            dist.barrier()
            if rank == 0:
                _damage(path, how)
            dist.barrier()
            clear_metadata_cache()  # (the cache knows .metadata, which is unchanged)
            warnings.clear()
            loaded, reader = _load(path, mesh, Shard(0), FastFileSystemReader(path), FastLoadPlanner())
            _check(loaded, mesh, Shard(0))
            report[how] = {"table_read": bool(getattr(reader._metadata_read, "table_loaded", True)),
                           "warnings": list(warnings)}
        with open(os.path.join(root, f"report.{rank}.json"), "w") as f:  # (the process ends with the block)
            json.dump(report, f)


@pytest.mark.fastdcp_timeout(300)
def test_rank_sections_on_real_ranks(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    reports = []
    for rank in range(WORLD):
        with open(tmp_path / f"report.{rank}.json") as f:
            reports.append(json.load(f))
    path = tmp_path / "ckpt"
    md_size = os.path.getsize(path / ".metadata")
    # its first 4 KiB (which hold its head edge), then its tail edge unless the first read held it
    md_read = min(md_size, 4096) + (min(md_size, L.SECTION_EDGE_BYTES) if md_size > 4096 else 0)
    for r in reports:
        same = r["same_layout"]
        assert same["sectioned"] and not same["table_read"], r  # planned from its own section
        # of the index: the header, shared objects and one section (every rank read the whole
        # index before)
        assert 0 < same["bytes"] - md_read < r["index_size"], (same, md_read, r["index_size"])
        # Shard(0) -> Shard(1): each rank needs a piece of every save rank's chunk; found by
        # searching the other sections (here all four), not by reading the whole table
        assert not r["resharded_table_read"], r
        assert not r["warnings"], r
    # A damaged section: rank 1 warns, reads the whole table, loads bit-exactly; others unaffected.
    assert reports[1]["section"]["table_read"], reports[1]
    assert any("damaged section" in w for w in reports[1]["section"]["warnings"]), reports[1]
    assert not reports[0]["section"]["table_read"] and not reports[0]["section"]["warnings"], reports[0]
    # A damaged table as well: rank 1's whole-index read is refused, .metadata is parsed.
    assert any("damaged chunk index" in w for w in reports[1]["table"]["warnings"]), reports[1]
    # No index at all: every rank parses .metadata, quietly (stock-written checkpoints have none).
    assert all(r["missing"]["table_read"] and not r["missing"]["warnings"] for r in reports), reports
    _whole_index_size_check_counts_the_table_part(tmp_path / "intact")


def _whole_index_size_check_counts_the_table_part(path) -> None:
    """A whole-index read (no process group) checks the size of what it reads, the table part,
    against the .metadata: the sections after it may outgrow the .metadata (a replicated chunk is
    listed once there and once per rank in the sections), and must not make the index refused."""
    import logging

    from fastdcp.load import metadata_cache

    index_path = _index_path(path)
    with open_source(index_path) as source:
        table_part = read_index_header(source, "test").v2.common_offset
    md_size = os.path.getsize(path / ".metadata")
    index_size = os.path.getsize(index_path)
    assert table_part < index_size
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("fastdcp").addHandler(handler)
    saved = metadata_cache._INDEX_SIZE_RATIO, metadata_cache._INDEX_SIZE_SLACK
    try:
        metadata_cache._INDEX_SIZE_SLACK = 0
        # a bound between the table part and the whole file: the index is used
        metadata_cache._INDEX_SIZE_RATIO = (table_part + index_size) / 2 / md_size
        metadata_cache.clear_metadata_cache()
        assert metadata_cache.load_table_metadata(str(path)) is not None and not warned, warned
        # a bound below the table part: refused as implausibly large, with a warning
        metadata_cache._INDEX_SIZE_RATIO = (table_part - 1) / md_size
        assert metadata_cache.load_table_metadata(str(path)) is None
        assert any("implausibly large" in w for w in warned), warned
    finally:
        metadata_cache._INDEX_SIZE_RATIO, metadata_cache._INDEX_SIZE_SLACK = saved
        logging.getLogger("fastdcp").removeHandler(handler)
        metadata_cache.clear_metadata_cache()


# --------------------------------------------------------------------------- #
# Unit: sections of a bulk-planned table, and plans from them
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("layout", ["int64 records", "narrow records"])
def test_sections_hold_each_ranks_rows_and_round_trip(layout):
    import io

    import chunk_table_cases as T
    from fastdcp.format.chunk_table import RankRows

    if layout == "int64 records":  # chunks and byte lengths past 2^31
        table = T.random_table(11, entries=25, max_chunks=6)
    else:  # every value but byte offsets (past 2^40 here) and checksums within int32, 2^31 - 1 included
        table = T.random_table(11, entries=25, max_chunks=6, big=False)
        table.storage.byte_length.clamp_(max=(1 << 31) - 1)
        assert int(table.storage.byte_offset.max()) > 1 << 32 and int(table.storage.byte_length.max()) == (1 << 31) - 1
    assert fits_narrow_records(table) == (layout == "narrow records")
    ranks = 5
    generator = torch.Generator().manual_seed(3)
    rows, start = [], [0]
    for _ in range(ranks):
        pick = torch.randperm(table.rows, generator=generator)[: table.rows // 3].sort().values.tolist()
        rows += pick
        start.append(len(rows))
    table.rank_rows = RankRows(torch.tensor(start), torch.tensor(rows))
    out = io.BytesIO()
    write_chunk_index(out, table, **T.extras(), metadata_size=5, metadata_head_crc=6, metadata_tail_crc=7)
    whole = read_chunk_index(out.getvalue(), "test")  # version 2 reads whole as version 1 did
    assert torch.equal(whole.table.offsets, table.offsets) and whole.edge_bytes == L.SECTION_EDGE_BYTES
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        f.write(out.getvalue())
        f.flush()
        source = open_source(f.name)
        header = read_index_header(source, "test")
        # A section leaves out the chunks with no elements (at the tensor's edge: no load reads
        # them), unless the entry has an empty chunk inside the tensor.
        inner = set(inner_empty_entries(table))
        entry_of = table.entry_of_rows().tolist()

        def readable(row: int) -> bool:
            e = entry_of[row]
            size = table.sizes[e]
            return size is None or e in inner or all(table.lengths[row, d] > 0 for d in range(len(size)))

        dropped = 0
        magic = L.NARROW_SECTION_MAGIC if layout == "narrow records" else L.SECTION_MAGIC
        for r in range(ranks):
            assert _section_magic(f.name, r) == magic
            section = read_rank_section(source, header, r, "test")
            mine = [row for row in rows[start[r]:start[r + 1]] if readable(row)]
            dropped += start[r + 1] - start[r] - len(mine)
            assert torch.equal(section.table.offsets, table.offsets[mine])
            assert torch.equal(section.table.lengths, table.lengths[mine])
            assert torch.equal(section.table.storage.byte_offset, table.storage.byte_offset[mine])
            assert torch.equal(section.table.storage.byte_length, table.storage.byte_length[mine])
            assert torch.equal(section.table.storage.checksums, table.storage.checksums[mine])
            named = [section.table.storage.files[i] for i in section.table.storage.file_index.tolist()]
            assert named == [table.storage.files[i] for i in table.storage.file_index[mine].tolist()]
            entry = table.entry_of_rows()[mine]
            assert section.ordinals.tolist() == (torch.tensor(mine) - table.row_start[entry]).tolist()
        assert read_rank_section(source, header, ranks, "test") is None  # no such rank
        source.close()
        assert dropped  # (the random table has empty chunks at edges)


@pytest.mark.parametrize("layout", ["int64 records", "narrow records"])
def test_a_forged_section_is_refused_naming_it(tmp_path, layout):
    import io

    import chunk_table_cases as T
    from fastdcp.format.chunk_table import RankRows
    from fastdcp.format.metadata import CheckpointFormatError

    table = T.random_table(12, entries=10, max_chunks=3, big=layout == "int64 records")
    if layout == "narrow records":
        table.storage.byte_length.clamp_(max=(1 << 31) - 1)
    assert fits_narrow_records(table) == (layout == "narrow records")
    table.rank_rows = RankRows(torch.tensor([0, 2, table.rows]), torch.arange(table.rows))
    out = io.BytesIO()
    write_chunk_index(out, table, **T.extras(), metadata_size=5, metadata_head_crc=6, metadata_tail_crc=7)
    data = bytearray(out.getvalue())
    path = tmp_path / "index"
    path.write_bytes(bytes(data))
    offset, length = _section_span(str(path), 1)
    # A record naming an entry past the table, with the section's CRC recomputed.
    body_at = offset + L.SECTION_HEADER.size
    if layout == "int64 records":
        data[body_at: body_at + 8] = (10 ** 6).to_bytes(8, "little")
    else:  # the first int32 field, after every row's byte offset and checksum
        _, _, rows, _, _ = L.SECTION_HEADER.unpack_from(data, offset)
        entry_at = body_at + rows * 8 * len(L.WIDE_FIELDS)
        data[entry_at: entry_at + 4] = (10 ** 6).to_bytes(4, "little")
    crc = crc32c(bytes(data[offset: offset + length]))
    with open_source(path) as source:
        header = read_index_header(source, "x")
        entry_at = header.v2.directory_offset + L.DIRECTORY_ENTRY.size
    data[entry_at: entry_at + L.DIRECTORY_ENTRY.size] = L.DIRECTORY_ENTRY.pack(offset, length, crc, 0)
    path.write_bytes(bytes(data))
    with open_source(path) as source:
        header = read_index_header(source, "index 'x'")
        with pytest.raises(CheckpointFormatError, match=r"index 'x'.*section of rank 1.*entry that does not exist"):
            read_rank_section(source, header, 1, "index 'x'")
        assert read_rank_section(source, header, 0, "index 'x'") is not None
