"""Shared helpers for the stock <-> fast DCP compatibility tests.

Everything here is plain Python/torch so that it can be imported both by pytest
test modules and by worker processes spawned with ``torch.multiprocessing``.

Naming: a test case is a pair ``(writer_kind, reader_kind)`` with each kind in
``{"stock", "fast"}``.  Pair ids are ``"<writer>-<reader>"``: ``stock-stock`` is
the control (stock DCP on both sides, proves the test itself is right),
``fast-stock`` means "written by fastdcp, read by stock DCP", and so on.

``make_writer("fast", ...)`` imports :mod:`fastdcp` lazily; when the import fails
the test *fails* (it is never skipped).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import logging
import math
import random
import os
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

KINDS = ("stock", "fast")
PAIRS = [(w, r) for w in KINDS for r in KINDS]


def pair_id(writer_kind: str, reader_kind: str) -> str:
    return f"{writer_kind}-{reader_kind}"


PAIR_IDS = [pair_id(w, r) for w, r in PAIRS]

# Keyword arguments only the fast classes accept.
FAST_WRITER_ONLY_KW = ("direct_io", "io_threads", "task_bytes")
FAST_READER_ONLY_KW = ("direct_io", "io_threads", "task_bytes", "read_buffer_limit_bytes")


# --------------------------------------------------------------------------- #
# writer / reader factories
# --------------------------------------------------------------------------- #
def _import_fastdcp():
    # Deliberately no try/except: a broken fastdcp must make fast cases FAIL.
    import fastdcp  # noqa: PLC0415

    return fastdcp


def make_writer(kind: str, path, *, fast_options: Mapping[str, Any] | None = None, **kw):
    """Build a storage writer of ``kind`` ("stock" or "fast").

    ``kw`` go to both classes (the stock constructor signature);
    ``fast_options`` (direct_io, io_threads, task_bytes) only to the fast one.
    """
    if kind == "stock":
        return FileSystemWriter(path, **kw)
    if kind == "fast":
        fastdcp = _import_fastdcp()
        return fastdcp.FastFileSystemWriter(path, **kw, **dict(fast_options or {}))
    raise ValueError(f"unknown writer kind {kind!r}")


def make_reader(kind: str, path, *, fast_options: Mapping[str, Any] | None = None, **kw):
    """Build a storage reader of ``kind`` ("stock" or "fast").

    ``kw`` go to both classes (e.g. ``_extension_registry``); ``fast_options``
    (direct_io, io_threads, task_bytes, read_buffer_limit_bytes) only to the fast one.
    """
    if kind == "stock":
        return FileSystemReader(path, **kw)
    if kind == "fast":
        fastdcp = _import_fastdcp()
        return fastdcp.FastFileSystemReader(path, **kw, **dict(fast_options or {}))
    raise ValueError(f"unknown reader kind {kind!r}")


def _has_param(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def save(state_dict, writer, *, planner=None, no_dist: bool = True, **kw):
    """``dcp.save`` in a single process (``no_dist=True``) unless told otherwise."""
    if no_dist and _has_param(dcp.save, "no_dist"):
        kw["no_dist"] = True
    return dcp.save(state_dict, storage_writer=writer, planner=planner, **kw)


def load(state_dict, reader, *, planner=None, no_dist: bool = True, **kw):
    if no_dist and _has_param(dcp.load, "no_dist"):
        kw["no_dist"] = True
    return dcp.load(state_dict, storage_reader=reader, planner=planner, **kw)


# --------------------------------------------------------------------------- #
# dtypes
# --------------------------------------------------------------------------- #
def all_torch_dtypes() -> list[torch.dtype]:
    """Every ``torch.dtype`` exposed on the torch module (aliases removed)."""
    seen: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            seen[str(value)] = value
    return [seen[k] for k in sorted(seen)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Dtypes stock DCP (torch 2.13) cannot save, with the reason.  For these the
# rule is: the writer may raise (as stock does); if it does not, the result must
# load bit-exactly with the reader.  Every other dtype must round-trip.
STOCK_UNSUPPORTED_DTYPES: dict[str, str] = {}
for _n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"):
    STOCK_UNSUPPORTED_DTYPES[_n] = (
        "stock writer: torch._utils._element_size -> torch.iinfo() raises TypeError"
    )
for _n in [f"int{i}" for i in range(1, 8)] + [f"uint{i}" for i in range(1, 8)]:
    STOCK_UNSUPPORTED_DTYPES[_n] = (
        "sub-byte shell dtype: stock writer's _element_size raises TypeError"
    )
for _n in ("quint4x2", "quint2x4"):
    STOCK_UNSUPPORTED_DTYPES[_n] = (
        "stock writer clones the tensor: copy_kernel not implemented for it"
    )



def _cannot_copy(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            torch.empty(4, dtype=dtype).clone()
    except (NotImplementedError, RuntimeError, TypeError):
        return True
    return False


# Dtypes this torch cannot copy (torch 2.9: float4_e2m1fn_x2, "copy_kernel not implemented"), beyond
# the ones above: stock's reader copies every loaded tensor into its destination, so a stock load
# of one fails on this release (fastdcp's reader places the bytes without a copy kernel).
UNCOPYABLE_DTYPES: frozenset[str] = frozenset(
    dtype_name(d) for d in all_torch_dtypes()
    if dtype_name(d) not in STOCK_UNSUPPORTED_DTYPES and not dtype_name(d).startswith(("qint", "quint"))
    and _cannot_copy(d)
)

_QPARAMS = {  # dtype name -> (scale, zero_point)
    "qint8": (0.05, 3),
    "quint8": (0.05, 17),
    "qint32": (0.001, 0),
    "quint4x2": (0.3, 2),
    "quint2x4": (0.5, 1),
}


def _seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def random_tensor(dtype: torch.dtype, shape, seed) -> torch.Tensor:
    """A contiguous tensor of ``dtype``/``shape`` filled with random *bit patterns*.

    Floating types get arbitrary bytes (NaNs/infs/denormals included);
    ``bool`` gets 0/1 only (other byte values are not valid bools and copy_
    normalises them); quantized types are quantized from random normals.
    """
    shape = tuple(shape)
    g = torch.Generator().manual_seed(_seed_of(seed, str(dtype), shape))
    numel = math.prod(shape)
    name = dtype_name(dtype)
    if name in _QPARAMS:
        scale, zp = _QPARAMS[name]
        base = torch.randn(shape, generator=g)
        return torch.quantize_per_tensor(base, scale, zp, dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def random_float(shape, seed, dtype=torch.float32) -> torch.Tensor:
    """Random normal values (no NaNs) -- for tests that convert dtypes."""
    g = torch.Generator().manual_seed(_seed_of(seed, "normal", tuple(shape)))
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * 3).to(dtype)


# --------------------------------------------------------------------------- #
# bit-exact comparison
# --------------------------------------------------------------------------- #
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor whose equality means bitwise equality of ``t``'s elements."""
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    int_dtype = _SAME_SIZE_INT.get(t.element_size())
    if int_dtype is not None:
        # A same-itemsize view works for any strides and for 0-d tensors.
        return t.view(int_dtype)
    # e.g. complex128 (16 bytes): go through a contiguous byte view.
    c = t.contiguous()
    return c.reshape(-1).view(torch.uint8).reshape(*t.shape, t.element_size())


