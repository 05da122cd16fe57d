"""Device tensor bytes to objects through a pinned ring: each multipart part that holds device
bytes is copied device-to-host into a pinned slot and uploaded from that slot, with no other host
copy of the tensor.

A data-file image with device segments (:class:`fastdcp.save.file_image.FilePlan`) is cut into
ranges of exactly one part (``S3Options.part_bytes``; the last range shorter) by
:func:`fastdcp.save.device_ring.cut_ranges`, so the client's parts and the ranges coincide. For
each range, in order, the object's part stream (the iterator the client pulls its parts from):

* without device bytes, yields the range's host memory as it is (blob headers, CPU tensors, zeros);
* with device bytes, takes a free slot of the ring (waiting, GIL released, while every slot is in
  flight), enqueues the range's device-to-host copies into it (one ``copy_many``, then a token),
  copies the host segments beside them and zeroes the gaps
  (:func:`~fastdcp.save.device_ring.fill_host_bytes`), waits for the token and yields the slot.

The client keeps a part's buffer until that part's request is done (its retries included): a slot
is handed out as a view of its own, and it is free again when the client drops the view (a
``weakref.finalize`` on it), so a slot is never refilled while a request may still read it.
:meth:`UploadRing.close` waits for every slot out before the pinned memory goes back to the
process's pool; one still handed out after :data:`RETURN_TIMEOUT_S` keeps the memory out of the pool
for the life of the process (logged), never reused under a request.

Memory: ``slots * part_bytes`` pinned bytes, ``slots`` bounded by the writer's
``pinned_ring_limit_bytes`` (at least one slot) and by what the uploads can keep in flight.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Iterator

import numpy as np
import torch

from ..io.pinned_pool import PinnedLease, lease_pinned
from ..save.device_ring import RangeJob, cut_ranges, fill_host_bytes
from .client import ObjectStoreError, S3Options, object_error, require_obstore
from .location import ObjectLocation
from .transfer import range_chunks

__all__ = ["UploadRing", "ring_slots", "upload_device_image", "RETURN_TIMEOUT_S"]

logger = logging.getLogger("fastdcp")

# How long closing a ring waits for the client to drop the slots it holds (a request still
# retrying after its upload was given up).
RETURN_TIMEOUT_S = 60.0

# Pinned memory of rings whose slots the client never gave back: kept, never reused.
_kept_out: list[PinnedLease] = []


def ring_slots(limit_bytes: int, part_bytes: int, objects: int, parts_in_flight: int) -> int:
    """Slots of a ring for ``objects`` uploads of ``parts_in_flight`` parts each: enough that every
    upload has a part being filled beside those in flight, at most ``limit_bytes`` of
    ``part_bytes`` slots, never fewer than one."""
    wanted = max(1, objects) * (max(1, parts_in_flight) + 1)
    return max(1, min(wanted, limit_bytes // part_bytes))


class _SerialCopier:
    """One copier shared by the uploads of a save (each on a thread of its own), used by one at a
    time: enqueueing a range's copies and recording its token happen together."""

    def __init__(self, copier: Any) -> None:
        self._copier = copier
        self._lock = threading.Lock()

    def copy_range(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        with self._lock:
            self._copier.copy_many(pairs)
            return self._copier.record()

    def wait(self, token: Any) -> None:
        with self._lock:
            self._copier.wait(token)


class UploadRing:
    """``slots`` pinned slots of ``slot_bytes``, handed out to the object storage client as views.

    Args:
        slot_bytes: one part (``S3Options.part_bytes``).
        slots: how many (:func:`ring_slots`).
        copier: the device-to-host copier (``fastdcp.io.copy_engine.DeviceCopier`` or a stand-in).
    """

    def __init__(self, slot_bytes: int, slots: int, copier: Any) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise ValueError(f"a ring needs at least one slot of a positive size, got {slots} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.copier = _SerialCopier(copier)
        self._lease = lease_pinned(slot_bytes * slots)
        self._memory = self._lease.tensor[: slot_bytes * slots]
        self._array = self._memory.numpy()
        self._free = list(range(slots))
        self._out = 0
        self._changed = threading.Condition()
        self.parts = 0  # parts uploaded from a slot

    def take(self) -> int:
        """A free slot's number, waiting until one is free."""
        with self._changed:
            while not self._free:
                self._changed.wait()
            return self._free.pop()

    def give_back(self, index: int) -> None:
        """Slot ``index`` is free again (taken and never handed out, or dropped by the client)."""
        with self._changed:
            self._free.append(index)
            self._changed.notify()

    def slot(self, index: int) -> torch.Tensor:
        return self._memory[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def hand_out(self, index: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of slot ``index`` as a view of its own: the slot is given back when
        the last reference to the view (the client's) is dropped."""
        view = self._array[index * self.slot_bytes : index * self.slot_bytes + nbytes]
        with self._changed:
            self._out += 1
            self.parts += 1
        weakref.finalize(view, self._returned, index)
        return view

    def _returned(self, index: int) -> None:
        with self._changed:
            self._out -= 1
            self._free.append(index)
            self._changed.notify_all()

    def fill(self, job: RangeJob) -> np.ndarray:
        """A slot holding range ``job`` (its device bytes copied in and waited for), handed out."""
        index = self.take()
        try:
            slot = self.slot(index)
            pairs = [(slot[offset - job.start : offset - job.start + source.numel()], source)
                     for offset, source in job.device]
            token = self.copier.copy_range(pairs)
            fill_host_bytes(slot, job)
            self.copier.wait(token)
        except BaseException:
            self.give_back(index)
            raise
        return self.hand_out(index, job.end - job.start)

    def close(self, timeout: float = RETURN_TIMEOUT_S) -> None:
        """Wait until the client has dropped every slot out, then give the memory back to the pool
        (or, after ``timeout`` seconds, keep it out of the pool: see the module docstring)."""
        with self._changed:
            returned = self._changed.wait_for(lambda: self._out == 0, timeout)
        if returned:
            self._lease.release()
        else:
            _kept_out.append(self._lease)
            logger.warning("%d pinned upload slots were still held by the object storage client %g s after "
                           "their uploads ended: %d bytes are kept out of the pinned pool", self._out, timeout,
                           self._memory.numel())


def _parts(ring: UploadRing, ranges: list[RangeJob]) -> Iterator[Any]:
    """The object's bytes in order: host memory as it is, device ranges from ring slots."""
    for job in ranges:
        if not job.device:
            yield from range_chunks(job.segments, job.start, job.end)
            continue
        part = ring.fill(job)
        yield part
        del part  # the client holds it now; the slot comes back when the client drops it


def upload_device_image(store: Any, location: ObjectLocation, name: str, segments: list[tuple],
                        device: list[tuple[int, torch.Tensor]], size: int, ring: UploadRing, options: S3Options,
                        concurrency: int) -> None:
    """Upload one data-file image with device segments as object ``name`` (see the module
    docstring): one PUT up to ``part_bytes``, else a multipart upload with ``concurrency`` parts in
    flight. Errors name the object. Precondition: ``ring.slot_bytes == options.part_bytes``."""
    obstore = require_obstore()
    ranges = cut_ranges(0, size, segments, device, ring.slot_bytes)
    body: Any = None
    try:
        if size <= options.part_bytes:
            job = ranges[0]
            body = ring.fill(job) if job.device else b"".join(range_chunks(job.segments, 0, size))
            obstore.put(store, location.key(name), body, use_multipart=False)
        else:
            obstore.put(store, location.key(name), _parts(ring, ranges), use_multipart=True,
                        chunk_size=options.part_bytes, max_concurrency=max(1, concurrency))
    except ObjectStoreError:
        raise
    except Exception as error:  # noqa: BLE001 - translated, naming the object
        raise object_error(error, location.url(name), "writing", options) from error
    finally:
        body = None  # a slot out goes back now, even when an error's traceback keeps this frame
