"""Plans from per-rank sections of the chunk index equal the whole table's plan (itself stock's,
tests/planners/test_columnar_load_plan.py), item for item with index hints, or are refused.

Random saved tilings (empty chunks inside and at the edges of tensors included) are written as a
version 2 index whose sections hold random subsets of the rows; every destination of the random
cases is planned from each rank's section with the search over other sections
(``covering_read_items``): whenever that gives a plan, it must be the whole table's plan exactly.
"""

from __future__ import annotations

import io
import os
import random
import tempfile

import pytest
import torch

from fastdcp.format.chunk_table import NO_CHECKSUM, RankRows, StorageColumns, table_from_metadata
from fastdcp.format.index_sections import read_index_header, read_rank_section
from fastdcp.format.index_writer import inner_empty_entries, write_chunk_index
from fastdcp.io.positional import open_source
from fastdcp.planners import read_items as RI
from fastdcp.planners.chunk_validation import validate_chunk_table

from test_columnar_load_plan import _random_case  # noqa: E402  (tests/planners is on the path)


def _with_storage(table):
    rows = table.rows
    table.storage = StorageColumns(
        files=[f"__{i}_0.distcp" for i in range(3)],
        file_index=torch.arange(rows, dtype=torch.int32) % 3,
        byte_offset=torch.arange(rows, dtype=torch.int64) * 64,
        byte_length=torch.full((rows,), 64, dtype=torch.int64),
        checksums=torch.full((rows,), NO_CHECKSUM, dtype=torch.int64),
    )
    return table


def _sectioned(table, ranks: int, rng: random.Random):
    """Each row in one or two random sections, every section non-empty when rows allow."""
    members: list[list[int]] = [[] for _ in range(ranks)]
    for row in range(table.rows):
        for r in rng.sample(range(ranks), 1 if rng.random() < 0.8 else min(2, ranks)):
            members[r].append(row)
    rows = [row for m in members for row in sorted(m)]
    start = [0]
    for m in members:
        start.append(start[-1] + len(m))
    table.rank_rows = RankRows(torch.tensor(start, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64))
    return table


def _index_file(table) -> str:
    out = io.BytesIO()
    write_chunk_index(out, table, planner_data=None, storage_meta=None, version="1.0.0", metadata_size=1,
                      metadata_head_crc=2, metadata_tail_crc=3)
    f = tempfile.NamedTemporaryFile(delete=False)
    f.write(out.getvalue())
    f.close()
    return f.name


@pytest.mark.parametrize("block", range(4))
def test_section_plans_are_the_whole_tables_plan_or_refused(block):
    planned = refused = 0
    for seed in range(block * 60, block * 60 + 60):
        sd, md = _random_case(seed)
        table = _with_storage(table_from_metadata(md))
        if validate_chunk_table(table, several_ranks=True):
            continue  # overlapping saved chunks: DCP refuses to save those
        expected = RI.table_read_items(sd, table, True)
        rng = random.Random(seed)
        ranks = rng.randint(2, 5)
        path = _index_file(_sectioned(table, ranks, rng))
        try:
            with open_source(path) as source:
                header = read_index_header(source, "t")
                sections = {r: read_rank_section(source, header, r, "t") for r in range(ranks)}
        finally:
            os.remove(path)
        for r in range(ranks):
            found = RI.covering_read_items(sd, sections[r], sections.get, ranks, True,
                                           max_sections=rng.randint(1, ranks))
            if found is None:
                refused += 1
                continue
            planned += 1
            assert found[0] == expected, (seed, r)
    assert planned and refused  # both outcomes ran


def test_inner_empty_chunks_are_listed():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, \
        TensorStorageMetadata

    chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
              ChunkStorageMetadata(torch.Size([4]), torch.Size([0])),  # empty, strictly inside
              ChunkStorageMetadata(torch.Size([4]), torch.Size([4])),
              ChunkStorageMetadata(torch.Size([8]), torch.Size([0]))]  # empty, at the end: harmless
    md = Metadata({"inner": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8]), chunks),
                   "edge": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8]),
                                                 [chunks[0], chunks[2], chunks[3]])})
    assert inner_empty_entries(table_from_metadata(md)) == [0]
