"""The drainer: copies a committed local checkpoint to the shared tier in the background, then
commits it there, with no collective on the training path.

* Every rank copies its own data files (its part of the save, known when its ``write_data``
  returns) on a drain thread, through the native engine as a save writes
  (:meth:`fastdcp.tiered.shared_tier.DirectoryTier.put_images`): from the staged bytes while the
  local copy is written, when the save was staged, else from the local files once they are
  complete. Then it marks them drained locally.
* The coordinator, once it committed locally, waits until every data file the metadata names is
  complete in the shared tier (each arrives whole: :mod:`fastdcp.tiered.shared_tier`), copies the
  chunk index, and writes ``.metadata`` there last: the shared commit. Until then the shared tier
  holds the previous checkpoint (or none), never a partial one.
* A rank whose copy fails leaves ``.drain-failed.{token}.rank{R}`` (its error) in the shared tier
  when it can, so the coordinator stops waiting and fails naming it; a rank that died leaves
  nothing, and the coordinator fails at its deadline naming the files that never arrived.

Each failure is a :class:`TieredDrainWarning` and the exception of the save's ``durable`` future;
the local copy stays (it is never evicted before it is durable)."""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..format.metadata import METADATA_NAME
from ..save.crash_points import crash_point
from . import local_tier
from . import shared_tier
from .shared_tier import SharedTier, options_keyword, shared_tier_for

__all__ = ["TieredDrainError", "TieredDrainWarning", "LocalCommit", "drain_rank_files", "commit_when_drained",
           "failure_marker"]

COPY_THREADS = 2  # each drain job is one rank's files, written by the engine's own threads
POLL_START_S, POLL_MAX_S = 0.02, 1.0


class TieredDrainError(OSError):
    """Copying a checkpoint to the shared tier, or committing it there, failed (the message names
    the file or object and the cause)."""


class TieredDrainWarning(UserWarning):
    """A drain to the shared tier failed; the checkpoint stays committed in the local tier."""


def failure_marker(token: str, rank: int) -> str:
    return f".drain-failed.{token}.rank{rank}"


@dataclass(frozen=True)
class LocalCommit:
    """What the coordinator's local commit made current, read at commit time (a later save into
    the same local directory cannot change what is committed to the shared tier)."""

    local_directory: str
    metadata_name: str
    metadata_bytes: bytes
    side_files: tuple[tuple[str, bytes], ...]   # the chunk index, written before .metadata
    data_files: frozenset[str]
    token: str
    ranks: frozenset[int]


