"""Single-process interoperability tests: stock DCP <-> fastdcp, bit-exact.

Every test runs for the four (writer_kind, reader_kind) pairs, ids
``stock-stock`` (control), ``stock-fast``, ``fast-stock``, ``fast-fast``.
Validate the tests themselves with ``-k stock-stock``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import traceback
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import dcp_cases as C
from dcp_cases import PAIR_IDS, PAIRS

pairs = pytest.mark.parametrize(("writer_kind", "reader_kind"), PAIRS, ids=PAIR_IDS)

HERE = Path(__file__).resolve().parent  # this test module, imported by name in child processes
TESTS_DIR = HERE.parent  # the shared helpers (dcp_cases, _crash_worker)
REPO_ROOT = TESTS_DIR.parent


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
class _NoFastdcpUnpickler(pickle.Unpickler):
    """Unpickles ``.metadata`` like a machine without fastdcp installed would."""

    def find_class(self, module, name):
        if module.split(".")[0] == "fastdcp":
            raise pickle.UnpicklingError(
                f".metadata references {module}.{name}: stock readers without fastdcp cannot load it"
            )
        return super().find_class(module, name)


def check_metadata_is_stock(ckpt_dir) -> None:
    with open(Path(ckpt_dir) / ".metadata", "rb") as f:
        md = _NoFastdcpUnpickler(f).load()
    assert type(md) is dcp.Metadata, f".metadata holds {type(md)}, not torch's Metadata"


def save_checked(sd, writer_kind, path, **kw):
    """Save with ``writer_kind`` and check the .metadata is stock-only."""
    writer = C.make_writer(writer_kind, path, **kw)
    C.save(sd, writer)
    check_metadata_is_stock(path)


def roundtrip(writer_kind, reader_kind, path, sd, *, layout="contiguous", writer_kw=None, reader_kw=None,
              writer_fast=None, reader_fast=None):
    writer = C.make_writer(writer_kind, path, fast_options=writer_fast, **(writer_kw or {}))
    C.save(sd, writer)
    check_metadata_is_stock(path)
    dest = C.destination_for(sd, layout=layout)
    reader = C.make_reader(reader_kind, path, fast_options=reader_fast, **(reader_kw or {}))
    C.load_in_place_and_check(reader, sd, dest)
    return dest


def _wait(result):
    """async_save returns a Future or an AsyncSaveResponse."""
    if isinstance(result, Future):
        return result.result(timeout=240)
    staging = getattr(result, "staging_completion", None)
    if staging is not None:
        staging.result(timeout=240)
    return result.upload_completion.result(timeout=240)


def _outcome(fn):
    """Run fn(); return ("ok", value) or ("raise", exception)."""
    try:
        return "ok", fn()
    except BaseException as e:  # CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, TimeoutError)):
            raise
        return "raise", e


# --------------------------------------------------------------------------- #
# the comparison helpers themselves must catch a single wrong byte
# --------------------------------------------------------------------------- #
def test_helpers_detect_single_byte_and_layout_differences():
    for dt in C.all_torch_dtypes():
        name = C.dtype_name(dt)
        if name.startswith("quint") or name.startswith("qint"):
            continue
        t = C.random_tensor(dt, (5, 8), ("selftest", name))
        bits_only = name in C.STOCK_UNSUPPORTED_DTYPES or name in C.UNCOPYABLE_DTYPES
        u = t.clone() if not bits_only else torch.empty_like(t)
        if bits_only:
            C.bit_view(u).copy_(C.bit_view(t))
        C.assert_tensor_bitexact(u, t)
        raw = C.bit_view(u).reshape(-1).view(torch.uint8)
        raw[len(raw) // 2] ^= 0x01
        with pytest.raises(AssertionError, match="differ"):
            C.assert_tensor_bitexact(u, t)
    # NaN payloads differ -> must be detected (torch.equal alone would not).
    a = torch.tensor([float("nan")], dtype=torch.float32)
    b = a.view(torch.int32).add(1).view(torch.float32)
    with pytest.raises(AssertionError):
        C.assert_tensor_bitexact(a, b)
    # -0.0 vs 0.0 compare equal as floats, not as bits.
    with pytest.raises(AssertionError):
        C.assert_tensor_bitexact(torch.tensor([-0.0]), torch.tensor([0.0]))
    x = torch.arange(12.0).reshape(3, 4)
    with pytest.raises(AssertionError, match="stride"):
        C.assert_tensor_bitexact(x.t().contiguous(), x.t())
    with pytest.raises(AssertionError, match="dtype"):
        C.assert_tensor_bitexact(x.double(), x)
    with pytest.raises(AssertionError, match="shape"):
        C.assert_tensor_bitexact(x.reshape(4, 3), x)
    with pytest.raises(AssertionError):
        C.assert_same({"a": io.BytesIO(b"x")}, {"a": io.BytesIO(b"y")})
    with pytest.raises(AssertionError):
        C.assert_same({"a": 1}, {"a": 1.0})
    with pytest.raises(AssertionError, match="keys"):
        C.assert_same({"a": 1}, {"a": 1, "b": 2})


# --------------------------------------------------------------------------- #
# dtypes
# --------------------------------------------------------------------------- #
ALL_DTYPES = C.all_torch_dtypes()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=[C.dtype_name(d) for d in ALL_DTYPES])
@pairs
def test_every_dtype(writer_kind, reader_kind, dtype, tmp_path):
    name = C.dtype_name(dtype)
    sd = {
        "m": C.random_tensor(dtype, (5, 8), ("dtype", name, "m")),
        "v": C.random_tensor(dtype, (64,), ("dtype", name, "v")),
        "s": C.random_tensor(dtype, (), ("dtype", name, "s")),
    }
    writer = C.make_writer(writer_kind, tmp_path)
    if name in C.STOCK_UNSUPPORTED_DTYPES:
        # Stock refuses these.  A writer may refuse too; if it accepts, the
        # checkpoint must read back exactly.
        status, _ = _outcome(lambda: C.save(sd, writer))
        if status == "raise":
            return
    else:
        C.save(sd, writer)
    check_metadata_is_stock(tmp_path)
    dest = C.destination_for(sd)
    if name in C.UNCOPYABLE_DTYPES and reader_kind == "stock":
        # This torch has no copy kernel for the dtype, and stock's reader copies: its load fails.
        with pytest.raises(CheckpointException, match="not implemented"):
            C.load_in_place_and_check(C.make_reader(reader_kind, tmp_path), sd, dest)
        return
    C.load_in_place_and_check(C.make_reader(reader_kind, tmp_path), sd, dest)


def test_dtype_classification_is_complete():
    """The core dtypes must be in the must-round-trip set, never in the lenient one."""
    must = {C.dtype_name(d) for d in ALL_DTYPES} - set(C.STOCK_UNSUPPORTED_DTYPES)
    for required in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                     "int8", "int16", "int32", "int64", "uint8", "bool", "complex64", "complex128"):
        assert required in must


# --------------------------------------------------------------------------- #
# shapes / layouts
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("layout", ["contiguous", "same", "offset"])
@pairs
def test_shapes_and_layouts(writer_kind, reader_kind, layout, tmp_path):
    """0-d, empty, non-contiguous, storage-offset views, 4-D, 63x47 and a 16 MiB
    tensor; loaded into contiguous destinations, destinations with the source's
    own (non-contiguous) strides, and destinations at a storage offset."""
    sd = C.zoo_tensors(seed=1, large=True)
    roundtrip(writer_kind, reader_kind, tmp_path, sd, layout=layout)


@pairs
def test_transposed_destination(writer_kind, reader_kind, tmp_path):
    sd = {k: v for k, v in C.zoo_tensors(seed=2, large=False).items() if v.dim() == 2}
    roundtrip(writer_kind, reader_kind, tmp_path, sd, layout="transposed")


@pairs
def test_saved_strides_survive_empty_planner_load(writer_kind, reader_kind, tmp_path):
    """Loading with no destination (the planner allocates from metadata, as
    dcp_to_torch_save does) gives the same tensors from either reader."""
    sd = C.zoo_tensors(seed=3, large=False)
    save_checked(sd, writer_kind, tmp_path)

    def load_empty(kind):
        out: dict = {}
        _load_state_dict(out, storage_reader=C.make_reader(kind, tmp_path),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return out

    ref = load_empty("stock")
    got = load_empty(reader_kind)
    C.assert_same(got, ref)  # strides included: same allocation as stock
    C.assert_same(got, sd, check_stride=False)


# --------------------------------------------------------------------------- #
# non-tensor objects
# --------------------------------------------------------------------------- #
@pairs
def test_python_objects(writer_kind, reader_kind, tmp_path):
    sd = C.object_state_dict(seed=4)
    roundtrip(writer_kind, reader_kind, tmp_path, sd)


@pairs
def test_many_small_tensors(writer_kind, reader_kind, tmp_path):
    sd = C.many_small_tensors(n=500, seed=5)
    roundtrip(writer_kind, reader_kind, tmp_path, sd)


# --------------------------------------------------------------------------- #
# model + optimizer
# --------------------------------------------------------------------------- #
def _train_one_step(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(17, 33), torch.nn.LayerNorm(33), torch.nn.GELU(),
        torch.nn.Linear(33, 5, bias=False),
    )
    model.register_buffer("step_counter", torch.tensor(3, dtype=torch.int64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)
    x = torch.randn(8, 17)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("api", ["plain", "get_state_dict"])
@pairs
def test_model_and_optimizer(writer_kind, reader_kind, api, tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _train_one_step(seed=10)
    fresh_model, fresh_opt = _train_one_step(seed=11)  # different values, same structure

    if api == "plain":
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        save_checked(sd, writer_kind, tmp_path)
        dest = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
        C.load(dest, C.make_reader(reader_kind, tmp_path))
        fresh_model.load_state_dict(dest["model"])
        fresh_opt.load_state_dict(dest["optim"])
        C.assert_same(fresh_model.state_dict(), model.state_dict())
        C.assert_same(fresh_opt.state_dict(), opt.state_dict())
    else:
        msd, osd = get_state_dict(model, opt)
        save_checked({"model": msd, "optim": osd}, writer_kind, tmp_path)
        fmsd, fosd = get_state_dict(fresh_model, fresh_opt)
        dest = {"model": fmsd, "optim": fosd}
        C.load(dest, C.make_reader(reader_kind, tmp_path))
        set_state_dict(fresh_model, fresh_opt, model_state_dict=dest["model"], optim_state_dict=dest["optim"])
        C.assert_same(fresh_model.state_dict(), model.state_dict())
        C.assert_same(fresh_opt.state_dict(), opt.state_dict())
    # and the restored model computes the same thing
    x = torch.randn(4, 17, generator=torch.Generator().manual_seed(0))
    C.assert_tensor_bitexact(fresh_model(x), model(x))


# --------------------------------------------------------------------------- #
# writer options
# --------------------------------------------------------------------------- #
WRITER_OPTIONS = {
    "default": {},
    "multi_file": {"single_file_per_rank": False},
    "threads3": {"thread_count": 3},
    "multi_file_threads3": {"single_file_per_rank": False, "thread_count": 3},
    "no_sync": {"sync_files": False},
    "no_copy_ahead": {"per_thread_copy_ahead": 0},
    "cache_staged": {"cache_staged_state_dict": True},
}


@pytest.mark.parametrize("opts", list(WRITER_OPTIONS.values()), ids=list(WRITER_OPTIONS))
@pairs
def test_writer_options(writer_kind, reader_kind, opts, tmp_path):
    sd = {**C.zoo_tensors(seed=6, large=False), **C.many_small_tensors(n=40, seed=6),
          "obj": C.object_state_dict(seed=6)}
    roundtrip(writer_kind, reader_kind, tmp_path, sd, writer_kw=opts)


@pairs
def test_overwrite_false_raises_like_stock(writer_kind, reader_kind, tmp_path):
    first = C.zoo_tensors(seed=7, large=False)
    second = C.zoo_tensors(seed=8, large=False)

    # What stock does (reference, in its own directory).
    ref_dir = tmp_path / "ref"
    C.save(first, C.make_writer("stock", ref_dir))
    ref_status, ref_exc = _outcome(lambda: C.save(second, C.make_writer("stock", ref_dir, overwrite=False)))
    assert ref_status == "raise", "stock FileSystemWriter(overwrite=False) no longer raises on an existing checkpoint"

    ckpt = tmp_path / "ckpt"
    C.save(first, C.make_writer(writer_kind, ckpt))
    status, exc = _outcome(lambda: C.save(second, C.make_writer(writer_kind, ckpt, overwrite=False)))
    assert status == "raise", "overwrite=False did not raise on an existing checkpoint"
    assert type(exc) is type(ref_exc), f"stock raises {type(ref_exc).__name__}, got {type(exc).__name__}: {exc}"
    # The refused save must not have damaged the existing checkpoint.
    C.load_in_place_and_check(C.make_reader(reader_kind, ckpt), first, C.destination_for(first))
    # overwrite=True (default) replaces it.
    C.save(second, C.make_writer(writer_kind, ckpt, overwrite=True))
    C.load_in_place_and_check(C.make_reader(reader_kind, ckpt), second, C.destination_for(second))


@pairs
def test_overwrite_with_different_layout(writer_kind, reader_kind, tmp_path):
    """A second save into the same directory with fewer files must not be
    confused by files left over from the first."""
    first = {**C.many_small_tensors(n=30, seed=20), "x": C.random_tensor(torch.float32, (100, 3), "x1")}
    second = {"x": C.random_tensor(torch.float32, (100, 3), "x2"), "only_second": torch.arange(5)}
    C.save(first, C.make_writer(writer_kind, tmp_path, single_file_per_rank=False, thread_count=3))
    C.save(second, C.make_writer(writer_kind, tmp_path))
    C.load_in_place_and_check(C.make_reader(reader_kind, tmp_path), second, C.destination_for(second))


# --------------------------------------------------------------------------- #
# format_utils
# --------------------------------------------------------------------------- #
@pairs
def test_dcp_to_torch_save(writer_kind, reader_kind, tmp_path):
    sd = {**C.zoo_tensors(seed=9, large=False), **C.object_state_dict(seed=9)}
    save_checked(sd, "stock", tmp_path / "stock_ckpt")
    save_checked(sd, writer_kind, tmp_path / "ckpt")
    dcp_to_torch_save(tmp_path / "stock_ckpt", tmp_path / "stock.pt")
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "conv.pt")
    ref = torch.load(tmp_path / "stock.pt", weights_only=False)
    got = torch.load(tmp_path / "conv.pt", weights_only=False)
    C.assert_same(got, ref)
    C.assert_same(got, C.drop_empty_dicts(sd), check_stride=False)
    # The same conversion through the pair's reader.
    out: dict = {}
    _load_state_dict(out, storage_reader=C.make_reader(reader_kind, tmp_path / "ckpt"),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    C.assert_same(out, ref)


# --------------------------------------------------------------------------- #
# dtype conversion on load (DefaultLoadPlanner copy_s into the destination)
# --------------------------------------------------------------------------- #
CONV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
               torch.int32, torch.uint8, torch.bool, torch.complex64]


def _conv_source(dt: torch.dtype) -> torch.Tensor:
    """Values whose conversion to every CONV_DTYPES member is well defined
    (non-negative, < 100): no UB in float->int casts."""
    base = C.random_float((9, 7), ("conv", str(dt)), torch.float64).abs().remainder(100)
    if dt == torch.bool:
        return base > 50
    if dt.is_complex:
        return torch.complex(base, base.flip(0)).to(dt)
    return base.to(dt)


def _specials() -> torch.Tensor:
    """IEEE special values (no NaN): rounding, overflow, denormals, signed zero."""
    return torch.tensor(
        [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-40, -1e-42, 3.4e38,
         65504.0, 65520.0, 1.00390625, 1.0078125 + 2**-20, 6.1e-5, 1e-8, 448.0, 464.0, 57344.0],
        dtype=torch.float32,
    )


def _nans() -> torch.Tensor:
    """NaNs with different sign / payload bits (quiet and signalling)."""
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5],
                        dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def _check_conversions_like_stock(reader_kind, tmp_path, sd, *, compare_with_copy=True):
    """Load every ``"<src>-><dst>"`` key of ``sd`` into a ``<dst>`` tensor with the
    stock reader and with ``reader_kind``; the results must be bit-identical
    (or both raise the same exception type)."""

    def dest_dtype(key):
        return getattr(torch, key.split("->")[1])

    failures = []
    for key, src in sd.items():
        d = dest_dtype(key)

        def do_load(kind):
            dest = {key: C.sentinel_like(src, dtype=d)}
            C.load(dest, C.make_reader(kind, tmp_path))
            return dest[key]

        ref_status, ref = _outcome(lambda: do_load("stock"))
        status, got = _outcome(lambda: do_load(reader_kind))
        try:
            if ref_status == "raise":
                assert status == "raise", f"{key}: stock raises {type(ref).__name__}, {reader_kind} reader loaded"
                assert type(got) is type(ref), f"{key}: stock raises {type(ref).__name__}, got {type(got).__name__}"
                continue
            assert status == "ok", f"{key}: stock loads, {reader_kind} reader raised {type(got).__name__}: {got}"
            C.assert_tensor_bitexact(got, ref, f"{key} ({reader_kind} reader vs stock reader)")
            if compare_with_copy:
                # stock semantics == Tensor.copy_
                expected = torch.empty(src.shape, dtype=d)
                expected.copy_(src)
                C.assert_tensor_bitexact(got, expected, f"{key} (vs Tensor.copy_)")
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} conversion(s) differ:\n" + "\n".join(failures)


@pairs
def test_load_converts_dtype_like_stock(writer_kind, reader_kind, tmp_path):
    """Destination dtype != saved dtype: stock's DefaultLoadPlanner/FileSystemReader
    copy_()s, i.e. converts silently (complex -> real drops the imaginary part)."""
    sd = {}
    for s in CONV_DTYPES:
        for d in CONV_DTYPES:
            if s != d:
                sd[f"{C.dtype_name(s)}->{C.dtype_name(d)}"] = _conv_source(s)
    for d in (torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2):
        sd[f"specials->{C.dtype_name(d)}"] = _specials()
    save_checked(sd, writer_kind, tmp_path)
    _check_conversions_like_stock(reader_kind, tmp_path, sd)


@pairs
def test_load_converts_nan_like_stock(writer_kind, reader_kind, tmp_path):
    """NaN bit patterns after a float32 -> other float conversion.  Stock (CPU
    Tensor.copy_) turns every float32 NaN into bfloat16 0xFFFF, *not* the
    0x7FC0 of c10::BFloat16's scalar conversion.  Kept separate so that a
    deliberate decision to differ only in NaN payloads can be marked here."""
    sd = {f"nan->{C.dtype_name(d)}": _nans()
          for d in (torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)}
    save_checked(sd, writer_kind, tmp_path)
    _check_conversions_like_stock(reader_kind, tmp_path, sd)


@pairs
def test_load_size_mismatch_and_missing_key_like_stock(writer_kind, reader_kind, tmp_path):
    sd = {"a": C.random_tensor(torch.float32, (5, 7), "a"), "b": torch.arange(10)}
    save_checked(sd, writer_kind, tmp_path)
    cases = {
        "size_mismatch": lambda: {"a": torch.zeros(5, 8)},
        "missing_key": lambda: {"nope": torch.zeros(3)},
    }
    for name, make_dest in cases.items():
        ref_status, ref = _outcome(lambda: C.load(make_dest(), C.make_reader("stock", tmp_path)))
        status, got = _outcome(lambda: C.load(make_dest(), C.make_reader(reader_kind, tmp_path)))
        assert status == ref_status, f"{name}: stock {ref_status}, {reader_kind} {status}: {got}"
        if ref_status == "raise":
            assert type(got) is type(ref), f"{name}: stock raises {type(ref).__name__}, got {type(got).__name__}"


# --------------------------------------------------------------------------- #
# partial loads and slices
# --------------------------------------------------------------------------- #
@pairs
def test_partial_load(writer_kind, reader_kind, tmp_path):
    small = C.many_small_tensors(n=200, seed=12)
    sd = {**small, **C.zoo_tensors(seed=12, large=True), "objs": C.object_state_dict(seed=12)}
    save_checked(sd, writer_kind, tmp_path)

    # every third small tensor, one big one, one nested tensor, one nested object
    keys = sorted(small)[::3] + ["large", "uneven"]
    expected = {k: sd[k] for k in keys}
    expected["objs"] = {"nested": {"tensor": sd["objs"]["nested"]["tensor"]}, "str": sd["objs"]["str"]}
    dest = C.destination_for(expected)
    C.load_in_place_and_check(C.make_reader(reader_kind, tmp_path), expected, dest)

    # allow_partial_load: a destination key absent from the checkpoint is left alone
    extra = C.sentinel_like(torch.empty(4, 4))
    extra_before = extra.clone()
    dest = {"uneven": C.sentinel_like(sd["uneven"]), "not_in_checkpoint": extra}
    C.load(dest, C.make_reader(reader_kind, tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True))
    C.assert_tensor_bitexact(dest["uneven"], sd["uneven"], check_stride=False)
    C.assert_tensor_bitexact(dest["not_in_checkpoint"], extra_before)


SLICES = {
    # fqn: list of (offsets, sizes)
    "uneven": [((0, 0), (63, 47)), ((10, 0), (20, 47)), ((0, 5), (63, 17)), ((7, 3), (41, 40)),
               ((62, 46), (1, 1)), ((31, 0), (1, 47)), ((0, 23), (63, 1))],
    "transposed": [((0, 0), (20, 24)), ((3, 2), (11, 13)), ((0, 7), (20, 1))],
    "every_other_col": [((1, 1), (20, 8))],
    "offset_view": [((2, 4), (9, 9))],
    "four_d": [((1, 0, 2, 1), (2, 4, 3, 5)), ((0, 3, 0, 0), (3, 1, 5, 6))],
    "large": [((0,), (1,)), ((1_000_003,), (2_500_000,)), ((4 * 1024 * 1024 - 5,), (8,))],
    "int64_vec": [((500,), (501,))],
}


@pairs
def test_slice_load(writer_kind, reader_kind, tmp_path):
    """Load boxes of saved tensors (non-zero storage_offsets, partial lengths) --
    the single-process form of a resharding read."""
    sd = C.zoo_tensors(seed=13, large=True)
    save_checked(sd, writer_kind, tmp_path)
    n_cases = max(len(v) for v in SLICES.values())
    for i in range(n_cases):
        slices = {k: v[i] for k, v in SLICES.items() if i < len(v)}
        dest = {k: C.sentinel_like(C.box(sd[k], *s)) for k, s in slices.items()}
        expected = {k: C.box(sd[k], *s) for k, s in slices.items()}
        C.load(dest, C.make_reader(reader_kind, tmp_path), planner=C.SliceLoadPlanner(slices))
        for k in slices:
            C.assert_tensor_bitexact(dest[k], expected[k], f"{k}{slices[k]}", check_stride=False)


# --------------------------------------------------------------------------- #
# async_save
# --------------------------------------------------------------------------- #
def _async_sd(seed):
    return {**C.zoo_tensors(seed=seed, large=True), "objs": C.object_state_dict(seed=seed)}


def _scribble(sd):
    """Overwrite every source tensor in place (after staging, must not matter)."""
    for t in C.tensor_leaves(sd).values():
        if t.numel() and not t.is_quantized:
            C.fill_storage_with_sentinel(t)


@pairs
def test_async_save_thread(writer_kind, reader_kind, tmp_path):
    sd = _async_sd(14)
    expected = C.deepcopy_state_dict(sd)
    writer = C.make_writer(writer_kind, tmp_path)
    res = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    _scribble(sd)  # the staged copy must be independent of the live tensors
    _wait(res)
    check_metadata_is_stock(tmp_path)
    for rk in {reader_kind, "stock"}:
        C.load_in_place_and_check(C.make_reader(rk, tmp_path), expected, C.destination_for(expected))


def _cached_staging_saves(writer_kind, root):
    """Two async_saves through one writer with cache_staged_state_dict=True:
    the second re-uses the staging buffers and must write the *new* values."""
    writer = C.make_writer(writer_kind, root / "a", cache_staged_state_dict=True)
    sd1 = C.zoo_tensors(seed=15, large=True)
    exp1 = C.deepcopy_state_dict(sd1)
    _wait(dcp.async_save(sd1, storage_writer=writer, checkpoint_id=root / "a", no_dist=True))
    sd2 = C.zoo_tensors(seed=16, large=True)  # same structure, new values
    exp2 = C.deepcopy_state_dict(sd2)
    _wait(dcp.async_save(sd2, storage_writer=writer, checkpoint_id=root / "b", no_dist=True))
    return [(root / "a", exp1), (root / "b", exp2)]


@pairs
def test_async_save_cached_staging_twice(writer_kind, reader_kind, tmp_path):
    # Stock's cached staging allocates pinned memory, which raises on a machine
    # without an accelerator.  Then the rule is "like stock or better": the
    # writer may fail the same way (skip: nothing to compare) or must succeed.
    probe_status, probe_exc = _outcome(lambda: _cached_staging_saves("stock", tmp_path / "stock_probe"))
    status, result = _outcome(lambda: _cached_staging_saves(writer_kind, tmp_path / "ckpt"))
    if status == "raise":
        if probe_status == "raise" and type(result) is type(probe_exc):
            pytest.skip(f"cache_staged_state_dict=True async_save fails here for stock too "
                        f"({type(probe_exc).__name__}: {str(probe_exc).strip().splitlines()[-1][:200]})")
        raise result
    for path, exp in result:
        C.load_in_place_and_check(C.make_reader(reader_kind, path), exp, C.destination_for(exp))


# -- process mode ------------------------------------------------------------
def _async_process_child(root: str) -> None:
    """Runs in a fresh interpreter: gloo world of 1, async_save in PROCESS mode
    for each writer kind, results to root/results.json."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    results = {}
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for kind in C.KINDS:
            try:
                sd = _async_sd(16)
                writer = C.make_writer(kind, os.path.join(root, kind))
                res = dcp.async_save(sd, storage_writer=writer,
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS)
                _scribble(sd)
                _wait(res)
                results[kind] = "ok"
            except BaseException:
                results[kind] = traceback.format_exc()
    finally:
        with open(os.path.join(root, "results.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def async_process_checkpoints(tmp_path_factory):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if not hasattr(AsyncCheckpointerType, "PROCESS"):
        pytest.skip("this torch has no AsyncCheckpointerType.PROCESS")
    root = tmp_path_factory.mktemp("async_process")
    env = dict(os.environ)
    # The DCP daemon's TCPStore is created at MASTER_ADDR (else the FQDN).
    env["MASTER_ADDR"] = "127.0.0.1"
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(TESTS_DIR)!r}, {str(REPO_ROOT)!r}]
        import test_interop
        test_interop._async_process_child({str(root)!r})
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
        out = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    except subprocess.TimeoutExpired as e:
        out = f"TIMEOUT after {e.timeout}s\nstderr:\n{(e.stderr or b'')[-8000:]!r}"
    results_path = root / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    return root, results, out


