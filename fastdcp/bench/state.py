"""Synthetic state dicts, their preallocated load targets, and bit-exact verification.

Tensor contents are a deterministic hash of (tensor seed, global element index), so any
process can generate exactly the elements of any box of any tensor (a DTensor shard in a
resharding test, a whole tensor in a single-process test) without materialising the rest.
A misplaced row, a transposed box or a swapped tensor therefore never verifies by chance.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Bytes written into destination tensors before every load: a load that silently does
# nothing (or skips a tensor) can never pass verification, even when the allocator hands
# back memory that still holds the previous run's (correct) bytes.
SCRIBBLE_BYTE = 0xA5


class VerificationError(RuntimeError):
    """A loaded value differs from what was saved. The benchmark must fail loudly."""


EXIT_VERIFY = 3  # the exit code of a run (the suite, or a scenario's child) whose checkpoint did not verify


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    shardable: bool = False  # 2-D and evenly divisible: becomes a DTensor in `reshard`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """Description of a state dict: tensors plus a few non-tensor (pickled) entries."""

    kind: str
    tensors: tuple[TensorSpec, ...]
    objects: tuple[tuple[str, Any], ...] = ()
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def summary(self) -> str:
        return (f"{self.kind}: {len(self.tensors)} tensors, {len(self.objects)} objects, "
                f"{self.tensor_bytes / MiB:.1f} MiB")


# --------------------------------------------------------------------------- specs

LLM_LAYERS = 7          # 7 layers x 4 matrices + embed + lm_head = 30 bf16 matrices
LLM_FP32_MATRICES = 2   # + 2 fp32 matrices = 32 large tensors (DESIGN.md §5)
LLM_NORMS = 300         # ~300 small fp32 norm vectors


def llm_like_spec(target_bytes: int, norms: int = LLM_NORMS) -> StateSpec:
    """LLM-like state dict of about `target_bytes`: bf16 2-D matrices (qkv, out, mlp up/down,
    embedding and lm_head), two fp32 matrices, `norms` (300) fp32 norm vectors and 2 non-tensor
    entries.

    Hidden size H is a multiple of 64, so every matrix dimension divides by 4 (Shard(0)/Shard(1)
    at world size 2 and 4 are even). Bytes ~= 208*H^2 + 1200*H.
    """
    h = max(64, int(math.sqrt(max(target_bytes, 1) / 208.0)) // 64 * 64)
    # take the multiple of 64 whose total is closest to the target
    candidates = [h, h + 64]
    h = min(candidates, key=lambda c: abs(208 * c * c + 1200 * c - target_bytes))
    ffn, vocab = 4 * h, 8 * h
    bf16, fp32 = torch.bfloat16, torch.float32
    tensors: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], dtype: torch.dtype, shardable: bool) -> None:
        tensors.append(TensorSpec(name, shape, dtype, seed=len(tensors) * 7919 + 17,
                                  shardable=shardable))

    add("model.embed_tokens.weight", (vocab, h), bf16, True)
    for i in range(LLM_LAYERS):
        p = f"model.layers.{i}"
        add(f"{p}.attn.qkv.weight", (3 * h, h), bf16, True)
        add(f"{p}.attn.out.weight", (h, h), bf16, True)
        add(f"{p}.mlp.up.weight", (ffn, h), bf16, True)
        add(f"{p}.mlp.down.weight", (h, ffn), bf16, True)
    add("lm_head.weight", (vocab, h), bf16, True)
    add("model.router.weight", (h, h), fp32, True)
    add("model.proj_fp32.weight", (h, h), fp32, True)
    for j in range(norms):
        add(f"model.norms.{j}.weight", (h,), fp32, False)
    objects = (("step", 1000 + h), ("run_info", f"fastdcp-bench llm-like hidden={h}"))
    return StateSpec("llm_like", tuple(tensors), objects, params={"hidden": h, "layers": LLM_LAYERS, "norms": norms})


def small_tensor_spec(count: int, tensor_bytes: int, large_count: int, large_bytes: int) -> StateSpec:
    """`count` tiny fp32 tensors (`tensor_bytes` each) plus `large_count` bf16 matrices."""
    tensors: list[TensorSpec] = []
    n = max(1, tensor_bytes // 4)
    for i in range(count):
        tensors.append(TensorSpec(f"small.{i}", (n,), torch.float32, seed=i * 31 + 5))
    cols = 1024
    rows = max(4, large_bytes // (2 * cols) // 4 * 4)
    for j in range(large_count):
        tensors.append(TensorSpec(f"large.{j}", (rows, cols), torch.bfloat16,
                                  seed=10_000_019 + j, shardable=True))
    objects = (("step", 7), ("run_info", "fastdcp-bench many-small"))
    return StateSpec("small_tensors", tuple(tensors), objects,
                     params={"count": count, "tensor_bytes": tensor_bytes,
                             "large_count": large_count, "large_bytes": rows * cols * 2})


# --------------------------------------------------------------------------- contents

_MUL1 = np.uint32(0x9E3779B1)
_MUL2 = np.uint32(0x85EBCA6B)
_CHUNK = 1 << 20  # elements per hashing step (bounded temporaries)
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-fill")  # numpy drops the GIL


def _hash32(idx: np.ndarray, seed: int) -> np.ndarray:
    """A bijective 32-bit mix of (index ^ seed); mutates and returns `idx` when it is uint32."""
    t = idx if idx.dtype == np.uint32 else idx.astype(np.uint32)
    t ^= np.uint32(seed & 0xFFFFFFFF)
    t *= _MUL1
    t ^= t >> np.uint32(15)
    t *= _MUL2
    t ^= t >> np.uint32(13)
    return t


def _indices(start: int, stop: int) -> np.ndarray:
    if stop <= 1 << 32:
        return np.arange(start, stop, dtype=np.uint32)
    return np.arange(start, stop, dtype=np.uint64)  # truncated to 32 bits by _hash32


def _store(dst: np.ndarray, h: np.ndarray) -> None:
    """Write hash words `h` (uint32) into `dst` (unsigned words of 1, 2, 4 or 8 bytes)."""
    size = dst.dtype.itemsize
    if size == 4:
        dst[...] = h
    elif size in (1, 2):
        h >>= np.uint32(32 - 8 * size)  # keep the best-mixed high bits
        dst[...] = h                     # (same-kind unsigned cast truncates exactly)
    elif size == 8:
        hi = _hash32(h.copy(), 0x5BD1E995).astype(np.uint64)
        dst[...] = (hi << np.uint64(32)) | h.astype(np.uint64)
    else:
        raise ValueError(f"unsupported element size {size}")


_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_words(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a contiguous tensor's bytes as unsigned words of its element size."""
    size = t.element_size()
    return t.view(_TORCH_INT[size]).numpy().view(_NP_UINT[size])


