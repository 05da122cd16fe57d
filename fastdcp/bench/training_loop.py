"""Training-loop scenario (`train_loop`): what checkpointing costs a training job.

A synthetic training step of fixed cost (an LLM-like stack of large Linear layers plus one
BatchNorm1d, so that module buffers change in every forward; AdamW) runs N steps, with a
``dcp.async_save`` every k steps, once per system, interleaved with the same loop without
checkpoints (``no_ckpt``): no_ckpt A B C no_ckpt A B C ... The checkpointed state is
``{"model": ..., "optim": ...}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict``
(it needs no process group): parameters + AdamW moments + steps + BatchNorm buffers, about
``--size`` bytes. AdamW state exists before the first checkpoint (warm-up steps calibrate the
batch so that one step takes about ``--train-step-ms``). Every loop, the first too, starts with
``WARMUP_STEPS`` untimed steps of the same work (``warmup_steps`` / ``warmup_seconds`` on its
``loop`` row), so that no loop is timed cold.

Every checkpoint goes into a new directory through a NEW writer (``storage_writer=Writer(path),
checkpoint_id=path``). As torchtitan does, the previous checkpoint's upload is waited on at the
next checkpoint step (``waited_prev``, part of that checkpoint's ``blocked``), and the loop ends
when its last checkpoint is durable (``drain``, part of the loop time: a run is not over while
its checkpoint is still being written).

Per system, measured and recorded (scenario "train_loop", one Recorder row per metric):

* ``loop``: wall seconds of the N steps (+ drain), the verification copies excluded;
  ``slowdown``: loop - the no_ckpt loop of the same repeat (ratio in ``extra``);
* ``blocked``: per checkpoint, ``waited_prev`` + seconds inside ``async_save`` + the loop's own
  wait for staging before ``optimizer.step()`` (``step_wait``: stock's ZOC protocol waits on
  ``staging_completion``; fastdcp's guard waits in an optimizer step pre-hook);
* ``staged``: from the call until ``response.staging_completion`` resolved (= the call when
  ``async_save`` returns a plain future); ``durable``: until the upload future resolved. Both
  are taken by done-callbacks, so measuring never blocks the loop;
* peak host memory: ``/proc/self/status`` VmHWM after resetting it (``5`` into
  ``/proc/self/clear_refs``) before the loop, on ``loop`` rows (``extra.peak_host_bytes``, and
  ``peak_above_start_bytes`` above the RSS the loop started with).

Verification: right before each ``async_save`` (clock paused; no upload is in flight then) the
exact state is copied. The copies go to files written with write(), so they count in no
process's resident memory and do not inflate the peak measured: on /dev/shm when a loop's copies
fit in memory, else in the target directory, fsynced while the clock is stopped (in-process
clones, with a note, where neither works). After the loop every checkpoint is loaded with stock ``dcp.load`` +
``FileSystemReader`` into a fresh, scribbled destination and compared bit-exact with its copy
(every tensor including BatchNorm running stats and AdamW ``step``, every object); a mismatch
raises VerificationError. Checkpoints and copies are deleted after verifying.

Systems (each only when available; otherwise a note says why):

* ``stock_default``: ``FileSystemWriter``, async_save's default staging (blocks for the copy);
* ``stock_zoc``: ``FileSystemWriter`` + ``DefaultStager(StagingOptions(True, True, True, True))``
  (needs an accelerator); the loop waits on ``staging_completion`` before ``optimizer.step()``;
* ``fastdcp_blocking``: ``fastdcp.FastFileSystemWriter(path)`` (returns once staged);
* ``fastdcp_overlap``: ``FastFileSystemWriter(path, async_staging=True)`` with one
  ``fastdcp.guard(optimizer, model)`` for the whole loop (removed after it); the loop itself does
  not wait on staging;
* ``fastdcp_overlap_budget``: the same with ``snapshot_limit_bytes = --size / 4``: staging holds
  at most a quarter of the state; the rest is written from the live tensors before the guard lets
  the optimizer step (bounded host memory, paid for in step waits at storage speed).

The stock systems run when ``stock`` is among ``--systems``, the fastdcp ones when ``fastdcp``
is. A GPU variant (model on CUDA, ``config.device == "cuda"``) runs where CUDA is available.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from .config import fmt_size
from .host_peak import HostPeak
from .scenarios import Context, _async_kwargs, check
from .state import VerificationError, scribble

SCENARIO = "train_loop"
GROUP = "train"                  # directory under each target; removed by the runner afterwards
NO_CKPT = "no_ckpt"              # the same loop without checkpoints (the reference)
TRAIN_SYSTEMS = ("stock_default", "stock_zoc", "fastdcp_blocking", "fastdcp_overlap", "fastdcp_overlap_budget")
# fastdcp_overlap_budget's snapshot_limit_bytes, as a fraction of --size: bounded host memory, the
# rest of the state written from the live tensors while the guard holds the optimizer step
BUDGET_FRACTION = 4
SHM = "/dev/shm"
MIN_BATCH = 2                    # BatchNorm1d in training mode needs two samples
WARMUP_STEPS = 2                 # untimed steps at the start of every loop, before its clock starts


# --------------------------------------------------------------------------- the training step

def hidden_for(state_bytes: int) -> int:
    """Hidden size H (a multiple of 16) whose model + AdamW state is closest to `state_bytes`.

    Two MLP blocks (H -> 4H -> H) and a head (H -> H): 17 H^2 + 14 H parameters; fp32 weights
    plus AdamW's two fp32 moments make 12 bytes per parameter (the BatchNorm buffers and the
    per-parameter `step` tensors are negligible)."""
    per = lambda h: 12 * (17 * h * h + 14 * h)  # noqa: E731
    h = max(16, int(math.sqrt(max(state_bytes, 1) / 204.0)) // 16 * 16)
    return min((h, h + 16), key=lambda c: abs(per(c) - state_bytes))


def build_model(hidden: int) -> nn.Module:
    h = hidden
    return nn.Sequential(
        nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h),
        nn.BatchNorm1d(h),  # running_mean/var and num_batches_tracked change in every forward
        nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h),
        nn.Linear(h, h),
    )


MAX_BATCH = 4096  # samples per forward pass; beyond it a step takes several micro-batches


class SyntheticTraining:
    """Model, AdamW and a fixed batch: every step does the same matrix products."""

    def __init__(self, state_bytes: int, device: str = "cpu", seed: int = 0) -> None:
        self.device = device
        self.hidden = hidden_for(state_bytes)
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = build_model(self.hidden).to(device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self._gen = gen
        self.batch = 0
        self.micro_steps = 1  # forward/backward passes per step (gradient accumulation)
        self.set_batch(8)

    def set_batch(self, batch: int) -> None:
        self.batch = max(MIN_BATCH, int(batch))
        self.x = torch.randn(self.batch, self.hidden, generator=self._gen).to(self.device)
        self.y = torch.randn(self.batch, self.hidden, generator=self._gen).to(self.device)

    def forward_backward(self) -> None:
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        for _ in range(self.micro_steps):
            self.forward_backward()
        self.optimizer_step()
        self.sync()

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optim"} as torchtitan builds it: FQN-keyed, the live tensors (no copies)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def warm_up(self, n: int) -> float:
        """`n` untimed steps (the same work as a loop's steps), so that the loop timed next does not
        start cold; returns their seconds."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        return time.perf_counter() - t0

    def timed_steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            out.append(time.perf_counter() - t0)
        return out

    def calibrate(self, target_s: float, batch: int | None = None) -> float:
        """Warm-up steps (they create AdamW's state) and the batch for ~`target_s` per step:
        the step time is fitted as fixed + per-sample cost from two batches (the fastest of
        a few steps each: other processes only ever make a step slower). Returns the median
        step time at the chosen batch."""
        if batch is None:
            b0, b1 = 16, 128  # far apart: the fit is then less sensitive to a disturbed step
            self.set_batch(b0)
            t0 = min(self.timed_steps(4))
            self.set_batch(b1)
            t1 = min(self.timed_steps(4))
            per = (t1 - t0) / (b1 - b0)
            if per <= 0:  # noise beat the fit: keep the larger batch
                batch = b1
            else:
                batch = int(round((target_s - (t0 - b0 * per)) / per))
            batch = max(MIN_BATCH, min(MAX_BATCH, batch))
        self.set_batch(batch)
        step = statistics.median(self.timed_steps(3))
        if batch >= MAX_BATCH and step < 0.5 * target_s:
            # A fast device: the largest batch is still a short step, so a step accumulates
            # gradients over several micro-batches, as training with a large global batch does.
            self.micro_steps = max(1, min(1000, math.ceil(target_s / max(step, 1e-6))))
            step = statistics.median(self.timed_steps(3))
        return step

    def state_bytes(self) -> int:
        total = 0
        for _, v in _leaves(self.state_dict()):
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
        return total


# --------------------------------------------------------------------------- state walking

def _leaves(obj: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) of a nested dict/list state dict, in a stable order."""
    if isinstance(obj, dict):
        out: list[tuple[tuple, Any]] = []
        for k, v in obj.items():
            out += _leaves(v, path + (k,))
        return out
    if isinstance(obj, list):
        out = []
        for i, v in enumerate(obj):
            out += _leaves(v, path + (i,))
        return out
    return [(path, obj)]


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def flat(sd: Any) -> dict[str, Any]:
    return {_name(p): v for p, v in _leaves(sd)}


def _fresh_like(obj: Any) -> Any:
    """A load destination shaped like `obj`: new CPU tensors full of the scribble byte, None for
    every object (a load that skips an entry can never verify)."""
    if isinstance(obj, dict):
        return {k: _fresh_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh_like(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        t = torch.empty(obj.shape, dtype=obj.dtype)
        scribble({"t": t})
        return t
    return None


# --------------------------------------------------------------------------- verification copies

@dataclass
class Snapshot:
    """The exact state at one async_save call: tensors' bytes in a file (or in-process clones),
    objects deep-copied, the nested layout kept for building a load destination."""
    layout: Any                                   # the state dict with tensors as metadata
    file: str | None = None
    entries: list[tuple[str, torch.dtype, tuple, int]] = field(default_factory=list)  # name, dtype, shape, offset
    clones: dict[str, torch.Tensor] | None = None
    objects: dict[str, Any] = field(default_factory=dict)

    def expected(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.objects)
        if self.clones is not None:
            out.update(self.clones)
            return out
        with open(self.file, "rb") as f:
            for name, dtype, shape, offset in self.entries:
                t = torch.empty(shape, dtype=dtype)
                f.seek(offset)
                view = t.reshape(-1).view(torch.uint8).numpy()
                if f.readinto(memoryview(view)) != view.nbytes:
                    raise VerificationError(f"verification copy {self.file} is truncated at {name!r}")
                out[name] = t
        return out

    def destination(self) -> Any:
        return _fresh_like(self.layout)

    def discard(self) -> None:
        if self.file:
            try:
                os.unlink(self.file)
            except FileNotFoundError:
                pass
        self.clones = None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


class SnapshotStore:
    """Where the verification copies go. Files written with write() (resident in no process, so
    not part of the peak host memory measured): on /dev/shm when one loop's copies fit in half the
    available memory, else in the target directory `disk_dir`, fsynced while the loop's clock is
    stopped (so that no writeback of them runs behind the training steps). In-process clones
    (with a note) where neither is possible."""

    def __init__(self, ctx: Context, loop_bytes: int, disk_dir: str) -> None:
        self.root: str | None = None
        self.fsync = False
        avail = _mem_available()
        shm_ok = os.path.isdir(SHM) and os.access(SHM, os.W_OK)
        if shm_ok:
            st = os.statvfs(SHM)
            shm_ok = st.f_bavail * st.f_frsize > loop_bytes and (avail is None or 2 * loop_bytes < avail)
        if shm_ok:
            self.root = tempfile.mkdtemp(prefix="fastdcp_bench_train_copies_", dir=SHM)
        elif os.path.isdir(disk_dir) and os.access(disk_dir, os.W_OK):
            self.root = tempfile.mkdtemp(prefix="train_copies_", dir=disk_dir)
            self.fsync = True
            ctx.note(f"{SCENARIO}: the verification copies of a loop ({fmt_size(loop_bytes)}) go to {disk_dir}, "
                     f"fsynced while the loop's clock is stopped ({SHM} is missing or too small for them)")
        else:
            ctx.note(f"{SCENARIO}: nowhere to write the verification copies: they are in-process clones "
                     f"and the peak host memory of checkpointing loops includes them")
        self._n = 0

    def take(self, sd: dict[str, Any]) -> Snapshot:
        layout = _layout(sd)
        snap = Snapshot(layout=layout)
        tensors = []
        for path, v in _leaves(sd):
            if isinstance(v, torch.Tensor):
                tensors.append((_name(path), v.detach()))
            else:
                snap.objects[_name(path)] = copy.deepcopy(v)
        if self.root is None:
            snap.clones = {n: t.to("cpu", copy=True) for n, t in tensors}
            return snap
        self._n += 1
        snap.file = os.path.join(self.root, f"copy{self._n}.bin")
        offset = 0
        with open(snap.file, "wb") as f:
            for name, t in tensors:
                c = t.cpu().contiguous() if t.device.type != "cpu" or not t.is_contiguous() else t
                f.write(memoryview(c.reshape(-1).view(torch.uint8).numpy()))
                snap.entries.append((name, t.dtype, tuple(t.shape), offset))
                offset += c.numel() * c.element_size()
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return snap

    def close(self) -> None:
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)


def _layout(obj: Any) -> Any:
    """The nested structure of a state dict with every tensor as a meta tensor (shape, dtype)."""
    if isinstance(obj, dict):
        return {k: _layout(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_layout(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    return None


# --------------------------------------------------------------------------- other processes

def _user_ticks() -> tuple[int, int] | None:
    """(user ticks of the whole machine, user ticks of this process), from /proc."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle ...
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]) + int(fields[2]), int(own[11])  # machine user + nice, own utime
    except (OSError, IndexError, ValueError):
        return None


