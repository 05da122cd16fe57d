"""A checkpoint's files on disk: reading ``.metadata`` and finding data files without being led
out of the checkpoint directory.

:func:`load_metadata` reads a metadata file (a FIFO planted as ``.metadata`` never blocks) and
parses it with :func:`fastdcp.format.metadata.parse_metadata`. :func:`check_relative_path` /
:func:`check_data_paths` refuse a ``relative_path`` that could lead out of the checkpoint
directory: absolute paths, ``..``, NUL bytes, empty names, symlinks leading out;
:func:`resolve_data_file` also requires an existing regular file (a FIFO would block the reader
forever). :func:`check_file_extents` checks every byte range the metadata places in one data file
against the file's size, so a truncated file or an absurd length fails before anything is
allocated.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint import metadata as _md

from ..format.metadata import (
    METADATA_NAME,
    SHOW_CHARS,
    CheckpointFormatError,
    CheckpointNotFoundError,
    entry_name,
    parse_metadata,
    shown,
)

__all__ = [
    "metadata_path",
    "load_metadata",
    "check_relative_path",
    "resolve_data_file",
    "check_data_paths",
    "check_file_extents",
    "file_extents",
]


def fsync_directory(path: str | os.PathLike) -> None:
    """Make the directory's entries durable (files created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def metadata_path(checkpoint_dir: str | os.PathLike, rank: int | None = None) -> str:
    """Where stock DCP keeps the metadata: ``.metadata``, or ``__{rank}.metadata`` for a save
    without rank coordination (``read_metadata(rank=...)``)."""
    name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
    return os.path.join(os.fspath(checkpoint_dir), name)


def load_metadata(
    path: str | os.PathLike, *, rank: int | None = None, allow_unsafe: bool = False
) -> _md.Metadata:
    """Read and validate a checkpoint's metadata.

    ``path`` is the checkpoint directory (``.metadata``, or ``__{rank}.metadata`` when ``rank`` is
    given, as stock ``read_metadata(rank=...)``) or a metadata file itself. Restricted unpickling
    unless ``allow_unsafe``; see :func:`parse_metadata`. A missing directory or metadata file
    raises :class:`CheckpointNotFoundError` (a ``FileNotFoundError``).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        file = metadata_path(path, rank)
    elif os.path.exists(path) and rank is None:
        file = path
    elif not os.path.lexists(path):
        raise CheckpointNotFoundError(f"'{path}' is not a DCP checkpoint: the directory does not exist")
    else:
        raise CheckpointFormatError(f"'{path}' is not a DCP checkpoint: not a directory")
    try:
        # O_NONBLOCK: opening a FIFO planted as .metadata must not wait for a writer.
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"'{path}' is not a DCP checkpoint: no {os.path.basename(file)} (was the save interrupted?)"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointFormatError(f"checkpoint metadata '{file}' is not a regular file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        data = f.read()
    return parse_metadata(data, f"checkpoint metadata '{file}'", allow_unsafe=allow_unsafe)


def _refusal(checkpoint_dir: str, relative_path: Any, entry: Any, reason: str) -> CheckpointFormatError:
    named = f"checkpoint metadata entry {entry_name(entry)}" if entry is not None else "checkpoint metadata"
    return CheckpointFormatError(
        f"{named} in '{checkpoint_dir}' names data file {shown(relative_path)}, which is refused: {reason}"
    )


def check_relative_path(checkpoint_dir: str | os.PathLike, relative_path: Any, *, entry: Any = None) -> str:
    """``checkpoint_dir/relative_path`` after checking it cannot lead out of the checkpoint.

    Refuses (:class:`CheckpointFormatError`) a ``relative_path`` that is not a non-empty string,
    contains a NUL byte, is absolute, has a ``..`` component, or resolves through symlinks outside
    ``checkpoint_dir`` (or to the directory itself). The file need not exist. ``entry`` (e.g. the
    MetadataIndex) is named in messages.
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    if type(relative_path) is not str:
        raise _refusal(checkpoint_dir, relative_path, entry, f"not a string but a {type(relative_path).__name__}")
    if not relative_path:
        raise _refusal(checkpoint_dir, relative_path, entry, "empty file name")
    if "\0" in relative_path:
        raise _refusal(checkpoint_dir, relative_path, entry, "it contains a NUL byte")
    if os.path.isabs(relative_path):
        raise _refusal(
            checkpoint_dir, relative_path, entry, "absolute path (data files must lie inside the checkpoint directory)"
        )
    parts = relative_path.split(os.sep)
    if os.altsep:
        parts = [q for part in parts for q in part.split(os.altsep)]
    if ".." in parts:
        raise _refusal(checkpoint_dir, relative_path, entry, "a '..' component leads out of the checkpoint directory")
    path = os.path.join(checkpoint_dir, relative_path)
    if len(parts) == 1:
        # A plain file name (the usual case) escapes only if it is itself a symlink: one lstat.
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                return path
        except FileNotFoundError:
            return path
    real_dir = os.path.realpath(checkpoint_dir)
    real = os.path.realpath(path)
    inside = real_dir if real_dir.endswith(os.sep) else real_dir + os.sep
    if not real.startswith(inside):
        raise _refusal(
            checkpoint_dir,
            relative_path,
            entry,
            f"it resolves to '{real[:SHOW_CHARS]}', outside the checkpoint directory (a symlink leading out?)",
        )
    return path


