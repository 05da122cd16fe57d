"""The box descriptor (``fastdcp.io.boxes``): its packed layout against the compiled ``struct
BoxCopy`` (``_C.box_copy_layout``: sizeof, offsetof, the ScalarKind numbers), packing and
unpacking, and ``_C.prepare_boxes`` (validate + simplify + prefix) on packed tables."""

from __future__ import annotations

import pytest
import torch

from fastdcp import _C
from fastdcp.io import boxes as B
from fastdcp.io.boxes import BOX_BYTES, Box, pack_boxes, unpack_boxes

if not hasattr(_C, "box_copy_layout"):  # an extension built before box_copy_layout existed
    pytest.fail("fastdcp._C has no box_copy_layout(): rebuild it (python setup.py build_ext --inplace)",
                pytrace=False)
NATIVE = _C.box_copy_layout()


def test_python_layout_is_the_native_struct():
    assert BOX_BYTES == NATIVE["size"] == _C.box_copy_size() == 232
    assert B.MAX_BOX_DIMS == NATIVE["max_dims"]
    assert B.BOX_OFFSETS == NATIVE["offsets"]
    assert set(B.BOX_OFFSETS) == {"ndim", *Box._fields}  # every Box field has its place, plus ndim
    assert NATIVE["align"] == 8


def test_kinds_are_the_native_scalar_kinds():
    kinds = NATIVE["kinds"]
    assert B.RAW == kinds["raw"]
    for dtype, number in B._KIND.items():
        assert kinds[str(dtype).removeprefix("torch.")] == number, dtype
    assert B.box_kinds(torch.uint16, torch.uint16) == (B.RAW, B.RAW)
    assert B.box_kinds(torch.float32, torch.bfloat16) == (kinds["float32"], kinds["bfloat16"])
    assert B.box_kinds(torch.complex64, torch.complex128) is None


def _field(raw: bytes, name: str, signed: bool, size: int, index: int = 0) -> int:
    """A field read at the compiled struct's offset (independently of the Python definition)."""
    at = NATIVE["offsets"][name] + index * size
    return int.from_bytes(raw[at : at + size], "little", signed=signed)


CASES = [
    Box(0x7F00_1234_5678_9ABC, 0xFFFF_FFFF_FFFF_FFF0, -1, -1, 2, 2, (), (), ()),
    Box(64, 128, 6, 15, 4, 2, (5,), (3,), (1,)),
    Box(1 << 40, (1 << 40) + 4096, 4, 3, 8, 4, (2, 3, 4), (12, 4, 1), (1, 2, 6)),
    Box(1, 2, -1, -1, 16, 16, tuple(range(1, 9)), tuple(range(10, 18)), tuple(range(20, 28))),
]


def test_pack_boxes_writes_each_field_at_its_native_offset():
    packed = pack_boxes(CASES)
    assert len(packed) == len(CASES) * BOX_BYTES
    for i, box in enumerate(CASES):
        raw = bytes(packed[i * BOX_BYTES : (i + 1) * BOX_BYTES])
        n = len(box.shape)
        assert (_field(raw, "src", False, 8), _field(raw, "dst", False, 8)) == (box.src, box.dst)
        assert _field(raw, "ndim", True, 4) == n
        for name in ("src_kind", "dst_kind", "src_elem_size", "dst_elem_size"):
            assert _field(raw, name, True, 4) == getattr(box, name), name
        for name in ("shape", "src_stride", "dst_stride"):
            values = [_field(raw, name, True, 8, d) for d in range(B.MAX_BOX_DIMS)]
            assert values == list(getattr(box, name)) + [0] * (B.MAX_BOX_DIMS - n), name
        end_of_ints = NATIVE["offsets"]["dst_elem_size"] + 4
        assert raw[end_of_ints : NATIVE["offsets"]["shape"]] == b"\0" * (NATIVE["offsets"]["shape"] - end_of_ints)
    assert unpack_boxes(packed, len(CASES)) == CASES
    # plain 9-tuples pack the same
    assert pack_boxes([tuple(b) for b in CASES]) == packed


def test_pack_boxes_refuses_what_the_struct_cannot_hold():
    with pytest.raises(ValueError):
        pack_boxes([Box(1, 2, -1, -1, 4, 4, (1,) * 9, (1,) * 9, (1,) * 9)])
    with pytest.raises(ValueError):
        pack_boxes([Box(1, 2, -1, -1, 4, 4, (2, 3), (3,), (3, 1))])


def test_a_byte_box_copies_its_bytes():
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    box = Box.of_bytes(src.data_ptr(), dst.data_ptr(), 100)
    _C.Engine(1, 1 << 20).box_copy([box])  # a Box is the tuple Engine.box_copy takes
    assert torch.equal(src, dst)
    table = torch.frombuffer(pack_boxes([box]), dtype=torch.int64).clone()
    dst.zero_()
    _C.Engine(1, 1 << 20).box_copy_table(table.data_ptr(), 1)  # and packed, what the kernel reads
    assert torch.equal(src, dst)


def _packed_table(boxes: list[Box]) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.frombuffer(pack_boxes(boxes), dtype=torch.int64).clone()  # 8-byte aligned
    prefix = torch.full((len(boxes) + 1,), -7, dtype=torch.int64)
    return table, prefix


def test_prepare_boxes_simplifies_in_place_and_writes_prefix():
    boxes = [
        Box(4096, 8192, -1, -1, 4, 4, (2, 3, 4), (12, 4, 1), (12, 4, 1)),  # contiguous: becomes 1-D
        Box(4096, 8192, 6, 15, 4, 2, (1, 5, 1), (5, 1, 1), (50, 10, 1)),  # size-1 dims dropped
        Box(4096, 8192, -1, -1, 2, 2, (), (), ()),  # 0-d: one element
        Box(4096, 8192, -1, -1, 2, 2, (3, 0), (1, 1), (1, 1)),  # empty
        Box(4096, 8192, -1, -1, 1, 1, (4, 6), (1, 4), (6, 1)),  # transpose stays 2-D
    ]
    table, prefix = _packed_table(boxes)
    total = _C.prepare_boxes(table.data_ptr(), len(boxes), prefix.data_ptr())
    assert total == 24 + 5 + 1 + 0 + 24
    assert prefix.tolist() == [0, 24, 29, 30, 30, 54]
    got = unpack_boxes(table.numpy().tobytes(), len(boxes))
    assert got[0][6:] == ((24,), (1,), (1,))
    assert got[1][2:] == (6, 15, 4, 2, (5,), (1,), (10,))
    assert got[2][6:] == ((1,), (1,), (1,))
    assert got[3].shape == (0,)
    assert got[4][6:] == ((4, 6), (1, 4), (6, 1))
    assert all(g[:2] == (4096, 8192) for g in got)


@pytest.mark.parametrize(
    "bad, message",
    [
        (Box(1, 2, -1, -1, 4, 4, (3,), (1,), (0,)), "destination stride 0"),
        (Box(1, 2, 9, 6, 8, 4, (3,), (1,), (1,)), "unsupported kinds"),
        (Box(1, 2, 6, 15, 4, 4, (3,), (1,), (1,)), "element size"),
        (Box(0, 2, -1, -1, 4, 4, (3,), (1,), (1,)), "null pointer"),
    ],
)
def test_prepare_boxes_rejects_invalid_descriptors(bad, message):
    good = Box(1, 2, -1, -1, 4, 4, (3,), (1,), (1,))
    table, prefix = _packed_table([good, bad])
    with pytest.raises(ValueError, match=f"box 1: .*{message}"):
        _C.prepare_boxes(table.data_ptr(), 2, prefix.data_ptr())
