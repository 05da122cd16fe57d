"""Deadline-guarded check-ins of a load's ranks: a load that waits on a rank longer than its
deadline fails on every rank still running, naming the ranks it waited for and what each was doing.

Without them, one stalled rank (stuck before the load, in a hung file read, dead without closing
its connections) holds every other rank inside DCP's next collective until the process group's
timeout, or forever (torchtitan#3065). With them, each rank of a load publishes what it is doing
(``reading .metadata of X``, ``reading data file '__1_0.distcp' of X``) in the default process
group's c10d store, and every rank checks in at two points and waits there, at most
``load_deadline_s`` after its own arrival, for every other rank:

* ``start``: after reading ``.metadata`` (all ranks reached the load, before DCP's first collective);
* ``end``: after this rank's reads (all ranks finished reading, before DCP's last collective).

A point ends with one verdict for all ranks, set once by ``compare_set``: ``passed`` (set by the
last rank to arrive) or ``failed`` (set by the first rank whose deadline passed, with the ranks it
was missing). Every rank then acts on the same verdict: all go on, or all raise
:class:`LoadDeadlineError`, also a rank that arrives after the verdict. A point costs a rank four
store round trips (append, add, then a compare_set, or a wait and a get) and a status one.

The error has to leave ``dcp.load`` at once. DCP catches whatever a reader raises and ships it to
the coordinator inside its next collective, and that collective waits for every rank of the load,
the stalled one too. An object collective pickles before it communicates, so the error refuses to
be pickled the first time (:meth:`LoadDeadlineError.__reduce__`): the pickling inside DCP's
collective raises it on this rank, before any communication, and it leaves ``dcp.load`` as itself.
No rank enters the collective (the verdict is the same everywhere), so the process group stays
usable; a later load checks in under new keys.

Which ranks: every rank of the default process group. DCP does not tell a storage reader which
group a load runs on before its first collective, so the check-ins cannot follow a smaller one:
a load on only some of the ranks (``dcp.load(process_group=...)`` over a subset, or
``no_dist=True`` on some ranks of a multi-rank job) must pass ``load_deadline_s=None``. Any group
over all ranks (``dist.new_group(backend="gloo")``) is fine. No check-ins at all without an
initialised default group, with one rank, or with the ``fake`` backend (simulated ranks).

Keys: a load is ``(name, n)``, the n-th guarded load of the checkpoint ``name`` in this process;
ranks do the same loads in the same order, so they agree without communicating. A rank's status
key is one per rank (overwritten by each load), so a rank that never reached a load is reported
with what it did last. Keys stay in the store (a few short keys per load, and the list of ranks
at each point).

:func:`stall_point` is the test hook: a named moment of a load where a test makes one rank stall.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "LoadDeadlineError",
    "LoadCheckIns",
    "DEFAULT_LOAD_DEADLINE_S",
    "DEADLINE_FROM_ENV",
    "START",
    "END",
    "resolve_load_deadline",
    "begin_load",
    "reading_files_status",
    "stall_point",
]

# Off unless asked for: a storage reader cannot tell a load on a subset of the ranks (``no_dist=True``
# on rank 0 alone, an evaluation job's usual load) from one on all of them, and such a load would
# wait out the deadline and fail; and at thousands of ranks every load would add its store round
# trips. Suggested value when asked for: torch's default process-group timeout.
DEFAULT_LOAD_DEADLINE_S: float | None = None
SUGGESTED_LOAD_DEADLINE_S = 1800.0
_ENV = "FASTDCP_LOAD_DEADLINE_S"

START = "start"
END = "end"
# point -> (where the ranks wait, what the missing ranks had not done yet)
_POINTS = {
    START: ("at the start of the load", "reach it"),
    END: ("at the end of its reads", "finish theirs"),
}
_SHOWN_RANKS = 8  # missing ranks whose status a message names (and fetches from the store)


class _FromEnv:
    def __repr__(self) -> str:
        return f"<{_ENV}, else none>"


DEADLINE_FROM_ENV: Any = _FromEnv()  # the default of a reader's load_deadline_s


class LoadDeadlineError(TimeoutError):
    """A load waited on other ranks longer than its deadline (``load_deadline_s``).

    ``path``: the checkpoint; ``point``: ``"start"`` or ``"end"``; ``deadline_s``; ``missing``:
    the ranks it waited for; ``statuses``: what the first few of them were last doing."""

    def __init__(self, message: str, *, path: str = "", point: str = "", deadline_s: float = 0.0,
                 missing: tuple[int, ...] = (), statuses: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.point = point
        self.deadline_s = deadline_s
        self.missing = tuple(missing)
        self.statuses = dict(statuses or {})
        self._escape = True

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> Any:
        # See the module docstring: the first pickling is DCP shipping this error through a
        # collective that waits for the stalled rank; refusing it makes the error leave dcp.load.
        if self.__dict__.get("_escape"):
            self._escape = False
            raise self
        state = {k: v for k, v in self.__dict__.items() if k != "_escape"}
        return (_rebuild_error, (str(self), state))


def _rebuild_error(message: str, state: dict[str, Any]) -> LoadDeadlineError:
    error = LoadDeadlineError(message)
    error.__dict__.update(state)
    error._escape = False
    return error


def resolve_load_deadline(value: Any = DEADLINE_FROM_ENV) -> float | None:
    """Seconds of a reader's deadline, or None (no check-ins): ``value``, else the environment
    ``FASTDCP_LOAD_DEADLINE_S``, else none (see ``DEFAULT_LOAD_DEADLINE_S``). None, 0 (and ``none``/``off`` in the environment)
    turn the check-ins off."""
    where = "load_deadline_s"
    if value is DEADLINE_FROM_ENV:
        raw = os.environ.get(_ENV, "").strip()
        if not raw:
            return DEFAULT_LOAD_DEADLINE_S
        if raw.lower() in ("none", "off"):
            return None
        value, where = raw, f"{_ENV}={raw!r}"
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected seconds (a number), None or 0") from None
    if seconds != seconds or seconds < 0:
        raise ValueError(f"{where}: expected seconds >= 0 (0: no deadline), got {value!r}")
    return seconds or None


# ------------------------------------------------------------------------------ the check-ins

_counter_lock = threading.Lock()
_loads_begun: dict[str, int] = {}  # checkpoint name -> guarded loads of it begun in this process


def default_group_store(prefix: str) -> tuple[Any, int, int] | None:
    """(the default process group's key-value store under ``prefix``, this rank, the world size)
    when this process has other ranks to coordinate with through it (an initialised default group
    of several ranks, not the ``fake`` backend, with a store), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world < 2 or dist.get_backend() == "fake":
            return None
        from torch.distributed import distributed_c10d as c10d

        default_store = getattr(c10d, "_get_default_store", None)
        store = default_store() if default_store is not None else None
    except (RuntimeError, ValueError, AttributeError):
        return None
    if store is None:
        return None
    return dist.PrefixStore(prefix, store), rank, world


def _process_group() -> tuple[Any, int, int] | None:
    """(the store of the load check-ins, this rank, the world size), or None: see
    :func:`default_group_store`."""
    return default_group_store("fastdcp/load")


def begin_load(deadline_s: float | None, name: str, status: str) -> LoadCheckIns | None:
    """The check-ins of a load of the checkpoint ``name`` that starts now on this rank (its
    ``status`` published), or None when there are none (no deadline, no other ranks)."""
    if deadline_s is None:
        return None
    group = _process_group()
    if group is None:
        return None
    store, rank, world = group
    with _counter_lock:
        n = _loads_begun[name] = _loads_begun.get(name, 0) + 1
    check_ins = LoadCheckIns(store, rank, world, name, n, deadline_s)
    check_ins.status(status)
    return check_ins


class LoadCheckIns:
    """One load's check-ins on one rank, through ``store`` (shared by the ``world_size`` ranks):
    :meth:`status` publishes what this rank does, :meth:`check_in` waits for every rank."""

    def __init__(self, store: Any, rank: int, world_size: int, name: str, n: int, deadline_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.deadline_s = float(deadline_s)
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        self.key = f"{digest}/{n}"  # the same on every rank, different for every load

    def status(self, text: str) -> None:
        """Publish what this rank is doing now (``reading data file 'F' of X``)."""
        self.store.set(f"status/{self.rank}", f"{self.key}\n{text}")

    def check_in(self, point: str) -> None:
        """Arrive at ``point`` and wait until every rank has, at most ``deadline_s``. Raises
        :class:`LoadDeadlineError` when the point failed (here or on another rank); at
        ``start`` inside DCP's ``CheckpointException`` (``read_metadata``'s ``Exception``\\ s
        make DCP fall back to rank-local metadata instead)."""
        base = f"{self.key}/{point}"
        arrived = time.monotonic()
        self.store.append(f"{base}/ranks", f"{self.rank},")
        verdict_key = f"{base}/verdict"
        if self.store.add(f"{base}/count", 1) >= self.world_size:
            verdict = self.store.compare_set(verdict_key, "", "passed")
        elif self._wait(verdict_key, arrived + self.deadline_s):
            verdict = self.store.get(verdict_key)
        else:
            missing = sorted(set(range(self.world_size)) - self._arrived(base))
            shown = ",".join(str(r) for r in missing[:_SHOWN_RANKS])
            failed = f"failed\n{self.rank}\n{self.deadline_s!r}\n{len(missing)}\n{shown}"
            verdict = self.store.compare_set(verdict_key, "", failed)
        verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
        if verdict == "passed":
            return
        error = self._error(point, verdict)
        if point == START:
            raise CheckpointException(str(error), {self.rank: (error, traceback.extract_stack())}) from error
        raise error

    def _wait(self, key: str, until: float) -> bool:
        """Whether ``key`` appeared in the store before ``until`` (monotonic seconds)."""
        while True:
            remaining = until - time.monotonic()
            if remaining < 0.01:  # a wait's timeout of 0 (whole milliseconds) means none at all
                return self.store.check([key])
            try:
                self.store.wait([key], timedelta(seconds=remaining))
                return True
            except Exception:  # noqa: BLE001 - a timeout (its type differs by store); check() raises a real failure
                if self.store.check([key]):
                    return True
                if until - time.monotonic() > 0.05:
                    time.sleep(0.05)  # a store whose wait returned early: try again until the deadline

    def _arrived(self, base: str) -> set[int]:
        raw = self.store.get(f"{base}/ranks")
        raw = raw.decode() if isinstance(raw, bytes) else str(raw)
        return {int(r) for r in raw.split(",") if r.strip()}

    def _status_of(self, rank: int) -> tuple[str | None, str | None]:
        """(the key of the load rank ``rank`` last published a status in, that status)."""
        key = f"status/{rank}"
        if not self.store.check([key]):
            return None, None
        raw = self.store.get(key)
        raw = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        load, _, text = raw.partition("\n")
        return load, text

    def _error(self, point: str, verdict: str) -> LoadDeadlineError:
        _, giver, deadline, count, shown = (verdict.split("\n") + [""] * 5)[:5]
        missing = tuple(int(r) for r in shown.split(",") if r.strip())
        where, undone = _POINTS.get(point, (f"at {point}", "arrive"))
        deadline_s = float(deadline) if deadline else self.deadline_s
        statuses: dict[int, str] = {}
        lines = []
        for r in missing:
            load, text = self._status_of(r)
            if load == self.key:
                statuses[r] = text or ""
                lines.append(f"rank {r} was {text}")
            elif load is not None:
                statuses[r] = text or ""
                lines.append(f"rank {r} had not started this load (it was last {text}, in an earlier load)")
            else:
                lines.append(f"rank {r} had not started a fastdcp load")
        more = int(count or len(missing)) - len(missing)
        if more > 0:
            lines.append(f"and {more} more rank(s)")
        waited_for = "; ".join(lines)
        total = int(count or len(missing))
        if giver and int(giver) != self.rank and self.rank in missing:
            head = (f"fastdcp: the load of '{self.name}' failed on rank {self.rank}, which arrived {where} after "
                    f"the other ranks stopped waiting ({deadline_s:g} s, load_deadline_s); rank {giver} was "
                    f"waiting for {total} of {self.world_size} ranks to {undone}: {waited_for}")
        else:
            head = (f"fastdcp: the load of '{self.name}' waited {deadline_s:g} s (load_deadline_s) {where} for "
                    f"{total} of {self.world_size} ranks to {undone}: {waited_for}")
        message = (f"{head}. A stalled, slow or dead rank holds up every rank of a load, so the load failed on "
                   f"every rank still running. To wait longer, raise load_deadline_s (or {_ENV}); None or 0 turns "
                   "the check-ins off, as a load on only some of the ranks needs (they wait for every rank of "
                   "the default process group)")
        return LoadDeadlineError(message, path=self.name, point=point, deadline_s=deadline_s, missing=missing,
                                 statuses=statuses)


def reading_files_status(path: str, files: Any) -> str:
    """A rank's status while it reads ``files`` (relative paths) of the checkpoint ``path``."""
    names = sorted({str(f) for f in files})
    if not names:
        return f"done with its reads of {path} (it had none)"
    shown = ", ".join(f"'{n}'" for n in names[:3])
    if len(names) == 1:
        return f"reading data file {shown} of {path}"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"reading data files {shown}{more} of {path}"


# ------------------------------------------------------------------------------ the test hook


def stall_point(point: str) -> None:
    """Test hook: with ``FASTDCP_TEST_STALL_AT`` naming ``point`` (comma-separated ``point`` or
    ``point:rank`` entries; without a rank, every rank), sleep ``FASTDCP_TEST_STALL_S`` seconds
    (default 60), or until the file ``FASTDCP_TEST_STALL_UNTIL`` exists. The rank is the default
    process group's (0 without one). Points: ``read_metadata`` (a load's rank reading
    ``.metadata``), ``read_data`` (reading its data files)."""
    wanted = os.environ.get("FASTDCP_TEST_STALL_AT")
    if not wanted:
        return
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    for entry in wanted.split(","):
        name, _, only = entry.strip().partition(":")
        if name == point and (not only or int(only) == rank):
            break
    else:
        return
    until = time.monotonic() + float(os.environ.get("FASTDCP_TEST_STALL_S", "60"))
    release = os.environ.get("FASTDCP_TEST_STALL_UNTIL")
    while time.monotonic() < until and not (release and os.path.exists(release)):
        time.sleep(0.05)
