"""DCP's own cost, measured without any storage: the "floor" of a save or load.

`dcp.save` / `dcp.load` do a fixed amount of work per item outside any storage class (planning,
deduplication, metadata, the plan/result exchange, resolving and committing items in the
planner). To tell that apart from what a storage layer costs, the `small` scenario also runs
the very same `dcp.save` / `dcp.load` calls with

* NullStorageWriter: `write_data` returns one WriteResult per item without touching the data
  (no `resolve_data`, no bytes, no files); `finish` does nothing;
* NullStorageReader: `read_metadata` returns a Metadata object captured, outside the timing, from
  a real save of the same state; `read_data` returns an already completed future (nothing is
  read, resolved or committed: the destination is left as it was, so these "loads" are not
  verified; they load nothing by design).

A system's "own cost" is its time minus the floor measured with the same planners in the same
run (interleaved with the systems).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

FLOOR = "dcp_floor"                    # default planners, no storage
FLOOR_PLANNERS = "dcp_floor_planners"  # fastdcp's planners, no storage
BASELINE_SYSTEMS = (FLOOR, FLOOR_PLANNERS, "bare_copy")


class _NoStorage:
    """A storage_data value for every item (stock writes one _StorageInfo per item)."""

    def __repr__(self) -> str:
        return "<no storage>"


_NO_STORAGE = _NoStorage()


class NullStorageWriter(StorageWriter):
    """A StorageWriter that does no I/O at all."""

    def __init__(self) -> None:
        super().__init__()
        self.last_metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=item.index, size_in_bytes=0, storage_data=_NO_STORAGE)
                        for item in plan.items])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.last_metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class NullStorageReader(StorageReader):
    """A StorageReader that reads nothing: `metadata` comes from an earlier real save."""

    def __init__(self, metadata: Metadata) -> None:
        super().__init__()
        self.metadata = metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
