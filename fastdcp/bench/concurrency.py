"""Concurrency scenario (`concurrency`): several jobs saving into ONE checkpoint directory while
another job loads it.

The situations this stands for: a restarted job whose predecessor is still finishing an async
save, two jobs launched with the same output path, an evaluation job loading the latest
checkpoint while training overwrites it. :func:`run_shared_directory` runs one round:

* ``writers`` writer jobs (separate processes; a writer may have several ranks in a gloo group)
  each save ``saves_per_writer`` distinct states into the SAME directory with ``dcp.save`` and a
  new storage writer per save (stock ``FileSystemWriter(dir)`` or ``FastFileSystemWriter(dir)``,
  default arguments). They start together (every process reports ready, then waits for one
  "go" file), so their saves truly overlap.
* Optionally a loader process loads the directory in a loop while they run (stock
  ``FileSystemReader`` or ``FastFileSystemReader``), into preallocated tensors scribbled before
  every load, and classifies each load: ``ok`` (every tensor and the ``state_id`` entry from one
  state some writer saved), ``mix`` (it loaded without an error, but not one state), ``failed``
  (an exception: its type and first line).
* Writers record every save: ok, or failed (type and first line of the underlying exception; DCP
  wraps it in ``CheckpointException``, a ``BaseException``).
* After every job ended, the directory must load, with BOTH readers, as exactly one state a
  writer saved successfully ("ends as one committed state"). Files in it that the final
  ``.metadata`` does not reference are listed (informative).
* ``kill_writer_after_s`` (optionally after ``kill_writer_after_saves`` saves of that writer):
  SIGKILL one writer mid-loop; the other writers and the loader go on. The killed writer's saves
  are left out of the failure counts, but the directory must still end as one committed state
  (the state of the save it was killed in counts as committed when that save got to commit).

Every state is identifiable: state ``writer * 1000 + k`` (the directory is seeded with state 0
first, so a loader always has something to load), tensor ``i`` an int64 tensor whose element
``j`` is ``((state * 1024 + i) << 24) + j``. A mix of two states, two tensors swapped, or a tensor
torn between two saves (or left unwritten) cannot pass as a state.

Processes: the saving and loading processes are forked from a zygote (:class:`Zygote`, a
``python -c`` subprocess that imports torch, DCP and fastdcp once and starts no thread), so a
round costs saves and loads, not interpreter starts; each child runs one job function
(``module:function``), so tests can run jobs of their own in the same way.

The benchmark suite (``python -m fastdcp.bench --scenarios concurrency``) runs, per system (stock,
fastdcp) and ``--repeats`` rounds each, 2 writers, and 3 writers + a loader (16 tensors of
2 MiB, 8 saves per writer), and prints the counts (fastdcp/bench/report.py, ``concurrency_lines``).
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

SCENARIO = "concurrency"
GROUP = "concurrency"            # directory under the target; removed after every round
SYSTEMS = ("stock", "fastdcp")
MiB = 1 << 20

STATE_KEY = "state_id"           # the non-tensor entry naming the state
SEED_STATE = 0                   # the state the directory holds before the writers start
STATES_PER_WRITER = 1000         # state id = writer * 1000 + k
_TENSOR_SLOTS = 1024             # tensor code = state id * 1024 + tensor index
_CODE_SHIFT = 24                 # element j = (code << 24) + j: up to 16 Mi elements a tensor

OK, MIX, FAILED = "ok", "mix", "failed"
READY_TIMEOUT_S = 180.0          # process groups and first imports, on a busy 2-core machine
POLL_S = 0.002


# --------------------------------------------------------------------------- states

def state_id(writer: int, k: int) -> int:
    return writer * STATES_PER_WRITER + k


def tensor_key(index: int) -> str:
    return f"t{index:03d}"


def tensor_elements(tensor_bytes: int) -> int:
    n = tensor_bytes // 8
    if not 1 <= n < (1 << _CODE_SHIFT):
        raise ValueError(f"tensor_bytes={tensor_bytes}: expected 8 B .. {8 << _CODE_SHIFT} B")
    return n


def _code(state: int, index: int) -> int:
    return (state * _TENSOR_SLOTS + index) << _CODE_SHIFT


def make_state(state: int, tensors: int, tensor_bytes: int, indices: Sequence[int] | None = None) -> dict[str, Any]:
    """State ``state``: tensors ``indices`` (default all ``tensors``) plus the ``state_id`` entry.
    A rank of a multi-rank writer saves only its share of the indices (the keys differ by
    rank, so the checkpoint holds every tensor once, as a one-process save would)."""
    import torch

    n = tensor_elements(tensor_bytes)
    base = torch.arange(n, dtype=torch.int64)
    out: dict[str, Any] = {tensor_key(i): base + _code(state, i) for i in (indices if indices is not None else range(tensors))}
    out[STATE_KEY] = state
    return out


def make_destination(tensors: int, tensor_bytes: int) -> dict[str, Any]:
    import torch

    n = tensor_elements(tensor_bytes)
    return {**{tensor_key(i): torch.empty(n, dtype=torch.int64) for i in range(tensors)}, STATE_KEY: None}


def scribble(dest: dict[str, Any]) -> None:
    """Fill the destination with -1 (no state's value), so a tensor a load left alone shows."""
    for key, value in dest.items():
        if key != STATE_KEY:
            value.fill_(-1)
    dest[STATE_KEY] = None


def tensor_state(tensor: Any, index: int, base: Any) -> int | None:
    """The state whose tensor ``index`` this is, or None when it is no state's (torn, scribbled,
    another index)."""
    first = int(tensor[0]) if tensor.numel() else -1
    code = first >> _CODE_SHIFT
    state, slot = divmod(code, _TENSOR_SLOTS)
    if code < 0 or slot != index:
        return None
    if not bool(tensor.sub(base).eq_(_code(state, index)).all()):
        return None
    return state


def classify_loaded(dest: dict[str, Any], tensors: int, base: Any, valid: set[int]) -> tuple[str, int | None, str | None]:
    """(outcome, state, detail) of a load that raised nothing: ``ok`` and the state when every
    tensor and the ``state_id`` entry are of one state in ``valid``; else ``mix``."""
    per_tensor = [tensor_state(dest[tensor_key(i)], i, base) for i in range(tensors)]
    named = dest.get(STATE_KEY)
    found = set(per_tensor) | {named}
    if len(found) == 1 and named in valid:
        return OK, named, None
    counts = collections.Counter("?" if s is None else s for s in per_tensor)
    return MIX, None, f"tensors from states {dict(counts)}; {STATE_KEY} entry {named!r}"


# --------------------------------------------------------------------------- errors

@dataclass
class ErrorInfo:
    type: str          # the underlying exception's type (inside DCP's CheckpointException)
    line: str          # its first line
    text: str          # the whole text (CheckpointException's text holds every rank's error)


def describe_error(error: BaseException) -> ErrorInfo:
    """What a save or load raised. DCP's ``CheckpointException`` text starts with the list of
    failed ranks; the type and first line worth reporting are those of the first rank's error."""
    inner = error
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = failures[min(failures)]
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            inner = wrapped[0]
    message = str(inner).strip()
    line = message.splitlines()[0] if message else ""
    text = f"{type(inner).__name__}: {message}" + ("" if inner is error else f"\n{error}")
    return ErrorInfo(type(inner).__name__, line[:400], text[:8000])


_TOKEN_RE = re.compile(r"(?<![0-9a-f])[0-9a-f]{8}(?![0-9a-f])")


def error_key(error_type: str, line: str, directory: str) -> str:
    """An error's first line with the directory and save tokens blanked, so that the same
    failure in different saves counts as one."""
    line = line.replace(os.path.abspath(directory), "<dir>")
    return f"{error_type}: {_TOKEN_RE.sub('<token>', line)}"


# --------------------------------------------------------------------------- job side

def _storage_writer(system: str, directory: str) -> Any:
    if system == "stock":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(directory)
    from fastdcp import FastFileSystemWriter

    return FastFileSystemWriter(directory)


def _storage_reader(system: str, directory: str) -> Any:
    if system == "stock":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(directory)
    from fastdcp import FastFileSystemReader

    return FastFileSystemReader(directory)


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def ready_and_wait(control: str, name: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Report ``name`` ready, then wait for the runner's go (so every job starts together)."""
    with open(os.path.join(control, f"{name}.ready"), "w"):
        pass
    go = os.path.join(control, "go")
    deadline = time.monotonic() + timeout
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: no go within {timeout} s")
        time.sleep(POLL_S)


def writer_job(system: str, directory: str, control: str, records: str, writer: int, saves: int, tensors: int,
               tensor_bytes: int, rank: int = 0, world_size: int = 1, barrier: bool = True,
               store: str | None = None) -> None:
    """Save states ``writer * 1000 + k`` (k < ``saves``) into ``directory``, a new storage writer
    per save, recording ``start`` and ``end`` of each (``records``, JSON lines). With
    ``world_size`` > 1, this is rank ``rank`` of a gloo group (file store ``store``) saving its
    share of the tensors; else ``no_dist``."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if world_size > 1:
        import datetime

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=READY_TIMEOUT_S))
    indices = [i for i in range(tensors) if i % world_size == rank]
    if barrier:
        ready_and_wait(control, f"writer{writer}.{rank}")
    kwargs = {} if world_size > 1 else {"no_dist": True}
    for k in range(saves):
        state = make_state(state_id(writer, k), tensors, tensor_bytes, indices)
        storage_writer = _storage_writer(system, directory)
        base = {"writer": writer, "rank": rank, "k": k, "state": state_id(writer, k)}
        _append(records, {**base, "event": "start", "t": time.monotonic()})
        error = None
        try:
            dcp.save(state, storage_writer=storage_writer, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            error = describe_error(exc)
        _append(records, {**base, "event": "end", "t": time.monotonic(), "ok": error is None,
                          "error": None if error is None else asdict(error)})
    if world_size > 1:
        dist.destroy_process_group()


def loader_job(system: str, directory: str, control: str, records: str, tensors: int, tensor_bytes: int,
               valid: list[int]) -> None:
    """Load ``directory`` in a loop from the go until the ``stop`` file exists, recording each
    load's interval and outcome (``records``, JSON lines)."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    dest = make_destination(tensors, tensor_bytes)
    base = torch.arange(tensor_elements(tensor_bytes), dtype=torch.int64)
    valid_states = set(valid)
    stop = os.path.join(control, "stop")
    ready_and_wait(control, "loader")
    while not os.path.exists(stop):
        scribble(dest)
        reader = _storage_reader(system, directory)
        started = time.monotonic()
        try:
            dcp.load(dest, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            ended = time.monotonic()
            error = describe_error(exc)
            record = {"outcome": FAILED, "state": None, "detail": None, "error": asdict(error)}
        else:
            ended = time.monotonic()
            outcome, state, detail = classify_loaded(dest, tensors, base, valid_states)
            record = {"outcome": outcome, "state": state, "detail": detail, "error": None}
        _append(records, {"started": started, "ended": ended, **record})


# --------------------------------------------------------------------------- the zygote

def _run_child(job: dict[str, Any]) -> None:
    """In a forked child: run ``job["target"]`` (``module:function``) with ``job["args"]``, output
    to ``job["log"]`` (the zygote's stdout is its channel to the runner), exit 0, or 3 after
    writing the exception to the log."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 0
    try:
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(job.get("env") or {})
        module, _, function = job["target"].partition(":")
        getattr(importlib.import_module(module), function)(**job.get("args", {}))
    except BaseException:  # noqa: BLE001 - reported through the log and the exit code
        code = 3
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def zygote_main() -> None:
    """The zygote: import the heavy modules once, then fork a child per ``fork`` command.

    Commands (JSON lines on stdin, one JSON answer each on stdout): ``{"op": "fork", "job":
    {...}}`` -> ``{"pid": N}``; ``{"op": "wait", "pid": N, "timeout": S}`` -> ``{"done": bool,
    "signal": K|null, "code": C|null}``; ``{"op": "exit"}``."""
    import torch
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    try:
        import fastdcp  # noqa: F401
    except ImportError:
        pass
    torch.set_num_threads(1)  # no intra-op thread pool in the process children are forked from
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                _run_child(cmd["job"])
            answer: dict[str, Any] = {"pid": pid}
        elif cmd["op"] == "wait":
            deadline = time.monotonic() + float(cmd.get("timeout") or 0)
            while True:
                done, status = os.waitpid(cmd["pid"], os.WNOHANG)
                if done or time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
            answer = {"done": bool(done),
                      "signal": os.WTERMSIG(status) if done and os.WIFSIGNALED(status) else None,
                      "code": os.WEXITSTATUS(status) if done and os.WIFEXITED(status) else None}
        elif cmd["op"] == "exit":
            break
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(answer), file=out, flush=True)


@dataclass
class ChildExit:
    done: bool
    signal: int | None
    code: int | None

    def describe(self) -> str:
        if not self.done:
            return "still running"
        return f"killed by signal {self.signal}" if self.signal is not None else f"exit code {self.code}"


class Zygote:
    """Runner-side handle on a zygote process (see :func:`zygote_main`). ``extra_paths`` go on
    its ``sys.path`` (modules of job functions); a context manager."""

    def __init__(self, extra_paths: Sequence[str] = ()) -> None:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds fastdcp/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([repo, *extra_paths, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        # The DCP process-mode daemon opens its TCPStore at MASTER_ADDR (else the host's FQDN).
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from fastdcp.bench.concurrency import zygote_main; zygote_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
        ready = self._read()
        if "ready" not in ready:
            raise RuntimeError(f"concurrency zygote did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"concurrency zygote died (exit code {self.proc.poll()})")
        return json.loads(line)

    def _send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def fork(self, target: str | Callable[..., Any], log: str, env: dict[str, str] | None = None, **args: Any) -> int:
        """Start a child running ``target`` (``module:function`` or a module-level function)
        with keyword ``args`` (JSON values), its output going to ``log``."""
        if callable(target):
            target = f"{target.__module__}:{target.__name__}"
        return int(self._send({"op": "fork", "job": {"target": target, "args": args, "log": log,
                                                       "env": env or {}}})["pid"])

    def wait(self, pid: int, timeout: float) -> ChildExit:
        return ChildExit(**self._send({"op": "wait", "pid": pid, "timeout": timeout}))

    def kill(self, pid: int) -> ChildExit:
        """SIGKILL a child and reap it."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.wait(pid, 60.0)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - it is going away either way
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- results

@dataclass
class SaveRecord:
    """One save of one writer (all its ranks): ok only when every rank's ``dcp.save`` returned."""
    writer: int
    k: int
    state: int
    started: float                 # seconds from the go
    ended: float | None            # None: never ended (killed)
    ok: bool | None                # None: never ended
    error_type: str | None = None
    error_line: str | None = None
    error_text: str | None = None


@dataclass
class LoadRecord:
    started: float                 # seconds from the go
    ended: float
    outcome: str                   # ok | mix | failed
    state: int | None
    detail: str | None = None
    error_type: str | None = None
    error_line: str | None = None


@dataclass
class FinalLoad:
    """The directory after the round, loaded by one reader."""
    reader: str                    # "stock" (FileSystemReader) | "fastdcp" (FastFileSystemReader)
    outcome: str                   # ok | mix | failed | none (no .metadata)
    state: int | None
    detail: str | None = None


@dataclass
class SharedDirectoryResult:
    system: str
    directory: str
    writers: int
    ranks_per_writer: list[int]
    saves_per_writer: int
    tensors: int
    tensor_bytes: int
    loader: bool
    seconds: float                 # from the go until the last writer ended
    saves: list[SaveRecord]
    loads: list[LoadRecord]
    final: list[FinalLoad]
    leftover_files: list[str]      # in the directory, not referenced by the final .metadata
    writer_exits: dict[int, str]   # writer -> how its processes ended (every rank the same, or listed)
    killed_writer: int | None = None
    kill_seconds: float | None = None     # from the go
    kill_landed_mid_loop: bool = False    # the killed writer still had saves to do
    files_at_kill: list[str] = field(default_factory=list)

    # -- saves (the killed writer's are left out of ok/failed)
    def _counted(self) -> list[SaveRecord]:
        return [s for s in self.saves if s.writer != self.killed_writer]

    @property
    def saves_ok(self) -> int:
        return sum(1 for s in self._counted() if s.ok)

    @property
    def saves_failed(self) -> int:
        return sum(1 for s in self._counted() if not s.ok)

    @property
    def failed_saves(self) -> list[SaveRecord]:
        return [s for s in self._counted() if not s.ok]

    def save_errors(self) -> collections.Counter[str]:
        return collections.Counter(error_key(s.error_type or "no record", s.error_line or "", self.directory)
                                   for s in self.failed_saves)

    @property
    def committed_states(self) -> set[int]:
        """States a writer saved successfully, and the state of the save the killed writer was
        in when it died (it may have got as far as its commit)."""
        out = {s.state for s in self.saves if s.ok}
        out |= {s.state for s in self.saves if s.writer == self.killed_writer and s.ok is None}
        return out

    @property
    def saves_overlapping_another_writer(self) -> int:
        """Saves whose interval overlaps a save of another writer (the round really was concurrent)."""
        spans = [(s.writer, s.started, s.ended if s.ended is not None else self.seconds) for s in self.saves]
        return sum(1 for w, a, b in spans if any(w2 != w and a2 < b and a < b2 for w2, a2, b2 in spans))

    # -- loads
    def _loads(self, outcome: str) -> int:
        return sum(1 for load in self.loads if load.outcome == outcome)

    @property
    def loads_ok(self) -> int:
        return self._loads(OK)

    @property
    def loads_mix(self) -> int:
        return self._loads(MIX)

    @property
    def loads_failed(self) -> int:
        return self._loads(FAILED)

    def load_errors(self) -> collections.Counter[str]:
        return collections.Counter(error_key(x.error_type or "", x.error_line or "", self.directory)
                                   for x in self.loads if x.outcome == FAILED)

    @property
    def loads_during_saves(self) -> int:
        """Loads whose interval overlaps the saving window (the first save's start to the last
        save's end)."""
        if not self.saves:
            return 0
        first = min(s.started for s in self.saves)
        last = max(s.ended if s.ended is not None else self.seconds for s in self.saves)
        return sum(1 for x in self.loads if x.started < last and x.ended > first)

    @property
    def loads_of_failed_saves(self) -> int:
        """Loads that returned the state of a save that reported failure (it was never committed,
        so a reader should not have seen it)."""
        failed = {s.state for s in self.saves if s.ok is False}
        return sum(1 for x in self.loads if x.outcome == OK and x.state in failed)

    # -- the end
    @property
    def final_one_committed_state(self) -> bool:
        """Both readers load the directory as the same one state, saved successfully by a writer."""
        states = {f.state for f in self.final}
        return (len(self.final) == 2 and all(f.outcome == OK for f in self.final) and len(states) == 1
                and states <= self.committed_states)

    def final_description(self) -> str:
        return "; ".join(f"{f.reader}: {f.outcome}" + (f" state {f.state}" if f.state is not None else "")
                         + (f" ({f.detail})" if f.detail else "") for f in self.final)

    def summary(self) -> dict[str, Any]:
        """Counts of the round (the benchmark's per-round record)."""
        return {
            "saves_ok": self.saves_ok, "saves_failed": self.saves_failed,
            "save_errors": dict(self.save_errors()),
            "loads_ok": self.loads_ok, "loads_mix": self.loads_mix, "loads_failed": self.loads_failed,
            "load_errors": dict(self.load_errors()), "loads_during_saves": self.loads_during_saves,
            "loads_of_failed_saves": self.loads_of_failed_saves,
            "saves_overlapping_another_writer": self.saves_overlapping_another_writer,
            "final_one_committed_state": self.final_one_committed_state,
            "final": self.final_description(), "leftover_files": len(self.leftover_files),
            "killed_writer": self.killed_writer, "kill_landed_mid_loop": self.kill_landed_mid_loop,
        }

    def describe(self) -> str:
        s = self.summary()
        top_save = self.save_errors().most_common(1)
        top_load = self.load_errors().most_common(1)
        return (f"{self.system}: {self.writers} writers {self.ranks_per_writer} ranks, "
                f"{'a loader' if self.loader else 'no loader'}, {self.seconds:.2f} s: "
                f"saves ok {s['saves_ok']} failed {s['saves_failed']}"
                + (f" (most: {top_save[0][1]}x {top_save[0][0]})" if top_save else "")
                + f"; loads ok {s['loads_ok']} mix {s['loads_mix']} failed {s['loads_failed']}"
                + (f" (most: {top_load[0][1]}x {top_load[0][0]})" if top_load else "")
                + f", {s['loads_during_saves']} during saves; final: {self.final_description()}"
                + f"; leftovers {len(self.leftover_files)}"
                + (f"; killed writer {self.killed_writer} at {self.kill_seconds:.2f} s"
                   f"{' mid-loop' if self.kill_landed_mid_loop else ' (it had finished)'}"
                   if self.killed_writer is not None else ""))


# --------------------------------------------------------------------------- runner side

def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut short by a SIGKILL
    return out


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path) as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def final_load(directory: str, reader: str, tensors: int, tensor_bytes: int, valid: set[int]) -> FinalLoad:
    """Load ``directory`` with ``reader`` ("stock" | "fastdcp") in this process and classify it."""
    import torch
    import torch.distributed.checkpoint as dcp

    if not os.path.exists(os.path.join(directory, ".metadata")):
        return FinalLoad(reader, "none", None, "no .metadata")
    dest = make_destination(tensors, tensor_bytes)
    scribble(dest)
    try:
        storage_reader = _storage_reader(reader, directory)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(dest, storage_reader=storage_reader, no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = describe_error(exc)
        return FinalLoad(reader, FAILED, None, f"{error.type}: {error.line}")
    base = torch.arange(tensor_elements(tensor_bytes), dtype=torch.int64)
    outcome, state, detail = classify_loaded(dest, tensors, base, valid)
    return FinalLoad(reader, outcome, state, detail)


def referenced_files(directory: str) -> set[str] | None:
    """The data files the directory's ``.metadata`` references (stock reader), or None."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(directory).read_metadata()
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return None
    return {info.relative_path for info in md.storage_data.values()}


def _crash_log(control: str, writer: int, ranks: int) -> str:
    return "\n".join(_tail(os.path.join(control, f"writer{writer}.{rank}.log"), 1500) for rank in range(ranks))


def _save_records(raw: list[dict[str, Any]], go: float, ranks: dict[int, int]) -> list[SaveRecord]:
    """One SaveRecord per (writer, k) from the ranks' start/end lines."""
    by: dict[tuple[int, int], dict[str, Any]] = {}
    for r in raw:
        entry = by.setdefault((r["writer"], r["k"]), {"state": r["state"], "starts": [], "ends": []})
        entry["starts" if r["event"] == "start" else "ends"].append(r)
    out = []
    for (writer, k), e in sorted(by.items()):
        if not e["starts"]:
            continue
        started = min(r["t"] for r in e["starts"]) - go
        ended_all = len(e["ends"]) == ranks.get(writer, 1)
        rec = SaveRecord(writer, k, e["state"], started,
                         max(r["t"] for r in e["ends"]) - go if ended_all else None,
                         all(r["ok"] for r in e["ends"]) if ended_all else None)
        bad = next((r["error"] for r in sorted(e["ends"], key=lambda r: r["rank"]) if not r["ok"]), None)
        if bad is not None:
            rec.ok = False
            rec.error_type, rec.error_line, rec.error_text = bad["type"], bad["line"], bad["text"]
        out.append(rec)
    return out


def run_shared_directory(
    system: str,
    directory: str,
    *,
    writers: int = 2,
    saves_per_writer: int = 8,
    tensors: int = 16,
    tensor_bytes: int = 2 * MiB,
    loader: bool = True,
    ranks_per_writer: Sequence[int] | None = None,
    kill_writer_after_s: float | None = None,
    kill_writer_after_saves: int = 0,
    killed_writer: int | None = None,
    writer_env: dict[int, dict[str, str]] | None = None,
    zygote: Zygote | None = None,
    timeout_s: float = 300.0,
) -> SharedDirectoryResult:
    """One round (see the module docstring) into ``directory`` (created; must not hold a
    checkpoint yet). ``system``: "stock" or "fastdcp" (the writers' and the loader's classes).
    ``ranks_per_writer``: ranks of each writer (default 1 each; more than one: a gloo group).
    ``kill_writer_after_s``: SIGKILL writer ``killed_writer`` (default the last one) that many
    seconds after the go, or, with ``kill_writer_after_saves`` = n, that many seconds after its
    n-th save ended. ``writer_env``: environment variables per writer (e.g. the writer's test
    hook ``FASTDCP_TEST_PAUSE_AT``, to make a kill land in a known phase). ``zygote``: reuse one
    across rounds (else one is started for this call)."""
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r}: expected one of {SYSTEMS}")
    if not 1 <= saves_per_writer < STATES_PER_WRITER:
        raise ValueError(f"saves_per_writer must be 1..{STATES_PER_WRITER - 1}")
    ranks = list(ranks_per_writer or [1] * writers)
    if len(ranks) != writers or min(ranks) < 1:
        raise ValueError(f"ranks_per_writer {ranks}: expected {writers} counts >= 1")
    killing = kill_writer_after_s is not None
    victim = (killed_writer if killed_writer is not None else writers) if killing else None
    if victim is not None and not 1 <= victim <= writers:
        raise ValueError(f"killed_writer {victim}: writers are 1..{writers}")
    own_zygote = zygote is None
    zygote = zygote or Zygote()
    directory = os.path.abspath(directory)
    control = directory.rstrip(os.sep) + ".control"
    shutil.rmtree(control, ignore_errors=True)
    os.makedirs(control)
    os.makedirs(directory, exist_ok=True)
    records = os.path.join(control, "saves.jsonl")
    load_records = os.path.join(control, "loads.jsonl")
    common = {"system": system, "directory": directory, "control": control, "tensors": tensors,
              "tensor_bytes": tensor_bytes}
    children: dict[int, tuple[str, int | None]] = {}  # pid -> (name, writer)
    try:
        # The directory holds a checkpoint (state 0) before the writers start: the loader always
        # has one to load, and the writers overwrite one, as a restarted job does.
        seed_log = os.path.join(control, "seed.log")
        pid = zygote.fork(writer_job, seed_log, records=os.path.join(control, "seed.jsonl"), writer=SEED_STATE,
                          saves=1, barrier=False, **common)
        status = zygote.wait(pid, timeout_s)
        seeded = _read_jsonl(os.path.join(control, "seed.jsonl"))
        if not (status.done and status.code == 0 and any(r.get("ok") for r in seeded)):
            if not status.done:
                zygote.kill(pid)
            raise RuntimeError(f"seeding {directory} failed ({status.describe()}): {seeded}\n{_tail(seed_log)}")

        expected_ready = []
        for w in range(1, writers + 1):
            for rank in range(ranks[w - 1]):
                name = f"writer{w}.{rank}"
                pid = zygote.fork(writer_job, os.path.join(control, f"{name}.log"),
                                  env=(writer_env or {}).get(w), records=records, writer=w,
                                  saves=saves_per_writer, rank=rank, world_size=ranks[w - 1],
                                  store=os.path.join(control, f"store{w}"), **common)
                children[pid] = (name, w)
                expected_ready.append(name)
        loader_pid = None
        if loader:
            valid = [SEED_STATE] + [state_id(w, k) for w in range(1, writers + 1) for k in range(saves_per_writer)]
            loader_pid = zygote.fork(loader_job, os.path.join(control, "loader.log"), records=load_records,
                                     valid=valid, **common)
            children[loader_pid] = ("loader", None)
            expected_ready.append("loader")

        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(os.path.exists(os.path.join(control, f"{n}.ready")) for n in expected_ready):
            if time.monotonic() > deadline:
                raise RuntimeError("jobs not ready in time: " + "; ".join(
                    f"{n}: {_tail(os.path.join(control, n + '.log'), 800)}" for n in expected_ready
                    if not os.path.exists(os.path.join(control, f"{n}.ready"))))
            time.sleep(POLL_S)
        go = time.monotonic()
        with open(os.path.join(control, "go"), "w"):
            pass

        kill_seconds, mid_loop, files_at_kill = None, False, []
        exits: dict[int, ChildExit] = {}
        if victim is not None:
            if kill_writer_after_saves > 0:
                while True:
                    ends = [r for r in _read_jsonl(records) if r["writer"] == victim and r["event"] == "end"
                            and r["rank"] == 0]
                    if len(ends) >= kill_writer_after_saves or time.monotonic() - go > timeout_s:
                        break
                    time.sleep(POLL_S)
            time.sleep(max(0.0, kill_writer_after_s))
            kill_seconds = time.monotonic() - go
            victims = [p for p, (_, w) in children.items() if w == victim]
            for p in victims:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in victims:
                exits[p] = zygote.wait(p, 60.0)
            files_at_kill = sorted(os.listdir(directory))
            ends = [r for r in _read_jsonl(records) if r["writer"] == victim and r["event"] == "end" and r["rank"] == 0]
            mid_loop = len(ends) < saves_per_writer

        writer_deadline = go + timeout_s
        for p, (name, w) in children.items():
            if w is None or p in exits:
                continue
            exits[p] = zygote.wait(p, max(0.0, writer_deadline - time.monotonic()))
            if not exits[p].done:
                exits[p] = zygote.kill(p)
        ended = time.monotonic()
        with open(os.path.join(control, "stop"), "w"):
            pass
        if loader_pid is not None:
            exits[loader_pid] = zygote.wait(loader_pid, 120.0)
            if not exits[loader_pid].done:
                exits[loader_pid] = zygote.kill(loader_pid)
        writer_of = {p: w for p, (_, w) in children.items()}
        children.clear()  # every child is reaped
        if loader_pid is not None and not (exits[loader_pid].done and exits[loader_pid].code == 0):
            raise RuntimeError(f"the loader process failed ({exits[loader_pid].describe()}):\n"
                               + _tail(os.path.join(control, "loader.log")))
        writer_exits: dict[int, str] = {}
        for w in range(1, writers + 1):
            states = sorted({exits[p].describe() for p in exits if writer_of.get(p) == w})
            writer_exits[w] = ", ".join(states)
        crashed = {w for p, s in exits.items() if (w := writer_of.get(p)) is not None and w != victim
                   and not (s.done and s.code == 0)}
        saves = _save_records(_read_jsonl(records), go, {w: ranks[w - 1] for w in range(1, writers + 1)})
        loads = [LoadRecord(r["started"] - go, r["ended"] - go, r["outcome"], r["state"], r["detail"],
                            (r["error"] or {}).get("type"), (r["error"] or {}).get("line"))
                 for r in _read_jsonl(load_records)]
        # Saves that never recorded a start or an end (a writer died outside dcp.save) count as
        # failed, so a crashed writer cannot hide its missing saves.
        for w in range(1, writers + 1):
            if w == victim:
                continue
            seen = {s.k for s in saves if s.writer == w}
            for k in range(saves_per_writer):
                if k not in seen:
                    saves.append(SaveRecord(w, k, state_id(w, k), 0.0, None, False, "no record",
                                            f"writer {w} ({writer_exits[w]}) ended without recording this save",
                                            _crash_log(control, w, ranks[w - 1]) if w in crashed else None))
            for s in saves:
                if s.writer == w and s.ok is None:
                    s.ok, s.error_type, s.error_line = False, "no record", "the save never ended"
        saves.sort(key=lambda s: (s.writer, s.k))
        valid = {SEED_STATE} | {state_id(w, k) for w in range(1, writers + 1) for k in range(saves_per_writer)}
        final = [final_load(directory, reader, tensors, tensor_bytes, valid) for reader in ("stock", "fastdcp")]
        refs = referenced_files(directory)
        names = set(os.listdir(directory))
        leftovers = sorted(names - (refs or set()) - {".metadata"})
        return SharedDirectoryResult(
            system=system, directory=directory, writers=writers, ranks_per_writer=ranks,
            saves_per_writer=saves_per_writer, tensors=tensors, tensor_bytes=tensor_bytes, loader=loader,
            seconds=ended - go, saves=saves, loads=loads, final=final, leftover_files=leftovers,
            writer_exits=writer_exits, killed_writer=victim, kill_seconds=kill_seconds,
            kill_landed_mid_loop=mid_loop, files_at_kill=files_at_kill)
    finally:
        for p in list(children):
            zygote.kill(p)
        if own_zygote:
            zygote.close()


# --------------------------------------------------------------------------- the benchmark scenario

@dataclass(frozen=True)
class ConcurrencyCase:
    writers: int
    loader: bool

    def config(self) -> dict[str, Any]:
        return {"writers": self.writers, "loader": self.loader}


# 2 writers (two jobs given one path), and 3 writers with an evaluation job loading meanwhile
CASES = (ConcurrencyCase(writers=2, loader=False), ConcurrencyCase(writers=3, loader=True))
SAVES_PER_WRITER = 8
TENSORS = 16
TENSOR_BYTES = 2 * MiB


def run_concurrency(ctx: Any, wheres: list[str]) -> None:
    """The `concurrency` scenario: per case, ``--repeats`` rounds, stock and fastdcp interleaved
    (stock fastdcp stock fastdcp ...), each round in a fresh directory on ``dir`` (the disk, where
    fsync makes the saves long enough to overlap), one Recorder row per (system, case) with one
    sample per round: seconds from the go until the last writer ended, and the round's counts
    (:meth:`SharedDirectoryResult.summary`) in ``extra``."""
    where = "dir" if "dir" in wheres else wheres[0]
    systems = []
    for system in ctx.systems:
        if system.name not in SYSTEMS:
            continue
        if system.standin:
            ctx.note(f"{SCENARIO}: {system.name} not measured: it is a stand-in")
            continue
        systems.append(system)
    if not systems:
        ctx.note(f"{SCENARIO}: no system to measure (it runs stock and fastdcp)")
        return
    root = os.path.join(ctx.targets[where], GROUP)
    nbytes = TENSORS * TENSOR_BYTES
    with Zygote() as zygote:
        for case in CASES:
            for rep in range(ctx.cfg.repeats):
                for system in systems:
                    directory = os.path.join(root, system.name, f"w{case.writers}", f"r{rep}")
                    result = run_shared_directory(system.name, directory, writers=case.writers,
                                                  saves_per_writer=SAVES_PER_WRITER, tensors=TENSORS,
                                                  tensor_bytes=TENSOR_BYTES, loader=case.loader, zygote=zygote)
                    ctx.recorder.add(SCENARIO, where, system.name, case.config(),
                                     nbytes * case.writers * SAVES_PER_WRITER, result.seconds, None,
                                     system.description, **result.summary())
                    ctx.progress(f"{SCENARIO} {where} round {rep + 1}/{ctx.cfg.repeats}: {result.describe()}")
                    shutil.rmtree(directory, ignore_errors=True)
                    shutil.rmtree(directory + ".control", ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
