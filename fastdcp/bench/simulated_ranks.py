"""The ranks of an FSDP2 training job simulated one at a time in one process, for the `plan_scale`
scenario (fastdcp/bench/plan_scale.py):

* :class:`ModelShape` / :class:`SimulatedRanks`: a Llama-shaped model's state dict with AdamW
  state, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it on rank ``r`` of
  ``N`` under FSDP2 (``{"model": {fqn: DTensor}, "optim": {"state": {fqn: {"step", "exp_avg",
  "exp_avg_sq"}}, "param_groups": [...]}}``, every DTensor ``Shard(0)`` over a 1-D mesh of ``N``
  ranks), built on the ``fake`` process-group backend, re-initialised as rank ``r`` for every
  state dict;
* :func:`write_results`: what a rank's ``FileSystemWriter.write_data`` would return for its final
  save plan, laid out as stock lays out its one file per rank, without writing anything;
  :func:`create_sparse_files` makes the files those results name (sparse);
* :class:`ChunkLayout` / :func:`reference_read_items`: stock ``DefaultLoadPlanner``'s local read
  plan for a ``Shard(0)`` checkpoint, found by bisection instead of stock's sweep over every
  stored chunk (stock's costs seconds per rank at thousands of ranks);
* :func:`deferred_stock_validation` / :func:`estimate_validation`: stock's global save plan
  validation (O(N^2) per tensor whose largest dimension is not dimension 0) left out of a
  ``create_global_plan`` call and timed on one entry per chunk layout instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import sys
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import default_planner as _default_planner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items
from torch.distributed.checkpoint.resharding import (
    _check_shard_metadata_pair_overlap,
    _shards_get_overlap_region_wrt_saved_tensor,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..compat.torch_internals import valid_plan_result, validation_passed

__all__ = [
    "ModelShape",
    "LLAMA_7B",
    "SimulatedRanks",
    "shard_rows",
    "sample_ranks",
    "tensor_blob_overhead",
    "write_results",
    "create_sparse_files",
    "ChunkLayout",
    "reference_read_items",
    "deferred_stock_validation",
    "ValidationEstimate",
    "estimate_validation",
]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: per layer q/k/v/o (hidden x hidden: as many key/value heads as
    query heads), gate/up (intermediate x hidden), down (hidden x intermediate) and two RMSNorm
    weights; the embedding, the final norm and an untied lm_head."""

    layers: int = 32
    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32
    vocab: int = 32000

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """(fqn, global shape) of every parameter, in ``named_parameters()`` order."""
        h, i = self.hidden, self.intermediate
        params: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            params += [(f"{p}self_attn.{name}_proj.weight", (h, h)) for name in "qkvo"]
            params += [(f"{p}mlp.gate_proj.weight", (i, h)), (f"{p}mlp.up_proj.weight", (i, h)),
                       (f"{p}mlp.down_proj.weight", (h, i))]
            params += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
        params += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return params

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}, "
                f"{self.heads} heads, vocab {self.vocab}")


LLAMA_7B = ModelShape()


def shard_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s ``Shard(0)`` piece of ``rows`` rows: ``torch.chunk``'s
    split (pieces of ceil(rows / world_size); the last ranks may get fewer rows, or none, their
    empty piece placed at the end), as DTensor and FSDP2 shard."""
    piece = -(-rows // world_size)
    start = min(rank * piece, rows)
    return start, max(0, min(rows, start + piece) - start)


def sample_ranks(world_size: int) -> list[int]:
    """The ranks whose rank-side steps are measured (their process state is kept between
    steps): the coordinator 0, rank 1, the middle rank and the last rank."""
    return sorted({r for r in (0, 1, world_size // 2, world_size - 1) if 0 <= r < world_size})


def _adamw_param_group(fqns: list[str]) -> dict[str, Any]:
    """The one param group of ``torch.optim.AdamW``'s state dict (this torch's keys and
    defaults), its ``params`` named by FQN as ``get_state_dict`` names them."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.empty(1))])
    group = dict(optimizer.state_dict()["param_groups"][0])
    group["params"] = list(fqns)
    return group


def _fake_backend_available() -> None:
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed import fake_pg  # noqa: F401


