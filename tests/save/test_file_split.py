"""How a rank's data is split into files (``fastdcp.save.file_split``).

With ``thread_count`` left unset the writer spreads a rank's tensors over one file per engine
thread (none under ``AUTO_MIN_FILE_BYTES``); an explicit ``thread_count`` is stock's split exactly.
Every layout must load bit-exact with stock ``FileSystemReader`` and with fastdcp's reader, and an
overwrite must leave exactly the new files."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type
from torch.distributed.checkpoint.planner import WriteItemType

from fastdcp import FastFileSystemReader, FastFileSystemWriter
from fastdcp.save import file_split
from fastdcp.save.file_split import AUTO_MIN_FILE_BYTES, auto_file_count, local_bytes, split_into_files

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

MIB = 1 << 20


def _items(state: dict) -> list:
    """The write items DCP's default planner makes for ``state`` on one rank."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return list(planner.create_local_plan().items)


def _data_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))


def _state(mib_per_tensor: float, count: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = int(mib_per_tensor * MIB) // (256 * 4)
    state = {f"w{i}": torch.randn(rows, 256, generator=g) for i in range(count)}
    state["step"] = seed  # a byte item
    state["bias"] = torch.arange(10, dtype=torch.float16) + seed
    return state


def _assert_loads(directory: Path, expected: dict) -> None:
    for reader in (FileSystemReader(directory), FastFileSystemReader(directory)):
        dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()}
        dcp.load(dest, storage_reader=reader, no_dist=True)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(dest[key], value), f"{type(reader).__name__}: {key} differs"
            else:
                assert dest[key] == value, f"{type(reader).__name__}: {key} = {dest[key]!r}"


# --------------------------------------------------------------------------------------------- #
# The split itself.


def test_a_small_state_stays_one_file():
    items = _items(_state(1, 8))
    assert auto_file_count(items, io_threads=8) == 1
    assert split_into_files(items, True, None, io_threads=8) == [items]


def test_one_file_per_thread_none_under_the_minimum():
    items = _items(_state(8, 20))  # 160 MiB in 20 tensors
    total = sum(local_bytes(i) for i in items)
    assert auto_file_count(items, io_threads=4) == 4
    assert auto_file_count(items, io_threads=64) == total // AUTO_MIN_FILE_BYTES  # 5, not 64
    files = split_into_files(items, True, None, io_threads=4)
    assert len(files) == 4
    assert sorted(id(i) for f in files for i in f) == sorted(id(i) for i in items), "an item lost or duplicated"
    sizes = [sum(local_bytes(i) for i in f) for f in files]
    assert max(sizes) - min(sizes) <= 8 * MIB, f"unbalanced files: {sizes}"
    assert all(sum(1 for i in f if i.type == WriteItemType.BYTE_IO) <= 1 for f in files)


def test_never_more_files_than_items():
    items = _items({"big": torch.zeros(64 * MIB, dtype=torch.uint8)})  # one 64 MiB item
    assert auto_file_count(items, io_threads=8) == 1


def test_balance_counts_the_bytes_this_rank_writes(monkeypatch):
    """Sharded items are weighed by their chunk, not by the global tensor (which stock uses)."""
    items = _items(_state(8, 4))
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO and local_bytes(i) >= 8 * MIB]
    # Pretend the first item is a 1/8 shard of a tensor 8x its size: global size 8x, chunk unchanged.
    first = tensor_items[0]
    global_size = torch.Size([first.tensor_data.size[0] * 8, *first.tensor_data.size[1:]])
    tensor_items[0] = dataclasses.replace(first, tensor_data=dataclasses.replace(first.tensor_data, size=global_size))
    monkeypatch.setattr(file_split, "AUTO_MIN_FILE_BYTES", 8 * MIB)
    files = split_into_files(tensor_items, True, None, io_threads=2)
    assert sorted(len(f) for f in files) == [2, 2], f"the shard was weighed by its global size: {files}"


def test_explicit_thread_count_is_stocks_split():
    items = _items(_state(8, 20))
    ours = split_into_files(items, True, 3, io_threads=8)
    stock = _split_by_size_and_type(3, list(items))
    assert [[i.index for i in f] for f in ours] == [[i.index for i in f] for f in stock]
    assert split_into_files(items, True, 1, io_threads=8) == [items]


def test_file_per_item_is_stocks():
    items = _items(_state(1, 3))
    assert split_into_files(items, False, None, io_threads=8) == [[i] for i in items]


# --------------------------------------------------------------------------------------------- #
# Saves with the automatic layout.


