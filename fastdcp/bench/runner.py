"""Entry point: parse options, set up targets, measure limits, run scenarios, report.

Exit status: 0 ok, 2 usage error, 3 a loaded state dict differed from what was saved,
4 fastdcp requested but not importable.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

from .config import ASYNC_SCENARIOS, BenchConfig, config_from_args, fmt_size
from .limits import measure_limits
from .machine import collect_machine
from .pagecache import choose_cold_method
from .floor import BASELINE_SYSTEMS
from .peers import prepare_peers, resolve_peers
from .report import (concurrency_lines, header_lines, peer_lines, print_report, reader_stats_lines,
                     run_description, sort_for_report, storage_lines, summary_lines, table_lines,
                     train_loop_lines, write_json, write_plot)
from .reshard import run_reshard
from .results import Recorder, finalize
from .concurrency import run_concurrency
from .convert import run_convert
from .object_storage import run_azure, run_s3
from .read_once import run_read_once
from .replicas import GROUP as REPLICAS_GROUP, replicas_lines, run_replicas
from .plan_scale import run_plan_scale
from .plan_scale_report import plan_scale_lines
from .scenarios import SINGLE_PROCESS, Context, Progress, run_checkpoint_load, run_small
from .training_loop import run_train_loop
from .tiered import GROUP as TIERED_GROUP, run_tiered, tiered_lines
from .box_copy import run_box_copy
from .raw_io import RAW_IO
from .storages import MountedStorage, StorageUnavailable, image_bytes_for, mount_storage
from .state import EXIT_VERIFY, VerificationError
from .systems import FastDCPUnavailable, fastdcp_build_info, resolve_systems

EXIT_OK, EXIT_USAGE, EXIT_NO_FASTDCP = 0, 2, 4  # EXIT_VERIFY (3): .state
SHM = "/dev/shm"
_NO_LOCAL_STORAGE = frozenset({"s3", "azure", "read_once", "plan_scale", "box_copy"})

# Every single-process scenario by name: scenarios.py's, and the modules built on it.
SCENARIO_RUNNERS = {**SINGLE_PROCESS, "train_loop": run_train_loop, "concurrency": run_concurrency,
                    "convert": run_convert, "plan_scale": run_plan_scale, "box_copy": run_box_copy,
                    "s3": run_s3, "azure": run_azure, "read_once": run_read_once, "tiered": run_tiered,
                    "replicas": run_replicas}


def _banner(lines: list[str]) -> None:
    bar = "!" * 78
    print("\n".join([bar, *lines, bar]), file=sys.stderr, flush=True)


class Targets:
    """Temp directories we own on each storage target, and the storages mounted for the run
    (storages.py); all removed on close(). `skipped`: storages asked for that could not be made."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.paths: dict[str, str] = {}
        self.mounted: dict[str, MountedStorage] = {}
        self.skipped: dict[str, str] = {}
        self._made_parent: str | None = None
        parent = os.path.abspath(cfg.dir or os.path.join(os.getcwd(), "bench_out"))
        if not os.path.isdir(parent):
            os.makedirs(parent)
            self._made_parent = parent
        self.paths["dir"] = tempfile.mkdtemp(prefix="fastdcp_bench_", dir=parent)
        if cfg.shm and os.path.isdir(SHM) and os.access(SHM, os.W_OK):
            self.paths["shm"] = tempfile.mkdtemp(prefix="fastdcp_bench_", dir=SHM)
        checkpoints = len(cfg.systems) + len(cfg.peers) + 1
        try:
            for name in cfg.storages:
                try:
                    storage = mount_storage(name, parent, image_bytes_for(cfg.size, checkpoints, cfg.probe_bytes))
                except StorageUnavailable as e:
                    self.skipped[name] = str(e)
                    continue
                self.mounted[name] = storage
                self.paths[name] = tempfile.mkdtemp(prefix="fastdcp_bench_", dir=storage.path)
        except BaseException:
            self.close()
            raise

    def describe(self) -> list[str]:
        """One line per mounted storage, and one per storage skipped, saying why."""
        return ([f"storage {n}: {s.description}" for n, s in self.mounted.items()]
                + [f"storage {n} skipped: {why}" for n, why in self.skipped.items()])

    def close(self, keep: bool = False) -> None:
        """Remove our directories (with `keep`, only those on mounted storages, which go) and take
        the mounted storages down."""
        for where, p in self.paths.items():
            if not keep or where in self.mounted:
                shutil.rmtree(p, ignore_errors=True)
        for name, storage in self.mounted.items():
            for error in storage.close():
                print(f"fastdcp.bench: could not take down storage {name}: {error}", file=sys.stderr)
        self.mounted = {}
        if self._made_parent and not keep:
            try:
                os.rmdir(self._made_parent)
            except OSError:
                pass


