"""Chunk tables for the ``.metadata`` emitter, chunk index and TableMetadata tests: random tables
covering every feature of the format, a scale-shaped table made with tensor ops, and a strict
comparison of two ``Metadata`` object graphs (types, attribute dicts in order, index hints)."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import StorageMeta, TensorProperties

from fastdcp.format.chunk_table import NO_CHECKSUM, ChunkTable, StorageColumns

import dcp_cases as C

ALL_DTYPES = C.all_torch_dtypes()
FQN_STYLES = (
    "model.layers.{i}.weight",
    "optim.state.émbed.{i}.exp_avg",  # non-ASCII
    "模型.层{i}",
    "emoji_\U0001f600_{i}",
    "surrogate_\udc80_{i}",  # a lone surrogate: pickle passes it through
    "long_" + "x" * 300 + "_{i}",  # > 255 bytes: BINUNICODE instead of SHORT_BINUNICODE
)
BIG = (1 << 31, (1 << 32) + 5, 1 << 40, (1 << 62) - 1)


def _properties(rng: random.Random, dtype: torch.dtype) -> TensorProperties:
    return TensorProperties(
        dtype=dtype,
        layout=rng.choice([torch.strided, torch.strided, torch.sparse_coo]),
        requires_grad=rng.random() < 0.2,
        memory_format=rng.choice([torch.contiguous_format, torch.contiguous_format, torch.channels_last,
                                  torch.preserve_format]),
        pin_memory=rng.random() < 0.2,
    )


def _dim_size(rng: random.Random, big: bool) -> int:
    r = rng.random()
    if r < 0.1:
        return 0
    if big and r < 0.3:
        return rng.choice(BIG)
    return rng.randint(1, 70_000 if r < 0.6 else 40)


def random_table(
    seed: int,
    *,
    entries: int = 40,
    max_chunks: int = 9,
    max_ndim: int = 5,
    files: int = 4,
    checksums: str = "mixed",
    big: bool = True,
    storage: bool = True,
) -> ChunkTable:
    """A table with tensor entries of 0..max_ndim dimensions (zero-size dims, entries without
    chunks, chunks past 2^31), bytes entries, every dtype, odd fqns, several files and
    ``checksums`` "all", "none", "mixed" (per entry) or "rows" (alternating row by row)."""
    rng = random.Random(seed)
    fqns, props, sizes, boxes = [], [], [], []
    row_start = [0]
    for i in range(entries):
        fqns.append(rng.choice(FQN_STYLES).format(i=i))
        kind = rng.random()
        if kind < 0.12:
            props.append(None)
            sizes.append(None)
            boxes.append([((), ())])
        else:
            ndim = rng.randint(0, max_ndim)
            size = [_dim_size(rng, big) for _ in range(ndim)]
            props.append(_properties(rng, ALL_DTYPES[i % len(ALL_DTYPES)]))
            sizes.append(torch.Size(size))
            n = 0 if kind < 0.17 else rng.randint(1, max_chunks)
            chunks, seen = [], set()
            for _ in range(n):  # distinct offsets: they key storage_data
                off = tuple(rng.randint(0, d) for d in size)
                if off not in seen:
                    seen.add(off)
                    chunks.append((off, tuple(rng.randint(0, d - o) for d, o in zip(size, off))))
            boxes.append(chunks)
        row_start.append(row_start[-1] + len(boxes[-1]))
    rows = row_start[-1]
    width = max([1] + [len(s) for s in sizes if s is not None])
    offsets = torch.zeros((rows, width), dtype=torch.int64)
    lengths = torch.zeros((rows, width), dtype=torch.int64)
    r = 0
    for chunks in boxes:
        for off, length in chunks:
            if off:
                offsets[r, : len(off)] = torch.tensor(off)
                lengths[r, : len(length)] = torch.tensor(length)
            r += 1
    names = [f"__{k}_0.distcp" for k in range(files - 1)] + ["dossier_é.distcp"]
    crcs = []
    for e, chunks in enumerate(boxes):
        has = {"all": True, "none": False, "mixed": e % 3 != 0}.get(checksums)
        for k in range(len(chunks)):
            present = has if has is not None else (k + e) % 2 == 0
            crcs.append(rng.choice([0, 7, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, rng.getrandbits(32)])
                        if present else NO_CHECKSUM)
    table = ChunkTable(fqns, props, sizes, torch.tensor(row_start, dtype=torch.int64), offsets, lengths)
    if storage:
        table.storage = StorageColumns(
            files=names,
            file_index=torch.tensor([rng.randrange(files) for _ in range(rows)], dtype=torch.int32),
            byte_offset=torch.tensor([rng.choice([0, 64, 4096, rng.randint(0, 1 << 20)] + list(BIG[:3]))
                                      for _ in range(rows)], dtype=torch.int64),
            byte_length=torch.tensor([rng.choice([0, 1, 300, 1 << 31, 5 << 30]) for _ in range(rows)],
                                     dtype=torch.int64),
            checksums=torch.tensor(crcs, dtype=torch.int64),
        )
    return table


def extras(seed: int = 0) -> dict[str, Any]:
    """planner_data (shared and repeated strings, a nested list), storage_meta and version."""
    shared = ["a", "b"]
    return {
        "planner_data": {"model.w": ("model", "w"), "other": shared, "again": shared, "é": ("é", 1 << 40)},
        "storage_meta": StorageMeta(checkpoint_id=f"/ckpt/{seed}", save_id=f"save-{seed}", modules=["m"]),
        "version": "1.0.0",
    }


def sharded_table(ranks: int, entries: int, *, seed: int = 0, checksums: bool = True) -> ChunkTable:
    """The scale target's shape, made with tensor ops: ``entries`` 2-D tensors, each split in
    ``ranks`` Shard(0) chunks, rank r's chunks in file r (rows ordered entry-major)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 64, (entries,), generator=g)  # rows of each chunk
    cols = torch.randint(1, 8192, (entries,), generator=g)
    rows = ranks * entries
    rank = torch.arange(ranks).repeat(entries)
    entry = torch.arange(entries).repeat_interleave(ranks)
    offsets = torch.zeros(rows, 2, dtype=torch.int64)
    lengths = torch.zeros(rows, 2, dtype=torch.int64)
    offsets[:, 0] = rank * k[entry]
    lengths[:, 0] = k[entry]
    lengths[:, 1] = cols[entry]
    nbytes = lengths[:, 0] * lengths[:, 1] * 2 + 1024
    per_rank = nbytes.view(entries, ranks).t()  # file r holds its chunks of every entry in order
    starts = (per_rank.cumsum(1) - per_rank).t().reshape(-1)
    storage = StorageColumns(
        files=[f"__{r}_0.distcp" for r in range(ranks)],
        file_index=rank.to(torch.int32),
        byte_offset=starts,
        byte_length=nbytes,
        checksums=(torch.randint(0, 1 << 32, (rows,), generator=g) if checksums
                   else torch.full((rows,), NO_CHECKSUM, dtype=torch.int64)),
    )
    return ChunkTable(
        fqns=[f"model.layers.{e // 9}.part{e % 9}.weight" for e in range(entries)],
        properties=[TensorProperties(dtype=torch.bfloat16 if e % 3 else torch.float32) for e in range(entries)],
        sizes=[torch.Size([int(a) * ranks, int(b)]) for a, b in zip(k, cols)],
        row_start=torch.arange(0, rows + 1, ranks, dtype=torch.int64),
        offsets=offsets,
        lengths=lengths,
        storage=storage,
    )


def assert_same_objects(a: Any, b: Any, path: str = "metadata") -> None:
    """``a`` and ``b`` are the same object graph: same types, attribute dicts with the same keys in
    the same order, dict keys compared by their attributes too (MetadataIndex hints), equal
    leaves."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert len(a) == len(b), f"{path}: {len(a)} != {len(b)} items"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same_objects(ka, kb, f"{path}.key[{ka!r}]"[:300])
            assert_same_objects(va, vb, f"{path}[{ka!r}]"[:300])
    elif isinstance(a, (list, tuple)) and type(a) is not torch.Size:
        assert len(a) == len(b), f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_objects(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, (type, torch.dtype)):
        assert list(vars(a)) == list(vars(b)), f"{path}: attributes {list(vars(a))} != {list(vars(b))}"
        for key in vars(a):
            assert_same_objects(vars(a)[key], vars(b)[key], f"{path}.{key}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
        if type(a) is torch.Size:
            assert all(type(v) is int for v in a)
