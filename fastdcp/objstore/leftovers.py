"""What interrupted saves leave under a checkpoint's prefix in object storage, and removing it.

Data objects have save-unique names (``__{rank}_{token}_{i}.distcp``), and a checkpoint is what its
``.metadata`` names. A save that fails deletes what it uploaded and aborts its multipart uploads;
where it cannot (the network is gone, the process is killed), its completed objects stay behind.
Nothing names them, so they never load, but they take space. ``python -m fastdcp gc`` lists them
and, with ``--delete``, removes them.

A *leftover* is a data object directly under the prefix or under one of its hex sub-prefixes
(``FastS3Writer(key_prefixes=...)``), named as DCP names data files (stock's
``__{rank}_{i}.distcp`` or fastdcp's), or a chunk index named as fastdcp names it
(``.metadata.{token}.index``), that the committed ``.metadata`` does not name, and older than
``min_age_s``: object storage holds no in-flight marker, so a younger object may belong to a
save that is still running. Everything else is kept, and objects DCP would not have written are
never touched. Incomplete multipart uploads do not appear in a listing: a bucket lifecycle rule
(``AbortIncompleteMultipartUpload``) removes them.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from ..format.metadata import METADATA_NAME, CheckpointFormatError, CheckpointNotFoundError
from .client import S3Options, object_error, require_obstore
from .commit import chunk_index_name, read_checkpoint_metadata
from .location import ObjectLocation
from .transfer import delete_objects

__all__ = ["DEFAULT_MIN_AGE_S", "DATA_OBJECT_RE", "INDEX_OBJECT_RE", "StoredObject", "Leftovers", "list_objects",
           "find_leftovers", "remove_leftovers"]

DEFAULT_MIN_AGE_S = 3600.0  # as long as a save may take between its first upload and its commit

# Data objects as DCP names them: stock's __{rank}_{i}.distcp, fastdcp's __{rank}_{token}_{i}.distcp,
# either under a hex sub-prefix (key_prefixes).
DATA_OBJECT_RE = re.compile(r"^(?:[0-9a-f]+/)?__\d+_(?:[0-9a-f]+_)?\d+\.distcp$")
# The sub-prefixes FastS3Writer(key_prefixes=...) spreads data objects over.
_SUB_PREFIX_RE = re.compile(r"^[0-9a-f]+/$")

# The chunk index a save planned in bulk writes beside .metadata: .metadata.{token}.index.
INDEX_OBJECT_RE = re.compile(r"^\.metadata\.[0-9a-f]+\.index$")


@dataclass(frozen=True)
class StoredObject:
    """One object under the checkpoint's prefix: its name there (``<hex>/`` first when under a
    sub-prefix), size, last change."""

    name: str
    size: int
    modified: float  # seconds since the epoch


@dataclass
class Leftovers:
    """The objects under a checkpoint's prefix, sorted by what ``gc`` may do with them.

    Args:
        url: the checkpoint.
        committed: whether a ``.metadata`` is there (else every data object is a leftover once old).
        named: the ``.metadata`` and the objects it names (its chunk index too): kept.
        leftover: data objects and chunk indexes nothing names, older than the minimum age: removable.
        recent: data objects and chunk indexes nothing names yet, younger than the minimum age: kept.
        other: objects DCP would not have written: kept.
    """

    url: str
    committed: bool
    named: list[StoredObject] = field(default_factory=list)
    leftover: list[StoredObject] = field(default_factory=list)
    recent: list[StoredObject] = field(default_factory=list)
    other: list[StoredObject] = field(default_factory=list)


def list_objects(store: Any, location: ObjectLocation, options: S3Options) -> list[StoredObject]:
    """The objects directly under the checkpoint's prefix and under its hex sub-prefixes (one LIST,
    paged by the client, and one per sub-prefix); errors name the prefix."""
    obstore = require_obstore()
    prefix = location.key("")
    found: list[StoredObject] = []
    pending = [prefix]
    while pending:
        where = pending.pop()
        try:
            listed = obstore.list_with_delimiter(store, where or None)
        except Exception as error:  # noqa: BLE001 - translated, naming the prefix
            raise object_error(error, location.url(where[len(prefix):]), "listing", options) from error
        found += [StoredObject(meta["path"][len(prefix):], int(meta["size"]), meta["last_modified"].timestamp())
                  for meta in listed["objects"] if meta["path"].startswith(prefix)]
        if where == prefix:
            pending += [p if p.endswith("/") else p + "/" for p in listed["common_prefixes"]
                        if _SUB_PREFIX_RE.match((p if p.endswith("/") else p + "/")[len(prefix):])]
    return found


def find_leftovers(store: Any, location: ObjectLocation, options: S3Options, *, min_age_s: float = DEFAULT_MIN_AGE_S,
                   now: float | None = None) -> Leftovers:
    """Sort the objects under ``location`` (see the module docstring). A ``.metadata`` that cannot be
    read safely raises ``CheckpointFormatError``: what it names is unknown, so nothing is a leftover.

    Args:
        min_age_s: how old an unnamed data object must be to count as left over (default one hour).
        now: the time ages are measured from (default: now).
    """
    objects = list_objects(store, location, options)
    try:
        metadata = read_checkpoint_metadata(store, location, METADATA_NAME, options, allow_unsafe=False)
        referenced = {info.relative_path for info in (metadata.storage_data or {}).values()} | {METADATA_NAME}
        index = chunk_index_name(metadata)
        if index is not None:
            referenced.add(index)
        committed = True
    except CheckpointNotFoundError:
        referenced, committed = set(), False
    except CheckpointFormatError as error:
        raise CheckpointFormatError(f"{error}: it is unknown which objects it names, so none is collected") from None
    now = time.time() if now is None else now
    result = Leftovers(location.url(), committed)
    for obj in sorted(objects, key=lambda o: o.name):
        if obj.name in referenced:
            result.named.append(obj)
        elif not (DATA_OBJECT_RE.match(obj.name) or INDEX_OBJECT_RE.match(obj.name)):
            result.other.append(obj)
        elif now - obj.modified < min_age_s:
            result.recent.append(obj)
        else:
            result.leftover.append(obj)
    return result


def remove_leftovers(store: Any, location: ObjectLocation, leftovers: Leftovers, options: S3Options) -> list[str]:
    """Delete ``leftovers.leftover``; the URLs of those that could not be deleted."""
    return delete_objects(store, location, [obj.name for obj in leftovers.leftover], options)