@pytest.mark.fastdcp_timeout(600)
@pairs
def test_async_save_process(writer_kind, reader_kind, async_process_checkpoints):
    root, results, out = async_process_checkpoints
    status = results.get(writer_kind)
    assert status == "ok", f"async_save(PROCESS) with the {writer_kind} writer failed:\n{status}\n---\n{out}"
    expected = _async_sd(16)
    check_metadata_is_stock(root / writer_kind)
    C.load_in_place_and_check(C.make_reader(reader_kind, root / writer_kind), expected,
                              C.destination_for(expected))


# --------------------------------------------------------------------------- #
# _extensions (stream transforms)
# --------------------------------------------------------------------------- #
@pairs
def test_extension_xor(writer_kind, reader_kind, tmp_path):
    """A dependency-free StreamTransformExtension: items carry transform_descriptors."""
    sd = {**C.zoo_tensors(seed=17, large=False), "objs": C.object_state_dict(seed=17)}
    roundtrip(writer_kind, reader_kind, tmp_path, sd,
              writer_kw={"_extensions": [C.XorTransform()]},
              reader_kw={"_extension_registry": C.xor_registry()})
    # The transform really was applied (the reader without the registry entry fails).
    md = C.make_reader("stock", tmp_path).read_metadata()
    descs = {tuple(v.transform_descriptors or ()) for v in md.storage_data.values()}
    assert descs == {("fastdcp-test.xor/1",)}, descs


