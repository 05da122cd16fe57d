"""Planning at thousands of ranks (`plan_scale`): every coordinator and per-rank step of DCP's
save and load protocol for N simulated ranks in one process, stock against fastdcp.

What is simulated: rank ``r`` of an FSDP2 job of N ranks holding a Llama-7B-shaped model with
AdamW state (fastdcp/bench/simulated_ranks.py: ``get_state_dict``'s ``{"model", "optim"}``,
~1,190 entries per rank, every tensor a ``Shard(0)`` DTensor on a ``fake`` process group
re-initialised as rank ``r``). The steps are those of torch's ``_save_state_dict`` /
``_load_state_dict`` with ``use_collectives=True``, called on the systems' public classes,
collectives replaced by what they do to the data (``gather_object``: ``pickle.dumps`` on each
rank, ``pickle.loads`` of all N on the coordinator; ``scatter_object_list`` the reverse;
``broadcast_object_list``: pickled once, unpickled by every rank):

* save (first): per rank ``set_up_planner``, ``set_up_storage_writer``, ``create_local_plan``,
  ``prepare_local_plan``, pickle; coordinator: unpickle N, ``create_global_plan``,
  ``prepare_global_plan``, pickle N; per rank: unpickle, ``finish_plan``, the write results
  (what ``write_data`` returns, without I/O: :func:`simulated_ranks.write_results`; for fastdcp
  passed through ``fastdcp.save.results.pack_write_results``, as ``FastFileSystemWriter`` returns
  them), pickled; coordinator: unpickle N, ``finish`` with the real writer into a real directory
  (the data files the results name exist, sparse), then the ``.metadata`` DCP broadcasts back
  (``all_reduce`` returns ``finish``'s metadata to every rank);
* save (repeat): the same protocol again with new planner and writer objects and a new state dict
  of the same structure, into another directory, up to ``finish_plan``;
* load: a rank's first ``read_metadata`` in its process (fastdcp's metadata cache cleared), then
  for the same sharding (N ranks) and resharded to N/2 ranks: per rank ``set_up_planner``,
  ``set_up_storage_reader``, ``create_local_plan``, ``prepare_local_plan``, pickle; coordinator:
  unpickle, ``create_global_plan``, ``prepare_global_plan``, pickle; per rank: unpickle,
  ``finish_plan``;
* replicated load (``--plan-replicas R``, R > 1): the same checkpoint loaded HSDP-like, the state
  sharded over N/R ranks and replicated R times, rank ``r`` holding shard ``r % (N/R)`` (a
  ``(R, N/R)`` mesh of (replicate, shard) dimensions: the replica group of shard ``s`` is ranks
  ``s, s + N/R, ..., s + (R-1) N/R``). A rank's plan in that layout is its shard's plan in an
  N/R-rank load, so the phase is the load into N/R ranks above (``load_half`` itself when R = 2,
  else a ``load_replicated`` phase into N/R ranks), and from its plans
  :class:`ReplicatedLoadReads` counts the tensor bytes each rank reads from storage without
  read-once (its whole plan) and with it (its share of its group's plan as
  ``fastdcp.load.read_once.deal_items`` deals it), the job's totals and the checkpoint's tensor
  bytes.

Systems: ``stock`` (DefaultSavePlanner/DefaultLoadPlanner, FileSystemWriter/FileSystemReader) and
``fastdcp`` (FastSavePlanner/FastLoadPlanner, FastFileSystemWriter/FastFileSystemReader).

Object storage (``--plan-storage s3``): fastdcp alone, with ``FastS3Writer`` / ``FastS3Reader`` on a
local S3 server (SeaweedFS behind the counting proxy, :mod:`fastdcp.bench.s3_endpoint`): the
coordinator's ``finish`` PUTs the chunk index and ``.metadata``, and each sample rank's own load
fetches its metadata by ranged GETs (the bytes and requests are recorded). The data objects are
not written (no step of the protocol reads them; the local run's data files are sparse).

Separate processes: every simulated rank's steps run inside
``fastdcp.planners.plan_cache.simulated_process(state)``, so one rank's planner memory (plan
caches, the plans it sent, pickled and unpickled blobs) never serves another. The coordinator
(rank 0) keeps one state through the save and its repeat, and so do the measured sample ranks
(:func:`simulated_ranks.sample_ranks`: 0, 1, N/2, N-1). Every other rank is played twice, once
before the coordinator's plan (its local plan, pickled) and once after it (a fresh process state:
its local plan made again from a new state dict, checked equal to the one it sent, and for a plan
sent as columns registered under the token it was sent under; then its global plan, its write
results and its repeat's local plan, warm): keeping every rank's state (1.9 MiB each for fastdcp)
would take 31 GiB at 16,384 ranks. These unmeasured steps run in ``--plan-workers`` forked
processes (each with its own simulated process group); nothing is measured while they run. A load
is a new job: fresh states.

Shortcuts, each stated in the table where it applies:

* rank-side steps are timed on the sample ranks (the table shows the slowest); the others run
  untimed, only to produce what the coordinator receives;
* every rank reads the same ``.metadata``: it is read once, by a fresh rank process (timed),
  and that reader object (set up by each rank in turn, the coordinator last) serves all ranks;
* above ``--plan-all-load-ranks`` (default 4,096) ranks, a load runs on the sample ranks only
  (their own-process loads and local plans): the other ranks' load plans and the coordinator's
  round of that load are not simulated (no bar depends on them);
* when building every rank's local load plan with the system's planner would take longer than
  ``--plan-budget`` seconds (estimated from the sample ranks), the other ranks' plans are built by
  :func:`simulated_ranks.reference_read_items` (stock's items, found by bisection) and checked
  equal to the planner's on every sample rank;
* stock's global save plan validation is O(N^2) per tensor at this layout (about 30 min at
  4,096 ranks): above ``EXACT_VALIDATION_MAX_RANKS`` it is timed on one entry per chunk layout
  and extrapolated (:func:`simulated_ranks.estimate_validation`), and added to
  ``create_global_plan``.

Memory: per step, the peak resident memory above the RSS before it (VmHWM after a reset, heap
trimmed first: ``HostPeak.start(collect=False)``); for coordinator steps also what the step left held. The coordinator's peak
per phase is estimated as the largest (memory held by its earlier steps of the phase + the step's
peak + the bytes it received for the step).

Checks (a failure raises VerificationError at the end of the scenario): the reference read plans
equal the planner's on the sample ranks; at N <= ``VERIFY_METADATA_MAX_RANKS`` fastdcp's
``.metadata`` unpickles with plain ``pickle`` to the same ``state_dict_metadata`` as stock's; the
load plans of both systems are equal on rank 1. fastdcp/bench/plan_scale_report.py makes the
table, the growth exponents, the targets and the JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import inspect
import math
import multiprocessing
import os
import pickle
import shutil
import time
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from .host_peak import HostPeak
from .simulated_ranks import (
    LLAMA_7B,
    ChunkLayout,
    ModelShape,
    SimulatedRanks,
    create_sparse_files,
    deferred_stock_validation,
    estimate_validation,
    reference_read_items,
    sample_ranks,
    tensor_blob_overhead,
    write_results,
)
from .state import VerificationError

SCENARIO = "plan_scale"
GROUP = "plan_scale"
SYSTEMS = ("stock", "fastdcp")
FULL_RANKS = (256, 1024, 4096)
QUICK_RANKS = (8, 32)
DEFAULT_BUILD_BUDGET_S = 600.0
DEFAULT_ALL_LOAD_PLANS_MAX_RANKS = 4096
EXACT_VALIDATION_MAX_RANKS = 256
VERIFY_METADATA_MAX_RANKS = 256

# Phases and sides of a step.
SAVE, REPEAT, READ, LOAD_SAME, LOAD_HALF = "save", "repeat", "read", "load_same", "load_half"
RANK, COORDINATOR = "rank", "coordinator"
PHASES = (SAVE, REPEAT, READ, LOAD_SAME, LOAD_HALF)
# The load into N/R ranks whose plans are the replicated layout's (--plan-replicas R, R > 2).
LOAD_REPLICATED = "load_replicated"

# Step names, in protocol order (the report keeps this order).
SET_UP_PLANNER = "set_up_planner"
SET_UP_WRITER = "set_up_storage_writer"
SET_UP_READER = "set_up_storage_reader"
LOCAL_PLAN = "create_local_plan"
PREPARE_LOCAL = "prepare_local_plan"
GATHER_SEND = "gather: send (pickle)"
GATHER_RECEIVE = "gather: receive (unpickle N)"
GLOBAL_PLAN = "create_global_plan"
VALIDATION_ESTIMATE = "create_global_plan: of which stock's validation (estimated)"
PREPARE_GLOBAL = "prepare_global_plan"
SCATTER_SEND = "scatter: send (pickle N)"
SCATTER_RECEIVE = "scatter: receive (unpickle)"
FINISH_PLAN = "finish_plan"
RESULTS_SEND = "write results: send (pack + pickle)"
RESULTS_RECEIVE = "write results: receive (unpickle N)"
FINISH = "finish"
BROADCAST_SEND = "metadata broadcast: send (pickle)"
BROADCAST_RECEIVE = "metadata broadcast: receive (unpickle)"
READ_METADATA = "read_metadata (first in the process)"
OWN_LOAD = "own process: read_metadata + set-ups + local plan"


@dataclasses.dataclass(frozen=True)
class PlanSystem:
    """One side of the comparison: its planners, storage classes and write-result packing."""

    name: str
    save_planner: Callable[[], Any]
    load_planner: Callable[[], Any]
    writer: Callable[[str], Any]
    reader: Callable[[str], Any]
    pack_results: Callable[[SavePlan, list[WriteResult]], Any]
    description: dict[str, str]
    # Whether its save planner runs stock's O(N^2) global plan validation, which is then
    # estimated above EXACT_VALIDATION_MAX_RANKS (simulated_ranks.estimate_validation).
    defers_stock_validation: bool = False
    # How its load planner hands over a read plan's items (stock: a list; fastdcp: plan_cache's
    # _PackedItems, which cross the coordinator undecoded); the reference plans of unmeasured
    # ranks are packed the same way.
    pack_read_items: Callable[[list[Any]], Any] = list
    # Whether its checkpoints live in object storage (an s3:// location; data objects not written).
    object_storage: bool = False


def stock_system() -> PlanSystem:
    return PlanSystem(
        "stock", DefaultSavePlanner, DefaultLoadPlanner, FileSystemWriter, FileSystemReader,
        lambda plan, results: results,
        {"planners": "DefaultSavePlanner / DefaultLoadPlanner", "storage": "FileSystemWriter / FileSystemReader"},
        defers_stock_validation=True)


def fastdcp_system() -> PlanSystem:
    import fastdcp
    from fastdcp.planners.plan_cache import _PackedItems
    from fastdcp.save.results import pack_write_results

    return PlanSystem(
        "fastdcp", fastdcp.FastSavePlanner, fastdcp.FastLoadPlanner, fastdcp.FastFileSystemWriter,
        fastdcp.FastFileSystemReader, pack_write_results,
        {"planners": "FastSavePlanner / FastLoadPlanner", "storage": "FastFileSystemWriter / FastFileSystemReader"},
        pack_read_items=_PackedItems)


def fastdcp_s3_system() -> PlanSystem:
    """fastdcp's planners with its object storage classes (``--plan-storage s3``)."""
    import fastdcp
    from fastdcp.planners.plan_cache import _PackedItems
    from fastdcp.save.results import pack_write_results

    return PlanSystem(
        "fastdcp", fastdcp.FastSavePlanner, fastdcp.FastLoadPlanner, fastdcp.FastS3Writer, fastdcp.FastS3Reader,
        pack_write_results,
        {"planners": "FastSavePlanner / FastLoadPlanner", "storage": "FastS3Writer / FastS3Reader (s3://)"},
        pack_read_items=_PackedItems, object_storage=True)