class _Pools:
    """The process's drain threads (fresh after a fork). Non-daemon: a job that ends its script
    still finishes its drains before the interpreter exits."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.copy = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="fastdcp-drain")
        self.commit = ThreadPoolExecutor(1, thread_name_prefix="fastdcp-drain-commit")


_pools: _Pools | None = None
_pools_lock = threading.Lock()


def _get_pools() -> _Pools:
    global _pools
    with _pools_lock:
        if _pools is None or _pools.pid != os.getpid():
            _pools = _Pools()
        return _pools


def _report(error: BaseException) -> None:
    warnings.warn(f"fastdcp tiered checkpoint: {error} (the checkpoint stays committed in the local tier)",
                  TieredDrainWarning, stacklevel=2)


def drain_rank_files(tier: SharedTier, local_directory: str, names: list[str], token: str, rank: int,
                     local_root: str, keep_local: int, images: list[tuple] | None = None) -> Future:
    """Copy this rank's ``names`` from ``local_directory`` to the shared tier, on the process's
    drain threads; the future is done when all are complete there (then older durable local copies
    are evicted). ``images``: write these ``(name, size, segments)`` file images instead of reading
    the local files back (the writer's staged bytes; see :mod:`fastdcp.tiered.writer`)."""
    done = _get_pools().copy.submit(_drain, tier, local_directory, names, token, rank, images)
    _evict_when_done(done, local_root, keep_local, local_directory, tier)
    return done


def _committed_check(tier: SharedTier) -> Callable[[str], bool]:
    """Whether a checkpoint (by its shared location, a sibling of ``tier``'s) is committed in the
    shared tier: what a local directory holding replicas needs before it may be evicted."""
    options = getattr(tier, "options", None)

    def committed(location: str) -> bool:
        try:
            return bool(shared_tier_for(location, **options_keyword(options)).existing({METADATA_NAME}))
        except Exception:  # noqa: BLE001 - unknown: keep the local copy
            return False

    return committed


def _evict_when_done(future: Future, local_root: str, keep_local: int, protect: str, tier: SharedTier) -> None:
    """Once ``future`` succeeded, evict older durable local copies (after it is done: a waiter on
    it is not held up by the removal)."""
    def evict(done: Future) -> None:
        if done.exception() is None:
            try:
                local_tier.evict(local_root, keep_local, protect=protect, committed_in_shared=_committed_check(tier))
            except OSError:
                pass  # bookkeeping of the local tier: the shared copy is complete either way

    future.add_done_callback(evict)


def _drain(tier: SharedTier, local_directory: str, names: list[str], token: str, rank: int,
           images: list[tuple] | None) -> None:
    crash_point("drain")
    try:
        if images is not None:
            tier.put_images(images)
        else:
            shared_tier.put_files(tier, [(os.path.join(local_directory, name), name) for name in names])
    except BaseException as error:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        failure = TieredDrainError(f"cannot copy rank {rank}'s files ({shown}) from '{local_directory}' to "
                                   f"'{tier.url()}': {error}")
        try:
            tier.put_bytes(failure_marker(token, rank), str(failure).encode())
        except Exception:  # noqa: BLE001 - the shared tier may be what failed; the copy error is reported
            pass
        _report(failure)
        raise failure from error
    try:
        local_tier.mark_drained(local_directory, rank)
    except OSError:
        pass  # bookkeeping of the local tier: the shared copy is complete either way


def commit_when_drained(tier: SharedTier, commit: LocalCommit, own_drain: Future | None, deadline_s: float,
                        local_root: str, keep_local: int) -> Future:
    """The shared commit (coordinator): once every data file of ``commit`` is complete in the shared
    tier, write its side files, then ``.metadata``. Runs on the process's one commit thread, so
    commits reach the shared tier in save order. Older durable local copies are evicted once the
    future is done (not counted in it)."""
    done = _get_pools().commit.submit(_commit, tier, commit, own_drain, deadline_s)
    _evict_when_done(done, local_root, keep_local, commit.local_directory, tier)
    return done


def _commit(tier: SharedTier, commit: LocalCommit, own_drain: Future | None, deadline_s: float) -> None:
    try:
        if own_drain is not None:
            own_drain.result()
        _wait_for_data_files(tier, commit, deadline_s)
        for name, data in commit.side_files:
            tier.put_bytes(name, data)
        tier.put_bytes(commit.metadata_name, commit.metadata_bytes)
    except BaseException as error:
        if not isinstance(error, TieredDrainError):
            error = TieredDrainError(f"cannot commit '{tier.url(commit.metadata_name)}': {error}")
        if own_drain is None or own_drain.exception() is None:
            _report(error)  # (this rank's own copy failure was reported when it happened)
        raise error
    try:
        local_tier.mark_durable(commit.local_directory)
    except OSError:
        pass


def _wait_for_data_files(tier: SharedTier, commit: LocalCommit, deadline_s: float) -> None:
    missing = set(commit.data_files)
    markers = {failure_marker(commit.token, rank) for rank in commit.ranks}
    deadline = time.monotonic() + deadline_s
    pause = POLL_START_S
    while True:
        failed = tier.existing(markers)
        if failed:
            name = sorted(failed)[0]
            try:
                text = tier.read_bytes(name).decode(errors="replace")
            except Exception:  # noqa: BLE001 - the marker's name says which rank
                text = name
            raise TieredDrainError(f"cannot commit '{tier.url(commit.metadata_name)}': {text}")
        missing -= tier.existing(missing)
        if not missing:
            return
        if time.monotonic() >= deadline:
            shown = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise TieredDrainError(f"cannot commit '{tier.url(commit.metadata_name)}': after {deadline_s:g} s, "
                                      f"{len(missing)} data files never arrived in the shared tier ({shown}): did "
                                      "their rank die before its drain finished?")
        time.sleep(pause)
        pause = min(POLL_MAX_S, pause * 2)
