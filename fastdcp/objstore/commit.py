"""Committing a checkpoint in object storage: ``.metadata`` written last, by one PUT.

S3 replaces an object atomically, so the PUT of the finished ``.metadata`` is the commit: before
it, readers see the previous checkpoint (or none); after it, the new one, whose objects were all
complete before it started. No rename (on S3 a copy + delete, not atomic), no temp object, no
LIST. With ``create_only`` the PUT carries ``If-None-Match: *``: of two saves racing to create one
checkpoint, exactly one commits and the other fails naming the object.

A save planned in bulk (``FastSavePlanner``) also writes the chunk index beside ``.metadata``, as
on local disk: object ``.metadata.{token}.index`` (the save's token, so two saves' indexes never
share a name), PUT before ``.metadata``, which names it in its first bytes and stays a complete
stock pickle. ``FastS3Reader`` reads the index (a rank its own section) by ranged GETs.

After the commit, the objects that only the replaced ``.metadata`` named are deleted, its chunk
index with them (found by reading that metadata before the PUT: one GET, no LIST). A load that
started on the replaced checkpoint and is still reading then fails with an error naming the
missing object instead of mixing two checkpoints (object names are save-unique, so it can never
read the new save's bytes in the old one's place).
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..format.index_layout import edge_bytes_for
from ..format.index_link import metadata_facts
from ..format.index_writer import write_chunk_index
from ..format.metadata import CheckpointFormatError, CheckpointNotFoundError, parse_metadata
from ..format.metadata_emit import CHUNK_INDEX_ATTRIBUTE, write_metadata
from ..io.gc import gc_paused
from .client import (BucketNotFoundError, ObjectExistsError, ObjectNotFoundError, S3Options, object_error,
                     require_obstore)
from .location import ObjectLocation
from .transfer import delete_objects, upload_image

__all__ = ["object_exists", "is_object_name", "read_object", "read_checkpoint_metadata", "commit_metadata",
           "metadata_bytes", "metadata_objects", "plain_object_name", "chunk_index_name"]

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
                             allow_unsafe: bool, data: bytes | None = None) -> Metadata:
    """The checkpoint's metadata object ``name``, parsed and validated as on local disk
    (:func:`fastdcp.format.metadata.parse_metadata`), every data object it names checked to be a
    plain name under the checkpoint's prefix. A missing one is a ``CheckpointNotFoundError``.
    ``data``: the object's bytes when the caller has fetched them already (else one GET)."""
    if data is None:
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
    sub-prefix and a name (``FastS3Writer(key_prefixes=...)``); no empty, ``.`` or ``..`` part. Data
    objects are named so."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return len(parts) <= 2 and all(part and part not in (".", "..") for part in parts)


def plain_object_name(name: object) -> bool:
    """Whether ``name`` is an object directly under the checkpoint's prefix (an :func:`is_object_name`
    with no sub-prefix). Chunk indexes are named so."""
    return is_object_name(name) and "/" not in name


def chunk_index_name(metadata: Metadata) -> str | None:
    """The chunk index object a parsed ``.metadata`` names, when it names a plain one."""
    name = getattr(metadata, CHUNK_INDEX_ATTRIBUTE, None)
    return name if plain_object_name(name) else None


def metadata_objects(metadata: Metadata, name: str, token: str | None
                     ) -> tuple[bytes, tuple[str, bytes] | None]:
    """The objects a commit PUTs: the ``.metadata`` object's bytes, and (a save planned in bulk,
    with its ``token``) the chunk index's name and bytes (views of the buffers they were written
    into: hundreds of MB at thousands of ranks, not copied again). As on local disk
    (:mod:`fastdcp.save.commit`): ``.metadata`` streamed from the chunk table names the index
    ``{name}.{token}.index`` in its first bytes, and the index records the ``.metadata``'s size
    and the CRC-32C of its two ends, so a reader can tell that it belongs to that ``.metadata``.

    Args:
        metadata: the save's metadata (a ``TableMetadata`` with storage columns when planned in bulk).
        name: the ``.metadata`` object's name (``.metadata`` or ``__{rank}.metadata``).
        token: the save's token; None writes no index.
    """
    table = getattr(metadata, "chunk_table", None)
    if token is None or table is None or table.storage is None:
        return metadata_bytes(metadata), None
    index_name = f"{name}.{token}.index"
    facts = dict(planner_data=metadata.planner_data, storage_meta=metadata.storage_meta, version=metadata.version)
    out, index = io.BytesIO(), io.BytesIO()
    with gc_paused():
        write_metadata(out, table, chunk_index_name=index_name, **facts)
        data = out.getvalue()
        size, head_crc, tail_crc = metadata_facts(data, edge_bytes_for(table))
        write_chunk_index(index, table, metadata_size=size, metadata_head_crc=head_crc, metadata_tail_crc=tail_crc,
                          **facts)
    return data, (index_name, index.getvalue())


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
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    index = chunk_index_name(metadata)
    return names | {index} if index is not None else names


def commit_metadata(store: Any, location: ObjectLocation, name: str, metadata: Metadata, new_files: set[str],
                    *, create_only: bool, options: S3Options, token: str | None = None) -> None:
    """PUT ``metadata`` as object ``name`` (see the module docstring), its chunk index first when
    the save was planned in bulk, then delete the objects only the replaced metadata named.

    Args:
        new_files: this save's data objects.
        create_only: fail (``ObjectExistsError``) when ``name`` exists; this save's objects are
            deleted then.
        token: the save's token, which names the chunk index (None: no index).
    """
    obstore = require_obstore()
    body, index = metadata_objects(metadata, name, token)
    replaced = set() if create_only else _referenced(store, location, name, options)
    url = location.url(name)
    new_files = set(new_files)
    if index is not None:
        index_name, index_body = index
        try:
            upload_image(store, location, index_name, [(0, index_body)], len(index_body), options,
                         options.concurrency)
        except BaseException:
            # Nothing was committed (the .metadata PUT was not sent): nothing names this save's objects.
            delete_objects(store, location, sorted(new_files | {index_name}), options)
            raise
        new_files.add(index_name)
        del index, index_body
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
