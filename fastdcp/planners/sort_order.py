"""Stable sort orders of int64 keys in linear time, for planning at thousands of ranks.

The coordinator's bulk global plan sorts one int64 key per row twice (dedup by (fqn, offsets), then
the kept rows by entry); at 16,384 ranks that is ~20 M keys a sort, where torch's comparison sort
costs ~2.4 s on one core and the extension's radix sort (``fastdcp._C.stable_argsort_u64``, over
the bits the keys actually use) ~1 s (36-bit keys; measured on a 2-core VM).
"""

from __future__ import annotations

import torch

from .._native import _C

__all__ = ["stable_argsort", "RADIX_MIN_KEYS"]

# Below this many keys torch's sort is as fast and skips the extension call.
RADIX_MIN_KEYS = 1 << 15


def stable_argsort(keys: torch.Tensor) -> torch.Tensor:
    """``torch.argsort(keys, stable=True)`` for a 1-D int64 CPU tensor: the order that sorts
    ``keys`` ascending, equal keys in index order (int64, same length).

    Keys are shifted by their minimum (order-preserving) before the radix sort, so a narrow range
    of large or negative values sorts in few passes. Falls back to ``torch.argsort`` for short
    inputs, other dtypes or devices, keys whose range and index need more than 64 bits together,
    or when the extension is not built."""
    n = keys.numel()
    if n == 0 or n < RADIX_MIN_KEYS or _C is None or keys.dtype != torch.int64 or keys.device.type != "cpu" or keys.dim() != 1:
        return torch.argsort(keys, stable=True)
    low, high = torch.aminmax(keys)
    low, high = int(low), int(high)
    if high - low >= 1 << 63:
        return torch.argsort(keys, stable=True)
    shifted = keys - low if low else keys.contiguous()
    order = torch.empty(n, dtype=torch.int64)
    if not _C.stable_argsort_u64(shifted.data_ptr(), n, order.data_ptr()):
        return torch.argsort(keys, stable=True)  # a key and its index need more than 64 bits
    return order
