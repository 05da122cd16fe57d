"""Basic indexing of a stored tensor: ``ints``, ``slices`` (step 1) and ``Ellipsis`` turned into
the box to read (start and size per dimension) and the dimensions an integer index drops.

What :meth:`fastdcp.load.lazy.LazyCheckpoint.get_slice` accepts, checked before anything is
read: out-of-range integers raise ``IndexError`` as in torch, slices clamp as in Python, and
steps other than 1, ``None``/newaxis, tensors and lists are refused with a ``TypeError`` or
``ValueError`` saying what is supported (reading a strided selection would read the whole
bounding box anyway; ``ckpt.get_slice(k)[a:b][::2]`` says so explicitly).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

__all__ = ["Box", "box_of_index"]


@dataclass(frozen=True)
class Box:
    """The part of a tensor of shape ``len(starts)`` dims that an index selects."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    dropped: tuple[int, ...]  # dims indexed by an integer: removed from the result's shape

    @property
    def result_shape(self) -> tuple[int, ...]:
        return tuple(n for d, n in enumerate(self.sizes) if d not in self.dropped)


def box_of_index(index: Any, shape: tuple[int, ...]) -> Box:
    """The box ``tensor[index]`` covers for a tensor of ``shape`` (basic indexing only)."""
    parts = index if isinstance(index, tuple) else (index,)
    ellipses = sum(1 for p in parts if p is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    given = len(parts) - ellipses
    if given > len(shape):
        raise IndexError(f"too many indices for a tensor of {len(shape)} dimension(s): {given} given")
    if ellipses:
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        parts = parts[:at] + (slice(None),) * (len(shape) - given) + parts[at + 1 :]
    else:
        parts = parts + (slice(None),) * (len(shape) - given)
    starts: list[int] = []
    sizes: list[int] = []
    dropped: list[int] = []
    for d, (part, n) in enumerate(zip(parts, shape)):
        if isinstance(part, slice):
            start, stop, step = part.indices(n)
            if step != 1:
                raise ValueError(
                    f"get_slice supports slices with step 1 only (dimension {d} has step {part.step}); "
                    "read the enclosing range and step the result instead"
                )
            starts.append(start)
            sizes.append(max(0, stop - start))
            continue
        if part is None:
            raise TypeError("get_slice does not support None (newaxis); unsqueeze the result instead")
        if isinstance(part, bool):
            raise TypeError("get_slice does not support boolean indices")
        try:
            i = operator.index(part)
        except TypeError:
            raise TypeError(
                f"get_slice supports ints, slices and '...' only, not {type(part).__name__} (dimension {d})"
            ) from None
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of bounds for dimension {d} with size {n}")
        starts.append(i % n)
        sizes.append(1)
        dropped.append(d)
    return Box(tuple(starts), tuple(sizes), tuple(dropped))