def resolve_data_file(checkpoint_dir: str | os.PathLike, relative_path: Any, *, entry: Any = None) -> str:
    """The path of a data file the metadata names, checked to stay inside the checkpoint.

    :func:`check_relative_path`, plus: a missing file raises :class:`CheckpointNotFoundError`
    (a ``FileNotFoundError``); something that is not a regular file (a FIFO would block the
    reader forever, a device never ends) raises :class:`CheckpointFormatError`.
    Returns ``checkpoint_dir/relative_path``.
    """
    path = check_relative_path(checkpoint_dir, relative_path, entry=entry)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"checkpoint file '{path}' named in the checkpoint metadata does not exist"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(os.fspath(checkpoint_dir), relative_path, entry, "not a regular file")
    return path


def check_data_paths(checkpoint_dir: str | os.PathLike, storage_data: Mapping[Any, Any]) -> None:
    """:func:`check_relative_path` for every data file ``storage_data`` names (once per file)."""
    seen: set[Any] = set()
    for key, info in storage_data.items():
        rel = getattr(info, "relative_path", None)
        if type(rel) is str and rel in seen:
            continue
        check_relative_path(checkpoint_dir, rel, entry=key)
        seen.add(rel)


def file_extents(storage_data: Mapping[Any, Any]) -> dict[str, tuple[int, Any]]:
    """For each data file: the end of the furthest byte range placed in it, and that entry's key."""
    ends: dict[str, tuple[int, Any]] = {}
    for key, info in storage_data.items():
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(off) is not int or type(length) is not int:
            continue  # _validate/_check_storage_info report these
        end = off + length
        cur = ends.get(rel)
        if cur is None or end > cur[0]:
            ends[rel] = (end, key)
    return ends


def check_file_extents(extents: Mapping[str, tuple[int, Any]], relative_path: str, path: str, size: int) -> None:
    """Raise :class:`CheckpointFormatError` when the metadata places bytes past the end of the
    data file ``path`` (``size`` bytes); ``extents`` comes from :func:`file_extents`."""
    hit = extents.get(relative_path)
    if hit is not None and hit[0] > size:
        end, key = hit
        raise CheckpointFormatError(
            f"checkpoint file '{path}' is {size} bytes, but the metadata entry {entry_name(key)} needs bytes up to "
            f"{end}: the file is truncated or the checkpoint is damaged"
        )