def test_default_writer_spreads_a_large_state_and_stock_reads_it(tmp_path):
    state = _state(8, 20)  # 160 MiB
    writer = FastFileSystemWriter(tmp_path)
    assert writer.thread_count == 1 and writer.files_per_rank is None
    dcp.save(state, storage_writer=writer, no_dist=True)
    expected = auto_file_count(_items(state), writer.io_options.io_threads)
    assert expected > 1
    assert len(_data_files(tmp_path)) == expected
    _assert_loads(tmp_path, state)


def test_explicit_thread_count_one_keeps_one_file(tmp_path):
    state = _state(8, 20)
    dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    assert len(_data_files(tmp_path)) == 1
    _assert_loads(tmp_path, state)


def test_overwrite_replaces_every_file(tmp_path, monkeypatch):
    """A multi-file save over a multi-file checkpoint (and over a stock one): the new files only."""
    monkeypatch.setattr(file_split, "AUTO_MIN_FILE_BYTES", 2 * MIB)
    first = _state(2, 6, seed=1)
    dcp.save(first, storage_writer=FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    old_files = set(_data_files(tmp_path))
    for seed in (2, 3):
        state = _state(2, 6, seed=seed)
        dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
        files = set(_data_files(tmp_path))
        assert len(files) > 2 and not files & old_files, (old_files, files)
        _assert_loads(tmp_path, state)
        old_files = files


def test_async_save_with_the_automatic_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(file_split, "AUTO_MIN_FILE_BYTES", 2 * MIB)
    state = _state(2, 6, seed=4)
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    future = dcp.async_save(state, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.fill_(7)
    getattr(future, "upload_completion", future).result()
    assert len(_data_files(tmp_path)) > 2
    _assert_loads(tmp_path, expected)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_thread_count_must_be_a_positive_int_or_none(tmp_path, bad):
    with pytest.raises(ValueError, match="thread_count"):
        FastFileSystemWriter(tmp_path, thread_count=bad)


# --------------------------------------------------------------------------------------------- #
# Memory-backed filesystems: a write is a memory copy, so at most the rank's share of the CPUs.


@pytest.fixture
def shm_dir():
    import shutil
    import tempfile

    from fastdcp import _C

    if not os.path.isdir("/dev/shm") or not _C.on_memory_filesystem("/dev/shm"):
        pytest.skip("no memory-backed /dev/shm on this machine")
    directory = Path(tempfile.mkdtemp(prefix="fastdcp_split_", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_write_threads_on_a_memory_filesystem_are_the_cpu_share(shm_dir, tmp_path, monkeypatch):
    from fastdcp.io import engine

    monkeypatch.delenv("FASTDCP_IO_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    options = engine.IoOptions.resolve(direct_io=None, default_direct_io=True, io_threads=None, task_bytes=None)
    assert not options.io_threads_chosen
    assert options.write_threads_for(str(tmp_path)) == options.io_threads  # a disk: unchanged
    assert options.write_threads_for(str(shm_dir)) == min(options.io_threads, cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cpus))  # more ranks than CPUs on this node
    assert engine.cpu_share() == 1
    assert options.write_threads_for(str(shm_dir)) == 1
    chosen = engine.IoOptions.resolve(direct_io=None, default_direct_io=True, io_threads=6, task_bytes=None)
    assert chosen.io_threads_chosen and chosen.write_threads_for(str(shm_dir)) == 6
    monkeypatch.setenv("FASTDCP_IO_THREADS", "5")
    from_env = engine.IoOptions.resolve(direct_io=None, default_direct_io=True, io_threads=None, task_bytes=None)
    assert from_env.io_threads_chosen and from_env.write_threads_for(str(shm_dir)) == 5


def test_a_save_to_a_memory_filesystem_writes_one_file_per_cpu_share(shm_dir, monkeypatch):
    monkeypatch.delenv("FASTDCP_IO_THREADS", raising=False)
    state = _state(8, 20)  # 160 MiB: 5 files' worth at the 32 MiB minimum
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0))))  # a share of 1 CPU
    dcp.save(state, storage_writer=FastFileSystemWriter(shm_dir / "shared"), no_dist=True)
    assert len(_data_files(shm_dir / "shared")) == 1
    _assert_loads(shm_dir / "shared", state)
    dcp.save(state, storage_writer=FastFileSystemWriter(shm_dir / "chosen", io_threads=4), no_dist=True)
    assert len(_data_files(shm_dir / "chosen")) == 4  # an explicit io_threads is kept
    _assert_loads(shm_dir / "chosen", state)
