"""Many small tensors are packed: one stock-readable ``torch.save`` blob per tensor, all of a file
written by a few large engine requests (not a Python write per tensor), no bigger than stock's file.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dcp_cases as C
from fastdcp import FastFileSystemWriter
from fastdcp.io.engine import get_engine

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

N_SMALL = 3000


def _small_state(seed: int) -> dict:
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8, torch.bool]
    sd = {}
    for i in range(N_SMALL):
        dtype = rng.choice(dtypes)
        shape = rng.choice([(256,), (16, 16), (3, 5, 7), (1,), ()])
        sd[f"layer{i // 10}.p{i % 10}"] = C.random_tensor(dtype, shape, ("small", seed, i))
    sd["big"] = C.random_tensor(torch.float32, (512, 300), ("small", seed, "big"))
    return sd


def _dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("thread_count", [1, 3])
def test_small_tensors_are_packed_into_few_writes(tmp_path, thread_count):
    sd = _small_state(thread_count)
    expected = C.deepcopy_state_dict(sd)
    writer = FastFileSystemWriter(tmp_path / "fast", thread_count=thread_count)
    engine = get_engine(writer.io_options)
    before = engine.stats()["write_tasks"]
    dcp.save(sd, storage_writer=writer, no_dist=True)
    tasks = engine.stats()["write_tasks"] - before
    file_bytes = _dir_bytes(tmp_path / "fast")
    # One request per task_bytes of file image, per file, plus one partial task per file.
    bound = file_bytes // writer.io_options.task_bytes + 2 * thread_count
    assert tasks <= bound, f"{tasks} write requests for {N_SMALL} small tensors (expected at most {bound})"

    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", thread_count=thread_count), no_dist=True)
    assert file_bytes <= _dir_bytes(tmp_path / "stock"), "packed small tensors take more room than stock's"

    for reader in ("stock", "fast"):
        C.load_in_place_and_check(C.make_reader(reader, tmp_path / "fast"), expected, C.destination_for(expected))


def test_every_small_tensor_is_its_own_torch_save_blob(tmp_path):
    sd = _small_state(7)
    dcp.save(sd, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
    md = FileSystemReader(tmp_path).read_metadata()
    items = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    for index, info in random.Random(0).sample(items, 50) + items[-3:]:
        raw = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        loaded = torch.load(io.BytesIO(raw), weights_only=True)
        C.assert_tensor_bitexact(loaded, sd[index.fqn], index.fqn)