def _memory_note(cfg: BenchConfig, ctx: Context) -> None:
    """Warn when the state (source + destination) and tmpfs checkpoints may not fit in RAM."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    need = 2 * cfg.size + ((len(cfg.systems) + len(ctx.peers)) * cfg.size if "shm" in ctx.targets else 0)
    if need > 0.9 * avail:
        ctx.note(f"--size {fmt_size(cfg.size)} needs about {fmt_size(need)} of RAM (state, load target"
                 f"{', tmpfs checkpoints' if 'shm' in ctx.targets else ''}); {fmt_size(avail)} available")


def _note_io_modes(ctx: Context, targets: dict[str, str]) -> None:
    """Which write and cold-read mode fastdcp learnt per target (fastdcp.io.write_mode, read_mode),
    with both modes' GiB/s (medians of the timed runs of this run)."""
    from fastdcp.io.read_mode import chosen_read_modes
    from fastdcp.io.write_mode import chosen_write_modes

    for op, chosen, runs in (("write", chosen_write_modes(), "saves"), ("cold-read", chosen_read_modes(), "cold loads")):
        for directory, mode in chosen.items():
            where = next((w for w, root in targets.items() if directory.startswith(root)), directory)
            speeds = ", ".join(f"{name} {rate:.2f} GiB/s" for name, rate in (("O_DIRECT", mode.direct_gibps),
                                                                              ("buffered", mode.buffered_gibps))
                               if rate is not None)
            ctx.note(f"fastdcp {op} mode on {where}: {'O_DIRECT' if mode.direct else 'buffered'} ({mode.reason}"
                     + (f"; {runs} of this run: {speeds}, medians" if speeds else "") + ")")


def _read_limit(limits: object, where: str) -> float | None:
    storage = getattr(limits, "storage", None) or {}
    return storage[where].read_gibps if where in storage else None


def _release(ctx: Context, group: str) -> None:
    for root in ctx.targets.values():
        shutil.rmtree(os.path.join(root, group), ignore_errors=True)


