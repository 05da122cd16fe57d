"""The box descriptor of the native box copy, defined once: :class:`Box` and its packed bytes.

A :class:`Box` is what ``Engine.box_copy`` takes (it is a tuple), and :func:`pack_boxes` writes
boxes as ``struct BoxCopy`` (``csrc/box_copy.hpp``), the form ``_C.prepare_boxes``,
``Engine.box_copy_table`` and the CUDA kernel read. The struct's layout is derived from
:data:`BOX_FIELDS`; ``tests/io/test_boxes.py`` checks it against the extension's own offsets.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import torch

__all__ = ["Box", "BOX_FIELDS", "BOX_BYTES", "BOX_OFFSETS", "MAX_BOX_DIMS", "RAW", "box_kinds", "pack_boxes",
           "unpack_boxes"]

# The most dimensions a box may have (kMaxBoxDims).
MAX_BOX_DIMS = 8

# Raw elements (ScalarKind::kRawBytes): a byte copy of any dtype.
RAW = -1


class Box(NamedTuple):
    """One strided region to copy: addresses, element kinds and sizes, shape and element strides."""

    src: int
    dst: int
    src_kind: int
    dst_kind: int
    src_elem_size: int
    dst_elem_size: int
    shape: Sequence[int]
    src_stride: Sequence[int]
    dst_stride: Sequence[int]

    @classmethod
    def of_bytes(cls, src: int, dst: int, nbytes: int) -> "Box":
        """A plain copy of ``nbytes`` contiguous bytes."""
        return cls(src, dst, RAW, RAW, 1, 1, [nbytes], [1], [1])


# struct BoxCopy, field by field in declaration order: (name, struct code); "x" is padding.
BOX_FIELDS: tuple[tuple[str, str], ...] = (
    ("src", "Q"), ("dst", "Q"),
    ("ndim", "i"), ("src_kind", "i"), ("dst_kind", "i"), ("src_elem_size", "i"), ("dst_elem_size", "i"),
    ("", "4x"),  # to the 8-byte alignment of the arrays
    ("shape", f"{MAX_BOX_DIMS}q"), ("src_stride", f"{MAX_BOX_DIMS}q"), ("dst_stride", f"{MAX_BOX_DIMS}q"),
)
_BOX_STRUCT = struct.Struct("<" + "".join(code for _, code in BOX_FIELDS))
BOX_BYTES = _BOX_STRUCT.size
# Byte offset of each named field.
BOX_OFFSETS: dict[str, int] = {
    name: struct.calcsize("<" + "".join(code for _, code in BOX_FIELDS[:i]))
    for i, (name, _) in enumerate(BOX_FIELDS) if name
}

# c10::ScalarType numbers of the kinds the box copy knows (ScalarKind in csrc/box_copy.hpp).
_KIND = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex64: 9, torch.complex128: 10,
    torch.bool: 11, torch.bfloat16: 15,
}
# Kinds converted between (complex only copies to itself).
_CONVERTIBLE = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                          torch.float16, torch.bfloat16, torch.float32, torch.float64))


def box_kinds(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> tuple[int, int] | None:
    """The (src_kind, dst_kind) of a copy, or None when the box copy cannot convert between them."""
    if src_dtype == dst_dtype:
        return RAW, RAW
    if src_dtype in _CONVERTIBLE and dst_dtype in _CONVERTIBLE:
        return _KIND[src_dtype], _KIND[dst_dtype]
    return None


def pack_boxes(boxes: Sequence[Sequence]) -> bytearray:
    """``boxes`` (:class:`Box` or the same 9-tuples) as packed ``struct BoxCopy``; unused dimension
    slots and the padding are zero. Raises ValueError for more than 8 dims or mismatched strides."""
    out = bytearray(len(boxes) * BOX_BYTES)
    for i, (src, dst, src_kind, dst_kind, src_elem, dst_elem, shape, src_stride, dst_stride) in enumerate(boxes):
        ndim = len(shape)
        if ndim > MAX_BOX_DIMS or len(src_stride) != ndim or len(dst_stride) != ndim:
            raise ValueError(f"box {i}: {ndim} dims (at most {MAX_BOX_DIMS}) or mismatched strides")
        pad = (0,) * (MAX_BOX_DIMS - ndim)
        _BOX_STRUCT.pack_into(out, i * BOX_BYTES, src, dst, ndim, src_kind, dst_kind, src_elem, dst_elem,
                              *shape, *pad, *src_stride, *pad, *dst_stride, *pad)
    return out


def unpack_boxes(data: bytes | bytearray | memoryview, count: int) -> list[Box]:
    """The first ``count`` packed descriptors of ``data`` as boxes (shape and strides as tuples)."""
    out = []
    for i in range(count):
        src, dst, ndim, sk, dk, se, de, *dims = _BOX_STRUCT.unpack_from(data, i * BOX_BYTES)
        shape, src_stride, dst_stride = (tuple(dims[j * MAX_BOX_DIMS : j * MAX_BOX_DIMS + ndim]) for j in range(3))
        out.append(Box(src, dst, sk, dk, se, de, shape, src_stride, dst_stride))
    return out