class SimulatedRanks:
    """Ranks ``0..world_size-1`` of one job, one at a time. :meth:`state_dict` makes this process
    rank ``r`` (a fresh ``fake`` default process group of ``world_size`` ranks and a 1-D CPU mesh
    over it) and builds that rank's state dict; :meth:`close` destroys the process group.

    Precondition: no default process group exists, other than one a ``SimulatedRanks`` made.

    Local tensors are views into one uninitialised fp32 buffer (the largest local piece): plans
    depend on shapes, dtypes and placements, never on values or storage, and the views cost
    neither an allocation nor memory per rank."""

    def __init__(self, shape: ModelShape, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if dist.is_initialized() and not _is_simulated_group():
            raise RuntimeError("a default process group exists: simulated ranks need their own")
        _fake_backend_available()
        # init_process_group wraps sys.excepthook (a "[rank{r}]" prefix) every time: the wrapper
        # chain would grow by one per simulated rank, so the hook found here is put back each time.
        self._excepthook = sys.excepthook
        self.shape = shape
        self.world_size = world_size
        self._params = [(fqn, torch.Size(s), _contiguous_stride(s)) for fqn, s in shape.parameters()]
        self._param_group = _adamw_param_group([fqn for fqn, _, _ in self._params])
        largest = max(shard_rows(s[0], 0, world_size)[1] * math.prod(s[1:]) for _, s, _ in self._params)
        self._buffer = torch.empty(max(1, largest), dtype=torch.float32)

    @property
    def items_per_rank(self) -> int:
        """Entries of a rank's flattened state dict: 4 per parameter (weight, step, exp_avg,
        exp_avg_sq) and one per param-group key."""
        return 4 * len(self._params) + len(self._param_group)

    def _become(self, rank: int) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=self.world_size)
        sys.excepthook = self._excepthook
        global _simulated_group
        _simulated_group = dist.group.WORLD
        return init_device_mesh("cpu", (self.world_size,))

    def state_dict(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s ``{"model": ..., "optim": ...}`` (new objects on every call, as
        ``get_state_dict`` returns them for every checkpoint)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        mesh = self._become(rank)
        placements = (Shard(0),)
        buffer = self._buffer
        specs: dict[torch.Size, DTensorSpec] = {}

        def local(shape: torch.Size, stride: tuple[int, ...]) -> DTensor:
            # What DTensor.from_local(piece, mesh, placements, run_check=False, shape=shape,
            # stride=stride) builds, without its autograd function and with one spec per shape
            # (a spec is immutable and DTensors share them): from_local costs ~50 us a tensor,
            # a third of a simulated rank's time at 16,384 ranks.
            spec = specs.get(shape)
            if spec is None:
                spec = specs[shape] = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, buffer.dtype))
            rows = shard_rows(shape[0], rank, self.world_size)[1]
            piece = buffer[: rows * math.prod(shape[1:])].view(rows, *shape[1:])
            return DTensor(piece, spec, requires_grad=False)

        model: dict[str, Any] = {}
        state: dict[str, Any] = {}
        for fqn, shape, stride in self._params:
            model[fqn] = local(shape, stride)
            # torch 2.x AdamW keeps `step` as a 0-d float32 tensor per parameter, not sharded.
            state[fqn] = {"step": torch.zeros(()), "exp_avg": local(shape, stride),
                          "exp_avg_sq": local(shape, stride)}
        group = dict(self._param_group)
        group["params"] = list(group["params"])
        return {"model": model, "optim": {"state": state, "param_groups": [group]}}

    def close(self) -> None:
        if dist.is_initialized() and _is_simulated_group():
            dist.destroy_process_group()


# The default process group the latest SimulatedRanks made (ProcessGroup objects take no attributes).
_simulated_group: Any = None


def _is_simulated_group() -> bool:
    return _simulated_group is not None and dist.group.WORLD is _simulated_group


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


# --------------------------------------------------------------------------- write results


def tensor_blob_overhead() -> int:
    """Bytes ``torch.save`` adds around a tensor's data (zip headers, the pickled record, the
    64-byte alignment): the length of a saved 1-element tensor minus its 4 data bytes."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1), buffer)
    return buffer.getbuffer().nbytes - 4


def write_results(plan: SavePlan, planner: SavePlanner, blob_overhead: int) -> tuple[list[WriteResult], dict[str, int]]:
    """The ``WriteResult`` list stock ``FileSystemWriter.write_data`` returns for the final plan
    ``plan`` (one file per rank, ``{plan.storage_data.prefix}0.distcp``): byte items first, then
    tensors, both in plan order, at accumulating offsets; a byte item as long as the bytes
    ``planner.resolve_data`` gives for it, a tensor as long as its chunk's bytes plus
    ``blob_overhead``. Nothing is written. Also returns {file name: its length}.

    Precondition: ``plan.storage_data`` is the ``_StoragePrefix`` the writer's
    ``prepare_global_plan`` set, and ``planner`` is the rank's planner, set up for the save."""
    key = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    results: list[WriteResult] = []
    offset = 0
    byte_items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
    tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
    for item in byte_items:
        length = planner.resolve_data(item).getbuffer().nbytes
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(key, offset, length)))
        offset += length
    for item in tensor_items:
        data = item.tensor_data
        length = math.prod(data.chunk.sizes) * torch._utils._element_size(data.properties.dtype) + blob_overhead
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(key, offset, length)))
        offset += length
    return results, {key: offset}


def create_sparse_files(directory: str, lengths: Mapping[str, int]) -> None:
    """Create each file ``name`` in ``directory`` as a sparse file of ``lengths[name]`` bytes."""
    for name, length in lengths.items():
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, length)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- reference read plans