@dataclasses.dataclass
class StepRecord:
    """One measured step of one simulated process."""

    phase: str
    side: str
    step: str
    seconds: float
    peak_bytes: int | None          # resident memory above the RSS before the step, at its peak
    held_bytes: int | None = None   # RSS after the step - RSS before (coordinator and read steps)
    received_bytes: int = 0         # bytes the step received from other processes (collectives)
    rank: int | None = None
    note: str = ""


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclasses.dataclass
class SimulationOutcome:
    """What one system's simulation at one N measured and produced."""

    system: str
    ranks: int
    records: list[StepRecord]
    info: dict[str, Any]
    notes: list[str]
    checks: list[Check]
    metadata_file: str                                   # the first save's .metadata
    load_plans: dict[tuple[str, int], list[Any]]         # (phase, rank) -> items, for cross-checks


def element_sizes(metadata: Metadata) -> dict[str, int]:
    """The element size of every stored tensor entry's dtype, by FQN."""
    return {fqn: md.properties.dtype.itemsize for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def checkpoint_tensor_bytes(metadata: Metadata) -> int:
    """The checkpoint's tensor bytes, each stored element once (headers not counted)."""
    return sum(math.prod(md.size) * md.properties.dtype.itemsize
               for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))


def plan_tensor_bytes(items: list[ReadItem], sizes: dict[str, int]) -> int:
    """The tensor bytes a load plan reads from storage: over its tensor items, ``prod(lengths)``
    times the stored dtype's element size (``sizes``: :func:`element_sizes`); byte items and blob
    headers not counted."""
    return sum(math.prod(item.lengths) * sizes[item.storage_index.fqn]
               for item in items if item.type != LoadItemType.BYTE_IO)


def read_once_shares(items: list[ReadItem], members: int, sizes: dict[str, int], storage_data: Any) -> list[int]:
    """Each member's tensor bytes when a replica group of ``members`` ranks loads the plan
    ``items`` with read-once: the tensor items sorted by their place in storage (relative path,
    offset; then plan order), as ``ReadOnceShare.deal`` sorts them, dealt by
    ``fastdcp.load.read_once.deal_items``, each member's bytes added up."""
    from fastdcp.load.read_once import deal_items

    def where(i: int) -> tuple[tuple[str, int], int]:
        info = storage_data[items[i].storage_index]
        return (info.relative_path, info.offset), i

    order = sorted((i for i, item in enumerate(items) if item.type != LoadItemType.BYTE_IO), key=where)
    nbytes = [math.prod(items[i].lengths) * sizes[items[i].storage_index.fqn] for i in order]
    shares = [0] * members
    for owner, n in zip(deal_items(nbytes, members), nbytes):
        shares[owner] += n
    return shares


@dataclasses.dataclass(frozen=True)
class ReplicaGroupReads:
    """What one replica group of the replicated layout reads from storage.

    Args:
        shard: the group's shard (a rank of the N/R-rank load whose plan the group's members have).
        ranks: the members, ranks of the N-rank job: ``shard + k * N/R`` for k in 0..R-1.
        plan_tensor_bytes: tensor bytes of the plan: what each member reads without read-once.
        member_bytes: each member's share with read-once (:func:`read_once_shares`), in ``ranks`` order.
    """

    shard: int
    ranks: tuple[int, ...]
    plan_tensor_bytes: int
    member_bytes: tuple[int, ...]

    @property
    def read_once_bytes(self) -> int:
        """The largest member's share with read-once."""
        return max(self.member_bytes)

    def as_info(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ranks": list(self.ranks), "member_bytes": list(self.member_bytes),
                "read_once_bytes": self.read_once_bytes, "group_read_once_bytes": sum(self.member_bytes)}


