"""``fastdcp.open``: the lazy mapping over checkpoints written by stock ``FileSystemWriter`` and by
``FastFileSystemWriter`` (bit-exact tensors and slices, every savable dtype, 0-d, empty and
non-contiguous tensors, objects, DTensor shards saved by 2 gloo ranks), the bytes a slice reads,
and the errors for missing keys and damaged checkpoints."""

from __future__ import annotations

import os
import random
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

import dcp_cases as C
import fastdcp
from fastdcp import CheckpointFormatError, CheckpointNotFoundError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*quantize.*deprecated")

KINDS = ("stock", "fast")
HEADER_WINDOWS = (8 << 10) + (4 << 10)  # head and tail windows read per large blob (header_pass)


def _writer(kind: str, path):
    return FileSystemWriter(path) if kind == "stock" else fastdcp.FastFileSystemWriter(path)


def _savable_dtypes() -> list[torch.dtype]:
    return [d for d in C.all_torch_dtypes() if C.dtype_name(d) not in C.STOCK_UNSUPPORTED_DTYPES]


def _state() -> dict:
    return {
        "model": C.zoo_tensors(0, large=False),
        "dtypes": {C.dtype_name(d): C.random_tensor(d, (5, 3), ("dt", C.dtype_name(d))) for d in _savable_dtypes()},
        "big": C.random_tensor(torch.float32, (1024, 256), "big"),  # 1 MiB: read through windows
        "objects": C.object_state_dict(0),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("open")
    state = _state()
    paths = {}
    for kind in KINDS:
        paths[kind] = base / kind
        dcp.save(state, storage_writer=_writer(kind, paths[kind]), no_dist=True)
    return state, paths


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def test_every_tensor_is_bit_exact(saved, kind):
    state, paths = saved
    with fastdcp.open(paths[kind]) as ckpt:
        expected = C.tensor_leaves(state)  # flattened keys, as DCP stores them
        assert set(expected) <= set(ckpt.keys())
        for key, value in expected.items():
            C.assert_tensor_bitexact(ckpt[key], value, key, check_stride=False)
            info = ckpt.metadata(key)
            assert info.shape == tuple(value.shape) and info.dtype == value.dtype
            assert ckpt[key].is_contiguous() or value.is_quantized


def test_objects_come_back_as_dcp_loads_them(saved, kind):
    state, paths = saved
    with fastdcp.open(paths[kind]) as ckpt:
        objects = state["objects"]
        assert ckpt["objects.int"] == objects["int"]
        assert ckpt["objects.custom"] == objects["custom"]
        assert ckpt["objects.dataclass"] == objects["dataclass"]
        assert ckpt["objects.tuple_of_objs"] == objects["tuple_of_objs"]
        assert ckpt["objects.bytesio"].getvalue() == objects["bytesio"].getvalue()
        assert ckpt["objects.list_of_objs.3.k"] == "v"  # a list holding a dict is flattened
        info = ckpt.metadata("objects.custom")
        assert isinstance(info, fastdcp.ObjectInfo) and info.path == ("objects", "custom")
        assert ckpt.read_bytes("objects.custom")[:2] == b"PK"  # torch.save's zip, not unpickled
        with pytest.raises(TypeError, match="not a tensor"):
            ckpt.get_slice("objects.custom")


def test_slices_match_torch_indexing(saved, kind):
    state, paths = saved
    rng = random.Random(7)
    with fastdcp.open(paths[kind]) as ckpt:
        model = state["model"]
        for key, value in (("model.four_d", model["four_d"]), ("model.transposed", model["transposed"]),
                           ("model.uneven_bf16", model["uneven_bf16"]), ("big", state["big"])):
            sl = ckpt.get_slice(key)
            assert sl.shape == tuple(value.shape) and sl.dtype == value.dtype
            for _ in range(6):
                offsets, sizes = C.random_box(rng, value.shape)
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                C.assert_tensor_bitexact(sl[index], value[index], f"{key}{index}", check_stride=False)
            for index in ((2,), (-1,), (..., 2), (1, ..., slice(1, -1)), (slice(None, 2), 0), (slice(5, 2),)):
                C.assert_tensor_bitexact(sl[index], value[index], f"{key}{index}", check_stride=False)
        scalar = ckpt.get_slice("model.scalar_f32")
        C.assert_tensor_bitexact(scalar[...], state["model"]["scalar_f32"], "0-d", check_stride=False)
        C.assert_tensor_bitexact(scalar[()], state["model"]["scalar_f32"], "0-d", check_stride=False)
        assert ckpt.get_slice("model.empty_0x5")[:, 1:3].shape == (0, 2)


def test_unsupported_indices_are_refused_clearly(saved):
    _, paths = saved
    with fastdcp.open(paths["fast"]) as ckpt:
        sl = ckpt.get_slice("big")
        with pytest.raises(ValueError, match="step 1 only"):
            sl[::2]
        with pytest.raises(IndexError, match="out of bounds"):
            sl[1024]
        with pytest.raises(IndexError, match="too many indices"):
            sl[0, 0, 0]
        with pytest.raises(TypeError, match="newaxis"):
            sl[None]
        with pytest.raises(TypeError, match="ints, slices"):
            sl[[1, 2]]


def test_a_slice_reads_only_its_rows(saved, kind):
    state, paths = saved
    row_bytes = 256 * 4
    with fastdcp.open(paths[kind]) as ckpt:
        rows = ckpt.get_slice("big")[100:164]
        assert torch.equal(rows.view(torch.int32), state["big"][100:164].view(torch.int32))
        first = ckpt.bytes_read
        assert 64 * row_bytes <= first <= 64 * row_bytes + HEADER_WINDOWS
        ckpt.get_slice("big")[500:502]  # headers are parsed once per object
        assert ckpt.bytes_read - first == 2 * row_bytes


def test_iteration_is_in_storage_order_and_lazy(saved, kind):
    _, paths = saved
    with fastdcp.open(paths[kind]) as ckpt:
        assert ckpt.bytes_read == 0  # opening reads only .metadata
        positions = []
        for key in ckpt:
            info = ckpt.metadata(key)
            first = info.chunks[0] if isinstance(info, fastdcp.TensorInfo) else info
            positions.append((first.file, first.byte_offset))
        assert positions == sorted(positions)
        items = iter(ckpt.items())
        key, value = next(items)
        assert ckpt.bytes_read <= 1 << 20  # one entry read, not the checkpoint
        assert len(ckpt) == len(list(ckpt.keys())) and key in ckpt and "missing" not in ckpt


def test_missing_key_names_key_and_directory(saved):
    _, paths = saved
    with fastdcp.open(paths["stock"]) as ckpt:
        with pytest.raises(KeyError, match=r"model\.nope.*" + str(paths["stock"]).replace("/", ".")):
            ckpt["model.nope"]
        assert ckpt.get("model.nope") is None


def test_closed_checkpoint_refuses_reads(saved):
    _, paths = saved
    with fastdcp.open(paths["fast"]) as ckpt:
        pass
    with pytest.raises(ValueError, match="closed"):
        ckpt["big"]


def test_device_argument_moves_results(saved):
    _, paths = saved
    # No GPU here: the "meta" device exercises the same Tensor.to(device) step.
    with fastdcp.open(paths["fast"], device="meta") as ckpt:
        assert ckpt["big"].device.type == "meta"
        assert ckpt.get_slice("big")[1:3].shape == (2, 256)


def test_damaged_checkpoints_give_the_readers_errors(saved, tmp_path, kind):
    _, paths = saved
    dest = tmp_path / "ckpt"
    shutil.copytree(paths[kind], dest)
    ckpt = fastdcp.open(dest)
    info = ckpt.metadata("big")
    ckpt.close()
    data_file = dest / info.chunks[0].file
    os.truncate(data_file, info.chunks[0].byte_offset + 100)
    with fastdcp.open(dest) as ckpt:
        with pytest.raises(CheckpointFormatError, match="truncated"):
            ckpt["big"]
    os.remove(data_file)
    with fastdcp.open(dest) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            ckpt["big"]
    (dest / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointFormatError, match="metadata"):
        fastdcp.open(dest)
    with pytest.raises(CheckpointNotFoundError):
        fastdcp.open(tmp_path / "nowhere")


def test_damaged_blob_header_is_reported(saved, tmp_path):
    _, paths = saved
    dest = tmp_path / "ckpt"
    shutil.copytree(paths["stock"], dest)
    with fastdcp.open(dest) as ckpt:
        chunk = ckpt.metadata("big").chunks[0]
    with open(dest / chunk.file, "r+b") as f:  # wreck the blob's end records
        f.seek(chunk.byte_offset + chunk.byte_length - 64)
        f.write(b"\0" * 64)
    with fastdcp.open(dest) as ckpt:
        with pytest.raises(fastdcp.BlobFormatError, match=chunk.file):
            ckpt["big"]


def test_stream_transform_items_go_through_stock(tmp_path):
    state = {"w": C.random_tensor(torch.float32, (40, 9), "xor"), "n": 5}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, _extensions=[C.XorTransform()]), no_dist=True)
    with fastdcp.open(tmp_path, extension_registry=C.xor_registry()) as ckpt:
        C.assert_tensor_bitexact(ckpt["w"], state["w"], "w")
        C.assert_tensor_bitexact(ckpt.get_slice("w")[3:7, 2:5], state["w"][3:7, 2:5], "w box", check_stride=False)
        assert ckpt["n"] == 5


