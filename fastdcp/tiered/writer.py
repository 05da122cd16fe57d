"""FastTieredWriter: a save committed to node-local storage at memory speed, drained to shared
storage (a directory or ``s3://``) in the background and committed there last.

``dcp.save`` (or ``async_save``'s ``upload_completion``) returns at the local commit, exactly as
:class:`fastdcp.FastFileSystemWriter` commits into the checkpoint's local directory
(:func:`fastdcp.tiered.local_tier.local_directory`). Then :mod:`fastdcp.tiered.drain` copies each
rank's data files to the shared tier and the coordinator writes ``.metadata`` there once all of
them are complete. ``writer.durable`` is the future of the last save's drain: on the coordinator it
is done when the checkpoint is committed in the shared tier, on other ranks when this rank's files
are there. The coordinator's is set at its local commit (None until then).

With ``replicas=k`` each rank's committed files (and the coordinator's ``.metadata``) are also sent
to ``k`` peer ranks on other nodes in the background (:mod:`fastdcp.tiered.replicas`);
``writer.replicated`` is that exchange's future."""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ..io.backends import is_backend_url
from ..objstore.client import AzureOptions, S3Options
from ..save.file_image import FilePlan
from ..save.file_sink import FileSink
from ..save.writer import FastFileSystemWriter
from . import local_tier
from .drain import LocalCommit, commit_when_drained, drain_rank_files
from .peers import NODE_ENV, PeerGroup, existing_peer_group, peer_group, ranks_on_this_node
from .replicas import ReplicaJob, submit
from .shared_tier import SharedTier, shared_tier_for

__all__ = ["FastTieredWriter", "DEFAULT_DRAIN_TIMEOUT_S"]

DEFAULT_DRAIN_TIMEOUT_S = 3600.0
_RANK_OF_FILE = re.compile(r"^__(\d+)_")
_TOKEN_IN_NAME = re.compile(r"^__\d+_([0-9a-f]+)_")


