"""Replicas of a tiered checkpoint's local files on peer nodes, made in the background.

With ``FastTieredWriter(..., replicas=k)`` each rank, once its files are committed in its node's
local tier, sends them to ``k`` peer ranks on the next ``k`` nodes (:meth:`NodeMap.targets`) over the
process's peer group (:mod:`fastdcp.tiered.peers`), and keeps the files its own sources send it in
its node's local directory of the same checkpoint, each beside a sidecar ``.replica.<name>`` that
records its size and CRC-32C. The coordinator also sends ``.metadata`` (and the chunk index) once
it committed locally. So after the loss of any ``k`` nodes, every file of the checkpoint is still
on some node (:mod:`fastdcp.tiered.recovery` rebuilds it).

One thread per process runs the exchanges, one save after another in save order, every rank the
same sequence (a rank whose save failed still takes part, sending nothing): no collective and no
wait on the training path. A save's exchange, on each rank: post the files to its targets; receive
its sources' files (a file is renamed into place only once its CRC-32C matches); acknowledge each
source; wait for its targets' acknowledgements; then the coordinator's ``.metadata`` the same way.
``writer.replicated`` is the future of that exchange. Host memory: none beyond the files' own pages
(sent from and received into mappings of the local files).

A failed exchange (a peer died, the group timed out, a disk filled) fails that save's future and
stops replication in this process (a :class:`ReplicaWarning`, once): the peer group can no longer
be trusted to be in step. Saves, local commits and drains go on as without replicas."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..format.metadata import METADATA_NAME
from . import local_tier
from .peers import PeerGroup, PeerTransferError, recv_bytes, recv_file, send_bytes, send_file, skip_file, wait_all

__all__ = ["ReplicaError", "ReplicaWarning", "ReplicaJob", "submit", "wait_idle", "write_sidecar", "REPLICA_PREFIX", "replica_sidecar",
           "read_sidecar"]

logger = logging.getLogger("fastdcp")

REPLICA_PREFIX = local_tier.REPLICA_PREFIX


class ReplicaError(OSError):
    """Replicating a checkpoint's files to a peer node failed (the message names the files, the
    peer and the cause)."""


class ReplicaWarning(UserWarning):
    """Replication to peer nodes failed and stopped; checkpoints are still committed locally and
    drained to the shared tier."""


def replica_sidecar(directory: str, name: str) -> str:
    """The sidecar recording a replica's size and CRC-32C."""
    return os.path.join(directory, REPLICA_PREFIX + name)


def read_sidecar(directory: str, name: str) -> dict | None:
    """The sidecar of replica ``name`` in ``directory`` (``{"size", "crc32c", "from_rank"}``), or None
    when ``name`` is not a replica (or its sidecar is unreadable)."""
    try:
        with open(replica_sidecar(directory, name)) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


@dataclass
class ReplicaJob:
    """One save's exchange on this rank.

    Args:
        peers: the process's peer group.
        replicas: k.
        directory: this checkpoint's directory in this node's local tier.
        shared_path: the checkpoint's shared location (every rank's job of one save names the same).
        names: this rank's committed data files in ``directory`` (None: this rank's save failed).
        coordinator: whether this rank commits ``.metadata`` (it then sends it once ``metadata`` resolves).
    """

    peers: PeerGroup
    replicas: int
    directory: str
    shared_path: str
    names: list[str] | None
    coordinator: bool
    metadata: Future = field(default_factory=Future)   # coordinator: [(name, bytes)] or None (no commit)
    done: Future = field(default_factory=Future)