# ---- DTensor shards saved by 2 ranks ------------------------------------------------------------

DTENSOR_SHAPE = (37, 130)


def _full(name: str) -> torch.Tensor:
    return C.random_tensor(torch.bfloat16 if name == "s1" else torch.float32, DTENSOR_SHAPE, ("dtensor", name))


def _dtensor_worker(rank: int, store: str, root: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    with C.gloo_rank_mesh(rank, store) as mesh:
        state = {"s0": distribute_tensor(_full("s0"), mesh, [Shard(0)]),
                 "s1": distribute_tensor(_full("s1"), mesh, [Shard(1)])}
        for kind in KINDS:
            dcp.save(state, storage_writer=_writer(kind, os.path.join(root, kind)))


@pytest.fixture(scope="module")
def dtensor_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtensor")
    mp.start_processes(_dtensor_worker, args=(str(root / "store"), str(root)), nprocs=2, start_method="spawn")
    return root


@pytest.mark.fastdcp_timeout(120)
def test_dtensor_shards_are_assembled(dtensor_checkpoints, kind):
    with fastdcp.open(dtensor_checkpoints / kind) as ckpt:
        for name, dim in (("s0", 0), ("s1", 1)):
            info = ckpt.metadata(name)
            assert len(info.chunks) == 2 and {c.offsets[dim] for c in info.chunks} != {0}
            full = _full(name)
            C.assert_tensor_bitexact(ckpt[name], full, name)
            # A box across the shard boundary and one inside the second shard.
            C.assert_tensor_bitexact(ckpt.get_slice(name)[10:30, 60:70], full[10:30, 60:70], name, check_stride=False)
            C.assert_tensor_bitexact(ckpt.get_slice(name)[-3:, -2], full[-3:, -2], name, check_stride=False)


def test_stored_run_is_the_tensor_bytes_where_one_exists(saved, kind):
    """``stored_run`` (what ``convert`` copies file to file) names exactly the tensor's bytes for
    tensors stored whole, row-major, in their dtype; None where a byte copy would be wrong."""
    state, paths = saved
    runs = 0
    with fastdcp.open(paths[kind]) as ckpt:
        for key, info in ((k, ckpt.metadata(k)) for k in ckpt):
            run = ckpt.stored_run(key)
            if not isinstance(info, fastdcp.TensorInfo):
                assert run is None
                continue
            if run is None:
                continue
            with open(run.path, "rb") as f:
                f.seek(run.offset)
                data = f.read(run.nbytes)
            expected = ckpt[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert data == expected, f"{kind}: stored_run({key!r}) is not the tensor's bytes"
            runs += 1
    assert runs >= 10, f"{kind}: only {runs} tensors had a stored run: the fast path is not exercised"
    if kind == "stock":  # stock keeps a transposed tensor's strides: no row-major run to copy
        with fastdcp.open(paths[kind]) as ckpt:
            transposed = [k for k in ckpt if k.startswith("model.") and "transpos" in k]
            assert transposed and all(ckpt.stored_run(k) is None for k in transposed), transposed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU placement path)")
def test_cuda_device_reads_through_the_gpu_placement_path(saved, kind):
    state, paths = saved
    with fastdcp.open(paths[kind], device="cuda") as ckpt:
        got = ckpt["big"]
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu().view(torch.uint8), state["big"].view(torch.uint8))
        part = ckpt.get_slice("big")[100:300, 7:90]
        assert part.device.type == "cuda"
        assert torch.equal(part.cpu().view(torch.uint8), state["big"][100:300, 7:90].contiguous().view(torch.uint8))