@pairs
def test_extension_zstd(writer_kind, reader_kind, tmp_path):
    if not ZStandard.is_available():
        pytest.skip("ZStandard extension needs the 'zstandard' or 'pyzstd' module, neither is installed")
    sd = {**C.zoo_tensors(seed=18, large=True), "objs": C.object_state_dict(seed=18)}
    roundtrip(writer_kind, reader_kind, tmp_path, sd,
              writer_kw={"_extensions": [ZStandard()]},
              reader_kw={"_extension_registry": ExtensionRegistry()})


# --------------------------------------------------------------------------- #
# fast-only options (stock side ignores them; stock-stock runs once as control)
# --------------------------------------------------------------------------- #
FAST_OPTIONS = {
    "direct_io": ({"direct_io": True}, {"direct_io": True}),
    "buffered": ({"direct_io": False}, {"direct_io": False}),
    "threads4_small_tasks": ({"io_threads": 4, "task_bytes": 64 * 1024},
                             {"io_threads": 4, "task_bytes": 64 * 1024}),
    "one_thread": ({"io_threads": 1}, {"io_threads": 1}),
    "odd_task_bytes": ({"task_bytes": 12345}, {"task_bytes": 12345}),
    "tiny_read_budget": ({}, {"read_buffer_limit_bytes": 1 << 20, "task_bytes": 256 * 1024}),
}