def _first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """a, b: bit views (integer tensors) of actual / expected."""
    diff = (a != b).nonzero()
    n = diff.shape[0]
    if n == 0:
        return "no differing element found"
    idx = tuple(int(i) for i in diff[0])
    bits = a.element_size() * 8

    def hx(v):
        if isinstance(v, list):
            return "[" + " ".join(hx(x) for x in v) + "]"
        return f"0x{v & ((1 << bits) - 1):0{bits // 4}x}"

    return (f"{n} differing element(s) of {a.numel()}; first at index {idx}: "
            f"actual bits {hx(a[idx].tolist())}, expected bits {hx(b[idx].tolist())}")


def assert_tensor_bitexact(
    actual: torch.Tensor,
    expected: torch.Tensor,
    where: str = "tensor",
    *,
    check_stride: bool = True,
    check_type: bool = True,
) -> None:
    assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
    if check_type:
        assert type(actual) is type(expected), (
            f"{where}: type {type(actual).__name__} != {type(expected).__name__}"
        )
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.device == expected.device, f"{where}: device {actual.device} != {expected.device}"
    if check_stride:
        assert actual.stride() == expected.stride(), (
            f"{where}: stride {actual.stride()} != {expected.stride()}"
        )
    if expected.is_quantized:
        assert actual.is_quantized, f"{where}: expected a quantized tensor"
        assert actual.qscheme() == expected.qscheme(), f"{where}: qscheme differs"
        assert actual.q_scale() == expected.q_scale(), f"{where}: q_scale differs"
        assert actual.q_zero_point() == expected.q_zero_point(), f"{where}: q_zero_point differs"
    a, b = bit_view(actual), bit_view(expected)
    if not torch.equal(a, b):
        raise AssertionError(f"{where}: bytes differ ({actual.dtype}, shape {tuple(actual.shape)}): "
                             + _first_mismatch(a, b))


