"""Every torch internal fastdcp touches: where it lives, what fastdcp does with it, and the releases
it was checked on; and how fastdcp follows the releases where one behaves differently.

fastdcp lives inside DCP: it subclasses stock's writer, reader and planners and uses names that are
not torch's public API (a leading underscore, or a private module). :data:`INTERNALS` lists each
one; ``tests/compat/test_torch_internals.py`` resolves every entry on the torch under test and
fails, naming the entry, when one is missing, and it reads fastdcp's source to check that nothing
outside this list is used (a private name added to the code without an entry here fails the
suite). ``import fastdcp`` calls :func:`require_internals` first, so a torch that lacks a required
internal refuses with :class:`TorchInternalsMissing`, naming the torch version and each missing
piece, instead of an ``ImportError`` from deep inside a module or, worse, a silent change of
behaviour. ``python -m fastdcp.compat`` prints the list with what this torch has.

Where releases differ, fastdcp follows the release it runs on (each has a test that runs on every
release of the CI matrix, see README "Supported torch releases"):

* ``default_planner._validate_global_plan`` returns ``True``/``False`` and logs the messages up to
  2.11, and returns the list of messages (empty when valid) since 2.13:
  :func:`validation_passed` reads either; :func:`valid_plan_result` is what this release returns
  for a valid plan (asked of stock's function itself, not guessed from the version).
* ``FileSystemWriter.finish`` sets the version with ``dataclasses.replace(metadata, ...)`` in 2.11
  and by assignment since 2.13: ``TableMetadata`` (a ``Metadata`` backed by columns) turns into a
  stock ``Metadata`` under ``replace`` (:mod:`fastdcp.format.table_metadata`).
* ``state_dict_loader._load_state_dict`` catches any ``Exception`` from ``read_metadata()`` since
  2.11, tries the rank-local metadata, and then drops (2.11) or quotes (2.13) the first error:
  ``FastFileSystemReader.read_metadata`` raises a failed read's error as DCP's
  ``CheckpointException`` when the rank-local read that follows fails too, so every release reports
  the file and the problem.
* ``TensorProperties`` gains ``strides`` in 2.15 (a sixth field of its pickled state):
  :data:`TENSOR_PROPERTIES_HAVE_STRIDES` says whether this release has it; the restricted
  unpickler reads five or six fields (dropping strides where the field does not exist), the bulk
  planner records them as ``create_from_tensor`` does, and every dedup of properties keys on
  :func:`tensor_properties_key`, which reads every field this release's class has.
* Up to 2.9 stock plans a tensor's read items pair by pair in chunk order; since 2.11 by a sweep
  (fastdcp's order). The items are the same; tests compare them as a multiset on 2.9.
* ``DefaultStager`` closes its ``StateDictStager`` after every stage in 2.11 and 2.12, so its
  second stage fails (pytorch/pytorch#183413): :mod:`fastdcp.compat.stock_stager` asks stock's
  class whether it does, and only then gives a closed one a successor before the next stage
  (``fastdcp.enable()`` and ``FastFileSystemWriter`` install it).
* Not a name but a behaviour: DCP ships a rank's failure to the coordinator by pickling it inside
  its next object collective (``_DistWrapper.reduce_scatter`` / ``all_gather``), which pickles
  before it communicates. :class:`fastdcp.load.deadline.LoadDeadlineError` refuses its first
  pickling so that it leaves ``dcp.load`` at once instead of waiting in that collective for the
  stalled rank; ``tests/load/test_load_deadline.py`` checks it on real gloo ranks. A release that
  shipped failures otherwise would only make the error arrive later (with the stalled rank).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import operator
import sys
from typing import Any

from torch.distributed.checkpoint.metadata import TensorProperties

__all__ = [
    "Internal",
    "INTERNALS",
    "CHECKED_ON",
    "TorchInternalsMissing",
    "resolve",
    "missing_internals",
    "require_internals",
    "validation_passed",
    "valid_plan_result",
    "TENSOR_PROPERTIES_HAVE_STRIDES",
    "tensor_properties_key",
]

# The torch releases CI checks every entry below on (.ci/run: the whole suite on 2.11.0, 2.13.0 and
# 2.15.0, the interop subset on 2.9.1, whose whole suite passed when the matrix was set up).
CHECKED_ON = ("2.9.1", "2.11.0", "2.13.0", "2.15.0")

_DCP = "torch.distributed.checkpoint"


@dataclasses.dataclass(frozen=True)
class Internal:
    """One name fastdcp uses that torch does not promise to keep.

    ``name`` is an attribute path inside ``module`` (``None``: the module itself). A ``required``
    internal must resolve for fastdcp to import; an optional one has a fallback that ``used_for``
    states (never one that changes the checkpoint format or the guarantees), or is the
    benchmark's, whose scenario then fails with an ImportError naming it."""

    module: str
    name: str | None
    used_by: str
    used_for: str
    required: bool = True

    @property
    def qualified(self) -> str:
        return self.module if self.name is None else f"{self.module}.{self.name}"


def _dcp(module: str) -> str:
    return f"{_DCP}.{module}"


