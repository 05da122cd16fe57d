"""Unit tests for fastdcp/format/blob.py and fastdcp/format/blob_parse.py: hand-made torch.save blobs and the blob parser.

Everything is checked against the installed torch (torch.save / torch.load), no mocks.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import random
import struct
import time
import warnings
import zipfile
from collections import OrderedDict

import pytest
import torch

from fastdcp.format import blob as B
from fastdcp.format import blob_parse as BP


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _all_dtypes() -> list[torch.dtype]:
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _torch_can_save(dtype: torch.dtype) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            t = torch.empty(2, dtype=dtype)
            if t.is_quantized:
                return False
            torch.save(t, io.BytesIO())
            return True
        except Exception:
            return False


ALL_DTYPES = _all_dtypes()
SAVEABLE = [d for d in ALL_DTYPES if _torch_can_save(d)]
UNSAVEABLE = [d for d in ALL_DTYPES if d not in SAVEABLE]
SHAPES = [(), (0, 3), (7,), (2, 3, 5)]
OFFSETS = [0, 64, 4096 * 3 + 128]


def test_dtype_coverage():
    names = {str(d) for d in SAVEABLE}
    for must in (
        "torch.bfloat16",
        "torch.float16",
        "torch.float32",
        "torch.float64",
        "torch.float8_e4m3fn",
        "torch.float8_e5m2",
        "torch.uint16",
        "torch.uint32",
        "torch.uint64",
        "torch.bool",
        "torch.complex64",
        "torch.complex128",
        "torch.int8",
        "torch.int64",
    ):
        assert must in names


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (so every bit pattern, NaNs included, gets exercised)."""
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return torch.empty(shape, dtype=dtype)  # owns its (empty) storage, like a real checkpoint tensor
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous CPU tensor (works for every dtype, 0-d and empty included)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def _storage_bytes(t: torch.Tensor) -> bytes:
    s = t.untyped_storage()
    return ctypes.string_at(s.data_ptr(), s.nbytes()) if s.nbytes() else b""


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _records(blob: bytes) -> dict[str, bytes]:
    """name -> content of a stored zip, ignoring CRCs (ours are 0, which zipfile rejects on read)."""
    out = {}
    for info in zipfile.ZipFile(io.BytesIO(blob)).infolist():
        assert info.compress_type == zipfile.ZIP_STORED
        nlen, xlen = struct.unpack_from("<HH", blob, info.header_offset + 26)
        start = info.header_offset + 30 + nlen + xlen
        out[info.filename] = blob[start : start + info.file_size]
    return out


def _assemble(layout, t: torch.Tensor) -> bytes:
    return layout.head + _tensor_bytes(t.cpu()) + layout.tail


