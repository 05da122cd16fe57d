"""FastFileSystemWriter / FastFileSystemReader specifics: file layout, options, fallbacks, budget, errors."""

from __future__ import annotations

import inspect
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter
from fastdcp.format.blob_parse import parse_tensor_blob

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _save(sd, writer):
    dcp.save(sd, storage_writer=writer, no_dist=True)


def _load(sd, reader):
    dcp.load(sd, storage_reader=reader, no_dist=True)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300, 257, generator=g),
        "bf16": torch.randn(129, 65, generator=g).to(torch.bfloat16),
        "small": torch.randn(7, generator=g),
        "i64": torch.randint(-1000, 1000, (33, 3), generator=g),
        "scalar": torch.tensor(2.5),
        "meta": {"step": 3},
    }


def _assert_same(a, b):
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and b[k].shape == v.shape, k
            assert torch.equal(b[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        else:
            assert b[k] == v, k


def _empty_like(sd):
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1}) for k, v in sd.items()}


def test_tensor_bytes_sit_at_aligned_file_offsets(tmp_path):
    sd = _state()
    _save(sd, FastFileSystemWriter(tmp_path))
    md = FileSystemReader(tmp_path).read_metadata()
    checked = 0
    for index, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue
        raw = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        blob = parse_tensor_blob(raw, raw, len(raw), lambda o, n: raw[o : o + n], str(info.relative_path))
        nbytes = md.state_dict_metadata[index.fqn].size.numel() * md.state_dict_metadata[index.fqn].properties.dtype.itemsize
        # Tensors of 64 KiB and more sit on 4096 boundaries (O_DIRECT from aligned memory); smaller
        # ones are packed at torch's 64-byte alignment.
        assert (info.offset + blob.data_offset) % (4096 if nbytes >= 64 << 10 else 64) == 0, index.fqn
        assert info.offset % 64 == 0
        checked += 1
    assert checked == 5


@pytest.mark.parametrize("hook", ["open", "io"])
def test_direct_io_refused_falls_back_and_stays_compatible(tmp_path, monkeypatch, hook):
    monkeypatch.setenv("FASTDCP_TEST_DIRECT_EINVAL", hook)
    sd = _state(1)
    _save(sd, FastFileSystemWriter(tmp_path, direct_io=True))
    out = _empty_like(sd)
    _load(out, FileSystemReader(tmp_path))
    _assert_same(sd, out)


@pytest.mark.parametrize("direct", [False, True])
def test_short_transfers_at_writer_and_reader_level(tmp_path, monkeypatch, direct):
    monkeypatch.setenv("FASTDCP_TEST_MAX_IO_BYTES", "4096")
    sd = _state(2)
    _save(sd, FastFileSystemWriter(tmp_path, direct_io=direct, task_bytes=64 << 10))
    out = _empty_like(sd)
    _load(out, FastFileSystemReader(tmp_path, direct_io=direct, task_bytes=64 << 10))
    _assert_same(sd, out)


def test_writer_and_reader_are_picklable(tmp_path):
    w = FastFileSystemWriter(tmp_path, io_threads=3, direct_io=False)
    r = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=1 << 20)
    _save(_state(), w)  # creates the engine
    w2, r2 = pickle.loads(pickle.dumps(w)), pickle.loads(pickle.dumps(r))
    assert w2.io_options == w.io_options and r2.io_options == r.io_options
    out = _empty_like(_state())
    _load(out, r2)
    _assert_same(_state(), out)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(thread_count=0), "thread_count"),
        (dict(io_threads=-1), "io_threads"),
        (dict(task_bytes=0), "task_bytes"),
        (dict(io_threads=100000), "io_threads"),
    ],
)
def test_writer_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        FastFileSystemWriter(tmp_path, **kwargs)


def test_bad_environment_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDCP_DIRECT_IO", "sometimes")
    with pytest.raises(ValueError, match="FASTDCP_DIRECT_IO"):
        FastFileSystemReader(tmp_path)
    monkeypatch.setenv("FASTDCP_DIRECT_IO", "0")
    monkeypatch.setenv("FASTDCP_IO_THREADS", "many")
    with pytest.raises(ValueError, match="FASTDCP_IO_THREADS"):
        FastFileSystemWriter(tmp_path)


def test_memory_budget_bounds_staging(tmp_path):
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(512, 384, generator=g), "v": torch.randn(4096, generator=g)}  # 768 KiB + 16 KiB
    _save(sd, FastFileSystemWriter(tmp_path))
    # Destinations that force staging: transposed storage (non-contiguous) and a dtype conversion.
    out = {"w": torch.zeros(384, 512).t(), "v": torch.zeros(4096, dtype=torch.float64)}
    budget = 64 << 10
    reader = FastFileSystemReader(tmp_path, read_buffer_limit_bytes=budget)
    _load(out, reader)
    assert torch.equal(out["w"], sd["w"])
    assert torch.equal(out["v"], sd["v"].double())
    stats = reader.last_stats
    assert stats["staged_pieces"] > 1 and stats["staging_batches"] > 1
    assert 0 < stats["max_staging_bytes"] <= budget