INTERNALS: tuple[Internal, ...] = (
    # -- the file layout ----------------------------------------------------------------------
    Internal(_dcp("filesystem"), "_StorageInfo", "format, save, load",
             "a stored item's file, offset and length: what .metadata's storage_data holds"),
    Internal(_dcp("filesystem"), "_StoragePrefix", "save/commit",
             "the data-file prefix a rank's plan carries (stock's storage_data of a SavePlan)"),
    Internal(_dcp("filesystem"), "_split_by_size_and_type", "save/file_split",
             "stock's split of a rank's items into thread_count files, followed exactly"),
    Internal(_dcp("filesystem"), "_RestrictedMetadataUnpickler", "format/metadata",
             "globals users registered with stock's add_safe_metadata_globals are accepted too",
             required=False),
    Internal(_dcp("filesystem"), "SerializationFormat", "save/writer",
             "a non-torch.save serialization format is written by stock's code (absent: only torch.save)",
             required=False),
    # -- planning -----------------------------------------------------------------------------
    Internal(_dcp("planner_helpers"), "_create_write_items", "planners/items",
             "stock's write items of one object (DTensor, ShardedTensor, custom __create_write_items__)"),
    Internal(_dcp("planner_helpers"), "_create_read_items", "planners/items",
             "stock's read items of one object against its stored metadata"),
    Internal(_dcp("planner_helpers"), "_create_chunk_list", "planners/read_items",
             "the chunks a rank holds of one object, as stock computes them"),
    Internal(_dcp("default_planner"), "_validate_global_plan", "planners/items, bench",
             "stock's check of a global save plan; see validation_passed for its two return forms"),
    Internal(_dcp("_nested_dict"), "flatten_state_dict", "planners/structure",
             "stock's flattening of a nested state dict (the mapping in planner_data)"),
    Internal(_dcp("_version"), "_derived_version", "planners/structure",
             "the pre-2.4 flattening switch stock's flatten reads"),
    Internal(_dcp("_traverse"), "set_element", "cli/convert",
             "placing a value at a flattened path of a nested state dict"),
    Internal("torch.distributed._shard.sharded_tensor", "ShardedTensor", "planners/structure, save/staging",
             "legacy sharded tensors in a state dict"),
    Internal("torch.distributed._shard.sharded_tensor", "Shard", "save/staging",
             "the local shards of a staged ShardedTensor"),
    Internal("torch.distributed._shard.sharded_tensor", "ShardedTensor._init_from_local_shards_and_global_metadata",
             "save/staging", "a staged ShardedTensor rebuilt around its staged local shards"),
    # -- saving and async saves ---------------------------------------------------------------
    Internal(_dcp("_storage_utils"), "_storage_setup", "default_storage",
             "DCP's choice of storage for a checkpoint_id: what fastdcp.enable() replaces"),
    Internal(_dcp("_async_thread_executor"), None, "save/async_staging",
             "the module whose thread runs a thread-mode async_save (recognised by its frames)"),
    Internal("torch._utils", "_element_size", "save/file_split, planners/global_save_plan",
             "bytes per element of a dtype, as stock sizes items"),
    Internal("torch", "UntypedStorage._new_shared", "io/host_memory",
             "a shared-memory storage: staging slabs a process-mode save sends without a copy"),
    Internal("torch.cuda._pin_memory_utils", None, "io/host_memory",
             "page-locking a shared slab in place under CUDA (absent: slabs are not pinned in place)",
             required=False),
    Internal(_dcp("staging"), "DefaultStager._stage", "compat/stock_stager",
             "stock's stager's stage, wrapped where it closes its StateDictStager after every stage "
             "(2.11, 2.12: its second stage fails; absent: nothing to mend)", required=False),
    Internal(_dcp("_state_dict_stager"), "StateDictStager", "compat/stock_stager",
             "the StateDictStager a mended DefaultStager gets anew when the previous stage closed it",
             required=False),
    # -- loading ------------------------------------------------------------------------------
    Internal("torch.distributed.distributed_c10d", "_get_default_store", "load/deadline",
             "the default process group's c10d store, where a load's ranks check in against its deadline "
             "(absent: loads run without check-ins, as before)", required=False),
    # -- the tensor blob (torch.save's format) ------------------------------------------------
    Internal("torch._utils", "_rebuild_tensor_v2", "format/blob, format/blob_parse",
             "the function a torch.save pickle calls to rebuild a tensor (named in every blob)"),
    Internal("torch._utils", "_rebuild_tensor_v3", "format/blob, format/blob_parse",
             "the rebuild function of blobs that record a dtype (newer torch.save); absent: only v2 blobs",
             required=False),
    Internal("torch._utils", "_rebuild_parameter", "format/blob_parse",
             "the function a torch.save pickle calls to rebuild a Parameter"),
    Internal("torch.serialization", "_get_layout", "format/metadata",
             "how a pickled layout is rebuilt (allowed by the restricted unpickler)"),
    Internal("torch.serialization", "_get_storage_alignment", "cli/convert",
             "torch.save's record alignment, for a .pt written record by record"),
    Internal("torch._C", "PyTorchFileWriter", "cli/convert",
             "torch.save's own zip writer, for a .pt written one tensor at a time"),
    # -- the benchmark (python -m fastdcp.bench; nothing in a stage imports it) -----------------
    Internal(_dcp("_async_process_executor"), "_CHECKPOINT_PROCESS", "bench",
             "DCP's process-mode checkpoint process: stopped between scenarios, its pid for memory figures", required=False),
    Internal(_dcp("resharding"), "_check_shard_metadata_pair_overlap", "bench/simulated_ranks",
             "stock's load planning steps, replayed for simulated ranks (plan_scale)", required=False),
    Internal(_dcp("resharding"), "_shards_get_overlap_region_wrt_saved_tensor", "bench/simulated_ranks",
             "stock's load planning steps, replayed for simulated ranks (plan_scale)", required=False),
    Internal(_dcp("_fsspec_filesystem"), "FsspecWriter", "bench/object_storage",
             "stock's writer for URLs (s3://), compared with fastdcp's in the s3 scenario", required=False),
    Internal(_dcp("_fsspec_filesystem"), "FsspecReader", "bench/object_storage",
             "stock's reader for URLs (s3://), compared with fastdcp's in the s3 scenario", required=False),
    Internal("torch.distributed.tensor._dtensor_spec", "DTensorSpec", "bench/simulated_ranks",
             "a simulated rank's DTensors built with one spec per shape (what from_local builds, ~5x faster)",
             required=False),
    Internal("torch.distributed.tensor._dtensor_spec", "TensorMeta", "bench/simulated_ranks",
             "the global shape, stride and dtype inside a simulated rank's DTensor spec", required=False),
    Internal("torch.testing._internal.distributed.fake_pg", "FakeStore", "bench/simulated_ranks",
             "the fake process group that lets one process play thousands of ranks (plan_scale)", required=False),
)