def assert_same(actual: Any, expected: Any, where: str = "state_dict", *, check_stride: bool = True) -> None:
    """Recursive, bit-exact comparison of (nested) state dicts."""
    if isinstance(expected, torch.Tensor):
        assert_tensor_bitexact(actual, expected, where, check_stride=check_stride)
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: expected a mapping, got {type(actual)}"
        ka, ke = set(actual.keys()), set(expected.keys())
        assert ka == ke, f"{where}: keys differ: missing {sorted(map(str, ke - ka))}, extra {sorted(map(str, ka - ke))}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]", check_stride=check_stride)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: type {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{where}: len {len(actual)} != {len(expected)}"
        for i, (x, y) in enumerate(zip(actual, expected)):
            assert_same(x, y, f"{where}[{i}]", check_stride=check_stride)
    elif isinstance(expected, io.BytesIO):
        assert isinstance(actual, io.BytesIO), f"{where}: expected BytesIO, got {type(actual)}"
        assert actual.getvalue() == expected.getvalue(), f"{where}: BytesIO contents differ"
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), f"{where}: {actual!r} != nan"
    else:
        assert type(actual) is type(expected), f"{where}: type {type(actual)} != {type(expected)}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# --------------------------------------------------------------------------- #
# destinations for loads
# --------------------------------------------------------------------------- #
SENTINEL_BYTE = 0xA5


def fill_storage_with_sentinel(t: torch.Tensor) -> torch.Tensor:
    """Overwrite every byte of ``t``'s storage with SENTINEL_BYTE."""
    if t.is_quantized:
        return t
    st = t.untyped_storage()
    if st.nbytes():
        torch.empty(0, dtype=torch.uint8).set_(st).fill_(SENTINEL_BYTE)
    return t


def _is_overlapping(t: torch.Tensor) -> bool:
    return any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape))


def sentinel_like(t: torch.Tensor, *, dtype: torch.dtype | None = None, layout: str = "contiguous") -> torch.Tensor:
    """A fresh destination tensor of ``t``'s shape, filled with a sentinel byte pattern.

    layout: "contiguous", "same" (same strides as ``t``), "transposed" (2-D only:
    a column-major tensor), or "offset" (a view starting 3 elements into its storage).
    """
    dtype = dtype or t.dtype
    shape = tuple(t.shape)
    if t.is_quantized and dtype == t.dtype:
        return torch.quantize_per_tensor(
            torch.zeros(shape), t.q_scale(), t.q_zero_point(), t.dtype
        )
    if layout == "contiguous":
        out = torch.empty(shape, dtype=dtype)
    elif layout == "same" and not _is_overlapping(t):
        out = torch.empty_strided(shape, t.stride(), dtype=dtype)
    elif layout == "same":  # e.g. an expand()ed source: a copy_ target must not overlap
        out = torch.empty(shape, dtype=dtype)
    elif layout == "transposed":
        assert len(shape) == 2
        out = torch.empty((shape[1], shape[0]), dtype=dtype).t()
    elif layout == "offset":
        n = math.prod(shape)
        out = torch.empty(n + 3, dtype=dtype)[3:].view(shape)
    else:
        raise ValueError(layout)
    return fill_storage_with_sentinel(out)