class _Replicator:
    """The process's replication thread and its queue (fresh after a fork)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.Queue = queue.Queue()
        self.pending_metadata: Future | None = None
        self.last: Future | None = None   # the newest job's future
        self.warned = False
        # A daemon: a peer that never answers must not keep the job's processes from exiting.
        self.thread = threading.Thread(target=self._run, name="fastdcp-replicas", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job: ReplicaJob = self.jobs.get()
            try:
                if job.peers.broken is not None:
                    raise ReplicaError(f"replication to peer nodes stopped after an earlier failure: {job.peers.broken}")
                _exchange(job)
            except BaseException as error:  # noqa: BLE001 - reported through the job's future
                if not isinstance(error, ReplicaError):
                    error = ReplicaError(f"cannot replicate the files of '{job.shared_path}' to peer nodes: {error}")
                if job.peers.broken is None:
                    job.peers.broken = error
                if not self.warned:
                    self.warned = True
                    warnings.warn(f"fastdcp tiered checkpoint: {error} (replication is stopped for this process; "
                                  "checkpoints are still committed locally and drained)", ReplicaWarning, stacklevel=2)
                job.done.set_exception(error)
            else:
                job.done.set_result(None)


_replicator: _Replicator | None = None
_lock = threading.Lock()


def submit(job: ReplicaJob) -> Future:
    """Queue ``job`` behind this process's earlier exchanges; returns its future. A coordinator's
    earlier job still waiting for its ``.metadata`` gets None (that save did not commit: a new save
    began)."""
    global _replicator
    with _lock:
        if _replicator is None or _replicator.pid != os.getpid():
            _replicator = _Replicator()
        pending = _replicator.pending_metadata
        if pending is not None and not pending.done():
            pending.set_result(None)
        _replicator.pending_metadata = job.metadata if job.coordinator else None
        _replicator.last = job.done
        _replicator.jobs.put(job)
    return job.done


def wait_idle(timeout: float | None = None) -> None:
    """Wait until this process's queued exchanges are over (done or failed): the peer group then
    carries nothing else, and a load may use it. A coordinator's exchange still waiting for its
    ``.metadata`` is not waited for when no commit is coming (it gets None first)."""
    with _lock:
        replicator = _replicator if _replicator is not None and _replicator.pid == os.getpid() else None
        if replicator is None or replicator.last is None:
            return
        pending, last = replicator.pending_metadata, replicator.last
    if pending is not None and not pending.done():
        pending.set_result(None)  # a load now: the last save's commit, if any, has happened
    try:
        last.result(timeout)
    except Exception:  # noqa: BLE001 - its failure was reported through its own future
        pass


def _header(job: ReplicaJob) -> bytes:
    return json.dumps({"shared": job.shared_path, "ok": job.names is not None, "files": job.names or [],
                       "metadata": job.coordinator}).encode()


def _send(job: ReplicaJob, targets: list[int], files: list[tuple[str, bytes | None]], header: bytes) -> list:
    """Post ``header`` and each file (bytes, or None: the file of that name in the directory) to each target."""
    works: list = []
    group = job.peers.group
    for target in targets:
        works += send_bytes(group, target, header)
        for name, data in files:
            if data is None:
                works += send_file(group, target, os.path.join(job.directory, name))[0]
            else:
                works += send_bytes(group, target, data)
    return works


def _receive(job: ReplicaJob, source: int, names: list[str], what: str) -> str:
    """Receive ``names`` from ``source`` into the local directory; returns "" or what went wrong
    (a damaged file is dropped; every byte is still read, so the stream stays in step)."""
    group = job.peers.group
    problems = []
    try:
        os.makedirs(job.directory, exist_ok=True)
        local_tier.record_shared_location(job.directory, job.shared_path)
    except OSError as error:
        problems.append(str(error))  # (each file below then fails too, its bytes read all the same)
    for name in names:
        if not _safe_name(name):
            skip_file(group, source)
            problems.append(f"a file named {name!r} is not kept (not a checkpoint file's name)")
            continue
        path = os.path.join(job.directory, name)
        side = replica_sidecar(job.directory, name)
        try:
            write_sidecar(job.directory, name, receiving=True, from_rank=source)  # a replica from here on
        except OSError:
            pass  # the directory is gone (evicted as durable) or full: recv_file reports what it meets
        try:
            size, crc = recv_file(group, source, path)
            write_sidecar(job.directory, name, size=size, crc32c=crc, from_rank=source)
        except FileNotFoundError:
            # The local directory went while the bytes arrived: evicted as durable in the shared tier
            # (a replica that lags behind the newest keep_local checkpoints); nothing to keep.
            logger.info("tiered: replica %s not kept: its local directory was evicted", path)
            continue
        except (PeerTransferError, OSError) as error:
            problems.append(str(error))
            try:
                os.unlink(side)  # nothing arrived: no replica to mark
            except OSError:
                pass
            continue
    if problems:
        return f"{what} from rank {source}: " + "; ".join(problems)
    return ""


def write_sidecar(directory: str, name: str, **fields: object) -> None:
    """Write replica ``name``'s sidecar atomically (``size``, ``crc32c``, ``from_rank``; or
    ``receiving`` while its bytes arrive)."""
    side = replica_sidecar(directory, name)
    with open(side + ".tmp", "w") as f:
        json.dump(fields, f)
    os.replace(side + ".tmp", side)


def _safe_name(name: str) -> bool:
    """A data file's or the metadata's name, directly in the checkpoint's directory."""
    if not name or "/" in name or name in (".", ".."):
        return False
    return not name.startswith(".") or name == METADATA_NAME or name.startswith(METADATA_NAME + ".")


def _exchange(job: ReplicaJob) -> None:
    peers, group = job.peers, job.peers.group
    targets = peers.node_map.targets(peers.rank, job.replicas)
    sources = peers.node_map.sources(peers.rank, job.replicas)
    works = _send(job, targets, [(n, None) for n in job.names or []], _header(job))
    coordinator_sources = []
    for source in sources:
        header = json.loads(recv_bytes(group, source))
        if header.get("shared") != job.shared_path:
            raise ReplicaError(f"rank {source} replicates '{header.get('shared')}' while this rank replicates "
                               f"'{job.shared_path}': the ranks' saves are out of step")
        problem = _receive(job, source, list(header["files"]), "data files") if header["ok"] else ""
        works += send_bytes(group, source, problem.encode())
        if header.get("metadata"):
            coordinator_sources.append(source)
    problems = [recv_bytes(group, target).decode(errors="replace") for target in targets]
    wait_all(works)
    if job.coordinator:
        side = job.metadata.result()  # set by the coordinator's local commit (or None: no commit)
        files = [(name, data) for name, data in side or []]
        header = json.dumps({"shared": job.shared_path, "ok": side is not None,
                             "files": [name for name, _ in files]}).encode()
        works = _send(job, targets, files, header)
        problems += [recv_bytes(group, target).decode(errors="replace") for target in targets]
        wait_all(works)
    for source in coordinator_sources:
        header = json.loads(recv_bytes(group, source))
        problem = _receive(job, source, list(header["files"]), "the metadata") if header["ok"] else ""
        wait_all(send_bytes(group, source, problem.encode()))
    problems = [p for p in problems if p]
    if problems:
        raise ReplicaError(f"replicas of '{job.shared_path}' were refused by peer nodes: " + "; ".join(problems))
    logger.debug("tiered: rank %d's files of %s are on ranks %s", peers.rank, job.shared_path, targets)