class ChunkLayout:
    """For every tensor entry of a checkpoint whose chunks are sorted along dimension 0 (a
    ``Shard(0)`` save), the chunks' first and end rows, so that the chunks a box overlaps are
    found by bisection. Entries of another layout are left to stock's code."""

    def __init__(self, metadata: Metadata) -> None:
        self.rows: dict[str, tuple[list[int], list[int]]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if type(md) is not TensorStorageMetadata or len(md.size) == 0 or len(md.chunks) < 2:
                continue
            starts = [chunk.offsets[0] for chunk in md.chunks]
            ends = [chunk.offsets[0] + chunk.sizes[0] for chunk in md.chunks]
            if all(a <= b for a, b in zip(starts, starts[1:])) and all(a <= b for a, b in zip(ends, ends[1:])):
                self.rows[fqn] = (starts, ends)


def reference_read_items(flat_state_dict: Mapping[str, Any], metadata: Metadata, layout: ChunkLayout) -> list[ReadItem]:
    """Stock ``create_default_local_load_plan``'s items for ``flat_state_dict`` (stock's flattened
    destination, e.g. ``DefaultLoadPlanner.state_dict`` after ``set_up_planner``), built with the
    same stock helpers and objects, item for item, but finding the stored chunks a DTensor's local
    piece overlaps by bisection (:class:`ChunkLayout`) instead of stock's sweep over all of them.
    Entries outside ``layout`` take stock's code. Preconditions: every key is in the checkpoint
    (strict) with the destination's global shape; each DTensor has one local chunk."""
    items: list[ReadItem] = []
    state_md = metadata.state_dict_metadata
    for fqn, obj in flat_state_dict.items():
        md = state_md[fqn]
        rows = layout.rows.get(fqn)
        if rows is None or not isinstance(obj, DTensor):
            items += _create_read_items(fqn, md, obj)
            continue
        (local,) = obj.__create_chunk_list__()
        starts, ends = rows
        first_row, end_row = local.offsets[0], local.offsets[0] + local.sizes[0]
        for storage_idx in range(bisect_right(ends, first_row), bisect_left(starts, end_row)):
            stored: ChunkStorageMetadata = md.chunks[storage_idx]
            if not _check_shard_metadata_pair_overlap(local, stored):
                continue
            storage_offsets, dest_offsets, lengths = [], [], []
            for _dim, saved_offset, current_offset, length in _shards_get_overlap_region_wrt_saved_tensor(
                saved_shard=stored, current_shard=local
            ):
                storage_offsets.append(saved_offset)
                dest_offsets.append(current_offset)
                lengths.append(length)
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, local.offsets, 0),
                dest_offsets=torch.Size(dest_offsets),
                storage_index=MetadataIndex(fqn, stored.offsets, storage_idx),
                storage_offsets=torch.Size(storage_offsets),
                lengths=torch.Size(lengths),
            ))
    return items


# --------------------------------------------------------------------------- stock's validation


@contextlib.contextmanager
def deferred_stock_validation() -> Iterator[list[tuple[list[SavePlan], Metadata]]]:
    """Inside the block, stock ``DefaultSavePlanner``'s global plan validation only records its
    arguments (yielded list) and reports no error, so that :func:`estimate_validation` can time it
    on a sample. Not thread-safe; restores stock's function on exit."""
    captured: list[tuple[list[SavePlan], Metadata]] = []
    original = _default_planner._validate_global_plan

    valid = valid_plan_result()  # this release's "valid" (True, or no messages)

    def record(global_plan: list[SavePlan], metadata: Metadata) -> Any:
        captured.append((global_plan, metadata))
        return valid

    _default_planner._validate_global_plan = record
    try:
        yield captured
    finally:
        _default_planner._validate_global_plan = original


@dataclasses.dataclass(frozen=True)
class ValidationEstimate:
    seconds: float       # estimated time of stock's validation of every entry
    sampled: int         # entries validated for real (one per chunk layout)
    entries: int         # entries of the metadata
    errors: int          # errors the sampled entries reported (0 for a valid plan)

    def describe(self) -> str:
        return f"estimated from {self.sampled} of {self.entries} entries"


def estimate_validation(global_plan: list[SavePlan], metadata: Metadata) -> ValidationEstimate:
    """Stock ``_validate_global_plan``'s time for ``metadata``, from one entry per chunk layout
    (tensor size and chunk count: entries alike in both cost alike), each timed alone and counted
    once per entry of its layout. Entries stock skips (bytes, 0-d tensors) are counted at no cost."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if type(md) is TensorStorageMetadata and len(md.size) > 0:
            groups.setdefault((tuple(md.size), len(md.chunks)), []).append(fqn)
    validate = _default_planner._validate_global_plan
    seconds, errors = 0.0, 0
    for fqns in groups.values():
        sample = Metadata({fqns[0]: metadata.state_dict_metadata[fqns[0]]})
        started = time.perf_counter()
        passed, messages = validation_passed(validate(global_plan, sample))
        seconds += (time.perf_counter() - started) * len(fqns)
        errors += len(messages) or int(not passed)
    return ValidationEstimate(seconds=seconds, sampled=len(groups), entries=len(metadata.state_dict_metadata),
                              errors=errors)
