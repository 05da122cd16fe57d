"""fastdcp.planners.sort_order: the extension's radix sort gives torch.argsort(stable=True)'s order."""

from __future__ import annotations

import pytest
import torch

import fastdcp
from fastdcp.planners import sort_order
from fastdcp.planners.sort_order import stable_argsort


@pytest.fixture(autouse=True)
def _always_radix(monkeypatch):
    monkeypatch.setattr(sort_order, "RADIX_MIN_KEYS", 0)


def _cases():
    g = torch.Generator().manual_seed(0)
    yield "empty", torch.zeros(0, dtype=torch.int64)
    yield "one", torch.tensor([7])
    yield "all equal", torch.full((1000,), 5, dtype=torch.int64)
    yield "already sorted", torch.arange(5000)
    yield "descending", torch.arange(5000).flip(0)
    yield "few distinct (ties keep index order)", torch.randint(0, 3, (20000,), generator=g)
    yield "one digit", torch.randint(0, 2000, (20000,), generator=g)
    yield "34 bits", torch.randint(0, 1 << 34, (50000,), generator=g)
    yield "too wide to pack with the index (falls back)", torch.randint(0, 1 << 62, (5000,), generator=g)
    yield "negative and positive", torch.randint(-(1 << 30), 1 << 30, (50000,), generator=g)
    yield "large offset, narrow range", (1 << 62) + torch.randint(0, 100, (5000,), generator=g)
    yield "full int64 range (falls back)", torch.tensor([-(1 << 63), (1 << 63) - 1, 0, -1, 5])
    yield "one high digit differs", torch.tensor([1 << 50, 0, 1 << 50, 0, 1])


@pytest.mark.parametrize("name,keys", list(_cases()), ids=[name for name, _ in _cases()])
def test_stable_argsort_equals_torch(name, keys):
    assert torch.equal(stable_argsort(keys), torch.argsort(keys, stable=True))


def test_non_contiguous_and_other_dtypes():
    keys = torch.randint(0, 1000, (4000, 2))[:, 1]
    assert not keys.is_contiguous()
    assert torch.equal(stable_argsort(keys), torch.argsort(keys, stable=True))
    small = torch.randint(0, 100, (3000,), dtype=torch.int32)
    assert torch.equal(stable_argsort(small), torch.argsort(small, stable=True))


@pytest.mark.skipif(fastdcp._C is None, reason="needs the compiled extension")
def test_the_extension_checks_its_addresses_and_refuses_keys_too_wide():
    with pytest.raises(ValueError, match="null address"):
        fastdcp._C.stable_argsort_u64(0, 3, 0)
    keys = torch.tensor([1 << 62, 0, 5])  # 63 bits + 2 index bits
    order = torch.full((3,), -1, dtype=torch.int64)
    assert fastdcp._C.stable_argsort_u64(keys.data_ptr(), 3, order.data_ptr()) is False
    assert order.tolist() == [-1, -1, -1]  # nothing written
    keys = torch.tensor([1 << 61, 0, 5])
    assert fastdcp._C.stable_argsort_u64(keys.data_ptr(), 3, order.data_ptr()) is True
    assert order.tolist() == [1, 2, 0]