def _fast_option_params():
    params = [pytest.param("stock", "stock", {}, {}, id="stock-stock-defaults")]
    for w, r in PAIRS:
        if (w, r) == ("stock", "stock"):
            continue
        for name, (wo, ro) in FAST_OPTIONS.items():
            if w == "stock" and not ro:
                continue  # nothing fast-specific in this case for a stock writer + ...
            params.append(pytest.param(w, r, wo if w == "fast" else {}, ro if r == "fast" else {},
                                       id=f"{w}-{r}-{name}"))
    return params


@pytest.mark.parametrize(("writer_kind", "reader_kind", "writer_fast", "reader_fast"), _fast_option_params())
def test_fast_options(writer_kind, reader_kind, writer_fast, reader_fast, tmp_path):
    sd = {**C.zoo_tensors(seed=19, large=True), **C.many_small_tensors(n=50, seed=19)}
    roundtrip(writer_kind, reader_kind, tmp_path, sd, writer_fast=writer_fast, reader_fast=reader_fast)
    # and a resharding-style read with the same options
    slices = {k: v[-1] for k, v in SLICES.items() if k in sd}
    dest = {k: C.sentinel_like(C.box(sd[k], *s)) for k, s in slices.items()}
    C.load(dest, C.make_reader(reader_kind, tmp_path, fast_options=reader_fast), planner=C.SliceLoadPlanner(slices))
    for k, s in slices.items():
        C.assert_tensor_bitexact(dest[k], C.box(sd[k], *s), k, check_stride=False)


