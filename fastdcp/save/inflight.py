"""Saves in flight: the marker a save keeps in the checkpoint directory while it may still commit.

Several saves may run into one directory at once (a restarted job whose predecessor is still
finishing an async save, two jobs given the same path). Each save owns a token, and every file it
writes carries it (``__{rank}_{token}_{i}.distcp``, ``.metadata.{token}.tmp``). Before any of those
files exists, the save creates ``.saving.{token}.json`` with ``O_EXCL`` (so two saves can never
own one token) and removes it only after its ``.metadata`` rename, or after it failed and removed
its own files. The cleanup after a commit (``fastdcp.save.commit``) never deletes a file whose
token has a live marker.

A marker is live unless its save provably ended without removing it:

- written on this host (same host name, boot and PID namespace): the process that wrote it is
  gone (no such PID, a zombie, or a PID reused by a process started at another time);
- written elsewhere (another node on a shared filesystem): it has not been touched for
  ``stale_after_s`` (``FASTDCP_STALE_SAVE_S``, default one hour). The coordinator touches its
  marker when it starts to commit, so only a save stuck that long between planning and commit
  can be mistaken for a crashed one.

A marker that cannot be read yet (being written) counts as live while it is younger than that.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import dataclass


__all__ = [
    "ConcurrentSaveError",
    "marker_name",
    "marker_token",
    "claim",
    "release",
    "touch",
    "is_live",
    "stale_after_seconds",
]

_PREFIX = ".saving."
_SUFFIX = ".json"
_DEFAULT_STALE_AFTER_S = 3600


class ConcurrentSaveError(RuntimeError):
    """Another save into the same directory made this one impossible to commit safely."""


def marker_name(token: str) -> str:
    """The file name of the marker of the save owning ``token``."""
    return f"{_PREFIX}{token}{_SUFFIX}"


def marker_token(name: str) -> str | None:
    """The token a marker file name carries, or None when ``name`` is not a marker."""
    if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
        token = name[len(_PREFIX) : -len(_SUFFIX)]
        return token or None
    return None


def stale_after_seconds() -> float:
    """How long a marker written on another host stays live without being touched."""
    text = os.environ.get("FASTDCP_STALE_SAVE_S", "").strip()
    if not text:
        return float(_DEFAULT_STALE_AFTER_S)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"FASTDCP_STALE_SAVE_S={text!r}: expected a number of seconds > 0")
    return value


@dataclass(frozen=True)
class _Owner:
    """Who wrote a marker: enough to tell, on the same host, whether that process still runs."""

    host: str
    boot_id: str
    pid_namespace: str
    pid: int
    pid_start: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "_Owner":
        fields = json.loads(text)
        return cls(
            host=str(fields["host"]),
            boot_id=str(fields["boot_id"]),
            pid_namespace=str(fields["pid_namespace"]),
            pid=int(fields["pid"]),
            pid_start=str(fields["pid_start"]),
        )

    def same_machine(self, other: "_Owner") -> bool:
        return (self.host, self.boot_id, self.pid_namespace) == (other.host, other.boot_id, other.pid_namespace)


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/{pid}/stat`` field 22), or None when no such
    process runs (or it is a zombie). Without ``/proc``: "" when it exists (start unknown)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat:
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if fields and fields[0] in ("Z", "X"):
            return None
        return fields[19] if len(fields) > 19 else ""
    if os.path.isdir("/proc/self"):
        return None
    try:  # pragma: no cover - hosts without procfs
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


_this_process_cache: dict[int, _Owner] = {}


def _this_process() -> _Owner:
    """This process as a marker owner (cached per PID, so a forked child describes itself)."""
    pid = os.getpid()
    owner = _this_process_cache.get(pid)
    if owner is None:
        owner = _this_process_cache[pid] = _describe_this_process(pid)
    return owner


def _describe_this_process(pid: int) -> _Owner:
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return _Owner(
        host=socket.gethostname(),
        boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
        pid_namespace=namespace,
        pid=pid,
        pid_start=_process_start(pid) or "",
    )


def claim(directory: str, token: str) -> bool:
    """Create the marker of ``token`` in ``directory``; False when it exists already (another save
    owns the token: pick another). Precondition: no file of this save exists yet.

    The marker appears with its contents in one step where the filesystem allows it (an
    ``O_TMPFILE`` inode linked into place), so a process killed while claiming leaves either
    nothing or a complete marker. Elsewhere (NFS) it is created empty with ``O_EXCL`` and then
    written; an empty marker counts as live until it is ``stale_after_s`` old."""
    path = os.path.join(directory, marker_name(token))
    content = _this_process().to_json().encode()
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            fd = os.open(directory, tmpfile | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            fd = -1  # not supported here: create, then write
        if fd >= 0:
            try:
                os.write(fd, content)
                _link_anonymous(fd, directory, marker_name(token))
                return True
            except FileExistsError:
                return False
            except OSError:
                pass  # linking an O_TMPFILE inode refused: create, then write
            finally:
                os.close(fd)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except FileExistsError:
        return False
    except OSError as error:
        raise OSError(
            error.errno,
            f"cannot save into '{directory}': creating the save's in-flight marker {marker_name(token)} "
            f"(the first file a save writes) failed: {error.strerror}",
            path,
        ) from error
    try:
        os.write(fd, content)
    finally:
        os.close(fd)
    return True


def _link_anonymous(fd: int, directory: str, name: str) -> None:
    """Give the ``O_TMPFILE`` inode open as ``fd`` the name ``name`` in ``directory``.

    This must be ``linkat(..., AT_SYMLINK_FOLLOW)`` on ``/proc/self/fd/{fd}``: Python's
    ``os.link`` without a directory fd calls plain ``link()``, which does not follow that magic
    link and fails with EXDEV, so the marker used to be created empty and then written, and a
    process killed in between left an empty marker that counts as live until it is stale.
    ``dst_dir_fd`` makes Python call ``linkat`` with the flag. Raises ``FileExistsError`` when the
    name exists, ``OSError`` when the filesystem refuses."""
    directory_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=directory_fd, follow_symlinks=True)
    finally:
        os.close(directory_fd)


def release(directory: str, token: str) -> None:
    """Remove the marker of ``token`` (its save committed, or failed and removed its files)."""
    try:
        os.unlink(os.path.join(directory, marker_name(token)))
    except OSError:
        pass  # gone already, or unwritable: a dead marker is removed by a later cleanup


def touch(directory: str, token: str) -> bool:
    """Refresh the marker's time (the save is alive); False when the marker is gone, which means
    another save's cleanup judged this save dead and may have removed its files."""
    try:
        os.utime(os.path.join(directory, marker_name(token)))
    except FileNotFoundError:
        return False
    except OSError as error:  # e.g. EPERM on a marker of another user: it is there
        if error.errno not in (errno.EPERM, errno.EACCES):
            raise
    return True


def is_live(directory: str, token: str, *, now: float | None = None) -> bool:
    """Whether the save owning ``token`` may still be in flight (see the module docstring)."""
    path = os.path.join(directory, marker_name(token))
    try:
        with open(path) as f:
            text = f.read()
            mtime = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep its files
    age = (time.time() if now is None else now) - mtime
    fresh = age < stale_after_seconds()
    try:
        owner = _Owner.from_json(text)
    except (ValueError, KeyError, TypeError):
        return fresh  # still being written, or damaged: trust only its age
    here = _this_process()
    if not owner.same_machine(here):
        return fresh
    start = _process_start(owner.pid)
    if start is None:
        return False
    return not (owner.pid_start and start and start != owner.pid_start)