class FastTieredWriter(FastFileSystemWriter):
    """``FastTieredWriter("s3://bucket/run/step100")`` or ``FastTieredWriter("/shared/run/step100")``:
    the path is where the checkpoint must end up (the shared tier); it is first committed locally.

    ``local_root``: the node-local directory the checkpoints are committed to first (default
    ``$FASTDCP_LOCAL_TIER``, else ``/dev/shm/fastdcp-tiered``); each checkpoint gets its own
    directory under it. ``keep_local``: local checkpoints kept once durable in the shared tier
    (default 2; a checkpoint not yet durable is never evicted). ``drain_timeout_s``: how long the
    coordinator waits for every rank's files to reach the shared tier before failing the drain.
    ``s3_options`` / ``azure_options``: for an ``s3://`` / ``az://`` shared tier (default: the
    ``AWS_*`` / ``AZURE_STORAGE_*`` environment). Every
    other argument is :class:`fastdcp.FastFileSystemWriter`'s, for the local commit.

    ``replicas``: peer nodes that keep a copy of each rank's local files (default 0; needs
    ``torch.distributed`` and more nodes than ``replicas``); ``node``: this process's node name
    (default ``$FASTDCP_NODE``, else torchrun's ``GROUP_RANK``, else the host name)."""

    def __init__(self, path: str | os.PathLike, *args: Any, local_root: str | os.PathLike | None = None,
                 keep_local: int = 2, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 s3_options: S3Options | None = None, azure_options: AzureOptions | None = None, replicas: int = 0, node: str | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 0:
            raise ValueError(f"keep_local must be an int >= 0, got {keep_local!r}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
        if not drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {drain_timeout_s!r}")
        self.local_root = local_tier.local_root_from(local_root)
        self.keep_local = keep_local
        self.drain_timeout_s = float(drain_timeout_s)
        self.s3_options = s3_options
        self.azure_options = azure_options
        self.shared_path = self._shared_id(path)
        super().__init__(local_tier.local_directory(self.local_root, self.shared_path), *args, **kwargs)
        self.sink = TieredFileSink(self, self.sink)
        self.durable: Future | None = None
        self._rank_drain: Future | None = None
        self._commits = True  # whether this rank's finish() commits (see set_up_storage_writer)
        self.replicas = replicas
        self.node = node
        self.replicated: Future | None = None
        self._replica_job: ReplicaJob | None = None
        # Nodes named (FASTDCP_NODE or node=): the node map says which ranks share the local tier.
        self._node_named = node is not None or bool(os.environ.get(NODE_ENV))
        if replicas and dist.is_available() and dist.is_initialized():
            self._peers()  # the peer group is made collectively: here, on every rank alike

    def _peers(self) -> PeerGroup | None:
        """The process's peer group (None when this writer needs none: no replicas, nodes not
        named), checked to have room for this writer's replicas."""
        if not (self.replicas or self._node_named):
            return None
        if not (dist.is_available() and dist.is_initialized()):
            if not self.replicas:
                return None
            raise ValueError(f"FastTieredWriter(replicas={self.replicas}) needs torch.distributed initialized "
                             "(torchrun, or init_process_group): replicas go to ranks on other nodes")
        peers = peer_group(self.node)
        nodes = len(peers.node_map.nodes)
        if self.replicas and self.replicas >= nodes:
            raise ValueError(f"FastTieredWriter(replicas={self.replicas}) needs more than {self.replicas} nodes; this "
                             f"job runs on {nodes} ({', '.join(peers.node_map.names[:4])}"
                             f"{', ...' if nodes > 4 else ''}): set FASTDCP_NODE per process where nodes are not "
                             "told apart by host name or torchrun's GROUP_RANK, or lower replicas")
        return peers

    @staticmethod
    def _shared_id(path: str | os.PathLike) -> str:
        return str(path) if is_backend_url(path) else os.path.abspath(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_backend_url(checkpoint_id) or FastFileSystemWriter.validate_checkpoint_id(checkpoint_id)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["durable"] = None  # futures stay in the process that drains
        state["_rank_drain"] = None
        if state.get("replicas"):
            raise TypeError(f"FastTieredWriter(replicas={self.replicas}) cannot be sent to another process (its "
                            "replicas travel over this process's peer group): use dcp.async_save's default "
                            "thread mode, or replicas=0")
        state["replicated"] = None
        state["_node_named"] = False  # another process: its own environment
        state["_replica_job"] = None
        return state

    @property
    def local_path(self) -> str:
        """The checkpoint's directory in the local tier."""
        return str(self.path)

    @property
    def shared_tier(self) -> SharedTier:
        return shared_tier_for(self.shared_path, self.s3_options, self.azure_options)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.shared_path = self._shared_id(checkpoint_id)
            checkpoint_id = local_tier.local_directory(self.local_root, self.shared_path)
        super().reset(checkpoint_id)

    def stage(self, state_dict: dict[str, Any]) -> Any:
        self.durable = None  # async_save stages in the caller: from here on, durable is the new save's
        return super().stage(state_dict)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.durable = None
        self.replicated = None
        self._replica_job = None
        if kwargs.get("use_collectives", True):
            # Made here on every rank of a collective save (a collective the first time); replicas that
            # cannot be placed are refused here, before anything is written.
            self._peers()
        # The coordinator's (and, in a rank-local save, every rank's) durable future is the shared
        # commit, known only once finish() ran.
        self._commits = bool(is_coordinator) or not kwargs.get("use_collectives", True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        self._rank_drain = None
        try:
            result = super().write_data(plan, planner)  # may start the write-through (_write_files)
            result.wait()  # this rank's files are complete locally (the fast path is already done)
        except BaseException:
            self._replicate(None)  # the peers still expect this save's exchange: an empty one
            raise
        local_tier.record_shared_location(self.local_path, self.shared_path)
        prefix = self._written_prefix or ""
        names = sorted(n for n in os.listdir(self.local_path) if prefix and n.startswith(prefix))
        if self._rank_drain is None:  # not staged: copy the local files once they are complete
            self._rank_drain = drain_rank_files(self.shared_tier, self.local_path, names, _token_in(prefix) or "",
                                                self._rank(), self.local_root, self.keep_local)
        self.durable = None if self._commits else self._rank_drain
        self._replicate(names)
        return result

    def _replicate(self, names: list[str] | None) -> None:
        """Queue this save's exchange with the peer nodes (``names``: this rank's committed files;
        None: its save failed)."""
        if not self.replicas:
            return
        peers = self._peers()
        assert peers is not None
        job = ReplicaJob(peers, self.replicas, self.local_path, self.shared_path, names, self._commits)
        self._replica_job = job
        self.replicated = submit(job)

    def _rank(self) -> int:
        return int(getattr(self, "rank", 0) or 0)

    def _staged_images(self, files: list[FilePlan]) -> bool:
        if self._stager is None or not files or any(f.device_segments for f in files):
            return False
        # A segment outside every held slab is live memory (a sync save's, or a streamed tensor's).
        held = self._stager.held_ranges()
        return all(any(start <= segment[1] and segment[1] + segment[2] <= end for start, end in held)
                   for f in files for segment in f.segments if len(segment) == 3 and segment[2])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        job, self._replica_job = self._replica_job, None
        try:
            super().finish(metadata, results)  # the local commit
        except BaseException:
            if job is not None:
                job.metadata.set_result(None)  # nothing committed: the peers get no .metadata
            raise
        committed = self._last_commit
        assert committed is not None
        index_name = committed.chunk_index[0] if committed.chunk_index else None
        side = []
        if index_name is not None:
            with open(os.path.join(self.local_path, index_name), "rb") as f:
                side.append((index_name, f.read()))
        with open(os.path.join(self.local_path, committed.name), "rb") as f:
            metadata_bytes = f.read()
        data_files = frozenset(n for n in committed.files if n != index_name)
        ranks = frozenset(int(m.group(1)) for m in map(_RANK_OF_FILE.match, data_files) if m)
        token = next(filter(None, map(_token_in, sorted(data_files))), None) or self._save_token or ""
        commit = LocalCommit(self.local_path, committed.name, metadata_bytes, tuple(side), data_files, token, ranks)
        if job is not None and not job.metadata.done():
            job.metadata.set_result([*side, (committed.name, metadata_bytes)])
        self.durable = commit_when_drained(self.shared_tier, commit, self._rank_drain, self.drain_timeout_s,
                                           self.local_root, self.keep_local)

    def wait_durable(self, timeout: float | None = None) -> None:
        """Wait until the last save is durable in the shared tier (see the module docstring);
        raises the drain's error, or TimeoutError."""
        if self.durable is None:
            raise RuntimeError("no tiered save has been committed locally through this writer in this process "
                               "(wait for dcp.save to return, or for async_save's upload_completion)")
        self.durable.result(timeout)


def _token_in(name: str) -> str | None:
    """The save token in a fastdcp data file name or prefix (``__{rank}_{token}_...``)."""
    m = _TOKEN_IN_NAME.match(name)
    return m.group(1) if m else None


class TieredFileSink:
    """The local tier's files (:class:`fastdcp.save.file_sink.FileSink`): the local sink's writes;
    and when every byte of the images is in a staged slab (``async_save`` staged it, nothing
    streamed from live memory, no GPU bytes), the same images written to the shared tier at the
    same time, so that durability there does not wait for the local copy and a read back (the
    writer keeps the slab until that write is done). The local commit checks only the files of
    the ranks on this node: the others are in their own nodes' local tiers.

    Args:
        writer: the tiered writer; local: the sink of its local directory.
    """

    def __init__(self, writer: FastTieredWriter, local: FileSink) -> None:
        self.writer = writer
        self.local = local

    def claim_token(self) -> str:
        return self.local.claim_token()

    def storage_prefix(self, rank: int, token: str) -> str:
        return self.local.storage_prefix(rank, token)

    def data_file_path(self, storage_key: str) -> str:
        return self.local.data_file_path(storage_key)

    def write_threads(self) -> int:
        return self.local.write_threads()

    def write_files(self, files: list[FilePlan], options: Any) -> Future | None:
        writer = self.writer
        through = None
        if writer._staged_images(files):
            prefix = writer._written_prefix or ""
            images = [(os.path.basename(f.path), f.size, f.segments) for f in files]
            through = writer._rank_drain = drain_rank_files(
                writer.shared_tier, writer.local_path, [name for name, _, _ in images], _token_in(prefix) or "",
                writer._rank(), writer.local_root, writer.keep_local, images=images)
        self.local.write_files(files, options)
        return through

    def files_written_here(self, new_files: set[str]) -> set[str]:
        # (only a group that exists: a rank-local save must not start a collective here)
        writer = self.writer
        here = ranks_on_this_node(existing_peer_group() if writer.replicas or writer._node_named else None)
        if here is None:
            return set(new_files)
        return {name for name in new_files if (m := _RANK_OF_FILE.match(name)) is None or int(m.group(1)) in here}