class TorchInternalsMissing(ImportError):
    """This torch lacks internals fastdcp needs (moved, renamed or removed in this release)."""


def resolve(internal: Internal) -> Any:
    """The object ``internal`` names in this torch. Raises ``ImportError`` or ``AttributeError``
    when it is missing."""
    obj: Any = importlib.import_module(internal.module)
    for part in internal.name.split(".") if internal.name else ():
        obj = getattr(obj, part)
    return obj


def missing_internals(internals: tuple[Internal, ...] = INTERNALS) -> list[tuple[Internal, str]]:
    """The entries of ``internals`` this torch does not have, each with why (the error's text)."""
    missing = []
    for internal in internals:
        try:
            resolve(internal)
        except (ImportError, AttributeError) as e:
            missing.append((internal, f"{type(e).__name__}: {e}"))
    return missing


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", "(unknown)")


def require_internals(internals: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise :class:`TorchInternalsMissing` naming the torch version and every required internal
    this torch lacks (the optional ones fall back as their entry says)."""
    missing = missing_internals(tuple(i for i in internals if i.required))
    if not missing:
        return
    lines = "\n".join(f"  {i.qualified} (used by fastdcp's {i.used_by}: {i.used_for}): {why}" for i, why in missing)
    raise TorchInternalsMissing(
        f"fastdcp cannot run on torch {_torch_version()}: it lacks {len(missing)} internal(s) fastdcp relies on\n"
        f"{lines}\nfastdcp was checked on torch {', '.join(CHECKED_ON)}; install one of those (README: "
        "Supported torch releases)"
    )


# ---------------------------------------------------------------------------------- differences


@functools.cache
def valid_plan_result() -> Any:
    """What this release's ``default_planner._validate_global_plan`` returns for a valid plan:
    ``True`` (up to 2.11) or ``[]`` (since 2.13), asked of the function itself (an empty plan),
    not guessed from the version number. A stand-in for stock's validation returns this."""
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    result = default_planner._validate_global_plan([SavePlan([])], Metadata({}))
    if result is True or (isinstance(result, list) and not result):
        return result
    raise TorchInternalsMissing(
        f"torch {_torch_version()}: default_planner._validate_global_plan returned {result!r} for an empty plan "
        "(fastdcp knows True and []): its form changed in this release"
    )


def validation_passed(result: Any) -> tuple[bool, list[str]]:
    """``_validate_global_plan``'s result in either form, as (passed, messages). The bool form
    carries no messages (stock logged them as warnings)."""
    if isinstance(result, bool):
        return result, []
    messages = list(result)
    return not messages, messages


_TENSOR_PROPERTIES_FIELDS = tuple(f.name for f in dataclasses.fields(TensorProperties))
# torch 2.15 added TensorProperties.strides (pickled as a sixth field of its state).
TENSOR_PROPERTIES_HAVE_STRIDES = "strides" in _TENSOR_PROPERTIES_FIELDS
_properties_fields = operator.attrgetter(*_TENSOR_PROPERTIES_FIELDS)


def tensor_properties_key(props: Any) -> tuple[Any, ...]:
    """Every field of this release's ``TensorProperties`` (strides since 2.15), as a tuple: what
    makes two properties objects interchangeable, so every dedup of them keys on this rather than
    on a list of fields that a release can outgrow. ``AttributeError`` for an object without them."""
    return _properties_fields(props)