def fill_box(out: torch.Tensor, spec: TensorSpec, offsets: tuple[int, ...] | None = None) -> torch.Tensor:
    """Fill contiguous CPU tensor `out` (a box of `spec` starting at `offsets`) with the
    deterministic contents of that box. `offsets=None` means the whole tensor."""
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("fill_box needs a contiguous CPU tensor")
    gshape = spec.shape
    offsets = offsets or (0,) * len(gshape)
    words = _as_words(out).reshape(-1)
    if out.numel() == 0:
        return out
    if len(gshape) <= 1 or tuple(out.shape[1:]) == tuple(gshape[1:]):
        # a run of whole rows: one contiguous range of global indices
        inner = math.prod(gshape[1:]) if len(gshape) > 1 else 1
        base = offsets[0] * inner
        ranges = [(s, min(s + _CHUNK, out.numel())) for s in range(0, out.numel(), _CHUNK)]

        def work(r: tuple[int, int]) -> None:
            s, e = r
            _store(words[s:e], _hash32(_indices(base + s, base + e), spec.seed))

        list(_POOL.map(work, ranges))
        return out
    if len(gshape) != 2:
        raise ValueError("column boxes are only supported for 2-D tensors")
    rows, cols = out.shape
    r0, c0 = offsets
    gcols = gshape[1]
    step = max(1, _CHUNK // cols)
    ranges = [(s, min(s + step, rows)) for s in range(0, rows, step)]
    w2 = words.reshape(rows, cols)
    col_idx = np.arange(c0, c0 + cols, dtype=np.uint64)[None, :]

    def work2(r: tuple[int, int]) -> None:
        s, e = r
        idx = np.arange(r0 + s, r0 + e, dtype=np.uint64)[:, None] * np.uint64(gcols) + col_idx
        _store(w2[s:e], _hash32(idx, spec.seed))

    list(_POOL.map(work2, ranges))
    return out


def make_tensor(spec: TensorSpec) -> torch.Tensor:
    return fill_box(torch.empty(spec.shape, dtype=spec.dtype), spec)


def build_state(spec: StateSpec) -> dict[str, Any]:
    """The source state dict (CPU), with deterministic contents."""
    sd: dict[str, Any] = {t.name: make_tensor(t) for t in spec.tensors}
    sd.update(dict(spec.objects))
    return sd


def build_destination(spec: StateSpec, device: str = "cpu") -> dict[str, Any]:
    """Preallocated load target with the same layout (touched once, so page faults are not timed)."""
    sd: dict[str, Any] = {}
    for t in spec.tensors:
        d = torch.empty(t.shape, dtype=t.dtype, device=device)
        sd[t.name] = d
    for k, _ in spec.objects:
        sd[k] = None
    scribble(sd)
    return sd


def _tensor_of(v: Any) -> torch.Tensor | None:
    if isinstance(v, torch.Tensor):
        return v.to_local() if hasattr(v, "to_local") else v
    return None


def scribble(sd: dict[str, Any]) -> None:
    """Overwrite every destination tensor with SCRIBBLE_BYTE and every object with None."""
    for k, v in list(sd.items()):
        t = _tensor_of(v)
        if t is None:
            sd[k] = None
        elif t.numel():
            if t.is_contiguous():
                t.view(-1).view(torch.uint8).fill_(SCRIBBLE_BYTE)
            else:  # not produced by this harness; any value far from the hashed contents will do
                t.zero_()


def corrupt_one_byte(sd: dict[str, Any]) -> str:
    """Test hook: flip all bits of one byte of the first non-empty tensor (any device, any layout)."""
    for k, v in sd.items():
        t = _tensor_of(v)
        if t is not None and t.numel():
            elem = t[tuple(n // 2 for n in t.shape)]  # 0-d view into t's storage
            elem.unsqueeze(0).view(torch.uint8)[0] ^= 0xFF
            return k
    raise RuntimeError("nothing to corrupt")


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    t = _tensor_of(t)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the widest integer view (uint8 comparisons are ~4x slower)."""
    if a.numel() != b.numel():
        return False
    for width, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if a.numel() % width == 0:
            return torch.equal(a.view(dt), b.view(dt))
    return torch.equal(a, b)


def compare_tensor(name: str, expected: torch.Tensor, actual: Any, where: str) -> None:
    """Raise VerificationError unless `actual` has the shape, dtype and exact bytes of `expected`."""
    a = _tensor_of(actual)
    if a is None:
        raise VerificationError(f"{where}: {name!r} is not a tensor after load ({type(actual).__name__})")
    if tuple(a.shape) != tuple(expected.shape) or a.dtype != expected.dtype:
        raise VerificationError(f"{where}: {name!r} has shape/dtype {tuple(a.shape)}/{a.dtype}, "
                                f"expected {tuple(expected.shape)}/{expected.dtype}")
    eb, ab = _byte_view(expected), _byte_view(a)
    if not _bytes_equal(eb, ab):
        bad = (eb != ab).nonzero()
        first = int(bad[0]) if bad.numel() else -1
        raise VerificationError(
            f"{where}: tensor {name!r} differs from what was saved: {bad.numel()} of {eb.numel()} bytes "
            f"differ, first at byte {first} (expected 0x{int(eb[first]):02x}, got 0x{int(ab[first]):02x})")



def local_mismatch(expected: dict[str, torch.Tensor], loaded: dict[str, Any], where: str) -> str | None:
    """None when every loaded tensor (a DTensor's local shard, or a tensor) equals its expected
    local tensor bit for bit, else what differs (:func:`compare_tensor`'s message)."""
    try:
        for name, exp in expected.items():
            local = loaded[name].to_local() if hasattr(loaded[name], "to_local") else loaded[name]
            compare_tensor(name, exp, local, where)
    except VerificationError as error:
        return str(error)
    return None

def verify_state(expected: dict[str, Any], actual: dict[str, Any], where: str) -> None:
    """Bit-exact comparison of every entry (tensors by byte views, objects by ==)."""
    missing = [k for k in expected if k not in actual]
    if missing:
        raise VerificationError(f"{where}: keys missing after load: {missing[:5]}")
    for k, ev in expected.items():
        if isinstance(ev, torch.Tensor):
            compare_tensor(k, ev, actual[k], where)
        elif actual[k] != ev:
            raise VerificationError(f"{where}: object {k!r} loaded as {actual[k]!r}, saved {ev!r}")


def state_nbytes(sd: dict[str, Any]) -> int:
    total = 0
    for v in sd.values():
        t = _tensor_of(v)
        if t is not None:
            total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------- user checkpoints

def destination_from_metadata(metadata: Any) -> dict[str, Any]:
    """Preallocated (flat) state dict matching a DCP checkpoint's metadata: one full-size CPU
    tensor per TensorStorageMetadata entry, None placeholders for non-tensor entries."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    sd: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sd[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            sd[fqn] = None
    scribble(sd)
    return sd


def clone_state(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