def _load(blob: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _tensor_bytes(a.contiguous()) == _tensor_bytes(b.contiguous())


def _view_from_info(blob: bytes, info) -> torch.Tensor:
    """Rebuild the tensor a TensorBlobInfo describes from the blob bytes (as a reader would)."""
    raw = bytearray(blob[info.data_offset : info.data_offset + info.storage_nbytes])
    assert len(raw) == info.storage_nbytes
    if not raw:
        storage = torch.empty(0, dtype=info.dtype)
    else:
        storage = torch.frombuffer(raw, dtype=torch.uint8)
        storage = storage[: len(raw) // info.itemsize * info.itemsize].view(info.dtype)
    return torch.as_strided(storage, info.size, info.stride, info.storage_offset)


class _Reads:
    """A read_more callback over a full blob that records what it was asked for."""

    def __init__(self, blob: bytes):
        self.blob = blob
        self.calls: list[tuple[int, int]] = []

    def __call__(self, off: int, n: int) -> bytes:
        self.calls.append((off, n))
        return self.blob[off : off + n]


def _parse_full(blob: bytes, where: str = "mem"):
    def no_reads(off, n):
        raise AssertionError("read_more called although the windows cover the blob")

    return BP.parse_tensor_blob(blob, blob, len(blob), no_reads, where)


def _parse_windows(blob: bytes, head_n: int, tail_n: int, where: str = "mem"):
    reads = _Reads(blob)
    head = blob[: min(head_n, len(blob))]
    tail = blob[len(blob) - min(tail_n, len(blob)) :]
    return BP.parse_tensor_blob(head, tail, len(blob), reads, where), reads


# ---------------------------------------------------------------------------------------------
# writing: byte-identical data.pkl, small records, round trips through torch.load
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SAVEABLE, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_data_pkl_identical_to_torch_save(dtype, shape):
    t = _random_tensor(dtype, shape)
    ref = zipfile.ZipFile(io.BytesIO(_torch_save(t))).read("archive/data.pkl")
    layout = B.tensor_blob_layout(t, 0)
    assert _records(_assemble(layout, t))["archive/data.pkl"] == ref
    # Same from a meta tensor: nothing depends on the data or the device.
    meta = torch.empty(shape, dtype=dtype, device="meta")
    assert _records(_assemble(B.tensor_blob_layout(meta, 64), t))["archive/data.pkl"] == ref


def test_data_pkl_keeps_torch_strides_of_contiguous_tensors():
    # Contiguous, but with a non-canonical stride on a size-1 dim: torch.save records it as is.
    for t in (torch.randn(3, 1).t(), torch.empty(0, 3).t(), torch.randn(1, 1, 4)[:, :, :].transpose(0, 1)):
        assert t.is_contiguous()
        ref = zipfile.ZipFile(io.BytesIO(_torch_save(t))).read("archive/data.pkl")
        layout = B.tensor_blob_layout(t, 0)
        blob = _assemble(layout, t)
        assert _records(blob)["archive/data.pkl"] == ref
        assert _same_bits(_load(blob), t)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_data_pkl_of_cuda_tensor_says_cpu():
    t = torch.randn(4, 5, device="cuda").to(torch.bfloat16)
    ref = zipfile.ZipFile(io.BytesIO(_torch_save(t.cpu()))).read("archive/data.pkl")
    layout = B.tensor_blob_layout(t, 0)
    assert _records(_assemble(layout, t))["archive/data.pkl"] == ref
    assert _same_bits(_load(_assemble(layout, t)), t.cpu())


def test_records_match_torch_save():
    t = torch.randn(3, 4)
    theirs = _records(_torch_save(t))
    ours = _records(_assemble(B.tensor_blob_layout(t, 0), t))
    assert list(ours) == list(theirs)  # same names, same order
    for name in ("archive/.format_version", "archive/.storage_alignment", "archive/byteorder", "archive/version"):
        assert ours[name] == theirs[name], name
    assert ours["archive/data/0"] == theirs["archive/data/0"] == _tensor_bytes(t)
    sid = ours["archive/.data/serialization_id"]
    assert len(sid) == 40 and sid.isdigit()
    assert len(theirs["archive/.data/serialization_id"]) == 40


def test_serialization_id():
    t = torch.randn(2)
    sid = "1234567890" * 4
    blob = _assemble(B.tensor_blob_layout(t, 0, serialization_id=sid), t)
    assert _records(blob)["archive/.data/serialization_id"] == sid.encode()
    a = _records(_assemble(B.tensor_blob_layout(t, 0), t))["archive/.data/serialization_id"]
    b = _records(_assemble(B.tensor_blob_layout(t, 0), t))["archive/.data/serialization_id"]
    assert a != b  # random per blob, even through the template cache
    for bad in ("123", "x" * 40, "1" * 41, "١" * 40):
        with pytest.raises(ValueError):
            B.tensor_blob_layout(t, 0, serialization_id=bad)


@pytest.mark.parametrize("dtype", SAVEABLE, ids=str)
def test_round_trip_torch_load(dtype):
    for shape in SHAPES:
        t = _random_tensor(dtype, shape, seed=len(shape))
        for off in OFFSETS:
            layout = B.tensor_blob_layout(t, off)
            assert layout.blob_offset == off
            assert (off + layout.data_offset) % B.DATA_ALIGN == 0
            assert layout.data_file_offset == off + layout.data_offset
            assert len(layout.head) == layout.data_offset
            assert layout.data_nbytes == t.numel() * t.element_size()
            blob = _assemble(layout, t)
            assert len(blob) == layout.length
            # The blob inside a file at `off`: the tensor bytes sit at the aligned file offset.
            f = b"\xee" * off + blob + b"\xee" * 100
            n = layout.data_nbytes
            assert f[layout.data_file_offset : layout.data_file_offset + n] == _tensor_bytes(t)
            loaded = _load(f[off : off + layout.length])
            assert _same_bits(loaded, t), (dtype, shape, off)


@pytest.mark.parametrize("dtype", SAVEABLE, ids=str)
def test_force_zip64_loads(dtype):
    t = _random_tensor(dtype, (3, 5), seed=7)
    for off in (0, 4096 + 64):
        layout = B.tensor_blob_layout(t, off, force_zip64=True)
        assert (off + layout.data_offset) % B.DATA_ALIGN == 0
        blob = _assemble(layout, t)
        assert b"PK\x06\x06" in layout.tail and b"PK\x06\x07" in layout.tail
        assert _same_bits(_load(blob), t)
        assert [i.file_size for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()][4] == layout.data_nbytes
        info = _parse_full(blob)
        assert info.data_offset == layout.data_offset and info.storage_nbytes == layout.data_nbytes


@pytest.mark.parametrize("align", [64, 128, 512, 4096, 8192, B.MAX_DATA_ALIGN])
def test_data_align(align):
    t = torch.randn(33)
    for off in (0, 64, 192, 4096 * 5 + 64 * 7):
        layout = B.tensor_blob_layout(t, off, data_align=align)
        assert (off + layout.data_offset) % align == 0
        assert _same_bits(_load(_assemble(layout, t)), t)


def test_layout_preconditions():
    t = torch.randn(4, 4)
    for off in (1, 32, 100, -64):
        with pytest.raises(ValueError, match="file_offset"):
            B.tensor_blob_layout(t, off)
    for align in (0, 32, 100, 65536, 2 * B.MAX_DATA_ALIGN):
        with pytest.raises(ValueError, match="data_align"):
            B.tensor_blob_layout(t, 0, data_align=align)
    with pytest.raises(ValueError, match="contiguous"):
        B.tensor_blob_layout(t.t(), 0)
    with pytest.raises(ValueError, match="conj"):
        B.tensor_blob_layout(torch.randn(3, dtype=torch.complex64).conj(), 0)
    with pytest.raises(ValueError):
        B.tensor_blob_layout(torch.randn(3, 3).to_sparse(), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError):
        B.tensor_blob_layout(q, 0)


@pytest.mark.parametrize("dtype", UNSAVEABLE, ids=str)
def test_layout_rejects_dtypes_torch_cannot_save(dtype):
    try:
        t = torch.empty(2, dtype=dtype, device="meta")
    except Exception:
        pytest.skip(f"cannot even create {dtype}")
    with pytest.raises(ValueError):
        B.tensor_blob_layout(t, 0)


def test_huge_tensor_zip64_sparse_file(tmp_path):
    """> 4 GiB data: real zip64 records, checked on a sparse file (no data is written)."""
    t = torch.empty(2621440, 1024, dtype=torch.bfloat16, device="meta")  # 5 GiB
    layout = B.tensor_blob_layout(t, 128)
    assert layout.data_nbytes == 5 << 30
    assert (128 + layout.data_offset) % B.DATA_ALIGN == 0
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(layout.head)
        f.seek(layout.data_offset + layout.data_nbytes)
        f.write(layout.tail)
    assert os.path.getsize(path) == layout.length
    infos = zipfile.ZipFile(path).infolist()
    assert infos[4].filename == "archive/data/0" and infos[4].file_size == layout.data_nbytes
    assert infos[5].header_offset == layout.data_offset + layout.data_nbytes  # zip64 local header offset
    # torch's own reader (miniz) on the zip64 records, without reading the 5 GiB:
    x = torch.load(path, map_location="meta", weights_only=True)
    assert x.shape == t.shape and x.dtype == t.dtype
    with open(path, "rb") as f:

        def read_more(off, n):
            f.seek(off)
            return f.read(n)

        info = BP.parse_tensor_blob(layout.head, layout.tail, layout.length, read_more, str(path))
    assert (info.data_offset, info.storage_nbytes, info.size, info.stride) == (
        layout.data_offset,
        layout.data_nbytes,
        tuple(t.shape),
        (1024, 1),
    )


def test_parse_stock_zip64_sparse_file(tmp_path):
    """A > 4 GiB blob written by torch.save itself (skip_data: headers only, sparse file)."""
    from torch.serialization import skip_data

    try:
        # Never touched: skip_data writes the records' headers but not their bytes, so the
        # pages of this 5 GiB allocation are never committed.
        t = torch.empty(2621440, 1024, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("cannot reserve 5 GiB of address space")
    path = tmp_path / "stockbig.pt"
    with skip_data(materialize_fake_tensors=True):
        torch.save(t, path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4096)
        f.seek(size - 4096)
        tail = f.read()

        def read_more(off, n):
            f.seek(off)
            return f.read(n)

        info = BP.parse_tensor_blob(head, tail, size, read_more, str(path))
    assert info.storage_nbytes == 5 << 30
    assert info.size == (2621440, 1024) and info.stride == (1024, 1) and info.dtype == torch.bfloat16
    assert info.data_offset == 704  # archive name "stockbig/" from the file name


# ---------------------------------------------------------------------------------------------
# parsing stock and our blobs
# ---------------------------------------------------------------------------------------------


def _check_info(blob: bytes, info, expected: torch.Tensor) -> None:
    assert info.dtype == expected.dtype
    assert info.size == tuple(expected.shape)
    assert info.stride == tuple(expected.stride())
    assert info.storage_offset == expected.storage_offset()
    assert info.storage_nbytes == expected.untyped_storage().nbytes()
    assert blob[info.data_offset : info.data_offset + info.storage_nbytes] == _storage_bytes(expected)
    assert _same_bits(_view_from_info(blob, info), expected)


@pytest.mark.parametrize("dtype", SAVEABLE, ids=str)
def test_parse_stock_contiguous(dtype):
    for shape in SHAPES:
        t = _random_tensor(dtype, shape, seed=3)
        blob = _torch_save(t)
        info = _parse_full(blob)
        _check_info(blob, info, t)
        assert info.is_contiguous and info.nbytes == t.numel() * t.element_size()
        # Small windows: everything else must come through read_more.
        info2, reads = _parse_windows(blob, 64, 30)
        assert info2 == info and reads.calls


@pytest.mark.parametrize("dtype", SAVEABLE, ids=str)
def test_parse_our_blobs(dtype):
    t = _random_tensor(dtype, (4, 6), seed=11)
    for off in OFFSETS:
        for z64 in (False, True):
            layout = B.tensor_blob_layout(t, off, force_zip64=z64)
            blob = _assemble(layout, t)
            # The windows a writer has anyway: head and tail, nothing in between.
            reads = _Reads(blob)
            info = BP.parse_tensor_blob(layout.head, layout.tail, layout.length, reads, "ours")
            assert reads.calls == []
            assert info.data_offset == layout.data_offset
            assert info.storage_nbytes == layout.data_nbytes
            _check_info(blob, info, t)
            info2, reads = _parse_windows(blob, 10, 10)
            assert info2 == info and reads.calls


def test_parse_non_contiguous_and_offset_views():
    x = torch.randn(5, 7)
    cases = {
        "transpose": x.t(),  # strides kept by torch.save
        "slice_rows": x[2:],  # whole storage + storage offset
        "slice_cols": x[:, 3:5],
        "expand": torch.randn(3, 1).expand(3, 4),  # stride 0
        "step": torch.arange(20.0)[1::3],
        "scalar_view": x[2, 3],
    }
    for name, v in cases.items():
        blob = _torch_save(v)
        info = _parse_full(blob, name)
        _check_info(blob, info, v)
        assert info.first_byte_offset == info.data_offset + v.storage_offset() * 4
        info2, _ = _parse_windows(blob, 100, 100, name)
        assert info2 == info
    assert not _parse_full(_torch_save(x.t())).is_contiguous
    assert _parse_full(_torch_save(x[2:])).storage_offset == 14


def test_parse_v3_dtype_with_offset():
    x = _random_tensor(torch.float8_e4m3fn, (6, 8), seed=5)
    v = x[1:, 2:].t()
    blob = _torch_save(v)
    _check_info(blob, _parse_full(blob), v)


def test_parse_parameter_and_file_saved(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 4))
    blob = _torch_save(p)
    _check_info(blob, _parse_full(blob), p.detach())
    path = tmp_path / "weights_file.pt"
    torch.save(torch.arange(10, dtype=torch.int16), path)  # archive folder "weights_file/"
    blob = path.read_bytes()
    _check_info(blob, _parse_full(blob, str(path)), torch.arange(10, dtype=torch.int16))


def test_parse_windows_any_split():
    t = torch.randn(50)
    for blob in (_torch_save(t), _assemble(B.tensor_blob_layout(t, 64), t)):
        ref = _parse_full(blob)
        n = len(blob)
        for head_n, tail_n in [(0, 0), (0, n), (n, 0), (n // 2, n // 2 + 1), (n // 3, n // 3), (1, 22), (n, n)]:
            info, reads = _parse_windows(blob, head_n, tail_n)
            assert info == ref
            if head_n + tail_n >= n:
                assert reads.calls == []
            for off, k in reads.calls:
                assert 0 <= off and off + k <= n


# ---------------------------------------------------------------------------------------------
# hostile input: BlobFormatError, never another exception, nothing executed, no hang
# ---------------------------------------------------------------------------------------------


def _zip(records: list[tuple[str, bytes]], method: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as z:
        for name, data in records:
            z.writestr(name, data)
    return buf.getvalue()


def _blob_with_pkl(pkl: bytes, storage: bytes = b"\0" * 16) -> bytes:
    return _zip([("archive/data.pkl", pkl), ("archive/data/0", storage), ("archive/version", b"3\n")])


def _expect_error(blob: bytes, *, blob_length: int | None = None, match: str | None = None) -> BaseException:
    n = len(blob) if blob_length is None else blob_length
    with pytest.raises(B.BlobFormatError, match=match) as ei:
        BP.parse_tensor_blob(blob, blob, n, lambda o, k: blob[o : o + k], "/ckpt/__0_0.distcp")
    assert "/ckpt/__0_0.distcp" in str(ei.value)
    return ei.value


def _stub_pickle(reduce_value) -> bytes:
    buf = io.BytesIO()
    B._StubPickler(buf, protocol=2).dump(B._TensorStub(reduce_value))
    return buf.getvalue()


def _tensor_pickle(size, stride, storage_offset=0, numel=4, storage_cls=None, extra=()) -> bytes:
    storage = B._StorageStub(("storage", storage_cls or torch.FloatStorage, "0", "cpu", numel))
    args = (storage, storage_offset, size, stride, False, OrderedDict(), *extra)
    return _stub_pickle((torch._utils._rebuild_tensor_v2, args))


def test_crafted_pickle_sanity():
    # The crafting helper itself produces a parseable blob when the numbers are right.
    info = _parse_full(_blob_with_pkl(_tensor_pickle((2, 2), (2, 1))))
    assert info.size == (2, 2) and info.dtype == torch.float32 and info.storage_nbytes == 16


class _Evil:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval", "builtins.exec", "nested_in_hooks", "getattr"])
def test_malicious_pickle_never_runs(tmp_path, kind):
    marker = tmp_path / "pwned"
    cmd = f"open({str(marker)!r}, 'w').write('x')"
    if kind == "os.system":
        evil = _Evil(os.system, f"touch {marker}")
    elif kind == "builtins.eval":
        evil = _Evil(eval, cmd)
    elif kind == "builtins.exec":
        evil = _Evil(exec, cmd)
    elif kind == "getattr":
        evil = _Evil(getattr, "x")
    else:
        # A tensor-shaped pickle whose hooks dict holds the payload.
        storage = B._StorageStub(("storage", torch.FloatStorage, "0", "cpu", 4))
        hooks = OrderedDict(a=_Evil(eval, cmd))
        evil = B._TensorStub((torch._utils._rebuild_tensor_v2, (storage, 0, (4,), (1,), False, hooks)))
    buf = io.BytesIO()
    B._StubPickler(buf, protocol=2).dump(evil)
    err = _expect_error(_blob_with_pkl(buf.getvalue()), match="disallowed global")
    assert not marker.exists()
    assert "system" in str(err) or "eval" in str(err) or "exec" in str(err) or "getattr" in str(err)


def test_build_cannot_tamper_with_stand_ins():
    # GLOBAL _rebuild_tensor_v2; (None, {'__name__': 'x'}); BUILD -> setattr on the stand-in.
    pkl = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x08\x00\x00\x00__name__X\x01\x00\x00\x00xs\x86b."
    _expect_error(_blob_with_pkl(pkl))
    for pkl in (
        b"\x80\x02ccollections\nOrderedDict\n}X\x01\x00\x00\x00ak\x01sb.",  # BUILD on the class
        b"\x80\x02ctorch\nFloatStorage\nN}X\x01\x00\x00\x00aK\x01s\x86b.",  # slot-state on a stand-in
    ):
        _expect_error(_blob_with_pkl(pkl))
        # Second layer, below the opcode filter: the unpickler's stand-ins refuse setattr.
        with pytest.raises((AttributeError, TypeError, pickle.UnpicklingError)):
            BP._unpickler(pkl)[0].load()
    t = torch.randn(3)
    _check_info(_torch_save(t), _parse_full(_torch_save(t)), t)  # still works afterwards


@pytest.mark.parametrize(
    "pkl",
    [
        b"\x80\x02Nr\xff\xff\xff\x7f.",  # LONG_BINPUT: the memo table would be sized to 2**31 entries
        b"\x80\x02Nj\xff\xff\xff\x7f.",  # LONG_BINGET far out
        b"\x80\x03B\xff\xff\xff\x7f",  # BINBYTES: the unpickler preallocates 2 GiB
        b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\x7f",  # BINBYTES8
        b"\x80\x02X\xff\xff\xff\x7fabc.",  # BINUNICODE longer than the pickle
        b"\x80\x02I99999999999999999999999999999\n.",  # text INT
        b"\x80\x02\x82\x01.",  # EXT1
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n)\x81.",  # NEWOBJ
        b"\x80\x02N.junk",  # trailing bytes
        b"\x80\x02N",  # no STOP
        b"\x80\x02c" + b"a" * 1000 + b"\nb\n.",  # absurd GLOBAL line
    ],
)
def test_pickle_bombs_refused_fast(pkl):
    t0 = time.perf_counter()
    _expect_error(_blob_with_pkl(pkl))
    assert time.perf_counter() - t0 < 1.0


def test_parse_protocol_4_pickle():
    t = torch.randn(3, 4)
    buf = io.BytesIO()
    torch.save(t, buf, pickle_protocol=4)
    blob = buf.getvalue()
    _check_info(blob, _parse_full(blob), t)


def test_pickle_not_a_single_tensor():
    x, y = torch.randn(2), torch.randn(2)
    _expect_error(_blob_with_pkl(pickle.dumps({"a": 1}, protocol=2)), match="single tensor")
    _expect_error(_blob_with_pkl(pickle.dumps(3, protocol=2)), match="single tensor")
    _expect_error(_torch_save((x, y)))  # a tuple: not a single tensor
    _expect_error(_torch_save([x]))
    _expect_error(_torch_save({"w": x}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    _expect_error(_torch_save(q), match="disallowed global")
    _expect_error(_blob_with_pkl(b"garbage that is not a pickle"))
    _expect_error(_blob_with_pkl(b""))
    _expect_error(_blob_with_pkl(b"\x80\x02" + b"(" * 100000 + b"."))


def test_pickle_with_two_storages():
    s0 = B._StorageStub(("storage", torch.FloatStorage, "0", "cpu", 4))
    s1 = B._StorageStub(("storage", torch.FloatStorage, "1", "cpu", 4))
    hooks = OrderedDict(other=s1)  # smuggle a second storage in
    pkl = _stub_pickle((torch._utils._rebuild_tensor_v2, (s0, 0, (4,), (1,), False, hooks)))
    _expect_error(_blob_with_pkl(pkl))


@pytest.mark.parametrize(
    "size,stride,offset,numel,match",
    [
        ((1000,), (1,), 0, 4, "needs"),  # storage too small
        ((2, 2), (3, 1), 0, 4, "needs"),
        ((4,), (1,), 1, 4, "needs"),  # offset pushes past the end
        ((10**15, 10**15), (10**15, 1), 0, 4, "needs"),  # absurd sizes
        ((-1,), (1,), 0, 4, "negative"),
        ((4,), (-1,), 0, 4, "negative"),
        ((4,), (1,), -1, 4, "negative"),
        ((4, 1), (1,), 0, 4, "do not match"),
        ((4,), (1,), 0, 10**12, "bytes"),  # pid size disagrees with the record
        ((4,), (1,), 0, -4, "size"),
    ],
)
def test_absurd_geometry(size, stride, offset, numel, match):
    _expect_error(_blob_with_pkl(_tensor_pickle(size, stride, offset, numel)), match=match)


def test_bad_argument_types():
    for pkl in (
        _tensor_pickle([4], (1,)),  # list size
        _tensor_pickle((4.0,), (1,)),
        _tensor_pickle((True,), (1,)),
        _tensor_pickle((4,), (1,), extra=({"conj": True},)),  # conj metadata
        _tensor_pickle((4,), (1,), extra=(1, 2)),
        _tensor_pickle((4,), (1,), storage_cls=torch.UntypedStorage),  # v2 needs a typed storage
        _stub_pickle((torch._utils._rebuild_tensor_v3, ("nope", 0, (4,), (1,), False, OrderedDict(), torch.float32))),
    ):
        _expect_error(_blob_with_pkl(pkl))


def test_missing_or_compressed_records():
    pkl = _tensor_pickle((4,), (1,))
    _expect_error(_zip([("archive/data.pkl", pkl), ("archive/version", b"3\n")]), match="missing")
    _expect_error(_zip([("archive/data/0", b"\0" * 16), ("archive/version", b"3\n")]), match="data.pkl")
    _expect_error(_zip([("data.pkl", pkl), ("data/0", b"\0" * 16)]), match="folder")
    _expect_error(_blob_with_pkl(pkl).replace(b"archive/data/0", b"archive/data/1", 1))  # local name mismatch
    deflated = _zip([("archive/data.pkl", pkl), ("archive/data/0", b"\0" * 16)], method=zipfile.ZIP_DEFLATED)
    _expect_error(deflated, match="compressed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate, which is the point
        dup = _zip([("archive/data.pkl", pkl), ("archive/data/0", b"\0" * 16), ("archive/data.pkl", b"")])
    _expect_error(dup, match="duplicate")


def _sample_blobs() -> list[bytes]:
    t = torch.randn(6, 5)
    return [
        _torch_save(t),
        _assemble(B.tensor_blob_layout(t, 64), t),
        _assemble(B.tensor_blob_layout(t, 0, force_zip64=True, data_align=64), t),
    ]


def test_truncated_blobs():
    for blob in _sample_blobs():
        n = len(blob)
        for cut in list(range(0, n, 13)) + [n - 1, n - 21, n - 22, n - 23]:
            cut_blob = blob[:cut]
            with pytest.raises(B.BlobFormatError):
                BP.parse_tensor_blob(cut_blob, cut_blob, len(cut_blob), lambda o, k: cut_blob[o : o + k], "cut")
        # The caller believes the blob is longer than it is: read_more comes back short.
        with pytest.raises(B.BlobFormatError):
            BP.parse_tensor_blob(blob[:10], b"", n, lambda o, k: blob[o : o + k][: max(0, k - 1)], "short")
        # Windows larger than the blob are a caller bug, reported the same way.
        with pytest.raises(B.BlobFormatError):
            BP.parse_tensor_blob(blob, b"", n - 1, lambda o, k: b"", "bad")
        # Leading bytes missing: all offsets are off.
        for skip in (1, 30, 64):
            b2 = blob[skip:]
            with pytest.raises(B.BlobFormatError):
                BP.parse_tensor_blob(b2, b2, len(b2), lambda o, k: b2[o : o + k], "skip")


@pytest.mark.parametrize("sig", [b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"])
def test_flipped_signatures(sig):
    flipped_any = False
    for i, blob in enumerate(_sample_blobs()):
        info = _parse_full(blob)
        if sig == b"PK\x06\x07" and i == 0:
            # torch.save always writes zip64 end records but also valid 32-bit EOCD values, so
            # without the locator the archive still reads (as it does in miniz): not an error.
            continue
        pos = -1
        while True:
            pos = blob.find(sig, pos + 1)
            if pos < 0:
                break
            if sig == b"PK\x03\x04":
                # Only the local headers the parser reads: data.pkl (at 0) and the storage's.
                nlen = struct.unpack_from("<H", blob, pos + 26)[0]
                name = blob[pos + 30 : pos + 30 + nlen]
                if not (name.endswith(b"/data.pkl") or name.endswith(b"/data/0")):
                    continue
            bad = bytearray(blob)
            bad[pos + 2] ^= 0xFF
            _expect_error(bytes(bad))
            flipped_any = True
        assert info.storage_nbytes == 120
    assert flipped_any


def _patch(blob: bytes, off: int, fmt: str, value: int) -> bytes:
    b = bytearray(blob)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def test_absurd_zip_numbers():
    blob = _sample_blobs()[1]  # ours, no zip64
    eocd = len(blob) - 22
    cd_size_off, cd_off_off, n_off = eocd + 12, eocd + 16, eocd + 10
    (cd_off,) = struct.unpack_from("<I", blob, cd_off_off)
    for bad in (
        _patch(blob, cd_size_off, "<I", 0xFFFFFFF0),
        _patch(blob, cd_size_off, "<I", 10),
        _patch(blob, cd_off_off, "<I", 0xFFFFFFF0),
        _patch(blob, cd_off_off, "<I", len(blob)),
        _patch(blob, n_off, "<H", 0xFFFF),
        _patch(blob, n_off, "<H", 0),
        _patch(blob, eocd + 8, "<H", 3),  # entries on this disk != total
        _patch(blob, eocd + 20, "<H", 5),  # comment length past the end
        _patch(blob, cd_off + 42, "<I", 0xFFFFFFF0),  # data.pkl local header offset
        _patch(blob, cd_off + 42, "<I", 0xFFFFFFFF),  # zip64 sentinel without zip64 extra
        _patch(blob, cd_off + 20, "<I", 0xFFFFFFF0),  # data.pkl compressed size
        _patch(blob, cd_off + 24, "<I", 0x7FFFFFF0),  # data.pkl uncompressed size
        _patch(blob, cd_off + 28, "<H", 0xFFFF),  # name length
        _patch(blob, cd_off + 30, "<H", 0xFFFF),  # extra length
    ):
        _expect_error(bad)
    z64 = _sample_blobs()[2]
    loc = len(z64) - 22 - 20
    (z64_eocd,) = struct.unpack_from("<Q", z64, loc + 8)
    for bad in (
        _patch(z64, loc + 8, "<Q", 2**63),
        _patch(z64, loc + 8, "<Q", 0),
        _patch(z64, loc + 16, "<I", 7),  # disks
        _patch(z64, z64_eocd + 40, "<Q", 2**62),  # cd size
        _patch(z64, z64_eocd + 48, "<Q", 2**62),  # cd offset
        _patch(z64, z64_eocd + 32, "<Q", 2**40),  # total entries
    ):
        _expect_error(bad)


def test_random_corruption_fuzz():
    """Random byte flips: either a consistent result or BlobFormatError, nothing else."""
    rng = random.Random(1234)
    deadline = time.monotonic() + 5
    for blob in _sample_blobs():
        for _ in range(400):
            if time.monotonic() > deadline:
                break
            bad = bytearray(blob)
            for _ in range(rng.choice((1, 2, 4))):
                pos = rng.randrange(len(bad))
                # favour the metadata-dense regions (start and end)
                if rng.random() < 0.6:
                    pos = rng.choice((rng.randrange(min(300, len(bad))), len(bad) - 1 - rng.randrange(400)))
                bad[pos] = rng.randrange(256)
            bad = bytes(bad)
            try:
                info = BP.parse_tensor_blob(bad, bad, len(bad), lambda o, k: bad[o : o + k], "fuzz")
            except B.BlobFormatError:
                continue
            assert 0 <= info.data_offset and info.data_offset + info.storage_nbytes <= len(bad)
            if info.numel:
                assert info.first_byte_offset + info.itemsize <= info.data_offset + info.storage_nbytes


# ---------------------------------------------------------------------------------------------
# speed (generous bounds: catches pathologies, not noise)
# ---------------------------------------------------------------------------------------------


def test_layout_and_parse_are_fast():
    metas = [torch.empty(i % 50 + 1, 128, device="meta") for i in range(200)]
    t0 = time.perf_counter()
    for rep in range(10):
        for i, m in enumerate(metas):
            B.tensor_blob_layout(m, 64 * (i + rep))
    per_layout = (time.perf_counter() - t0) / 2000
    blob = _torch_save(torch.randn(64, 64))
    t0 = time.perf_counter()
    for _ in range(2000):
        _parse_full(blob)
    per_parse = (time.perf_counter() - t0) / 2000
    assert per_layout < 500e-6, per_layout
    assert per_parse < 500e-6, per_parse
