"""What one run of a load's placements did (:class:`PlacementStats`), filled by ``load/placement.py``
and ``load/gpu_placement.py``; the reader publishes it as ``last_stats`` (:meth:`PlacementStats.as_dict`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["PlacementStats"]


@dataclass
class PlacementStats:
    """Counters of one ``run_placements``; bytes are of stored elements, seconds of wall time."""

    bytes_needed: int = 0  # bytes of every piece's elements
    bytes_read: int = 0  # bytes the engine's run tables read (header-pass windows not counted)
    requests: int = 0  # read requests issued (rows of the run tables)
    window_pieces: int = 0  # pieces copied from the header pass's memory (CPU and device)
    runs_pieces: int = 0  # pieces read straight into their CPU destination
    staged_pieces: int = 0  # CPU pieces (after splitting to the budget) read into staging
    staging_batches: int = 0  # batches of the CPU staging buffer
    max_staging_bytes: int = 0  # size of the CPU staging buffer (both halves)
    read_seconds: float = 0.0  # in the engine's reads (on whichever thread read)
    place_seconds: float = 0.0  # in the CPU box copies
    gpu_pieces: int = 0  # pieces placed on a device (CUDA or stand-in), after splitting
    gpu_batches: int = 0  # batches uploaded to a device
    gpu_staging_bytes: int = 0  # largest pinned staging of one device (all its slots)
    gpu_slots: int = 0  # pinned slots of the last device's pipeline
    gpu_kernel_boxes: int = 0  # boxes placed by the box-copy kernel (or the stand-in's box copy)
    gpu_fallback_copies: int = 0  # device pieces placed by Tensor.copy_ instead

    def as_dict(self) -> dict[str, int | float]:
        """Every counter by name (the reader's ``last_stats``)."""
        return dataclasses.asdict(self)