@dataclasses.dataclass(frozen=True)
class ReplicatedLoadReads:
    """The tensor bytes a job of ``ranks`` ranks reads from storage when it loads the checkpoint
    sharded over ``ranks / replicas`` ranks and replicated ``replicas`` times, without and with
    read-once (headers not counted).

    Args:
        replicas: R; ranks: N; phase: the load phase (into N/R ranks) whose plans these are.
        groups: the sample shards' groups.
        shard_plans_tensor_bytes: the tensor bytes of all N/R distinct plans added up; None when not
            every rank's plan was built (the load above ``--plan-all-load-ranks``).
        needed_bytes: the checkpoint's tensor bytes, each stored element once.
    """

    replicas: int
    ranks: int
    phase: str
    groups: list[ReplicaGroupReads]
    shard_plans_tensor_bytes: int | None
    needed_bytes: int

    @property
    def storage_bytes_without_read_once(self) -> int | None:
        """Every rank reads its whole plan: R times the distinct plans."""
        return None if self.shard_plans_tensor_bytes is None else self.replicas * self.shard_plans_tensor_bytes

    @property
    def storage_bytes_with_read_once(self) -> int | None:
        """Each group reads its plan once."""
        return self.shard_plans_tensor_bytes

    def as_info(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "ranks": self.ranks, "shard_ranks": self.ranks // self.replicas,
                "phase": self.phase, "layout": "rank r holds shard r % (N/R)",
                "groups": [g.as_info() for g in self.groups],
                "rank_plan_tensor_bytes": max(g.plan_tensor_bytes for g in self.groups),
                "rank_read_once_bytes": max(g.read_once_bytes for g in self.groups),
                "shard_plans_tensor_bytes": self.shard_plans_tensor_bytes, "needed_bytes": self.needed_bytes,
                "storage_bytes_without_read_once": self.storage_bytes_without_read_once,
                "storage_bytes_with_read_once": self.storage_bytes_with_read_once}


@dataclasses.dataclass
class _CountedPlans:
    """What a load phase collects when its plans are counted: each rank's plan tensor bytes and
    the sample ranks' items (:meth:`PlanScaleSimulation._load_into`)."""

    sizes: dict[str, int]
    tensor_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    sample_items: dict[int, list[ReadItem]] = dataclasses.field(default_factory=dict)


def _process_state() -> Any:
    from fastdcp.planners.plan_cache import PlanProcessState

    return PlanProcessState()


def _simulated(state: Any) -> Any:
    from fastdcp.planners.plan_cache import simulated_process

    return simulated_process(state)


def _clear_metadata_cache() -> None:
    from fastdcp.load.metadata_cache import clear_metadata_cache

    clear_metadata_cache()


def _started_meter() -> HostPeak:
    # Without HostPeak's full garbage collection per step (~150 short steps; seconds each at large
    # N): the simulation collects garbage itself between phases.
    meter = HostPeak()
    meter.start(collect=False)
    return meter


def _takes_kwargs(method: Callable[..., Any]) -> bool:
    # DCP passes rank= and use_collectives= only to set-up methods that accept **kwargs.
    return "kwargs" in inspect.signature(method).parameters


