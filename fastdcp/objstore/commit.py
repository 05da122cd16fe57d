"""Committing a checkpoint in object storage: ``.metadata`` written last, by one PUT.

S3 replaces an object atomically, so the PUT of the finished ``.metadata`` is the commit: before
it, readers see the previous checkpoint (or none); after it, the new one, whose objects were all
complete before it started. No rename (on S3 a copy + delete, not atomic), no temp object, no
LIST. With ``create_only`` the PUT carries ``If-None-Match: *``: of two saves racing to create one
checkpoint, exactly one commits and the other fails naming the object.

After the commit, the objects that only the replaced ``.metadata`` named are deleted (found by
reading that metadata before the PUT: one GET, no LIST). A load that started on the replaced
checkpoint and is still reading then fails with an error naming the missing object instead of
mixing two checkpoints (object names are save-unique, so it can never read the new save's bytes
in the old one's place).
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..format.metadata import CheckpointFormatError, CheckpointNotFoundError, parse_metadata
from ..format.metadata_emit import write_metadata
from ..io.gc import gc_paused
from .client import (BucketNotFoundError, ObjectExistsError, ObjectNotFoundError, S3Options, object_error,
                     require_obstore)
from .location import ObjectLocation
from .transfer import delete_objects

__all__ = ["object_exists", "is_object_name", "read_object", "read_checkpoint_metadata", "commit_metadata", "metadata_bytes"]

logger = logging.getLogger("fastdcp")


def object_exists(store: Any, location: ObjectLocation, name: str, options: S3Options) -> bool:
    """Whether object ``name`` exists (one HEAD)."""
    obstore = require_obstore()
    try:
        obstore.head(store, location.key(name))
    except Exception as error:  # noqa: BLE001 - translated below
        translated = object_error(error, location.url(name), "checking", options)
        if isinstance(translated, ObjectNotFoundError) and not isinstance(translated, BucketNotFoundError):
            return False
        raise translated from error
    return True


def read_object(store: Any, location: ObjectLocation, name: str, options: S3Options) -> bytes:
    """The whole object ``name`` (one GET); errors name it."""
    obstore = require_obstore()
    try:
        return bytes(obstore.get(store, location.key(name)).bytes())
    except Exception as error:  # noqa: BLE001 - translated, naming the object
        raise object_error(error, location.url(name), "reading", options) from error


def read_checkpoint_metadata(store: Any, location: ObjectLocation, name: str, options: S3Options,
                             allow_unsafe: bool) -> Metadata:
    """The checkpoint's metadata object ``name``, parsed and validated as on local disk
    (:func:`fastdcp.format.metadata.parse_metadata`), every data object it names checked to be a
    plain name under the checkpoint's prefix. A missing one is a ``CheckpointNotFoundError``."""
    try:
        data = read_object(store, location, name, options)
    except ObjectNotFoundError as error:
        raise CheckpointNotFoundError(
            f"'{location.url()}' is not a DCP checkpoint: {error} (was the save interrupted?)"
        ) from None
    metadata = parse_metadata(data, location.url(name), allow_unsafe=allow_unsafe)
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not is_object_name(rel):
            raise CheckpointFormatError(f"{location.url(name)} names a data object {rel!r} outside the checkpoint")
    return metadata


def is_object_name(rel: Any) -> bool:
    """Whether ``rel`` names an object inside a checkpoint's prefix: a plain name, or one
    sub-prefix and a name (``FastS3Writer(key_prefixes=...)``); no empty, ``.`` or ``..`` part."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return len(parts) <= 2 and all(part and part not in (".", "..") for part in parts)


def metadata_bytes(metadata: Metadata) -> bytes:
    """``metadata`` as stock's ``.metadata`` pickle (streamed from the chunk table when the save was
    planned in bulk)."""
    table = getattr(metadata, "chunk_table", None)
    out = io.BytesIO()
    with gc_paused():
        if table is not None and table.storage is not None:
            write_metadata(out, table, planner_data=metadata.planner_data, storage_meta=metadata.storage_meta,
                           version=metadata.version)
        else:
            pickle.dump(metadata, out)
    return out.getvalue()


def _referenced(store: Any, location: ObjectLocation, name: str, options: S3Options) -> set[str]:
    """The objects the current ``name`` names; empty when there is none or it cannot be parsed
    (then nothing is deleted: a damaged metadata's objects are left for a person to look at)."""
    try:
        metadata = read_checkpoint_metadata(store, location, name, options, allow_unsafe=False)
    except CheckpointNotFoundError:
        return set()
    except OSError:  # the store failed: the commit would too
        raise
    except Exception:  # noqa: BLE001 - damaged: see the docstring
        logger.warning("%s could not be parsed: the objects of the checkpoint it committed are kept",
                       location.url(name))
        return set()
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


def commit_metadata(store: Any, location: ObjectLocation, name: str, metadata: Metadata, new_files: set[str],
                    *, create_only: bool, options: S3Options) -> None:
    """PUT ``metadata`` as object ``name`` (see the module docstring), then delete the objects only
    the replaced metadata named."""
    obstore = require_obstore()
    body = metadata_bytes(metadata)
    replaced = set() if create_only else _referenced(store, location, name, options)
    url = location.url(name)
    try:
        obstore.put(store, location.key(name), body, mode="create" if create_only else "overwrite",
                    use_multipart=False)
    except Exception as error:  # noqa: BLE001 - translated, naming the object
        translated = object_error(error, url, "committing", options)
        if isinstance(translated, ObjectExistsError):
            # Refused for certain (not a timeout that may have committed): nothing names this
            # save's objects, so they go.
            delete_objects(store, location, sorted(new_files), options)
            translated = ObjectExistsError(
                f"committing {url}: a checkpoint was committed there while this save ran, and overwrite=False "
                "(this save's objects were deleted)"
            )
        raise translated from error
    stale = sorted(replaced - set(new_files))
    if stale:
        failed = delete_objects(store, location, stale, options)
        if failed:
            logger.warning("committed %s, but %d objects of the checkpoint it replaced could not be deleted: %s",
                           url, len(failed), ", ".join(failed[:3]))
    logger.debug("committed %s (%d objects, %d replaced objects deleted)", url, len(new_files), len(stale))