# --------------------------------------------------------------------------- #
# the tests can see a single corrupted byte
# --------------------------------------------------------------------------- #
@pairs
def test_detects_single_corrupted_byte(writer_kind, reader_kind, tmp_path):
    """Flip one byte of tensor data on disk: the load either raises or the
    comparison fails.  Proves a silent corruption cannot pass the suite."""
    t = C.random_tensor(torch.float32, (256, 33), "corrupt")
    sd = {"t": t}
    save_checked(sd, writer_kind, tmp_path)
    needle = C.bit_view(t).contiguous().view(torch.uint8).numpy().tobytes()
    hits = []
    for f in sorted(tmp_path.glob("*.distcp")):
        data = f.read_bytes()
        pos = data.find(needle)
        if pos >= 0:
            hits.append((f, pos))
    assert len(hits) == 1, f"tensor bytes found {len(hits)} times in the .distcp files (expected raw, once)"
    f, pos = hits[0]
    with open(f, "r+b") as fh:
        fh.seek(pos + 4097)
        b = fh.read(1)
        fh.seek(pos + 4097)
        fh.write(bytes([b[0] ^ 0x10]))
    dest = C.destination_for(sd)
    try:
        C.load(dest, C.make_reader(reader_kind, tmp_path))
    except BaseException as e:  # noqa: BLE001 -- raising is an acceptable way to notice
        if isinstance(e, (KeyboardInterrupt, TimeoutError)):
            raise
        return
    with pytest.raises(AssertionError, match="differ"):
        C.assert_same(dest, sd, check_stride=False)
