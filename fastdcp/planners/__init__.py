"""Planners: FastSavePlanner and FastLoadPlanner, DCP planners whose per-save and per-load cost does not grow
with Python work per item when the state dict keeps its structure.

Stock ``DefaultSavePlanner``/``DefaultLoadPlanner`` rebuild every plan from scratch on every call:
flatten the state dict, build a ``WriteItem``/``ReadItem`` (with its ``MetadataIndex``,
``torch.Size`` and ``TensorProperties``) per tensor, dedup and build ``Metadata`` on the coordinator,
and pickle all of it for the plan collectives. For 5,000 small tensors that is most of a save or load.
These planners produce the same plans and metadata (stock readers and writers accept them, and a
checkpoint they write loads bit-exactly with stock ``DefaultLoadPlanner``), but:

- **Structure key.** One pass over the state dict flattens it (stock ``flatten_state_dict``
  semantics, including ``flatten_sharded_tensors``) and records, per leaf, everything the stock plan
  depends on: the object path, and the type, shape, dtype, layout, requires_grad and pinning of a
  tensor; the global shape, placements, mesh shape and coordinate of a DTensor; the global metadata
  and local shard boxes of a ShardedTensor. (Strides and values do not change a plan, so they are
  not part of the key.) Leaves whose plan only stock code knows how to build (tensor subclasses
  with their own ``__create_write_items__``, meta tensors on load, ...) make the state dict
  uncacheable and those calls take the stock path.
- **Local plan cache** (every rank): structure key -> the local plan's items. On a hit,
  ``create_local_plan`` builds nothing.
- **Global plan cache** (coordinator): the local plans it received -> the deduplicated global plans
  and ``Metadata``. Every rank always sends its complete local plan, so the coordinator decides hit
  or miss from what it received (no rank guesses what the coordinator holds, and no extra
  collective is needed): if any rank's structure changed, its plan differs, and the coordinator
  replans for everyone. The ``storage_data`` of every plan (the writer's file prefixes, fresh per
  save for ``FastFileSystemWriter``) is never cached: it is taken from this save's plans, and the
  writer's ``prepare_global_plan`` runs on every save. ``Metadata`` is handed out as a fresh object
  with fresh top-level dicts, since writers assign ``storage_data``/``storage_meta`` on it.
- **Plan transfer.** Save plans cross the gather as columns (:mod:`fastdcp.planners.plan_columns`:
  a compressed structure blob every FSDP rank shares, decoded once by the coordinator, plus one
  int64 buffer per rank) and come back as a keep mask, index hints and table rows; the coordinator
  plans in bulk (:mod:`fastdcp.planners.global_save_plan`) and validates chunks in O(R log R)
  (:mod:`fastdcp.planners.chunk_validation`). Read plans pickle as one cached blob
  (:class:`fastdcp.planners.plan_cache._PackedItems`), and the receiving side keeps the lists it
  unpickled by blob.
- **Bulk construction on a miss.** Items for plain tensors are built in one pass, sharing equal
  ``TensorProperties``, offsets and chunks (which also makes ``.metadata`` smaller and faster to
  unpickle); DTensor/ShardedTensor/object leaves use stock's helpers; replicated items are
  deduplicated across ranks largest first onto the rank with the fewest bytes so far (each written
  exactly once, bytes spread by size). Garbage collection is paused while the many small objects of
  a plan are built or unpickled (a full collection of a large heap otherwise costs more than the
  work itself).
- **Per-item calls** (``resolve_data``, ``resolve_tensor``) look tensors up with one dict access.

``FastLoadPlanner`` plans from the checkpoint's chunk table when the reader provides one
(:mod:`fastdcp.planners.read_items`: bisection over sorted chunk columns, never building the
metadata's per-chunk objects), and caches the local read plan keyed on the destination's structure
key and what it reads of the checkpoint: the content of its ``state_dict_metadata``, or, where the
checkpoint has a chunk index (saved with ``FastSavePlanner``), the index's table itself. Loading the
same checkpoint again reuses the plan; another checkpoint of the same model reuses it only without a
chunk index (planning from an index, ~35 ms at 5 million chunks, costs less than hashing its columns);
a checkpoint with other shapes or chunks replans.

Caches are per process, bounded (:data:`fastdcp.planners.process_state._CACHE_ENTRIES` structures
each), hold no tensors, and can be dropped with :func:`clear_plan_caches`. Plans handed out share their (frozen) items with the
cache; like DCP's own code, callers must not mutate a plan's item list or metadata entries in place.
"""

from .load_planner import FastLoadPlanner
from .plan_cache import clear_plan_caches
from .save_planner import FastSavePlanner

__all__ = ["FastSavePlanner", "FastLoadPlanner", "clear_plan_caches"]