def test_direct_read_into_destination_skips_staging(tmp_path):
    sd = {"w": torch.randn(1024, 1024)}  # 4 MiB: larger than a header window
    _save(sd, FastFileSystemWriter(tmp_path))
    out = {"w": torch.zeros(1024, 1024)}
    reader = FastFileSystemReader(tmp_path)
    _load(out, reader)
    assert torch.equal(out["w"], sd["w"])
    assert reader.last_stats["runs_pieces"] == 1 and reader.last_stats["staged_pieces"] == 0
    assert reader.last_stats["bytes_read"] == sd["w"].nbytes and reader.last_stats["requests"] == 1


def _only_data_file(directory):
    """The one data file of a single-rank, single-file save (its name carries a per-save token)."""
    (path,) = directory.glob("__0_*.distcp")
    return path


def test_missing_data_file_names_the_file(tmp_path):
    _save(_state(), FastFileSystemWriter(tmp_path))
    path = _only_data_file(tmp_path)
    os.remove(path)
    with pytest.raises(CheckpointException) as info:
        _load(_empty_like(_state()), FastFileSystemReader(tmp_path))
    assert path.name in str(info.value) and "does not exist" in str(info.value)


def test_truncated_data_file_names_the_file(tmp_path):
    sd = {"w": torch.randn(1024, 1024)}
    _save(sd, FastFileSystemWriter(tmp_path))
    path = _only_data_file(tmp_path)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointException) as info:
        _load({"w": torch.zeros(1024, 1024)}, FastFileSystemReader(tmp_path))
    assert path.name in str(info.value)


def test_corrupted_blob_header_is_a_clear_error(tmp_path):
    sd = {"w": torch.randn(64, 64)}
    _save(sd, FastFileSystemWriter(tmp_path))
    path = _only_data_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[0:4] = b"XXXX"  # local header signature of data.pkl
    data[-22:-18] = b"YYYY"  # end of central directory signature
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _load({"w": torch.zeros(64, 64)}, FastFileSystemReader(tmp_path))
    assert path.name in str(info.value)


def test_unloadable_quantized_dtype_is_refused_clearly(tmp_path):
    if not hasattr(torch, "quint4x2"):
        pytest.skip("this torch has no quint4x2")
    q = torch.quantize_per_tensor(torch.rand(8), 0.5, 1, torch.quint4x2)
    with pytest.raises(CheckpointException, match="cannot be checkpointed"):
        _save({"q": q}, FastFileSystemWriter(tmp_path))


def test_build_info_reports_the_build():
    info = fastdcp.build_info()
    for key in ("cuda", "o_direct", "io_uring", "torch", "fastdcp", "torch_compiled"):
        assert key in info
    assert info["o_direct"] is True
    assert info["torch"] == torch.__version__


def test_overwrite_false_raises_like_stock(tmp_path):
    _save(_state(), FastFileSystemWriter(tmp_path))
    for writer in (FileSystemWriter(tmp_path, overwrite=False), FastFileSystemWriter(tmp_path, overwrite=False)):
        with pytest.raises(CheckpointException, match="already exists"):
            _save(_state(), writer)


def test_a_reused_plan_never_rewrites_the_live_files(tmp_path, monkeypatch):
    """Stock ``DefaultSavePlanner(enable_plan_caching=True)`` hands the second save the first
    save's final plans, file prefix included: the writer must still write new files (never open a
    file the live checkpoint references) and name them in the metadata."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner.__init__).parameters:
        pytest.skip("this torch's DefaultSavePlanner has no plan caching")
    first = _state(1)
    dcp.save(first, storage_writer=FastFileSystemWriter(tmp_path), planner=DefaultSavePlanner(enable_plan_caching=True),
             no_dist=True)
    live = {info.relative_path for info in FileSystemReader(tmp_path).read_metadata().storage_data.values()}
    opened = []
    from fastdcp._native import _C

    real_file = _C.File

    def recording_file(path, mode, direct):
        opened.append(os.path.basename(path))
        return real_file(path, mode, direct)

    monkeypatch.setattr(_C, "File", recording_file)
    second = _state(2)
    dcp.save(second, storage_writer=FastFileSystemWriter(tmp_path), planner=DefaultSavePlanner(enable_plan_caching=True),
             no_dist=True)
    assert opened and not set(opened) & live, f"the second save rewrote live files {set(opened) & live}"
    out = _empty_like(second)
    _load(out, FileSystemReader(tmp_path))
    _assert_same(second, out)
