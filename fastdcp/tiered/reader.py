"""FastTieredReader: load a tiered checkpoint from the node's local tier when it holds it whole,
else from the shared tier.

Each rank decides for itself when it reads ``.metadata``: the local copy (the directory
:class:`fastdcp.FastTieredWriter` committed to) is used when its ``.metadata`` parses and every
file it names is there, as after a restart on the same node, even when the drain never finished;
otherwise the shared tier. Both tiers hold the same bytes under the same names, so ranks that
decided differently load the same checkpoint. ``tier`` says which one this rank read.

With ``from_peers=True`` (every rank, ``torch.distributed`` initialized) the ranks decide together:
the checkpoint is rebuilt from the local tiers of the nodes that hold it, files moved between nodes
as the load needs them (:mod:`fastdcp.tiered.recovery`; ``tier`` "local" or "peers"), else every
rank reads the shared tier ("shared")."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageReader

from ..format.metadata import METADATA_NAME
from ..load.deadline import DEADLINE_FROM_ENV, END, START, LoadCheckIns, begin_load, resolve_load_deadline, stall_point
from ..load.reader import FastFileSystemReader
from ..io.backends import backend_for, is_backend_url
from ..objstore.client import AzureOptions, S3Options
from . import local_tier
from .peers import peer_group
from .recovery import Recovery, fetch_missing, plan_recovery

__all__ = ["FastTieredReader"]


class FastTieredReader(StorageReader):
    """``FastTieredReader("s3://bucket/run/step100")`` or ``FastTieredReader("/shared/run/step100")``
    (the checkpoint's shared location, as given to :class:`fastdcp.FastTieredWriter`), with the same
    ``local_root``. ``s3_options`` / ``azure_options`` for an ``s3://`` / ``az://`` shared tier; every other keyword is
    :class:`fastdcp.FastFileSystemReader`'s. Attributes the chosen reader has (``last_stats``,
    ``last_read_mode``) are read through.

    ``load_deadline_s`` guards the load as a whole (:mod:`fastdcp.load.deadline`), named by the
    shared location: ranks that chose different tiers check in together, and a rank that tried
    its local copy first checks in once.

    ``from_peers``: rebuild the checkpoint from the nodes' local tiers (see the module docstring);
    ``node``: this process's node name, as the writer's. ``shared_bytes_read``: the bytes this rank's
    last load read from the shared tier."""

    def __init__(self, path: str | os.PathLike, *, local_root: str | os.PathLike | None = None,
                 s3_options: S3Options | None = None, azure_options: AzureOptions | None = None, from_peers: bool = False, node: str | None = None,
                 **reader_kwargs: Any) -> None:
        self.local_root = local_tier.local_root_from(local_root)
        self.from_peers = bool(from_peers)
        self.node = node
        self.shared_bytes_read = 0
        self.s3_options = s3_options
        self.azure_options = azure_options
        self.load_deadline_s = resolve_load_deadline(reader_kwargs.pop("load_deadline_s", DEADLINE_FROM_ENV))
        self._check_ins: LoadCheckIns | None = None
        self._reader_kwargs = {**reader_kwargs, "load_deadline_s": None}  # the tiered reader checks in itself
        self._point_at(path)

    def _point_at(self, path: str | os.PathLike) -> None:
        self.shared_path = str(path) if is_backend_url(path) else os.path.abspath(os.fspath(path))
        self.local_path = local_tier.local_directory(self.local_root, self.shared_path)
        self.tier: str | None = None  # "local" or "shared", once read_metadata chose
        self._inner: StorageReader | None = None
        self._local: FastFileSystemReader | None = None
        self._shared: StorageReader | None = None
        self._recovery: Recovery | None = None

    def _local_reader(self) -> FastFileSystemReader:
        if self._local is None:
            self._local = FastFileSystemReader(self.local_path, **self._reader_kwargs)
        return self._local

    def _shared_reader(self) -> StorageReader:
        if self._shared is None:
            backend = backend_for(self.shared_path)
            if backend is not None:
                options = {k: v for k, v in (("s3_options", self.s3_options), ("azure_options", self.azure_options))
                           if v is not None}
                self._shared = backend.load("reader")(self.shared_path, **options, **self._reader_kwargs)
            else:
                self._shared = FastFileSystemReader(self.shared_path, **self._reader_kwargs)
        return self._shared

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_backend_url(checkpoint_id) or FastFileSystemReader.validate_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return self.shared_path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self._point_at(checkpoint_id)
        for reader in (self._local, self._shared):
            if reader is not None:
                reader.reset()
        self._inner, self.tier, self._recovery = None, None, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        check_ins = None
        if kwargs.get("rank") is None:
            self._check_ins = None
            check_ins = begin_load(self.load_deadline_s, self.shared_path,
                                   f"reading .metadata of {self.shared_path} (or of its local copy {self.local_path})")
            stall_point("read_metadata")
        try:
            metadata = self._choose_and_read_metadata(*args, **kwargs)
        finally:
            if check_ins is not None:
                check_ins.check_in(START)  # raises LoadDeadlineError past the deadline
        self._check_ins = check_ins
        return metadata

    def _choose_and_read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self.from_peers and rank is None and dist.is_available() and dist.is_initialized():
            self._recovery = plan_recovery(peer_group(self.node), self.local_path, self.shared_path)
            if self._recovery.tier == "shared":
                self._inner, self.tier = self._shared_reader(), "shared"
            else:
                self._inner, self.tier = self._local_reader(), self._recovery.tier
            return self._inner.read_metadata(*args, **kwargs)
        name = f"__{rank}{METADATA_NAME}" if rank is not None else METADATA_NAME
        if os.path.isfile(os.path.join(self.local_path, name)):
            local = self._local_reader()
            try:
                metadata = local.read_metadata(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a damaged local copy: the shared tier's is the checkpoint
                metadata = None
            if metadata is not None and local_tier.holds_every_file(self.local_path, metadata):
                self._inner, self.tier = local, "local"
                return metadata
        self._inner, self.tier = self._shared_reader(), "shared"
        return self._inner.read_metadata(*args, **kwargs)

    def _chosen(self) -> StorageReader:
        if self._inner is None:  # DCP reads the metadata first; a caller that did not gets the shared tier
            self._inner, self.tier = self._shared_reader(), "shared"
        return self._inner

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._chosen().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self._chosen().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return self._chosen().prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        check_ins, self._check_ins = self._check_ins, None
        if check_ins is None:
            return self._read_data(plan, planner)
        try:
            inner = self._chosen()
            check_ins.status(f"reading its data from the {self.tier} tier, {getattr(inner, 'path', self.shared_path)}")
            stall_point("read_data")
            return self._read_data(plan, planner)
        finally:
            check_ins.check_in(END)

    def _read_data(self, plan: Any, planner: Any) -> Any:
        inner = self._chosen()
        recovery = self._recovery
        if recovery is not None and recovery.tier != "shared":
            storage_data = inner.storage_data
            fetch_missing(recovery, {storage_data[item.storage_index].relative_path for item in plan.items},
                          self.shared_path)
            self.tier = recovery.tier
        result = inner.read_data(plan, planner)
        self.shared_bytes_read = 0
        if self.tier == "shared":
            stats = getattr(inner, "last_stats", None) or {}
            self.shared_bytes_read = int(stats.get("bytes_read", 0)) or sum(
                int(inner.storage_data[item.storage_index].length or 0) for item in plan.items)
        return result

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(f"{type(self).__name__}.{name}: no load has chosen a tier yet")
        return getattr(inner, name)
