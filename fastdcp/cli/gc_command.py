"""``python -m fastdcp gc s3://bucket/prefix [--delete]``: what interrupted saves left under an
object storage checkpoint (:mod:`fastdcp.objstore.leftovers`), listed, and removed on request.

A dry run by default. Local directories need no such command: every save into one removes what
earlier saves left there (docs/GUARANTEES.md, "Crash consistency").
"""

from __future__ import annotations

import json
import sys

from ..format.metadata import CheckpointFormatError
from ..objstore.client import AzureOptions, ObjectStoreError, S3Options, default_options, store_for
from ..objstore.leftovers import Leftovers, StoredObject, find_leftovers, remove_leftovers
from ..objstore.location import ObjectLocation, is_object_url
from .checkpoint import EXIT_DAMAGED, EXIT_OK, EXIT_USAGE, human_size

__all__ = ["run_gc"]


def _total(objects: list[StoredObject]) -> str:
    return f"{len(objects)} object{'' if len(objects) == 1 else 's'}, {human_size(sum(o.size for o in objects))}"


def _as_json(found: Leftovers, deleted: bool, failed: list[str]) -> dict:
    def rows(objects: list[StoredObject]) -> list[dict]:
        return [{"name": o.name, "size": o.size, "modified": o.modified} for o in objects]

    return {"url": found.url, "committed": found.committed, "named": rows(found.named),
            "leftover": rows(found.leftover), "recent": rows(found.recent), "other": rows(found.other),
            "deleted": deleted, "failed": failed}


def run_gc(target: str, *, delete: bool, min_age_s: float, as_json: bool, options: S3Options | AzureOptions | None = None) -> int:
    """List (and with ``delete`` remove) the leftovers under ``target``; the exit status: 0 done, 1
    a ``.metadata`` that cannot be read safely or objects that could not be deleted, 2 usage."""
    if not is_object_url(target):
        print(f"error: {target} is not an object storage URL (s3://bucket/prefix, az://container/prefix). A local directory needs no gc: "
              f"every save into it removes what earlier saves left there.", file=sys.stderr)
        return EXIT_USAGE
    if min_age_s < 0:
        print(f"error: --min-age-s must be 0 or more, not {min_age_s:g}", file=sys.stderr)
        return EXIT_USAGE
    try:
        location = ObjectLocation.parse(target)
        options = options or default_options(location)
        store = store_for(location, options)
        found = find_leftovers(store, location, options, min_age_s=min_age_s)
    except ValueError as error:
        damaged = isinstance(error, CheckpointFormatError)
        print(f"{'DAMAGED' if damaged else 'error'}: {error}", file=sys.stderr)
        return EXIT_DAMAGED if damaged else EXIT_USAGE
    except ObjectStoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    failed = remove_leftovers(store, location, found, options) if delete and found.leftover else []
    if as_json:
        json.dump(_as_json(found, delete, failed), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_DAMAGED if failed else EXIT_OK
    state = "a committed checkpoint" if found.committed else "no committed checkpoint (no .metadata)"
    print(f"{found.url}: {state}; kept: {_total(found.named)} it names")
    print(f"left over (named by no .metadata, older than {min_age_s:g} s): {_total(found.leftover)}")
    for obj in found.leftover:
        print(f"  {obj.name}  {human_size(obj.size)}")
    if found.recent:
        print(f"kept, younger than {min_age_s:g} s (a save may still own them): {_total(found.recent)}")
    if found.other:
        print(f"kept, not written by DCP: {_total(found.other)}")
    if not found.leftover:
        print("nothing to delete")
    elif not delete:
        print(f"dry run: nothing deleted; add --delete to remove the {_total(found.leftover)} left over")
    elif failed:
        print(f"deleted {len(found.leftover) - len(failed)}; could not delete {len(failed)}: {', '.join(failed[:5])}")
        return EXIT_DAMAGED
    else:
        print(f"deleted {_total(found.leftover)}")
    return EXIT_OK
