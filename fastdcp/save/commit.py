"""Committing a save: save-unique file names, the atomic ``.metadata`` swap, and the cleanup rule.

Data files get save-unique names, ``__{rank}_{token}_{i}.distcp``, where ``token`` is 8 random hex
digits the coordinator claims per save together with its in-flight marker
(``fastdcp.save.inflight``: ``.saving.{token}.json``, created with ``O_EXCL`` before any file of
the save exists). Commit protocol, on the coordinator, after every rank has fsynced its data
files: fsync the directory, write ``.metadata.{token}.tmp``, fsync it, check that the marker and
every file the new metadata names are still there (else :class:`ConcurrentSaveError`: another
save interfered), ``rename`` it over ``.metadata`` (atomic: there is never a moment without a
valid ``.metadata``), fsync the directory, remove the marker, and only then clean up.

The cleanup removes only files that are provably dead. It lists the directory, then drops every
file whose token has a live marker (a save that may still commit), then reads which files the
metadata in the directory *now* references, and deletes the rest of the files named like ours or
stock's: data files (``__{rank}_{i}.distcp``, ``__{rank}_{token}_{i}.distcp``) and metadata temp
files (``.metadata.tmp``, ``.metadata.{token}.tmp``, and the ``__{rank}.`` variants), plus the
markers of saves that died. That order is what makes it safe against saves committing meanwhile:
a save removes its marker only after its rename, so a file found without a live marker belongs to
a save that committed before the metadata is read (and is kept if that metadata is still
current), failed, or died. No other file is ever removed.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import secrets
import warnings
from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata

from ..format.index_layout import edge_bytes_for
from ..format.index_link import metadata_facts
from ..format.index_writer import write_chunk_index
from ..format.metadata import METADATA_NAME, RANK_METADATA_RE
from ..format.metadata_emit import CHUNK_INDEX_ATTRIBUTE, write_metadata
from ..io.checkpoint_files import fsync_directory, load_metadata
from ..io.gc import gc_paused
from ..io.positional import FileSource
from . import inflight
from .crash_points import crash_point
from .inflight import ConcurrentSaveError

__all__ = [
    "claim_token",
    "CommittedMetadata",
    "ConcurrentSaveError",
    "unused_prefix",
    "remove_partial_files",
    "commit_metadata",
    "remove_unreferenced",
]

_TOKEN_HEX = 8

logger = logging.getLogger("fastdcp")  # the library's one logger: it prints nothing by itself

# A prefix this writer generated: "__{rank}_{token}_". Only files under such a prefix are ever
# removed after a failed save (they cannot belong to any other save: the token is checked unique).
_OWNED_PREFIX_RE = re.compile(rf"^__(\d+)_([0-9a-f]{{{_TOKEN_HEX}}})_$")

# Data files as stock (__{rank}_{i}.distcp) or fastdcp (__{rank}_{token}_{i}.distcp) name them.
_DATA_FILE_RE = re.compile(rf"^__(\d+)_(?:([0-9a-f]{{{_TOKEN_HEX}}})_)?\d+{re.escape(DEFAULT_SUFFIX)}$")

# Metadata temp files: stock's (.metadata.tmp, __{rank}.metadata.tmp) and ours (.{token}.tmp).
_METADATA_TMP_RE = re.compile(rf"^(?:__(\d+))?\.metadata(?:\.([0-9a-f]{{{_TOKEN_HEX}}}))?\.tmp$")

# The chunk index written beside a metadata file planned in bulk: .metadata.{token}.index.
_CHUNK_INDEX_RE = re.compile(rf"^(?:__(\d+))?\.metadata\.([0-9a-f]{{{_TOKEN_HEX}}})\.index$")



def claim_token(directory: str) -> str:
    """A token no file in ``directory`` carries yet, claimed for this save with its in-flight
    marker (``fastdcp.save.inflight``), so this save's names are unique there and no other save's
    cleanup removes its files. Precondition: ``directory`` exists."""
    while True:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            names = []
        token = secrets.token_hex(_TOKEN_HEX // 2)
        if any(f"_{token}_" in name or f".{token}." in name for name in names):
            continue
        if inflight.claim(directory, token):
            return token


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # best effort: the next successful save removes it


def _referenced_files(path: str) -> set[str] | None:
    """The data files a metadata file references, or None when it cannot be read safely."""
    try:
        metadata = load_metadata(path)  # the reader's restricted unpickler: builds nothing else
        files = {info.relative_path for info in metadata.storage_data.values()}
        index = getattr(metadata, CHUNK_INDEX_ATTRIBUTE, None)
        return files | {index} if isinstance(index, str) else files
    except Exception:  # noqa: BLE001 - unreadable for any reason: the caller stays conservative
        return None


def unused_prefix(directory: str, storage_plan: _StoragePrefix, rank: int | None) -> tuple[_StoragePrefix, str | None]:
    """``storage_plan``, or a fresh ``__{rank}_{token}_`` prefix when files under it exist; and the
    token claimed for that fresh prefix (None when ``storage_plan`` is kept).

    A save never writes into an existing file (that is what keeps overwriting atomic). The
    prefix normally comes fresh from the writer's ``prepare_global_plan``, but a planner may hand
    back an old final plan instead: stock ``DefaultSavePlanner(enable_plan_caching=True)`` reuses
    the previous save's plans, prefix included, which would rewrite the live checkpoint's files
    in place. The write results carry the file names, so the metadata names the new files."""
    prefix = storage_plan.prefix
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return storage_plan, None
    if not any(name.startswith(prefix) for name in names):
        return storage_plan, None
    match = re.match(r"^__(\d+)_", prefix)
    rank_text = match.group(1) if match else str(rank or 0)
    token = claim_token(directory)
    return _StoragePrefix(f"__{rank_text}_{token}_"), token


def remove_partial_files(directory: str, prefix: str) -> None:
    """Best effort: delete the data files of a failed save. Only under a prefix this writer
    generated (save-unique), so no file of an existing checkpoint is touched."""
    if _OWNED_PREFIX_RE.match(prefix) is None:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        if name.startswith(prefix) and name.endswith(DEFAULT_SUFFIX):
            _remove_quietly(os.path.join(directory, name))


@dataclass(frozen=True)
class CommittedMetadata:
    """What one commit made current: the metadata file's name and identity, and the data files
    it references (so the cleanup need not parse the file it just wrote)."""

    name: str
    identity: tuple[int, int]  # (st_dev, st_ino) of the renamed file
    files: frozenset[str]
    # The chunk index committed with it: (name, metadata size, head CRC-32C, tail CRC-32C).
    chunk_index: tuple[str, int, int, int] | None = None


def _interfered(directory: str, what: str) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"a concurrent save into '{directory}' interfered with this one, so it was not "
        f"committed: {what}. The directory holds whatever the other save committed; save again "
        "(and give concurrent jobs different checkpoint directories)"
    )


def commit_metadata(
    directory: str, metadata_name: str, token: str, metadata: Metadata, new_files: set[str], sync: bool,
    written_here: set[str] | None = None,
) -> CommittedMetadata:
    """Make ``metadata`` the checkpoint's ``metadata_name`` atomically (coordinator only, after
    every rank's data files are durable; ``sync``: fsync as the protocol says). ``token``: this
    save's claimed token (its marker exists).

    Unlike stock (which removes ``.metadata`` and then renames the temp file over it), the new
    metadata is renamed straight over the old one, so every instant has a valid ``.metadata``
    naming files that exist: the old checkpoint's until the rename, the new one's after it. Just
    before the rename, the marker and every file in ``new_files`` must still exist, else
    :class:`ConcurrentSaveError` (the check is what keeps a ``.metadata`` naming a missing file
    from ever being committed; ``written_here``: only these of them, where the other ranks' files
    are in other directories, as in a node-local tier). If the commit fails, this save's data files (``new_files``
    carrying ``token``), the temp file and the markers are removed: nothing references them."""
    tmp_name = f"{metadata_name}.{token}.tmp"
    tmp_path = os.path.join(directory, tmp_name)
    final_path = os.path.join(directory, metadata_name)
    tokens = _tokens_of(new_files) | {token}
    committed = False
    chunk_index = None
    try:
        if sync:
            fsync_directory(directory)  # the data files' entries, before anything names them
        table = getattr(metadata, "chunk_table", None)
        if table is not None and table.storage is not None:
            index_name = f"{metadata_name}.{token}.index"
            new_files = new_files | {index_name}
            if written_here is not None:
                written_here = written_here | {index_name}
            st, index_facts = _write_table_metadata(directory, tmp_path, index_name, metadata, sync)
            chunk_index = (index_name, *index_facts)
        else:
            with open(tmp_path, "wb") as f, gc_paused():
                pickle.dump(metadata, f)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
                st = os.fstat(f.fileno())
        if not inflight.touch(directory, token):
            raise _interfered(directory, f"the marker of this save ({inflight.marker_name(token)}) was removed")
        present = set(os.listdir(directory))
        missing = sorted(((new_files if written_here is None else written_here) | {tmp_name}) - present)
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise _interfered(directory, f"{len(missing)} of its files disappeared before the commit ({shown})")
        crash_point("commit")
        try:
            os.replace(tmp_path, final_path)
        except FileNotFoundError:
            raise _interfered(directory, f"its metadata temp file {tmp_name} disappeared before the rename") from None
        committed = True
    except BaseException:
        if not committed:
            _remove_quietly(tmp_path)
            for name in new_files:
                if (f"_{token}_" in name and _DATA_FILE_RE.match(name)) or _CHUNK_INDEX_RE.match(name):
                    _remove_quietly(os.path.join(directory, name))
            for owned in tokens:
                inflight.release(directory, owned)
        raise
    if sync:
        fsync_directory(directory)  # the commit is durable before anything old is removed
    for owned in tokens:  # after the rename: see the module docstring for why not before
        inflight.release(directory, owned)
    logger.debug("committed %s in %s (%d data files)", metadata_name, directory, len(new_files))
    return CommittedMetadata(metadata_name, (st.st_dev, st.st_ino), frozenset(new_files), chunk_index)


def _write_table_metadata(directory: str, tmp_path: str, index_name: str, metadata: Metadata,
                          sync: bool) -> tuple[os.stat_result, tuple[int, int, int]]:
    """Write a metadata planned in bulk (its ``chunk_table`` has storage columns): the stock-format
    pickle streamed from the columns to ``tmp_path``, then the chunk index ``index_name`` that
    records the metadata file's size and the CRC-32C of its two ends (so a reader can tell that
    the index belongs to the ``.metadata`` it found). Returns the metadata file's stat and those
    facts (size, head CRC, tail CRC)."""
    table = metadata.chunk_table
    facts = dict(planner_data=metadata.planner_data, storage_meta=metadata.storage_meta, version=metadata.version)
    with open(tmp_path, "w+b") as f, gc_paused():
        write_metadata(f, table, chunk_index_name=index_name, **facts)
        f.flush()
        if sync:
            os.fsync(f.fileno())
        st = os.fstat(f.fileno())
        with FileSource(os.dup(f.fileno()), tmp_path) as written:
            size, head_crc, tail_crc = metadata_facts(written, edge_bytes_for(table))
    with open(os.path.join(directory, index_name), "wb") as f:
        write_chunk_index(
            f, table, metadata_size=size, metadata_head_crc=head_crc, metadata_tail_crc=tail_crc, **facts
        )
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return st, (size, head_crc, tail_crc)


def _tokens_of(names: set[str] | frozenset[str]) -> set[str]:
    """The save tokens carried by fastdcp data file names."""
    tokens = set()
    for name in names:
        match = _DATA_FILE_RE.match(name) or _CHUNK_INDEX_RE.match(name)
        if match and match.group(2):
            tokens.add(match.group(2))
    return tokens


def _current_references(directory: str, name: str, committed: CommittedMetadata) -> set[str] | None:
    """The files metadata ``name`` references now, or None when it cannot be read safely. The
    file this save just renamed is recognised by identity instead of being parsed again."""
    path = os.path.join(directory, name)
    if name == committed.name:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return set()
        except OSError:
            return None
        if (st.st_dev, st.st_ino) == committed.identity:
            return set(committed.files)
    return _referenced_files(path)


def remove_unreferenced(directory: str, committed: CommittedMetadata, rank: int | None) -> None:
    """Delete what is provably dead (see the module docstring): data files (stock or fastdcp
    naming), metadata temp files and markers of ended saves, that no save in flight owns and no
    metadata in the directory references. ``rank``: a rank-local save (``use_collectives=False``)
    of that rank, which only touches its own rank's files; None for a global save. Errors here
    never fail the (already committed) save: they become warnings."""
    rank_local = rank is not None
    try:
        names = os.listdir(directory)
    except OSError as error:
        warnings.warn(f"fastdcp: could not list {directory} to remove old checkpoint files: {error}", stacklevel=3)
        return
    # 1. Candidates by name, and whose save may still be in flight (before reading any metadata).
    candidates: list[tuple[str, str | None]] = []  # (name, token)
    dead_markers: list[str] = []
    for name in sorted(names):
        match = _DATA_FILE_RE.match(name) or _METADATA_TMP_RE.match(name) or _CHUNK_INDEX_RE.match(name)
        if match is not None:
            if rank_local and match.group(1) != str(rank):
                continue
            candidates.append((name, match.group(2)))
        elif inflight.marker_token(name) is not None:
            dead_markers.append(name)
    tokens = {token for _, token in candidates if token} | {inflight.marker_token(n) for n in dead_markers}
    live = {token for token in tokens if inflight.is_live(directory, token)}
    if live:
        logger.info("cleanup of %s keeps the files of %d save(s) still in flight (tokens %s)",
                    directory, len(live), ", ".join(sorted(live)))
    dead_markers = [n for n in dead_markers if inflight.marker_token(n) not in live]
    candidates = [(name, token) for name, token in candidates if token not in live]
    # 2. What the metadata references now. Rank-local metadata next to a global .metadata may
    #    describe another live checkpoint in the same directory: never delete what it references.
    if rank_local:
        metadata_names = ([METADATA_NAME] if METADATA_NAME in names else []) + [committed.name]
    else:
        metadata_names = [METADATA_NAME] + [n for n in names if RANK_METADATA_RE.match(n)]
    protected: set[str] = set()
    remove_data = True
    for name in dict.fromkeys(metadata_names):
        refs = _current_references(directory, name, committed)
        if refs is None:
            remove_data = False  # cannot tell what it needs: keep every data file
            warnings.warn(
                f"fastdcp: kept every old data file in {directory}: {name} could not be read safely, "
                "so it is unknown which of them it references",
                stacklevel=3,
            )
        else:
            protected |= refs
    # 3. Delete.
    removed = 0
    for name, _ in candidates:
        if name in protected or (not remove_data and _DATA_FILE_RE.match(name)):
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
    for name in dead_markers:
        _remove_quietly(os.path.join(directory, name))
    logger.debug("cleanup of %s removed %d old files and %d markers of ended saves", directory, removed, len(dead_markers))