class PlanScaleSimulation:
    """One system's save (first and repeat) and load (same sharding and N/2; with ``replicas`` R > 1
    also the replicated layout's, into N/R ranks) at ``world_size`` simulated ranks, into
    ``directory`` (created; the caller removes it), or for a system on object storage under
    ``location`` (``s3://bucket/prefix``, the ``AWS_*`` environment pointing at its server).
    :meth:`run` returns the :class:`SimulationOutcome`. Precondition: no default process group
    exists."""

    def __init__(self, system: PlanSystem, world_size: int, directory: str, *, shape: ModelShape = LLAMA_7B,
                 build_budget_s: float = DEFAULT_BUILD_BUDGET_S,
                 exact_validation_max_ranks: int = EXACT_VALIDATION_MAX_RANKS,
                 all_load_plans_max_ranks: int = DEFAULT_ALL_LOAD_PLANS_MAX_RANKS, workers: int = 1,
                 progress: Callable[[str], None] | None = None, location: str | None = None,
                 replicas: int = 1) -> None:
        if world_size < 2:
            raise ValueError(f"plan_scale needs at least 2 ranks, got {world_size}")
        if replicas < 1 or world_size % replicas:
            raise ValueError(f"plan_scale: {world_size} ranks are not {replicas} replicas of equal shard groups")
        if system.object_storage != (location is not None):
            raise ValueError(f"plan_scale: the {system.name} system {'needs' if system.object_storage else 'takes no'} "
                             "s3:// location")
        self.system = system
        self.world_size = world_size
        self.directory = directory
        self.shape = shape
        self.build_budget_s = build_budget_s
        self.exact_validation = world_size <= exact_validation_max_ranks
        self.all_load_plans_max_ranks = all_load_plans_max_ranks
        self.workers = max(1, workers)
        self.replicas = replicas
        self.progress = progress or (lambda message: None)
        self.records: list[StepRecord] = []
        self.notes: list[str] = []
        self.checks: list[Check] = []
        self.info: dict[str, Any] = {}
        self.load_plans: dict[tuple[str, int], list[Any]] = {}
        self.local = location is None
        where = directory if location is None else location
        self.checkpoint = os.path.join(where, "save") if self.local else f"{where}/save"
        self.repeat_checkpoint = os.path.join(where, "repeat") if self.local else f"{where}/repeat"
        self.blob_overhead = tensor_blob_overhead()

    # ------------------------------------------------------------------ measuring

    def _step(self, phase: str, side: str, name: str, fn: Callable[[], Any], *, rank: int | None = None,
              received_bytes: int = 0) -> Any:
        """Run ``fn`` as one measured step: wall time, peak memory above the RSS before it, and
        for coordinator and read steps the memory it left held."""
        meter = _started_meter()
        started = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - started
        peak = max(0, meter.stop() - meter.start_bytes)
        held = None
        if side == COORDINATOR or phase == READ:
            held = _started_meter().start_bytes - meter.start_bytes
        self.records.append(StepRecord(phase, side, name, seconds, peak, held, received_bytes, rank))
        return value

    def _rank_step(self, phase: str | None, name: str, fn: Callable[[], Any], rank: int) -> Any:
        """A rank-side step: measured when ``phase`` is given (a sample rank), else just run."""
        return self._step(phase, RANK, name, fn, rank=rank) if phase else fn()

    def _tell(self, message: str) -> None:
        self.progress(f"{SCENARIO} N={self.world_size} {self.system.name}: {message}")

    # ------------------------------------------------------------------ save

    def _local_save(self, state_dict: dict[str, Any], rank: int, path: str, phase: str | None) -> tuple[Any, Any, bytes]:
        """One rank's local step of a save and its pickled plan (DCP's ``local_step`` and the
        sending side of ``gather_object``); measured when ``phase`` is given."""
        planner, writer = self.system.save_planner(), self.system.writer(path)
        coordinator = rank == 0

        def set_up_planner() -> None:
            storage_meta = writer.storage_meta()
            planner.set_up_planner(state_dict=state_dict, storage_meta=storage_meta, is_coordinator=coordinator)

        def set_up_writer() -> None:
            if _takes_kwargs(writer.set_up_storage_writer):
                writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
            else:
                writer.set_up_storage_writer(coordinator)

        self._rank_step(phase, SET_UP_PLANNER, set_up_planner, rank)
        self._rank_step(phase, SET_UP_WRITER, set_up_writer, rank)
        plan = self._rank_step(phase, LOCAL_PLAN, planner.create_local_plan, rank)
        prepared = self._rank_step(phase, PREPARE_LOCAL, lambda: writer.prepare_local_plan(plan), rank)
        blob = self._rank_step(phase, GATHER_SEND, lambda: pickle.dumps(prepared), rank)
        return planner, writer, blob

    def _coordinator_round(self, phase: str, blobs: list[bytes | None], create_global: Callable[[list[Any]], list[Any]],
                           prepare_global: Callable[[list[Any]], list[Any]]) -> list[bytes]:
        """The coordinator's part of DCP's ``reduce_scatter``: unpickle every rank's plan,
        ``create_global`` (the planner's), ``prepare_global`` (the storage layer's), pickle every
        rank's global plan. ``blobs`` is emptied (the received buffers are freed); the gathered
        plans are dropped after the scatter, as ``reduce_scatter`` drops them when it returns."""
        received = sum(len(b) for b in blobs if b is not None)
        holder: dict[str, Any] = {}

        def gather() -> None:
            holder["plans"] = [pickle.loads(b) for b in blobs]
            blobs.clear()

        def scatter() -> list[bytes]:
            out = [pickle.dumps(plan) for plan in holder["global"]]
            holder.clear()
            return out

        self._step(phase, COORDINATOR, GATHER_RECEIVE, gather, received_bytes=received)
        self._step(phase, COORDINATOR, GLOBAL_PLAN, lambda: holder.__setitem__("global", create_global(holder["plans"])))
        self._step(phase, COORDINATOR, PREPARE_GLOBAL,
                   lambda: holder.__setitem__("global", prepare_global(holder["global"])))
        return self._step(phase, COORDINATOR, SCATTER_SEND, scatter)

    def _coordinator_plan(self, phase: str, planner: Any, writer: Any, blobs: list[bytes | None]
                          ) -> tuple[list[bytes], Metadata]:
        """The coordinator's global step of a save (:meth:`_coordinator_round`): the pickled
        global plans and the global metadata. Stock's validation is estimated above
        ``exact_validation_max_ranks`` (:meth:`_add_validation_estimate`)."""
        out: dict[str, Any] = {}

        def create_global(plans: list[Any]) -> list[Any]:
            if self.exact_validation or not self.system.defers_stock_validation:
                global_plans, out["metadata"] = planner.create_global_plan(plans)
                return global_plans
            with deferred_stock_validation() as captured:
                global_plans, out["metadata"] = planner.create_global_plan(plans)
            out["validation"] = captured
            return global_plans

        scattered = self._coordinator_round(phase, blobs, create_global, writer.prepare_global_plan)
        if "validation" in out:
            self._add_validation_estimate(phase, out["validation"])
        return scattered, out["metadata"]

    def _add_validation_estimate(self, phase: str, captured: list[tuple[list[SavePlan], Metadata]]) -> None:
        """Time stock's deferred validation on a sample (:func:`estimate_validation`), add the
        estimate to the phase's create_global_plan step and record it below that step."""
        if len(captured) != 1:
            raise RuntimeError(f"expected one deferred validation call, got {len(captured)}")
        estimate = estimate_validation(*captured[0])
        if estimate.errors:
            self.checks.append(Check(f"{phase}: stock's validation of the sampled entries", False,
                                     f"{estimate.errors} errors"))
        at = max(i for i, r in enumerate(self.records) if r.phase == phase and r.step == GLOBAL_PLAN)
        record = self.records[at]
        record.seconds += estimate.seconds
        record.note = f"incl. stock's validation {estimate.describe()}"
        self.records.insert(at + 1, StepRecord(phase, COORDINATOR, VALIDATION_ESTIMATE, estimate.seconds, None,
                                               note=estimate.describe()))

    def _receive(self, phase: str, states: dict[int, Any], planners: dict[int, Any], scattered: list[bytes]) -> None:
        """The sample ranks' side of the scatter: unpickle their global plan, ``finish_plan``."""
        for r, state in states.items():
            planner, blob = planners[r], scattered[r]
            with _simulated(state):
                central = self._step(phase, RANK, SCATTER_RECEIVE, lambda: pickle.loads(blob), rank=r)
                self._step(phase, RANK, FINISH_PLAN, lambda: planner.finish_plan(central), rank=r)

    def _save(self) -> None:
        """The first save and its repeat, every rank (see the module docstring)."""
        n = self.world_size
        samples = sample_ranks(n)
        ranks = SimulatedRanks(self.shape, n)
        try:
            self.info["items_per_rank"] = ranks.items_per_rank
            coordinator_state = _process_state()
            states = {r: coordinator_state if r == 0 else _process_state() for r in samples}
            kept, sent, blobs = self._first_local_plans(ranks, states)
            self.info["local_plan_bytes"] = sum(len(b) for b in blobs if b is not None)

            self._tell("save: coordinator plans")
            gc.collect()
            planner0, writer0 = kept[0]
            with _simulated(coordinator_state):
                scattered, metadata = self._coordinator_plan(SAVE, planner0, writer0, blobs)
            self.info["global_plan_bytes"] = sum(len(b) for b in scattered)

            self._tell("save: ranks finish their plans and report their writes; the repeat's local plans")
            result_blobs, repeat_blobs = self._rest_of_ranks(ranks, states, kept, sent, scattered)

            self._tell("save: coordinator commits")
            gc.collect()
            self._commit(coordinator_state, writer0, metadata, result_blobs, samples[1], states[samples[1]])
            kept.clear()
            planner0 = writer0 = metadata = None
            gc.collect()

            self._tell("repeat save")
            self._repeat(ranks, states, repeat_blobs)
        finally:
            ranks.close()
            if self.local:
                shutil.rmtree(self.repeat_checkpoint, ignore_errors=True)
        gc.collect()

    def _first_local_plans(self, ranks: SimulatedRanks, states: dict[int, Any]
                           ) -> tuple[dict[int, tuple[Any, Any]], dict[int, Any], list[bytes | None]]:
        """Every rank's local plan of the first save, pickled: (the sample ranks' planner and
        writer, what each other rank sent (:func:`_sent_plan`), the pickled plans). The sample
        ranks run here, measured; the others in :meth:`_unmeasured` (their process state is not
        kept: :meth:`_rest_of_ranks` makes it again)."""
        self._tell(f"save: {ranks.world_size} local plans")
        kept: dict[int, tuple[Any, Any]] = {}
        blobs: list[bytes | None] = [None] * ranks.world_size
        for r in sorted(states):
            with _simulated(states[r]):
                planner, writer, blobs[r] = self._local_save(ranks.state_dict(r), r, self.checkpoint, SAVE)
            kept[r] = (planner, writer)
        sent: dict[int, Any] = {}
        others = [r for r in range(ranks.world_size) if r not in states]
        for r, blob, what in self._unmeasured(_first_plan_of, others, ranks):
            blobs[r], sent[r] = blob, what
        return kept, sent, blobs

    def _rest_of_ranks(self, ranks: SimulatedRanks, states: dict[int, Any], kept: dict[int, tuple[Any, Any]],
                       sent: dict[int, Any], scattered: list[bytes]) -> tuple[list[bytes | None], list[bytes | None]]:
        """Every rank receives its global plan, finishes it and reports its writes (the files the
        results name are created, sparse; not in object storage); the unmeasured ranks (:func:`_rest_of_rank`) also make
        their repeat's local plan (warm, as their process would). Returns the pickled write
        results and the unmeasured ranks' pickled repeat plans. ``scattered`` is consumed."""
        n = ranks.world_size
        result_blobs: list[bytes | None] = [None] * n
        repeat_blobs: list[bytes | None] = [None] * n
        if self.local:
            os.makedirs(self.checkpoint, exist_ok=True)
        for r in sorted(states):
            planner, _ = kept[r]
            with _simulated(states[r]):
                blob = scattered[r]
                central = self._step(SAVE, RANK, SCATTER_RECEIVE, lambda: pickle.loads(blob), rank=r)
                final = self._step(SAVE, RANK, FINISH_PLAN, lambda: planner.finish_plan(central), rank=r)
                results, lengths = write_results(final, planner, self.blob_overhead)
                result_blobs[r] = self._step(
                    SAVE, RANK, RESULTS_SEND, lambda: pickle.dumps(self.system.pack_results(final, results)), rank=r)
            scattered[r] = b""  # received
            if self.local:
                create_sparse_files(self.checkpoint, lengths)
        others = [r for r in range(n) if r not in states]
        work = ((r, scattered[r], sent.pop(r)) for r in others)
        differ = []
        for r, result_blob, lengths, repeat_blob, same in self._unmeasured(_rest_of_rank, work, ranks):
            result_blobs[r], repeat_blobs[r] = result_blob, repeat_blob
            scattered[r] = b""
            if self.local:
                create_sparse_files(self.checkpoint, lengths)
            if not same:
                differ.append(r)
        if others:
            self.checks.append(Check(
                f"save: the {len(others)} unmeasured ranks' local plans, made again in their process before it "
                f"received its global plan, equal the plans they sent", not differ,
                f"differ on ranks {differ[:10]}" if differ else ""))
        return result_blobs, repeat_blobs

    def _unmeasured(self, work: Callable[[Any], Any], tasks: Any, ranks: SimulatedRanks, **shared: Any) -> Any:
        """``work(task)`` for every task (an unmeasured rank's untimed steps, playing ``ranks``,
        with the objects ``shared`` inherited, never pickled),
        yielding the results in order: in ``workers`` forked processes when there are several
        (each with its own ``SimulatedRanks`` of the same world; nothing measured runs meanwhile,
        and the pool is gone before the next measured step), else in this process."""
        global _POOL
        _POOL = (self, ranks, shared)
        try:
            if self.workers == 1:
                yield from map(work, tasks)
                return
            gc.collect()
            gc.freeze()  # the workers' collections leave the parent's objects (and their pages) alone
            try:
                with multiprocessing.get_context("fork").Pool(self.workers, initializer=_start_pool_worker) as pool:
                    yield from pool.imap(work, tasks, chunksize=8)
            finally:
                gc.unfreeze()
        finally:
            _POOL = None

    def _commit(self, coordinator_state: Any, writer0: Any, metadata: Metadata, result_blobs: list[bytes | None],
                receiver: int, receiver_state: Any) -> None:
        """The coordinator gathers the write results, ``finish``es, and pickles the metadata DCP
        broadcasts back; rank ``receiver`` unpickles it. ``result_blobs`` is consumed."""
        received = sum(len(b) for b in result_blobs if b is not None)
        holder: dict[str, Any] = {}

        def gather_results() -> None:
            holder["results"] = [pickle.loads(b) for b in result_blobs]
            result_blobs.clear()

        def finish() -> None:
            writer0.finish(metadata=metadata, results=holder.pop("results"))

        with _simulated(coordinator_state):
            self._step(SAVE, COORDINATOR, RESULTS_RECEIVE, gather_results, received_bytes=received)
            self._step(SAVE, COORDINATOR, FINISH, finish)
            broadcast = self._step(SAVE, COORDINATOR, BROADCAST_SEND, lambda: pickle.dumps(metadata))
        self.info["metadata_broadcast_bytes"] = len(broadcast)
        if self.local:
            self.info["metadata_file_bytes"] = os.path.getsize(os.path.join(self.checkpoint, ".metadata"))
            self.info["chunk_index_bytes"] = _chunk_index_size(self.checkpoint)
        else:
            self.info["metadata_file_bytes"], self.info["chunk_index_bytes"] = _object_sizes(self.checkpoint)
        self.info["chunks"] = sum(len(getattr(md, "chunks", ())) for md in metadata.state_dict_metadata.values())
        with _simulated(receiver_state):
            self._step(SAVE, RANK, BROADCAST_RECEIVE, lambda: pickle.loads(broadcast), rank=receiver,
                       received_bytes=len(broadcast))

    def _repeat(self, ranks: SimulatedRanks, states: dict[int, Any], repeat_blobs: list[bytes | None]) -> None:
        """The repeat save on the sample ranks (new planners, writers and state dicts, the same
        structure) and the coordinator, up to ``finish_plan``; the other ranks' plans are in
        ``repeat_blobs`` already."""
        kept: dict[int, Any] = {}
        for r in states:
            state_dict = ranks.state_dict(r)
            with _simulated(states[r]):
                planner, writer, repeat_blobs[r] = self._local_save(state_dict, r, self.repeat_checkpoint, REPEAT)
            kept[r] = (planner, writer)
        with _simulated(states[0]):
            scattered, _ = self._coordinator_plan(REPEAT, *kept[0], repeat_blobs)
        self._receive(REPEAT, states, {r: planner for r, (planner, _) in kept.items()}, scattered)

    # ------------------------------------------------------------------ load

    def _load(self) -> None:
        _clear_metadata_cache()  # a new job: no process has read this checkpoint
        reader = self.system.reader(self.checkpoint)
        with _simulated(_process_state()):
            metadata = self._step(READ, RANK, READ_METADATA, reader.read_metadata, rank=1)
        layout = ChunkLayout(metadata)
        loads = {LOAD_SAME: self.world_size, LOAD_HALF: self.world_size // 2}
        counted: _CountedPlans | None = None
        replicated = None
        if self.replicas > 1:
            # The replicated layout's plans are those of the load into N/R ranks: load_half's when
            # R = 2, else a load of their own.
            shards = self.world_size // self.replicas
            replicated = next((phase for phase, world in loads.items() if world == shards), LOAD_REPLICATED)
            loads[replicated] = shards
            counted = _CountedPlans(element_sizes(metadata))
        for phase, world in loads.items():
            self._load_into(phase, world, reader, metadata, layout, counted if phase == replicated else None)
        if counted is not None:
            self.info["replicated_load"] = self._replicated_reads(replicated, counted, metadata).as_info()
        del reader, metadata, layout, counted
        _clear_metadata_cache()
        gc.collect()

    def _local_load(self, phase: str | None, rank: int, state_dict: dict[str, Any], reader: Any,
                    metadata: Metadata) -> tuple[Any, LoadPlan]:
        """One rank's local step of a load (DCP's ``local_step`` after ``read_metadata``);
        measured when ``phase`` is given. Returns the planner and the prepared plan."""
        planner = self.system.load_planner()
        coordinator = rank == 0

        def set_up_reader() -> None:
            if _takes_kwargs(reader.set_up_storage_reader):
                reader.set_up_storage_reader(metadata, coordinator, rank=rank, use_collectives=True)
            else:
                reader.set_up_storage_reader(metadata, coordinator)

        self._rank_step(phase, SET_UP_PLANNER, lambda: planner.set_up_planner(state_dict, metadata, coordinator), rank)
        self._rank_step(phase, SET_UP_READER, set_up_reader, rank)
        plan = self._rank_step(phase, LOCAL_PLAN, planner.create_local_plan, rank)
        prepared = self._rank_step(phase, PREPARE_LOCAL, lambda: reader.prepare_local_plan(plan), rank)
        return planner, prepared

    def _reference_plan(self, state_dict: dict[str, Any], rank: int, reader: Any, metadata: Metadata,
                        layout: ChunkLayout) -> LoadPlan:
        """A rank's prepared local load plan with the items :func:`reference_read_items` builds
        (stock's flattening, stock's items), prepared by the shared reader."""
        flattening = DefaultLoadPlanner()
        flattening.set_up_planner(state_dict, metadata, rank == 0)
        items = reference_read_items(flattening.state_dict, metadata, layout)
        if _takes_kwargs(reader.set_up_storage_reader):
            reader.set_up_storage_reader(metadata, rank == 0, rank=rank, use_collectives=True)
        else:
            reader.set_up_storage_reader(metadata, rank == 0)
        return reader.prepare_local_plan(LoadPlan(self.system.pack_read_items(items)))

    def _replicated_reads(self, phase: str, counted: _CountedPlans, metadata: Metadata) -> ReplicatedLoadReads:
        """The replicated layout's reads from the plans ``phase`` (the load into N/R ranks)
        counted: each sample shard's group (its members' shares dealt over its plan), and the
        distinct plans' total when every rank's plan was counted."""
        shards, r = self.world_size // self.replicas, self.replicas
        groups = [ReplicaGroupReads(shard, tuple(shard + k * shards for k in range(r)), counted.tensor_bytes[shard],
                                    tuple(read_once_shares(items, r, counted.sizes, metadata.storage_data)))
                  for shard, items in sorted(counted.sample_items.items())]
        every = len(counted.tensor_bytes) == shards
        if not every:
            self.notes.append(f"replicated load: the job's storage totals are not counted (the {shards} shards' "
                              f"plans are built above --plan-all-load-ranks {self.all_load_plans_max_ranks} only on "
                              "the sample ranks)")
        return ReplicatedLoadReads(r, self.world_size, phase, groups,
                                   sum(counted.tensor_bytes.values()) if every else None,
                                   checkpoint_tensor_bytes(metadata))

    def _load_into(self, phase: str, world: int, reader: Any, metadata: Metadata, layout: ChunkLayout,
                   counted: _CountedPlans | None = None) -> None:
        """A load into ``world`` ranks: local plans (the sample ranks measured; the coordinator
        last, so that the shared reader was set up by it last, as in its own process), the
        coordinator's round, the sample ranks' receive. With ``counted``, every plan built is
        counted into it (:class:`_CountedPlans`)."""
        samples = sample_ranks(world)
        ranks = SimulatedRanks(self.shape, world)
        gc.collect()
        try:
            states = {r: _process_state() for r in samples}
            planners: dict[int, Any] = {}
            blobs: list[bytes | None] = [None] * world
            every_rank = world <= self.all_load_plans_max_ranks
            self._tell(f"{phase}: {world if every_rank else len(samples)} local load plans")
            matches: dict[int, bool | None] = {}
            for r in samples[1:]:
                planners[r], blobs[r], matches[r] = self._sample_load(phase, ranks, r, states[r], reader, metadata,
                                                                      layout, counted)
            if every_rank:
                self._other_load_plans(phase, ranks, [r for r in range(world) if r not in states], reader, metadata,
                                       layout, blobs, counted)
            planners[0], blobs[0], matches[0] = self._sample_load(phase, ranks, 0, states[0], reader, metadata, layout,
                                                                  counted)
            compared = [r for r, same in matches.items() if same is not None]
            if compared:
                differ = [r for r in compared if not matches[r]]
                self.checks.append(Check(
                    f"{phase}: reference read plans = {self.system.name}'s planner's on ranks "
                    f"{', '.join(map(str, compared))}", not differ, f"item lists differ on ranks {differ}" if differ else ""))

            if not every_rank:
                self.notes.append(
                    f"{phase}: the sample ranks' loads only ({', '.join(map(str, samples))}): above "
                    f"{self.all_load_plans_max_ranks} ranks the other ranks' load plans and the coordinator's round "
                    f"are not simulated (--plan-all-load-ranks)")
                return
            self._tell(f"{phase}: coordinator")
            gc.collect()
            with _simulated(states[0]):
                scattered = self._coordinator_round(phase, blobs, planners[0].create_global_plan,
                                                    reader.prepare_global_plan)
            self._receive(phase, states, planners, scattered)
        finally:
            ranks.close()

    def _own_load(self, phase: str, r: int, state_dict: dict[str, Any]) -> LoadPlan:
        """Rank ``r``'s load as its own process would start it (fastdcp only): a fresh reader and
        metadata cache, ``read_metadata`` with the default group being rank ``r`` of the load's
        world (so fastdcp may read just this rank's section of the chunk index), the set-ups and
        the local plan, measured as one step; the metadata bytes it read go into ``info`` (from
        object storage: the bytes its GETs fetched, and their number)."""
        from fastdcp.load.sectioned_metadata import metadata_bytes_read

        _clear_metadata_cache()
        gc.collect()
        reader = self.system.reader(self.checkpoint)
        planner = self.system.load_planner()
        before = metadata_bytes_read()
        fetched = getattr(reader, "metadata_fetched", None)
        requests_before = fetched.requests if fetched is not None else 0

        def run() -> tuple[LoadPlan, Any]:
            metadata = reader.read_metadata()
            planner.set_up_planner(state_dict, metadata, r == 0)
            if _takes_kwargs(reader.set_up_storage_reader):
                reader.set_up_storage_reader(metadata, r == 0, rank=r, use_collectives=True)
            else:
                reader.set_up_storage_reader(metadata, r == 0)
            return planner.create_local_plan(), metadata

        with _simulated(_process_state()):
            plan, metadata = self._step(phase, RANK, OWN_LOAD, run, rank=r)
        record = self.records[-1]
        reads = self.info.setdefault(f"{phase}_metadata_reads", {})
        reads[str(r)] = {"read_bytes": metadata_bytes_read() - before, "peak_bytes": record.peak_bytes,
                         "seconds": record.seconds, "from_section": not getattr(metadata, "table_loaded", True)}
        if fetched is not None:
            reads[str(r)]["requests"] = fetched.requests - requests_before
        del metadata  # (the reader and planner go with this call)
        _clear_metadata_cache()
        return plan

    def _sample_load(self, phase: str, ranks: SimulatedRanks, r: int, state: Any, reader: Any, metadata: Metadata,
                     layout: ChunkLayout, counted: _CountedPlans | None = None) -> tuple[Any, bytes, bool | None]:
        """A sample rank's measured local load step: its planner, its pickled plan, and whether the
        reference builds the same items (None when no other rank may need the reference). The
        items are kept on rank 1 for the comparison between systems, and in ``counted`` (after
        the measured steps) with the plan's tensor bytes."""
        state_dict = ranks.state_dict(r)
        own = self._own_load(phase, r, state_dict) if self.system.name == "fastdcp" else None
        with _simulated(state):
            planner, plan = self._local_load(phase, r, state_dict, reader, metadata)
            blob = self._step(phase, RANK, GATHER_SEND, lambda: pickle.dumps(plan), rank=r)
        if own is not None:
            same = list(own.items) == list(plan.items)
            self.checks.append(Check(f"{phase}: rank {r}'s plan in its own process (its section of the chunk index, "
                                     f"or the whole index) = its plan from the whole metadata", same,
                                     "" if same else "item lists differ"))
        if r == 1 or ranks.world_size == 1:
            self.load_plans[(phase, r)] = list(plan.items)
        if counted is not None:
            items = counted.sample_items[r] = list(plan.items)
            counted.tensor_bytes[r] = plan_tensor_bytes(items, counted.sizes)
        same = None
        if ranks.world_size > len(sample_ranks(ranks.world_size)):
            same = list(self._reference_plan(state_dict, r, reader, metadata, layout).items) == list(plan.items)
        return planner, blob, same

    def _other_load_plans(self, phase: str, ranks: SimulatedRanks, others: list[int], reader: Any,
                          metadata: Metadata, layout: ChunkLayout, blobs: list[bytes | None],
                          counted: _CountedPlans | None = None) -> None:
        """The unmeasured ranks' pickled local load plans, into ``blobs`` (and their tensor bytes
        into ``counted``): by the system's planner, or by the reference when that would take longer
        than the budget (estimated from the sample ranks measured so far)."""
        measured = [rec.seconds for rec in self.records
                    if rec.phase == phase and rec.side == RANK and rec.step in (SET_UP_PLANNER, SET_UP_READER, LOCAL_PLAN,
                                                                                 PREPARE_LOCAL)]
        sampled = len({rec.rank for rec in self.records if rec.phase == phase and rec.side == RANK})
        per_rank = sum(measured) / max(1, sampled)
        use_reference = bool(others) and per_rank * len(others) > self.build_budget_s
        self.info[f"{phase}_reference_plans"] = len(others) if use_reference else 0
        if use_reference:
            self.notes.append(
                f"{phase}: {len(others)} of {ranks.world_size} local load plans built by the reference (stock's items "
                f"by bisection, checked equal on the sample ranks), not by {self.system.name}'s planner: "
                f"{per_rank:.2f} s a rank x {len(others)} ranks > budget {self.build_budget_s:.0f} s")
        sizes = counted.sizes if counted is not None else None
        for r, blob, nbytes in self._unmeasured(_load_plan_of, others, ranks, reader=reader, metadata=metadata,
                                                layout=layout, use_reference=use_reference, sizes=sizes):
            blobs[r] = blob
            if counted is not None:
                counted.tensor_bytes[r] = nbytes

    # ------------------------------------------------------------------ run

    def run(self) -> SimulationOutcome:
        os.makedirs(self.directory, exist_ok=True)
        self._save()
        self._load()
        return SimulationOutcome(
            system=self.system.name, ranks=self.world_size, records=self.records, info=self.info,
            notes=self.notes, checks=self.checks,
            metadata_file=os.path.join(self.checkpoint, ".metadata") if self.local else f"{self.checkpoint}/.metadata",
            load_plans=self.load_plans)


# --------------------------------------------------------------------------- unmeasured ranks

# (simulation, ranks, shared objects) of the unmeasured ranks' work under way: forked pool workers
# inherit it.
_POOL: tuple[PlanScaleSimulation, SimulatedRanks, dict[str, Any]] | None = None


def _start_pool_worker() -> None:
    """A pool worker's own simulated ranks (the same world as the parent's): its process groups
    are its own, so it can become any rank."""
    global _POOL
    assert _POOL is not None
    sim, ranks, shared = _POOL
    _POOL = (sim, SimulatedRanks(sim.shape, ranks.world_size), shared)


def _sent_plan(planner: Any, blob: bytes) -> tuple[bytes | None, bytes]:
    """What a rank's pickled local save plan ``blob`` carried, to check a plan made again against:
    (the token its columns were sent under, a digest of the columns) for a plan sent as columns
    (fastdcp), else (None, a digest of the blob)."""
    columns = getattr(planner.plan.items, "columns", lambda: None)()
    if columns is None:
        return None, hashlib.blake2b(blob, digest_size=16).digest()
    sent = columns[0]
    return sent.token, hashlib.blake2b(sent.structure_blob + sent.numbers, digest_size=16).digest()


def _first_plan_of(r: int) -> tuple[int, bytes, tuple[bytes | None, bytes]]:
    """An unmeasured rank's local plan of the first save: (r, the pickled plan, what it sent)."""
    assert _POOL is not None
    sim, ranks, _ = _POOL
    with _simulated(_process_state()):
        planner, _, blob = sim._local_save(ranks.state_dict(r), r, sim.checkpoint, None)
        return r, blob, _sent_plan(planner, blob)


def _rest_of_rank(task: tuple[int, bytes, tuple[bytes | None, bytes]]
                  ) -> tuple[int, bytes, dict[str, int], bytes, bool]:
    """An unmeasured rank from its global plan on: its process state made again (its local plan,
    planned again from a new state dict, must equal the one it sent; a plan sent as columns is
    registered under the token it was sent under, as the process that sent it holds it), the
    global plan unpickled and finished, the write results pickled, the repeat save's local plan
    (warm). Returns (r, pickled results, {file: length}, pickled repeat plan, whether the plan
    made again equals the one sent)."""
    assert _POOL is not None
    sim, ranks, _ = _POOL
    r, central, (token, digest) = task
    state = _process_state()
    with _simulated(state):
        planner, _, blob = sim._local_save(ranks.state_dict(r), r, sim.checkpoint, None)
        again = _sent_plan(planner, blob)
        same = again[1] == digest
        if token is not None:
            state.sent_plans.put(token, planner.plan.items)
        final = planner.finish_plan(pickle.loads(central))
        results, lengths = write_results(final, planner, sim.blob_overhead)
        result_blob = pickle.dumps(sim.system.pack_results(final, results))
        _, _, repeat_blob = sim._local_save(ranks.state_dict(r), r, sim.repeat_checkpoint, None)
    return r, result_blob, lengths, repeat_blob, same


def _load_plan_of(r: int) -> tuple[int, bytes, int | None]:
    """An unmeasured rank's pickled local load plan, by the system's planner or by the reference
    (``shared``: reader, metadata, layout, use_reference, sizes): (r, the pickled plan, its tensor
    bytes (:func:`plan_tensor_bytes`) when ``sizes`` is given, else None)."""
    assert _POOL is not None
    sim, ranks, shared = _POOL
    reader, metadata, layout = shared["reader"], shared["metadata"], shared["layout"]
    use_reference, sizes = shared["use_reference"], shared["sizes"]
    state_dict = ranks.state_dict(r)
    with _simulated(_process_state()):
        if use_reference:
            plan = sim._reference_plan(state_dict, r, reader, metadata, layout)
        else:
            plan = sim._local_load(None, r, state_dict, reader, metadata)[1]
        return r, pickle.dumps(plan), None if sizes is None else plan_tensor_bytes(list(plan.items), sizes)


# --------------------------------------------------------------------------- the scenario


def _chunk_index_size(checkpoint: str) -> int | None:
    """The size of the chunk index the checkpoint's ``.metadata`` names (None: it names none)."""
    from fastdcp.format.index_link import find_chunk_index_name

    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        name = find_chunk_index_name(f.read(4096))
    return None if name is None else os.path.getsize(os.path.join(checkpoint, name))


def _object_sizes(url: str) -> tuple[int, int | None]:
    """The sizes of a checkpoint's ``.metadata`` object and of the chunk index it names (None: it
    names none), by HEAD requests."""
    import obstore

    from fastdcp.format.index_link import find_chunk_index_name
    from fastdcp.objstore.client import S3Options, store_for
    from fastdcp.objstore.location import ObjectLocation

    location = ObjectLocation.parse(url)
    store = store_for(location, S3Options())
    size = int(obstore.head(store, location.key(".metadata"))["size"])
    name = find_chunk_index_name(bytes(obstore.get_range(store, location.key(".metadata"), start=0,
                                                         end=min(size, 4096))))
    return size, None if name is None else int(obstore.head(store, location.key(name))["size"])


def _systems(ctx: Any) -> list[PlanSystem]:
    """stock when --systems has it; fastdcp when it has any fastdcp system that is not a stand-in;
    each only when ``--plan-systems`` names it (default: both). With ``--plan-storage s3``, fastdcp
    alone, on object storage."""
    systems = []
    allowed = set(getattr(ctx.cfg, "plan_systems", None) or SYSTEMS)
    if getattr(ctx.cfg, "plan_storage", "local") == "s3":
        if "stock" in allowed and any(s.name == "stock" for s in ctx.systems):
            ctx.note(f"{SCENARIO}: --plan-storage s3 simulates fastdcp only (stock's FsspecWriter/FsspecReader are "
                     "not simulated)")
        fast = [s for s in ctx.systems if s.name.startswith("fastdcp")] if "fastdcp" in allowed else []
        return [fastdcp_s3_system()] if fast and not any(s.standin for s in fast) else []
    if "stock" in allowed and any(s.name == "stock" for s in ctx.systems):
        systems.append(stock_system())
    fast = [s for s in ctx.systems if s.name.startswith("fastdcp")] if "fastdcp" in allowed else []
    if fast and not any(s.standin for s in fast):
        systems.append(fastdcp_system())
    elif fast:
        ctx.note(f"{SCENARIO}: fastdcp not measured: it is a stand-in")
    return systems


def _metadata_estimate(ranks: int, items_per_rank: int) -> int:
    # ~150 bytes of pickled .metadata per chunk (stock's), every entry chunked over all ranks.
    return 150 * ranks * items_per_rank


def _target(ctx: Any, wheres: list[str], ranks: int, copies: int) -> tuple[str, str]:
    """(where, root): /dev/shm when it is a target and has room for the .metadata files, else the disk."""
    need = 2 * copies * _metadata_estimate(ranks, 1200)
    for where in ("shm", "dir"):
        if where in wheres and where in ctx.targets:
            root = ctx.targets[where]
            if where == "dir" or shutil.disk_usage(root).free > need:
                return where, root
    where = next(iter(ctx.targets))
    return where, ctx.targets[where]


def _record(ctx: Any, where: str, system: PlanSystem, outcome: SimulationOutcome) -> None:
    n = outcome.ranks
    for rec in outcome.records:
        ctx.recorder.add(SCENARIO, where, system.name,
                         {"ranks": n, "phase": rec.phase, "side": rec.side, "step": rec.step},
                         0, rec.seconds, None, system.description, peak_bytes=rec.peak_bytes,
                         held_bytes=rec.held_bytes, received_bytes=rec.received_bytes, rank=rec.rank,
                         note=rec.note)
    ctx.recorder.add(SCENARIO, where, system.name, {"ranks": n, "phase": "info", "side": "-", "step": "info"},
                     0, 0.0, None, system.description, info=outcome.info, notes=outcome.notes)
    for note in outcome.notes:
        ctx.note(f"{SCENARIO} N={n} {system.name}: {note}")


def _record_check(ctx: Any, where: str, ranks: int, check: Check) -> None:
    ctx.recorder.add(SCENARIO, where, "checks", {"ranks": ranks, "phase": "check", "side": "-", "step": check.name},
                     0, 0.0, None, passed=check.passed, detail=check.detail)


def cross_checks(outcomes: dict[str, SimulationOutcome], verify_metadata: bool) -> list[Check]:
    """Checks between the systems' outcomes at one N: the same ``state_dict_metadata`` (when
    ``verify_metadata``; each ``.metadata`` unpickled with plain ``pickle``) and equal load plans on
    the ranks both kept."""
    checks: list[Check] = []
    stock, fast = outcomes.get("stock"), outcomes.get("fastdcp")
    if stock is None or fast is None:
        return checks
    if verify_metadata:
        with open(stock.metadata_file, "rb") as f:
            stock_md = pickle.load(f)
        with open(fast.metadata_file, "rb") as f:
            fast_md = pickle.load(f)
        same = stock_md.state_dict_metadata == fast_md.state_dict_metadata
        checks.append(Check("fastdcp's .metadata (plain pickle) = stock's: state_dict_metadata", same,
                            "" if same else _first_difference(stock_md.state_dict_metadata, fast_md.state_dict_metadata)))
        del stock_md, fast_md
    for key in sorted(set(stock.load_plans) & set(fast.load_plans)):
        same = stock.load_plans[key] == fast.load_plans[key]
        checks.append(Check(f"{key[0]}: fastdcp's local load plan = stock's on rank {key[1]}", same,
                            "" if same else f"{len(fast.load_plans[key])} vs {len(stock.load_plans[key])} items, or items differ"))
    return checks


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    if list(a) != list(b):
        return f"entries differ: {len(a)} vs {len(b)} (first: {sorted(set(a) ^ set(b))[:3]} or order)"
    for key in a:
        if a[key] != b[key]:
            return f"entry {key!r} differs"
    return "?"


def run_plan_scale(ctx: Any, wheres: list[str]) -> None:
    """The `plan_scale` scenario: for each N of ``--plan-ranks`` (ascending), stock then fastdcp,
    each simulated in full (:class:`PlanScaleSimulation`) into a directory of their own on
    /dev/shm when it has room (``--plan-storage s3``: fastdcp alone, into a bucket of a local S3
    server started for the run); one Recorder row per (system, N, phase, side, step) with one
    sample per measured rank, an info row per (system, N), a row per check. Raises
    VerificationError at the end when a check failed."""
    systems = _systems(ctx)
    if not systems:
        ctx.note(f"{SCENARIO}: no system to measure (it runs stock and fastdcp)")
        return
    if dist.is_initialized():
        ctx.note(f"{SCENARIO}: not run: a default process group exists (the simulated ranks need their own)")
        return
    with contextlib.ExitStack() as stack:
        bucket = None
        if any(system.object_storage for system in systems):
            bucket = _start_object_store(ctx, stack)
            if bucket is None:
                return
        _run_plan_scale(ctx, wheres, systems, bucket)


def _start_object_store(ctx: Any, stack: contextlib.ExitStack) -> str | None:
    """A local S3 server for ``--plan-storage s3``, stopped (and the environment restored) with
    ``stack``; the bucket made for the run, or None (noted) when no server starts."""
    import tempfile
    import uuid

    from .s3_endpoint import S3Endpoint, S3EndpointUnavailable

    workdir = tempfile.mkdtemp(prefix="fastdcp_bench_plan_s3_")
    stack.callback(shutil.rmtree, workdir, True)
    try:
        endpoint = S3Endpoint(workdir=workdir).start()
    except S3EndpointUnavailable as error:
        ctx.note(f"{SCENARIO}: not run on object storage: {error}")
        return None
    stack.callback(endpoint.stop)
    stack.enter_context(endpoint.exported())
    bucket = f"plan-scale-{uuid.uuid4().hex[:10]}"
    endpoint.create_bucket(bucket)
    ctx.note(f"{SCENARIO}: object storage: {endpoint.server_name} on 127.0.0.1 behind the counting proxy, no "
             "added latency; checkpoints under s3://" + bucket)
    return bucket


def _run_plan_scale(ctx: Any, wheres: list[str], systems: list[PlanSystem], bucket: str | None) -> None:
    """:func:`run_plan_scale`'s simulations, recorded; ``bucket``: where systems on object
    storage put their checkpoints (recorded as ``where=s3``)."""
    failed: list[str] = []
    for n in sorted(set(ctx.cfg.plan_ranks)):
        where, root = _target(ctx, wheres, n, len(systems))
        if bucket is not None:
            where = "s3"
        base = os.path.join(root, GROUP, f"n{n}")
        outcomes: dict[str, SimulationOutcome] = {}
        try:
            for system in systems:
                started = time.perf_counter()
                location = f"s3://{bucket}/{GROUP}/n{n}/{system.name}" if system.object_storage else None
                sim = PlanScaleSimulation(system, n, os.path.join(base, system.name),
                                          build_budget_s=ctx.cfg.plan_budget_s,
                                          all_load_plans_max_ranks=ctx.cfg.plan_all_load_ranks,
                                          workers=ctx.cfg.plan_workers, progress=ctx.progress, location=location,
                                          replicas=getattr(ctx.cfg, "plan_replicas", 1))
                outcome = sim.run()
                outcome.info["simulation_seconds"] = time.perf_counter() - started
                outcome.info["where"] = where
                _record(ctx, where, system, outcome)
                outcomes[system.name] = outcome
                for check in outcome.checks:
                    _record_check(ctx, where, n, check)
                    if not check.passed:
                        failed.append(f"N={n} {system.name}: {check.name}: {check.detail}")
                if n > VERIFY_METADATA_MAX_RANKS and system.name == "stock":
                    shutil.rmtree(os.path.join(base, system.name), ignore_errors=True)
            for check in cross_checks(outcomes, n <= VERIFY_METADATA_MAX_RANKS):
                _record_check(ctx, where, n, check)
                if not check.passed:
                    failed.append(f"N={n}: {check.name}: {check.detail}")
        finally:
            outcomes.clear()
            shutil.rmtree(base, ignore_errors=True)
            gc.collect()
    if failed:
        raise VerificationError(f"{SCENARIO}: " + "; ".join(failed))


def growth_exponent(t1: float | None, t2: float | None, n1: int, n2: int) -> float | None:
    """How a step's time grows with N between two runs: log(t2/t1) / log(n2/n1) (1: linear,
    2: quadratic). None when a time is missing or not positive, or n1 == n2."""
    if not t1 or not t2 or t1 <= 0 or t2 <= 0 or n1 == n2:
        return None
    return math.log(t2 / t1) / math.log(n2 / n1)


def n_log_n_exponent(n1: int, n2: int) -> float:
    """The growth exponent of N log N between n1 and n2 (the bar for the coordinator's growth)."""
    return math.log((n2 * math.log(n2)) / (n1 * math.log(n1))) / math.log(n2 / n1)