class OthersCPU:
    """CPU seconds that other processes spent in user space over a region: on a shared machine
    they slow a loop down whatever it does, so every loop records how much of the CPUs they took
    (kernel time is left out: the page-cache writeback of our own checkpoints is kernel time)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._ticks = _user_ticks()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._ticks = _user_ticks()

    def stop(self) -> tuple[float, float] | None:
        """(seconds of other processes' user CPU, their share of all CPUs over the region)."""
        end = _user_ticks()
        if end is None or self._ticks is None:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        others = max(0, (end[0] - self._ticks[0]) - (end[1] - self._ticks[1])) / hz
        wall = time.perf_counter() - self._t0
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # Ticks count in 1/HZ steps read at other moments than the clock: a fully busy machine can
        # read a tick over 100%.
        return others, min(1.0, others / (wall * cpus)) if wall > 0 else 0.0


# --------------------------------------------------------------------------- systems

@dataclass
class LoopSystem:
    name: str
    make_writer: Callable[[str], Any]
    description: dict[str, Any] = field(default_factory=dict)
    make_stager: Callable[[], Any] | None = None      # stock_zoc: async_stager= (one per loop)
    wait_staging_before_step: bool = False             # stock_zoc's protocol
    guard: Callable[[Any, Any], Any] | None = None     # fastdcp_overlap: fastdcp.guard
    release_pool: Callable[[], None] | None = None     # fastdcp: empty the staging pool between loops
    optional: bool = False  # a failure (not a verification failure) leaves it out with a note
    # async_save's keyword arguments; None: a single process's (thread executor, no_dist where
    # supported); a multi-rank loop passes {} so that the save runs over the default group
    save_kwargs: dict[str, Any] | None = None


def _zoc_unavailable() -> str | None:
    """Why stock's zero-overhead staging cannot run here (tried on a tiny state), or None."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if torch.cuda.is_available():
        return None
    path = tempfile.mkdtemp(prefix="fastdcp_bench_zoc_probe_")
    stager = None
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stager = DefaultStager(StagingOptions(True, True, True, True))
            resp = dcp.async_save({"probe": torch.zeros(4)}, checkpoint_id=path,
                                  storage_writer=FileSystemWriter(path), async_stager=stager,
                                  **_async_kwargs("thread"))
            resp.staging_completion.result()
            resp.upload_completion.result()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if stager is not None:
            try:
                stager.close()
            except Exception:
                pass
        shutil.rmtree(path, ignore_errors=True)


def loop_systems(ctx: Context) -> list[LoopSystem]:
    """The train_loop systems that can run here, in TRAIN_SYSTEMS order; a note for each one
    left out."""
    names = {s.name for s in ctx.systems}
    out: list[LoopSystem] = []
    if "stock" in names:
        out.append(LoopSystem("stock_default", lambda p: FileSystemWriter(p),
                              {"writer": "FileSystemWriter(path)", "staging": "async_save default "
                               "(the writer's BlockingAsyncStager: returns once copied)"}))
        why = _zoc_unavailable()
        if why is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            out.append(LoopSystem(
                "stock_zoc", lambda p: FileSystemWriter(p),
                {"writer": "FileSystemWriter(path)",
                 "staging": "async_stager=DefaultStager(StagingOptions(True, True, True, True)), one per "
                            "loop; the loop waits on staging_completion before optimizer.step()"},
                make_stager=lambda: DefaultStager(StagingOptions(True, True, True, True)),
                wait_staging_before_step=True, optional=True))
        else:
            ctx.note(f"{SCENARIO}: stock_zoc not measured: DefaultStager(StagingOptions(True, True, True, "
                     f"True)) needs an accelerator (pinned memory, non-blocking copies); here it fails "
                     f"with {why}")
    if "fastdcp" in names:
        fast = next(s for s in ctx.systems if s.name == "fastdcp")
        if fast.standin:
            out.append(LoopSystem("fastdcp_blocking", fast.make_writer,
                                  {"writer": "STAND-IN FileSystemWriter(path)"}))
            ctx.note(f"{SCENARIO}: fastdcp_overlap not measured: fastdcp is a stand-in")
            return out
        import fastdcp

        release = getattr(fastdcp, "release_staging", None)
        pool = "fastdcp.release_staging() before and after each loop" if release else "none"
        out.append(LoopSystem("fastdcp_blocking", lambda p: fastdcp.FastFileSystemWriter(p),
                              {"writer": "fastdcp.FastFileSystemWriter(path)",
                               "staging": "default (returns once staged)", "staging_pool": pool},
                              release_pool=release))
        params = inspect.signature(fastdcp.FastFileSystemWriter).parameters
        missing = [n for n, ok in (("fastdcp.guard", hasattr(fastdcp, "guard")),
                                   ("FastFileSystemWriter(async_staging=)", "async_staging" in params))
                   if not ok]
        if missing:
            ctx.note(f"{SCENARIO}: fastdcp_overlap not measured: this fastdcp has no {' / '.join(missing)}")
        else:
            out.append(LoopSystem(
                "fastdcp_overlap", lambda p: fastdcp.FastFileSystemWriter(p, async_staging=True),
                {"writer": "fastdcp.FastFileSystemWriter(path, async_staging=True)",
                 "guard": "fastdcp.guard(optimizer, model) once before the loop, .remove() after",
                 "staging_pool": pool},
                guard=fastdcp.guard, release_pool=release, optional=True))
            if "snapshot_limit_bytes" in params:
                budget = ctx.cfg.size // BUDGET_FRACTION
                out.append(LoopSystem(
                    "fastdcp_overlap_budget",
                    lambda p: fastdcp.FastFileSystemWriter(p, async_staging=True, snapshot_limit_bytes=budget),
                    {"writer": f"fastdcp.FastFileSystemWriter(path, async_staging=True, snapshot_limit_bytes={budget})",
                     "guard": "fastdcp.guard(optimizer, model) once before the loop, .remove() after",
                     "staging_pool": pool},
                    guard=fastdcp.guard, release_pool=release, optional=True))
    return out


# --------------------------------------------------------------------------- one loop

@dataclass
class CheckpointTiming:
    """One checkpoint of a loop; seconds, relative to the async_save call unless said otherwise."""
    index: int
    step: int
    path: str
    waited_prev: float = 0.0        # waiting for the previous upload at this checkpoint step
    in_call: float = 0.0            # inside dcp.async_save
    step_wait: float = 0.0          # waiting for staging before the optimizer steps that follow
    staged: float | None = None     # staging complete (staging_completion, else the call)
    durable: float | None = None    # upload future resolved
    _t0: float = 0.0
    # set by the done-callbacks: Future.result() returns before the completing thread has run
    # the callbacks, so the times are read only after these
    _staged_set: threading.Event = field(default_factory=threading.Event, repr=False)
    _durable_set: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait_times(self, timeout: float = 30.0) -> None:
        for name, ev in (("staged", self._staged_set), ("durable", self._durable_set)):
            if not ev.wait(timeout):
                raise RuntimeError(f"checkpoint {self.index}: no {name} time {timeout:.0f} s after the upload "
                                   f"future resolved (its {'staging_completion' if name == 'staged' else 'upload'} "
                                   f"future never completed)")

    @property
    def blocked(self) -> float:
        return self.waited_prev + self.in_call + self.step_wait


@dataclass
class LoopRun:
    system: str
    loop_seconds: float
    steps: int
    drain_seconds: float = 0.0
    peak_host_bytes: int = 0
    start_host_bytes: int = 0
    peak_method: str = "VmHWM"
    state_dict_seconds: float = 0.0     # get_state_dict per checkpoint, summed (in the loop time)
    copy_seconds: float = 0.0           # verification copies (excluded from the loop time)
    step_seconds: list[float] = field(default_factory=list)  # forward to optimizer step, per step
    others_cpu_seconds: float | None = None   # other processes' user CPU during the loop
    others_cpu_share: float | None = None     # ... as a share of all CPUs
    warmup_steps: int = 0                     # untimed steps before the loop's clock started
    warmup_seconds: float = 0.0
    checkpoints: list[CheckpointTiming] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)


class _Checkpointer:
    """Drives one system's async saves in a loop: the writer per checkpoint, the wait for the
    previous upload, stock's ZOC wait before the optimizer step, fastdcp's guard."""

    def __init__(self, system: LoopSystem, trainer: SyntheticTraining) -> None:
        self.system = system
        self.trainer = trainer
        self.kwargs = _async_kwargs("thread") if system.save_kwargs is None else dict(system.save_kwargs)
        self.stager = system.make_stager() if system.make_stager else None
        self.guard = system.guard(trainer.optimizer, trainer.model) if system.guard else None
        self.pending: tuple[CheckpointTiming, Any] | None = None  # (timing, response)
        self.last: CheckpointTiming | None = None
        self._t_step = 0.0
        # Registered after the guard's own pre-hook, so it runs after it: the time from calling
        # optimizer.step() to here is what the guard waited for staging.
        self._probe = trainer.optimizer.register_step_pre_hook(self._pre_step) if self.guard else None

    def _pre_step(self, *_: Any) -> None:
        if self.last is not None:
            self.last.step_wait += time.perf_counter() - self._t_step

    def before_optimizer_step(self) -> None:
        self._t_step = time.perf_counter()
        if self.system.wait_staging_before_step and self.pending is not None:
            timing, resp = self.pending
            staging = getattr(resp, "staging_completion", None)
            if staging is not None and not staging.done():
                t0 = time.perf_counter()
                staging.result()
                timing.step_wait += time.perf_counter() - t0

    def wait_previous(self) -> float:
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        timing, resp = self.pending
        getattr(resp, "upload_completion", resp).result()
        dt = time.perf_counter() - t0
        timing.wait_times()
        self.pending = None
        return dt

    def save(self, sd: dict[str, Any], timing: CheckpointTiming) -> None:
        def done(attr: str) -> Callable[[Future], None]:
            def cb(_: Future) -> None:  # runs in the thread that completes the future
                setattr(timing, attr, time.perf_counter() - timing._t0)
                getattr(timing, f"_{attr}_set").set()
            return cb

        kw = dict(self.kwargs)
        if self.stager is not None:
            kw["async_stager"] = self.stager
        timing._t0 = time.perf_counter()
        resp = dcp.async_save(sd, checkpoint_id=timing.path, storage_writer=self.system.make_writer(timing.path),
                              **kw)
        timing.in_call = time.perf_counter() - timing._t0
        staging = getattr(resp, "staging_completion", None)
        if staging is None:  # a plain future: the call returned with the state staged
            timing.staged = timing.in_call
            timing._staged_set.set()
        else:
            staging.add_done_callback(done("staged"))
        getattr(resp, "upload_completion", resp).add_done_callback(done("durable"))
        self.pending = (timing, resp)
        self.last = timing

    def close(self) -> None:
        if self._probe is not None:
            self._probe.remove()
        if self.guard is not None:
            self.guard.remove()
        if self.stager is not None:
            self.stager.close()


def run_loop(trainer: SyntheticTraining, steps: int, every: int, system: LoopSystem | None,
             root: str, snapshots: SnapshotStore | None, warmup_steps: int = WARMUP_STEPS) -> LoopRun:
    """`warmup_steps` untimed steps, then N timed steps; with a system, an async_save after every
    `every`-th timed step into root/ckpt<i>."""
    run = LoopRun(system=system.name if system else NO_CKPT, loop_seconds=0.0, steps=steps)
    # Every loop starts warm, the first of a run too: without these, the first loop of a one-repeat
    # tiered run (the reference without checkpoints) took 7.8 s, the checkpointing loops after it
    # 2.5-6.7 s, and every slowdown read negative.
    run.warmup_steps, run.warmup_seconds = warmup_steps, trainer.warm_up(warmup_steps)
    ckpt = _Checkpointer(system, trainer) if system else None
    peak = HostPeak()
    try:
        trainer.sync()
        peak.start()
        others = OthersCPU()
        others.start()
        paused = 0.0
        t_start = time.perf_counter()
        for s in range(1, steps + 1):
            t_step = time.perf_counter()
            for _ in range(trainer.micro_steps):
                trainer.forward_backward()
            if ckpt:
                ckpt.before_optimizer_step()
            trainer.optimizer_step()
            trainer.sync()
            run.step_seconds.append(time.perf_counter() - t_step)
            if ckpt is None or s % every:
                continue
            timing = CheckpointTiming(index=len(run.checkpoints), step=s,
                                      path=os.path.join(root, f"ckpt{len(run.checkpoints)}"))
            timing.waited_prev = ckpt.wait_previous()
            t_sd = time.perf_counter()
            sd = trainer.state_dict()
            run.state_dict_seconds += time.perf_counter() - t_sd
            if snapshots is not None:
                t_copy = time.perf_counter()  # the clock stops: no upload is in flight now
                run.snapshots.append(snapshots.take(sd))
                trainer.sync()
                dt = time.perf_counter() - t_copy
                paused += dt
                run.copy_seconds += dt
            ckpt.save(sd, timing)
            run.checkpoints.append(timing)
        if ckpt is not None:
            run.drain_seconds = ckpt.wait_previous()
        trainer.sync()
        run.loop_seconds = time.perf_counter() - t_start - paused
        taken = others.stop()
        if taken is not None:
            run.others_cpu_seconds, run.others_cpu_share = taken
        run.peak_host_bytes = peak.stop()
        run.start_host_bytes, run.peak_method = peak.start_bytes, peak.method
    finally:
        if ckpt is not None:
            ckpt.close()
    return run


# --------------------------------------------------------------------------- verification

def verify_loop(ctx: Context, system: LoopSystem, run: LoopRun, what: str) -> None:
    """Load every checkpoint of `run` with stock dcp.load + FileSystemReader into a fresh
    destination and compare it bit-exact with the copy taken at its async_save call."""
    for timing, snap in zip(run.checkpoints, run.snapshots):
        dest = snap.destination()
        dcp.load(dest, storage_reader=FileSystemReader(timing.path), no_dist=True)
        check(ctx, system, snap.expected(), flat(dest), f"{what}/ckpt{timing.index}@step{timing.step}")
        snap.discard()
        shutil.rmtree(timing.path, ignore_errors=True)


# --------------------------------------------------------------------------- the scenario

def _record(ctx: Context, where: str, device: str, run: LoopRun, base: LoopRun | None,
            system: LoopSystem | None, nbytes: int, extra_loop: dict[str, Any]) -> None:
    rec = ctx.recorder
    descr = system.description if system else {"what": "the same loop without checkpoints"}
    cfg = lambda metric: {"device": device, "metric": metric}  # noqa: E731
    rec.add(SCENARIO, where, run.system, cfg("loop"), nbytes, run.loop_seconds, None, descr,
            peak_host_bytes=run.peak_host_bytes, start_host_bytes=run.start_host_bytes,
            peak_above_start_bytes=run.peak_host_bytes - run.start_host_bytes, peak_method=run.peak_method,
            drain_seconds=run.drain_seconds, checkpoints=len(run.checkpoints), step_seconds=run.step_seconds,
            state_dict_seconds=run.state_dict_seconds, copy_seconds=run.copy_seconds,
            others_cpu_seconds=run.others_cpu_seconds, others_cpu_share=run.others_cpu_share,
            warmup_steps=run.warmup_steps, warmup_seconds=run.warmup_seconds, **extra_loop)
    if base is None or system is None:
        return
    rec.add(SCENARIO, where, run.system, cfg("slowdown"), nbytes, run.loop_seconds - base.loop_seconds, None,
            descr, ratio=run.loop_seconds / base.loop_seconds, baseline_seconds=base.loop_seconds)
    for c in run.checkpoints:
        rec.add(SCENARIO, where, run.system, cfg("blocked"), nbytes, c.blocked, None, descr,
                in_call=c.in_call, waited_prev=c.waited_prev, step_wait=c.step_wait, step=c.step)
        rec.add(SCENARIO, where, run.system, cfg("waited_prev"), nbytes, c.waited_prev, None, descr)
        rec.add(SCENARIO, where, run.system, cfg("step_wait"), nbytes, c.step_wait, None, descr)
        rec.add(SCENARIO, where, run.system, cfg("staged"), nbytes, c.staged, None, descr)
        rec.add(SCENARIO, where, run.system, cfg("durable"), nbytes, c.durable, None, descr)


def _log_run(ctx: Context, where: str, run: LoopRun, base: LoopRun | None, rep: int, repeats: int) -> None:
    msg = (f"{SCENARIO} {where:<4} {run.system:<16} {rep + 1}/{repeats}: loop {run.loop_seconds:7.3f} s")
    if base is not None and run.checkpoints:
        blocked = [c.blocked for c in run.checkpoints]
        msg += (f" ({100 * (run.loop_seconds / base.loop_seconds - 1):+6.1f}%), blocked max "
                f"{1e3 * max(blocked):7.1f} ms (waited_prev max {1e3 * max(c.waited_prev for c in run.checkpoints):.1f}"
                f" ms), staged {1e3 * statistics.median(c.staged for c in run.checkpoints):6.1f} ms, durable "
                f"{statistics.median(c.durable for c in run.checkpoints):6.3f} s, drain {run.drain_seconds:.3f} s")
    above = (run.peak_host_bytes - run.start_host_bytes) / 2**30
    msg += f", peak host {run.peak_host_bytes / 2**30:.2f} GiB (+{above:.2f})"
    if run.others_cpu_share is not None:
        msg += f"; other processes took {100 * run.others_cpu_share:.0f}% of the CPUs"
    ctx.progress(msg)


BUSY_SHARE = 0.05  # other processes above this share of the CPUs during a loop: say so


def _note_interference(ctx: Context, device: str) -> None:
    shares = [s for r in ctx.recorder.results
              if r.scenario == SCENARIO and r.config.get("device") == device and r.config["metric"] == "loop"
              for s in r.extra.get("others_cpu_share", []) if s is not None]
    if shares and max(shares) > BUSY_SHARE:
        ctx.note(f"{SCENARIO} {device}: other processes took up to {100 * max(shares):.0f}% of the CPUs during "
                 f"the loops (median {100 * statistics.median(shares):.0f}%): loop times and slowdowns are "
                 f"disturbed; the best-of column is the less disturbed estimate, a quiet machine the real one")


def _run_device(ctx: Context, wheres: list[str], device: str, systems: list[LoopSystem]) -> None:
    c = ctx.cfg
    steps, every = c.train_steps, c.train_every
    trainer = SyntheticTraining(c.size, device)
    step_s = trainer.calibrate(c.train_step_ms / 1e3, c.train_batch)
    nbytes = trainer.state_bytes()
    ctx.progress(f"{SCENARIO} {device}: hidden {trainer.hidden}, state {fmt_size(nbytes)} (model + AdamW), "
                 f"batch {trainer.batch} x {trainer.micro_steps} micro-batches, step {1e3 * step_s:.1f} ms; "
                 f"{steps} steps, async_save every {every} ({steps // every} checkpoints) per loop")
    if steps // every < 1:
        ctx.note(f"{SCENARIO}: --train-steps {steps} < --train-every {every}: the loops take no checkpoint")
    if not c.train_batch and not (0.5 * c.train_step_ms <= 1e3 * step_s <= 1.5 * c.train_step_ms):
        ctx.note(f"{SCENARIO} {device}: a step takes {1e3 * step_s:.0f} ms at batch {trainer.batch} (target "
                 f"{c.train_step_ms:.0f} ms; AdamW over {fmt_size(nbytes)} alone may take longer)")
    extra_loop = {"batch": trainer.batch, "micro_steps": trainer.micro_steps, "hidden": trainer.hidden,
                  "calibrated_step_seconds": step_s,
                  "steps": steps, "every": every}
    snapshots = SnapshotStore(ctx, (steps // every) * nbytes, ctx.targets[wheres[0]])
    live = list(systems)
    try:
        for where in wheres:
            for rep in range(c.repeats):
                base: LoopRun | None = None
                for system in [None, *list(live)]:
                    name = system.name if system else NO_CKPT
                    root = os.path.join(ctx.targets[where], GROUP, device, name, f"rep{rep}")
                    if system is not None and system.release_pool:
                        system.release_pool()
                    os.sync()  # flush unrelated dirty pages (the last loop's rmtree) outside the loop
                    try:
                        run = run_loop(trainer, steps, every, system, root, snapshots if system else None)
                    except VerificationError:
                        raise
                    except Exception as exc:
                        if system is None or not system.optional:
                            raise
                        live.remove(system)
                        ctx.note(f"{SCENARIO}: {name} failed ({type(exc).__name__}: {exc}); left out")
                        shutil.rmtree(root, ignore_errors=True)
                        continue
                    finally:
                        if system is not None and system.release_pool:
                            system.release_pool()
                    if system is not None:
                        verify_loop(ctx, system, run, f"{SCENARIO}/{where}/{device}/{name}/rep{rep}")
                        shutil.rmtree(root, ignore_errors=True)
                    _record(ctx, where, device, run, base, system, nbytes, extra_loop)
                    _log_run(ctx, where, run, base, rep, c.repeats)
                    if system is None:
                        base = run
        _note_interference(ctx, device)
    finally:
        snapshots.close()
        del trainer
        if device == "cuda":
            torch.cuda.empty_cache()


def run_train_loop(ctx: Context, wheres: list[str]) -> None:
    systems = loop_systems(ctx)
    if not systems:
        ctx.note(f"{SCENARIO}: no system to measure (it runs stock_* with --systems stock and "
                 f"fastdcp_* with fastdcp)")
        return
    devices = ctx.cfg.train_devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if "cuda" in devices and not torch.cuda.is_available():
        ctx.note(f"{SCENARIO}: cuda left out: CUDA is not available")
        devices = [d for d in devices if d != "cuda"]
    for device in devices:
        _run_device(ctx, wheres, device, systems)