def destination_for(obj: Any, *, layout: str = "contiguous") -> Any:
    """A load destination mirroring ``obj``: tensors become sentinel-filled tensors,
    other leaves become a placeholder string (DCP replaces non-tensor leaves)."""
    if isinstance(obj, torch.Tensor):
        return sentinel_like(obj, layout=layout)
    if isinstance(obj, Mapping):
        return type(obj)((k, destination_for(v, layout=layout)) for k, v in obj.items())
    if isinstance(obj, list):
        return [destination_for(v, layout=layout) for v in obj]
    if isinstance(obj, tuple):
        return tuple(destination_for(v, layout=layout) for v in obj)
    return "<placeholder>"


def tensor_leaves(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(tensor_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensor_leaves(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def load_in_place_and_check(reader, expected: Mapping, dest: Mapping, *, planner=None) -> None:
    """Load into ``dest`` and check (a) every destination tensor was filled *in place*
    (same object, same data_ptr, same strides) and (b) the values equal ``expected``
    bit for bit."""
    before = {k: (id(t), t.data_ptr() if not t.is_quantized else None, t.stride())
              for k, t in tensor_leaves(dest).items()}
    load(dest, reader, planner=planner)
    after = tensor_leaves(dest)
    for k, (ident, ptr, stride) in before.items():
        t = after.get(k)
        assert t is not None, f"{k}: destination tensor disappeared"
        assert id(t) == ident, f"{k}: destination tensor object was replaced (DCP loads in place)"
        if ptr is not None:
            assert t.data_ptr() == ptr, f"{k}: destination storage was replaced (DCP loads in place)"
        assert t.stride() == stride, f"{k}: destination strides changed"
    assert_same(dest, expected, check_stride=False)


# --------------------------------------------------------------------------- #
# state dict builders
# --------------------------------------------------------------------------- #
def zoo_tensors(seed: int = 0, *, large: bool = True) -> dict[str, torch.Tensor]:
    """Shapes and layouts that stress the format: 0-d, empty, non-contiguous,
    storage-offset views, 4-D, uneven 63x47, and a 16 MiB tensor."""
    base = random_tensor(torch.float32, (24, 20), (seed, "base"))
    sd: dict[str, torch.Tensor] = {
        "scalar_f32": random_tensor(torch.float32, (), (seed, "s32")),
        "scalar_i64": random_tensor(torch.int64, (), (seed, "s64")),
        "scalar_bf16": random_tensor(torch.bfloat16, (), (seed, "sbf")),
        "scalar_bool": random_tensor(torch.bool, (), (seed, "sb")),
        "empty_0": torch.empty((0,), dtype=torch.float32),
        "empty_0x5": torch.empty((0, 5), dtype=torch.float16),
        "empty_5x0": torch.empty((5, 0), dtype=torch.int32),
        "transposed": base.t(),  # non-contiguous, stride (1, 20)
        "every_other_col": base[:, ::2],  # non-dense view
        "offset_view": base[3:],  # storage offset 60 elements
        "offset_transposed": base[2:, 1:].t(),
        "expanded": random_tensor(torch.float32, (1, 7), (seed, "exp")).expand(5, 7),
        "four_d": random_tensor(torch.float32, (3, 4, 5, 6), (seed, "4d")),
        "uneven": random_tensor(torch.float32, (63, 47), (seed, "63x47")),
        "uneven_bf16": random_tensor(torch.bfloat16, (63, 47), (seed, "63x47bf")),
        "int64_vec": random_tensor(torch.int64, (1001,), (seed, "i64")),
        "odd_bytes": random_tensor(torch.uint8, (13, 7), (seed, "u8")),
    }
    if large:
        # 16 MiB + a few bytes: crosses any power-of-two chunk / task size.
        sd["large"] = random_tensor(torch.float32, (4 * 1024 * 1024 + 3,), (seed, "large"))
    return sd


class CustomPayload:
    """A picklable user class (saved as a non-tensor object)."""

    def __init__(self, name: str, values: list):
        self.name = name
        self.values = values

    def __eq__(self, other):
        return type(other) is CustomPayload and (self.name, self.values) == (other.name, other.values)

    def __repr__(self):
        return f"CustomPayload({self.name!r}, {self.values!r})"


@dataclasses.dataclass
class DataPayload:
    step: int
    tag: str


def object_state_dict(seed: int = 0) -> dict[str, Any]:
    """Non-tensor objects mixed with tensors, nested."""
    t = lambda name, shape=(4, 3), dt=torch.float32: random_tensor(dt, shape, (seed, name))  # noqa: E731
    buf = io.BytesIO(bytes(range(256)) * 3 + b"tail")
    return {
        "int": 42 + seed,
        "neg_big_int": -(2**70) + seed,
        "float": 3.25,
        "nan_float": float("nan"),
        "str": f"hello \u00e9\u4e16\u754c {seed}",
        "bytes": b"\x00\x01\xff" * 10,
        "none": None,
        "bool": True,
        "bytesio": buf,
        "tuple_of_objs": (1, "two", 3.0),
        "list_of_objs": ["a", 1, None, {"k": "v"}],
        "custom": CustomPayload("payload", [1, 2, 3]),
        "dataclass": DataPayload(step=7, tag="x"),
        "nested": {
            "tensor": t("nested.tensor"),
            "level2": {
                "tensor_i32": t("nested.l2", (5,), torch.int32),
                "obj": {"a": [1, 2, {"b": "c"}]},
                "empty_dict": {},
            },
            "list_mixed": [t("lm0", (2,)), "string-in-list", 17, t("lm3", (3, 1), torch.float64)],
            "bytesio": io.BytesIO(b"nested bytes"),
        },
        "top_tensor": t("top", (6,), torch.bfloat16),
    }


def many_small_tensors(n: int = 300, seed: int = 0) -> dict[str, torch.Tensor]:
    dts = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]
    return {
        f"layer{i:04d}.w": random_tensor(dts[i % len(dts)], (1 + i % 5, 3 + i % 7), (seed, "small", i))
        for i in range(n)
    }


# --------------------------------------------------------------------------- #
# a load planner that reads boxes (slices) of saved tensors
# --------------------------------------------------------------------------- #
class SliceLoadPlanner(DefaultLoadPlanner):
    """Loads ``slices = {fqn: (offsets, sizes)}`` -- a box of each saved tensor --
    into destination tensors of shape ``sizes``.  This is a single-process
    resharding read: the ReadItems it emits have non-zero ``storage_offsets`` and
    partial lengths, exactly like a DTensor reshard would."""

    def __init__(self, slices: Mapping[str, tuple[Sequence[int], Sequence[int]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.slices = dict(slices)

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, (offsets, sizes) in self.slices.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata), fqn
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        # dest tensors are plain tensors holding just the box; the ReadItem's
        # dest_offsets are relative to it (transform_tensor narrows).
        return self.state_dict[index.fqn]


def random_box(rng, shape: Sequence[int]) -> tuple[list[int], list[int]]:
    """A random non-empty box (offsets, sizes) inside a tensor of ``shape``."""
    offsets, sizes = [], []
    for n in shape:
        lo = rng.randrange(n)
        offsets.append(lo)
        sizes.append(rng.randrange(lo + 1, n + 1) - lo)
    return offsets, sizes


def box_state(seed: int) -> dict[str, torch.Tensor]:
    """Small tensors of several dtypes and shapes (a transposed one, a complex one) whose random
    boxes the placement tests load into every destination layout."""
    g = torch.Generator().manual_seed(seed)
    return {
        "m2": torch.randn(63, 47, generator=g),
        "wide": torch.randn(96, 384, generator=g),
        "b3": torch.randn(7, 13, 11, generator=g).to(torch.bfloat16),
        "i4": torch.randint(-30000, 30000, (3, 5, 7, 9), generator=g).to(torch.int16),
        "t2": torch.randn(29, 31, generator=g).t(),
        "c1": torch.randn(40, generator=g).to(torch.complex64),
    }


# The dtype a "convert" destination of box_state's tensors has (complex64 -> complex128 is a
# conversion no box kernel does: it takes the fallback copy).
CONVERTED_DTYPE = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32, torch.int16: torch.int64,
                   torch.complex64: torch.complex128}


def random_boxes(saved: dict[str, torch.Tensor], rng: random.Random, destination) -> tuple[dict, dict, dict]:
    """``(slices, dest, expected)`` for loading a random box of every tensor of ``saved``:
    ``destination(sizes, saved dtype)`` makes each destination; expected values are in its dtype."""
    slices, dest, expected = {}, {}, {}
    for name, tensor in saved.items():
        offsets, sizes = random_box(rng, tuple(tensor.shape))
        slices[name] = (offsets, sizes)
        dest[name] = destination(sizes, tensor.dtype)
        expected[name] = box(tensor, offsets, sizes).to(dest[name].dtype)
    return slices, dest, expected


def box_destination(sizes: Sequence[int], dtype: torch.dtype, layout: str, device: str = "cpu") -> torch.Tensor:
    """A destination filled with 7s: ``contiguous``, ``permuted`` (reversed-dims storage) or
    ``offset`` (a view at storage offset 5); any other layout name gives a contiguous tensor."""
    sizes = list(sizes)
    if layout == "permuted" and len(sizes) > 1:
        order = list(range(len(sizes)))[::-1]
        storage = torch.full([sizes[d] for d in order], 7, dtype=dtype, device=device)
        return storage.permute(*[order.index(d) for d in range(len(sizes))])
    if layout == "offset":
        n = 1
        for s in sizes:
            n *= s
        return torch.full((n + 5,), 7, dtype=dtype, device=device)[5:].view(sizes)
    return torch.full(sizes, 7, dtype=dtype, device=device)


def packed(t: torch.Tensor) -> torch.Tensor:
    """The same values in a fresh row-major CPU tensor (strides normalised, size-1 dims included)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def box(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    out = t
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        out = out.narrow(d, o, s)
    return out


# --------------------------------------------------------------------------- #
# a stream-transform extension without third-party dependencies
# --------------------------------------------------------------------------- #
class XorTransform(StreamTransformExtension):
    """XORs every byte with 0x5A.  Exercises the ``_extensions`` /
    ``transform_descriptors`` path without needing zstandard."""

    KEY = 0x5A

    @staticmethod
    def registry_name() -> str:
        return "fastdcp-test.xor"

    @staticmethod
    def from_descriptor(version: str) -> "XorTransform":
        if version.partition(".")[0] != "1":
            raise ValueError(f"Unknown XorTransform version {version!r}")
        return XorTransform()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    @staticmethod
    def _xor(b) -> bytes:
        arr = torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(memoryview(b)) else None
        if arr is None:
            return b""
        return (arr ^ XorTransform.KEY).numpy().tobytes()

    def transform_to(self, output):
        xor = self._xor

        class _Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                n = len(memoryview(b))
                output.write(xor(b))
                return n

            def flush(self) -> None:
                output.flush()

            def close(self) -> None:
                if not self.closed:
                    output.close()
                super().close()

        return _Writer()

    def transform_from(self, input):
        xor = self._xor

        class _Reader(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b) -> int:
                view = memoryview(b)
                data = input.read(len(view))
                if not data:
                    return 0
                view[: len(data)] = xor(data)
                return len(data)

        return _Reader()


def xor_registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(XorTransform)
    return reg


def drop_empty_dicts(obj):
    """Stock DCP does not record empty dicts: a load that builds its state dict
    from metadata (no destination given) has no entry for them."""
    if isinstance(obj, Mapping):
        out = {k: drop_empty_dicts(v) for k, v in obj.items()}
        return {k: v for k, v in out.items() if not (isinstance(v, Mapping) and not v)}
    return obj


def deepcopy_state_dict(sd):
    return copy.deepcopy(sd)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "False")


def message_tail(msg: str, limit: int) -> str:
    """The last ``limit`` characters of a worker's message (a traceback ends with its cause)."""
    msg = msg.strip()
    return msg if len(msg) <= limit else "..." + msg[-limit:]


@contextmanager
def gloo_rank_mesh(rank: int, store: str, world_size: int = 2) -> Iterator[Any]:
    """In a spawned rank: a gloo default group over ``file://{store}`` and a 1-D CPU device mesh
    for the body. The group is destroyed afterwards; when the body succeeded, the process then
    ends at once (:func:`fastdcp.bench.process_group.exit_spawned_rank`, which avoids torch's
    gloo abort at interpreter exit); a failure propagates to ``torch.multiprocessing``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fastdcp.bench.process_group import exit_spawned_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
    exit_spawned_rank()


@contextmanager
def warnings_logged_by(logger: logging.Logger) -> Iterator[list[str]]:
    """The warnings ``logger`` emits inside the block, each message on one line (whitespace runs
    collapsed). torch's loggers do not propagate to the root logger, so pytest's caplog misses them."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(" ".join(record.getMessage().split()))

    handler = _Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
