"""Committing a save: save-unique file names, the atomic ``.metadata`` swap, and the cleanup rule.

Data files get save-unique names, ``__{rank}_{token}_{i}.distcp``, where ``token`` is 8 random hex
digits the coordinator picks per save (so a save never touches the files the current
``.metadata`` points at). Commit protocol, on the coordinator, after every rank has fsynced its
data files: fsync the directory, write ``.metadata.{token}.tmp``, fsync it, ``rename`` it over
``.metadata`` (atomic: there is never a moment without a valid ``.metadata``), fsync the
directory, and only then delete what the new ``.metadata`` does not reference: data files named
like ours or stock's (``__{rank}_{i}.distcp``, ``__{rank}_{token}_{i}.distcp``) and stale metadata
temp files (``.metadata.tmp``, ``.metadata.{token}.tmp``, and the ``__{rank}.`` variants). No other
file is ever removed.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import warnings

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata

from ..format.metadata import METADATA_NAME, RANK_METADATA_RE
from ..io.checkpoint_files import load_metadata
from ..io.gc import gc_paused
from .crash_points import crash_point

__all__ = [
    "new_token",
    "owned_prefix",
    "unused_prefix",
    "remove_partial_files",
    "commit_metadata",
    "remove_unreferenced",
]

_TOKEN_HEX = 8

# A prefix this writer generated: "__{rank}_{token}_". Only files under such a prefix are ever
# removed after a failed save (they cannot belong to any other save: the token is checked unique).
_OWNED_PREFIX_RE = re.compile(rf"^__(\d+)_([0-9a-f]{{{_TOKEN_HEX}}})_$")

# Data files as stock (__{rank}_{i}.distcp) or fastdcp (__{rank}_{token}_{i}.distcp) name them.
_DATA_FILE_RE = re.compile(rf"^__(\d+)_(?:[0-9a-f]{{{_TOKEN_HEX}}}_)?\d+{re.escape(DEFAULT_SUFFIX)}$")

# Metadata temp files: stock's (.metadata.tmp, __{rank}.metadata.tmp) and ours (.{token}.tmp).
_METADATA_TMP_RE = re.compile(rf"^(?:__(\d+))?\.metadata(?:\.[0-9a-f]{{{_TOKEN_HEX}}})?\.tmp$")


def new_token(directory: str) -> str:
    """A token no file in ``directory`` carries yet, so this save's names are unique there."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        names = []
    while True:
        token = secrets.token_hex(_TOKEN_HEX // 2)
        if not any(f"_{token}_" in name or f".{token}." in name for name in names):
            return token


def _fsync_directory(path: str) -> None:
    """Make the directory entries (data files, the renamed .metadata) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # best effort: the next successful save removes it


def _referenced_files(path: str) -> set[str] | None:
    """The data files a metadata file references, or None when it cannot be read safely."""
    try:
        metadata = load_metadata(path)  # the reader's restricted unpickler: builds nothing else
        return {info.relative_path for info in metadata.storage_data.values()}
    except Exception:  # noqa: BLE001 - unreadable for any reason: the caller stays conservative
        return None


def owned_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is one this writer generated (``__{rank}_{token}_``): only files under
    such a prefix are ever removed after a failed save (the token was checked unique)."""
    return _OWNED_PREFIX_RE.match(prefix) is not None


def unused_prefix(directory: str, storage_plan: _StoragePrefix, rank: int | None) -> _StoragePrefix:
    """``storage_plan``, or a fresh ``__{rank}_{token}_`` prefix when files under it exist.

    A save never writes into an existing file (that is what keeps overwriting atomic). The
    prefix normally comes fresh from the writer's ``prepare_global_plan``, but a planner may hand
    back an old final plan instead: stock ``DefaultSavePlanner(enable_plan_caching=True)`` reuses
    the previous save's plans, prefix included, which would rewrite the live checkpoint's files
    in place. The write results carry the file names, so the metadata names the new files."""
    prefix = storage_plan.prefix
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return storage_plan
    if not any(name.startswith(prefix) for name in names):
        return storage_plan
    match = re.match(r"^__(\d+)_", prefix)
    rank_text = match.group(1) if match else str(rank or 0)
    return _StoragePrefix(f"__{rank_text}_{new_token(directory)}_")


def remove_partial_files(directory: str, prefix: str) -> None:
    """Best effort: delete the data files of a failed save. Only under a prefix this writer
    generated (save-unique), so no file of an existing checkpoint is touched."""
    if not owned_prefix(prefix):
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and name.endswith(DEFAULT_SUFFIX):
            _remove_quietly(os.path.join(directory, name))


def commit_metadata(
    directory: str, metadata_name: str, token: str, metadata: Metadata, new_files: set[str], sync: bool
) -> None:
    """Make ``metadata`` the checkpoint's ``metadata_name`` atomically (coordinator only, after
    every rank's data files are durable; ``sync``: fsync as the protocol says).

    Unlike stock (which removes ``.metadata`` and then renames the temp file over it), the new
    metadata is renamed straight over the old one, so every instant has a valid ``.metadata``
    naming files that exist: the old checkpoint's until the rename, the new one's after it. If
    the commit fails, this save's data files (``new_files`` carrying ``token``) and the temp file
    are removed: nothing references them."""
    tmp_path = os.path.join(directory, f"{metadata_name}.{token}.tmp")
    final_path = os.path.join(directory, metadata_name)
    committed = False
    try:
        if sync:
            _fsync_directory(directory)  # the data files' entries, before anything names them
        with open(tmp_path, "wb") as f, gc_paused():
            pickle.dump(metadata, f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        crash_point("commit")
        os.replace(tmp_path, final_path)
        committed = True
    except BaseException:
        if not committed:
            _remove_quietly(tmp_path)
            for name in new_files:
                if f"_{token}_" in name and _DATA_FILE_RE.match(name):
                    _remove_quietly(os.path.join(directory, name))
        raise
    if sync:
        _fsync_directory(directory)  # the commit is durable before anything old is removed


def remove_unreferenced(directory: str, keep: set[str], rank: int | None) -> None:
    """Delete leftovers: data files (stock or fastdcp naming) and metadata temp files that no
    metadata in the directory references. ``rank``: a rank-local save (``use_collectives=False``)
    of that rank, which only touches its own rank's files; None for a global save. Errors here
    never fail the (already committed) save: they become warnings."""
    rank_local = rank is not None
    try:
        names = os.listdir(directory)
    except OSError as error:
        warnings.warn(f"fastdcp: could not list {directory} to remove old checkpoint files: {error}", stacklevel=3)
        return
    protected = set(keep)
    # Metadata of the other kind (global vs rank-local) may describe another live checkpoint
    # in the same directory: never delete what it references.
    if rank_local:
        others = [METADATA_NAME] if METADATA_NAME in names else []
    else:
        others = [n for n in names if RANK_METADATA_RE.match(n)]
    remove_data = True
    for name in others:
        refs = _referenced_files(os.path.join(directory, name))
        if refs is None:
            remove_data = False  # cannot tell what it needs: keep every data file
            warnings.warn(
                f"fastdcp: kept every old data file in {directory}: {name} could not be read safely, "
                "so it is unknown which of them it references",
                stacklevel=3,
            )
        else:
            protected |= refs
    removed = 0
    for name in sorted(names):
        data = _DATA_FILE_RE.match(name)
        tmp = None if data else _METADATA_TMP_RE.match(name)
        match = data or tmp
        if match is None or name in protected or (data and not remove_data):
            continue
        if rank_local and match.group(1) != str(rank):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        except OSError as error:
            warnings.warn(f"fastdcp: could not remove old checkpoint file {name}: {error}", stacklevel=3)
            continue
        removed += 1
        if removed == 1:
            crash_point("cleanup_mid")