def _run(cfg: BenchConfig, ctx: Context) -> int:
    c = cfg
    wheres = list(ctx.targets)
    for i, scen in enumerate(c.scenarios):
        later = c.scenarios[i + 1:]
        if c.checkpoint:
            run_checkpoint_load(ctx, c.checkpoint, "dir")
            break
        if scen == "reshard":
            if not any(s in later for s in ("load", "gpu_load")):
                _release(ctx, "ckpt")  # tmpfs space for the resharding checkpoints
            ctx.release_main_state()  # the ranks build their own shards; free the parent's copy
            run_reshard(ctx, [w for w in c.reshard_wheres if w in ctx.targets] or ["dir"])
            _release(ctx, "reshard")
        elif scen == "small":
            run_small(ctx, [w for w in c.small_wheres if w in ctx.targets] or ["dir"])
            _release(ctx, "small")
        elif scen == "train_loop":
            SCENARIO_RUNNERS[scen](ctx, [w for w in c.train_wheres if w in ctx.targets] or ["dir"])
            _release(ctx, "train")
        elif scen == "tiered":
            SCENARIO_RUNNERS[scen](ctx, ["dir"])  # the shared tier: a directory on the disk
            _release(ctx, TIERED_GROUP)
        elif scen == "replicas":
            SCENARIO_RUNNERS[scen](ctx, ["dir"])  # the shared tier: a directory on the disk
            _release(ctx, REPLICAS_GROUP)
        elif scen in ASYNC_SCENARIOS:
            SCENARIO_RUNNERS[scen](ctx, [w for w in c.async_wheres if w in ctx.targets] or ["dir"])
            _release(ctx, "async")
        else:
            SCENARIO_RUNNERS[scen](ctx, wheres)
            if scen == "gpu_save":
                _release(ctx, "gpu")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(argv)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
    progress = Progress()
    system_notes: list[str] = []
    try:
        systems = resolve_systems(cfg.systems, cfg.standin, notes=system_notes)
    except FastDCPUnavailable as e:
        _banner(["BENCHMARK NOT RUN: fastdcp is not importable", str(e)])
        return EXIT_NO_FASTDCP
    peers = resolve_peers(cfg.peers, notes=system_notes) if any(
        s in cfg.scenarios for s in ("save", "load")) else []
    for n in system_notes:
        progress(f"NOTE: {n}")
    cfg.systems = [s.name for s in systems]
    if not systems:
        print("error: none of the requested systems can run", file=sys.stderr)
        return EXIT_USAGE
    if cfg.checkpoint and not os.path.isfile(os.path.join(cfg.checkpoint, ".metadata")):
        print(f"error: {cfg.checkpoint} is not a DCP checkpoint (no .metadata)", file=sys.stderr)
        return EXIT_USAGE
    standin = any(s.standin for s in systems)
    if standin:
        _banner(["'fastdcp' IS A STAND-IN: stock classes (FASTDCP_BENCH_STANDIN is set)"])
    targets = Targets(cfg)
    try:
        progress(f"systems {','.join(cfg.systems)}; peers {','.join(p.name for p in peers) or 'none'}; scenarios {','.join(cfg.scenarios)}; "
                 f"size {fmt_size(cfg.size)}; repeats {cfg.repeats}; targets "
                 + ", ".join(f"{w}={p}" for w, p in targets.paths.items()))
        facts_targets = dict(targets.paths)
        if cfg.checkpoint:
            facts_targets["checkpoint"] = os.path.abspath(cfg.checkpoint)
        uses_fastdcp = any(n.startswith("fastdcp") for n in cfg.systems)
        fast = ({"standin": True} if standin else fastdcp_build_info()) if uses_fastdcp else None
        machine = collect_machine(facts_targets, extra={"fastdcp": fast})
        cold = choose_cold_method(cfg.cold_method)
        # Scenarios that never touch the local storages need no probe of them (minutes at 1 GiB).
        probed = {} if set(cfg.scenarios) <= _NO_LOCAL_STORAGE else targets.paths
        limits = measure_limits(probed, cfg.probe_bytes, cfg.probe_configs, cfg.memcpy_bytes,
                                cfg.probe_method, progress, cold)
        ctx = Context(cfg=cfg, systems=systems, targets=targets.paths, recorder=Recorder(),
                      progress=progress, cold_method=cold, notes=list(system_notes), limits=limits)
        _memory_note(cfg, ctx)
        for line in targets.describe():
            ctx.note(line)
        if cold is None:
            ctx.note("no way to make the page cache cold here: loads are warm only")
        elif cold != "drop_caches" and cfg.cold_method == "auto":
            ctx.note("drop_caches not permitted: cold = posix_fadvise(DONTNEED) per checkpoint file")
        try:
            if peers:
                progress(f"peers {','.join(p.name for p in peers)}: untimed warm-up saves")
                ctx.peers = prepare_peers(peers, targets.paths["dir"], ctx.note)
            cfg.peers = [p.name for p in ctx.peers]
            try:
                _run(cfg, ctx)
            finally:
                ctx.close_raw_io()
            if uses_fastdcp and not standin:
                _note_io_modes(ctx, targets.paths)
        except VerificationError as e:
            _banner(["BENCHMARK FAILED: a loaded state dict is NOT bit-exact with what was saved", str(e)])
            return EXIT_VERIFY
        order = [*cfg.systems, *cfg.peers, RAW_IO, *BASELINE_SYSTEMS]
        results = sort_for_report(finalize(ctx.recorder.results, limits), order)
        lines = header_lines(machine, limits, cold, ctx.notes, standin)
        print_report(["", *lines, "", *table_lines(results), "", *summary_lines(results), "",
                      *peer_lines(results), "", *storage_lines(results, limits), "",
                      *reader_stats_lines(results), "", *train_loop_lines(results), "", *tiered_lines(results), "",
                      *replicas_lines(results, cfg.replicas_shared_mib_s, _read_limit(limits, "dir")), "",
                      *concurrency_lines(results), "", *plan_scale_lines(results)])
        if cfg.json_path:
            write_json(cfg.json_path, machine, limits, results, run_description(cfg), ctx.notes)
            progress(f"wrote {cfg.json_path}")
        if cfg.plot_path:
            err = write_plot(cfg.plot_path, results, limits, order)
            progress(f"plot: {err}" if err else f"wrote {cfg.plot_path}")
        progress(f"done in {progress.elapsed():.0f} s")
        return EXIT_OK
    finally:
        if cfg.keep:
            kept = [p for w, p in targets.paths.items() if w not in targets.mounted]
            progress(f"kept {', '.join(kept)}"
                     + (f" (storages {','.join(targets.mounted)} are taken down all the same)" if targets.mounted else ""))
        targets.close(keep=cfg.keep)
