"""Terminal table, JSON file and optional bar chart."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

from .limits import Limits
from .peers import PEER_SCENARIOS
from .plan_scale_report import plan_scale_json
from .replicas import replicas_rows
from .results import SYSTEM_SPECIFIC_KEYS, Result

LIMIT_POLICY = (
    "fraction of limit = median GiB/s / a limit measured in this run: save, small save, async "
    "'durable' and reshard save -> raw sequential write (incl. fsync) of that target (on tmpfs: "
    "writing a new file, i.e. page allocation + copy); cold load -> raw sequential read of that "
    "target; warm load, small load, async 'blocked' and loads from tmpfs (/dev/shm) -> memory "
    "copy (best method); gpu_save and gpu_async "
    "'durable' -> min(pinned D2H, write); gpu_async 'blocked' and 'staged' -> pinned D2H; gpu_load "
    "and reshard loads into GPU tensors -> min(pinned H2D, the CPU load's limit); box_copy -> "
    "device-to-device copy (bytes counted once) on the GPU, memory copy on the CPU.")
UNITS = ("GiB/s = tensor payload bytes / wall time (GiB = 2^30); median [min-max] over repeats. "
         "run=1st: a system's first save/load in that case (first use of its writer/planner "
         "objects), run=2nd+: the later ones.")
PEER_POLICY = (
    "peers: torch_save, safetensors, torchsnapshot, nvrx_async (nvidia-resiliency-ext as "
    "Megatron-Core drives it) run in the same interleaved save loop (and load loop where they "
    "have a load) on the same state, each save ending with the fsync of its files and directory; "
    "'fastdcp vs best peer' = fastdcp's median GiB/s / the fastest peer's, stock_best "
    "(FileSystemWriter(thread_count=4)) counting as a peer.")
BASELINE_POLICY = (
    "vs floor/bare: small -> median seconds above DCP's floor (dcp_floor: the same dcp.save/load "
    "with a storage that does no I/O, DCP's default planners; dcp_floor_planners: with "
    "fastdcp's planners, the floor of fastdcp_planners); async 'blocked' -> median seconds / "
    "the bare copy of the same bytes into preallocated host buffers (bare_copy).")


# Scenarios reported in a table of their own instead of the GiB/s table (their rows are times
# and slowdowns, for which GiB/s means nothing).
OWN_TABLE_SCENARIOS = ("train_loop", "tiered", "concurrency", "plan_scale", "replicas")


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def header_lines(machine: dict[str, Any], limits: Limits | None, cold_method: str | None,
                 notes: list[str], standin: bool) -> list[str]:
    m = machine
    lines = [
        f"machine: {m.get('cpu_model')} | {m.get('cpu_affinity') or m.get('cpu_count')} cores | "
        f"{m.get('ram_gib')} GiB RAM | kernel {m.get('kernel')} | torch {m.get('torch')} | "
        f"python {m.get('python')}",
    ]
    for g in m.get("gpus") or []:
        lines.append(f"gpu {g['index']}: {g['name']} {g['memory_gib']} GiB, PCIe {g.get('pcie_link')}")
    for w, t in (m.get("targets") or {}).items():
        lines.append(f"target {w:<10} {t['path']} ({t['fstype']} on {t['device']})")
    if limits:
        for w, s in limits.storage.items():
            modes = "; ".join(f"{op} by mode: " + ", ".join(f"{m} {v:.2f}" for m, v in sorted(d.items()))
                              for op, d in (("write", s.write_by_mode), ("read", s.read_by_mode)) if d)
            lines.append(f"limit  {w:<10} write {s.write_gibps:.2f} GiB/s, read {s.read_gibps:.2f} GiB/s "
                         f"[{s.method}; {s.bytes >> 20} MiB{'; ' + modes if modes else ''}], page-cache read "
                         f"{_f(s.page_cache_read_gibps)} GiB/s{' (' + s.note + ')' if s.note else ''}")
        meth = ", ".join(f"{k} {v:.2f}" for k, v in limits.memcpy_methods.items())
        lines.append(f"limit  memcpy     {limits.memcpy_gibps:.2f} GiB/s (best of: {meth})")
        if limits.h2d_gibps:
            lines.append(f"limit  pinned     H2D {limits.h2d_gibps:.2f} GiB/s, D2H {_f(limits.d2h_gibps)} GiB/s"
                         + (f", D2D {_f(limits.d2d_gibps)} GiB/s (bytes counted once)" if limits.d2d_gibps else ""))
    lines.append(f"cold page cache: {cold_method or 'not available: warm only'}"
                 + (" (global, after os.sync)" if cold_method == "drop_caches" else
                    " (per file, after os.sync)" if cold_method == "fadvise_dontneed" else ""))
    lines += [LIMIT_POLICY, UNITS, BASELINE_POLICY, PEER_POLICY]
    lines += [f"NOTE: {n}" for n in notes]
    if standin:
        lines.append("WARNING: 'fastdcp' IS A STAND-IN (stock FileSystemWriter/Reader): "
                     "FASTDCP_BENCH_STANDIN is set. These are NOT fastdcp numbers.")
    return lines


def table_lines(results: list[Result]) -> list[str]:
    cols = ["scenario", "config", "where", "system", "GiB/s median [min-max]", "s (med)",
            "vs stock", "vs best", "vs floor/bare", "of limit"]
    rows: list[list[str]] = []
    results = [r for r in results if r.scenario not in OWN_TABLE_SCENARIOS]
    if not results:
        return []
    for r in results:
        gib = "-" if r.gibps is None else f"{r.gibps:6.2f} [{r.gibps_min:.2f}-{r.gibps_max:.2f}]"
        lim = "-" if r.fraction_of_limit is None else f"{100 * r.fraction_of_limit:4.0f}% {(r.limit or '').removeprefix('case:')}"
        rows.append([r.scenario, r.label(), r.where, r.system, gib, _f(r.seconds_median, "{:.3f}"),
                     _f(r.ratio_vs_stock, "{:.2f}x"), _f(r.ratio_vs_stock_best, "{:.2f}x"),
                     _baseline_cell(r), lim])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    out = [fmt(cols), fmt(["-" * w for w in widths])]
    prev = None
    for r, row in zip(results, rows):
        case = r.case_key()
        if prev is not None and case != prev:
            out.append("")
        prev = case
        out.append(fmt(row))
    return out


def _baseline_cell(r: Result) -> str:
    if r.is_baseline:
        return "(baseline)"
    if r.baseline is None:
        return "-"
    if r.baseline == "bare_copy":
        return f"{r.ratio_to_baseline:.2f}x bare"
    return f"{r.above_baseline_seconds:+.3f} s"


def summary_lines(results: list[Result]) -> list[str]:
    """DCP's floor and each system's own cost above it (small); async blocked time vs the bare
    copy and the durable time."""
    out: list[str] = []
    cases: dict[tuple, dict[str, Result]] = {}
    for r in results:
        if r.config.get("ckpt_writer", r.system) == r.system:
            cases.setdefault(r.case_key(), {})[r.system] = r
    for case, by in cases.items():
        some = next(iter(by.values()))
        floor = by.get("dcp_floor")
        if floor is not None and floor.seconds_median:
            fp = by.get("dcp_floor_planners")
            fp_cache = f" [plan cache {', '.join(sorted(set(fp.extra['plan_cache'])))}]" \
                if fp is not None and fp.extra.get("plan_cache") else ""
            head = (f"  {some.scenario} {some.label()} {some.where}: DCP floor {floor.seconds_median:.3f} s"
                    + (f" (with fastdcp's planners {fp.seconds_median:.3f} s{fp_cache})"
                       if fp and fp.seconds_median else ""))
            parts = []
            stock_own = by["stock"].above_baseline_seconds if "stock" in by else None
            for name, r in by.items():
                if r.is_baseline or r.above_baseline_seconds is None:
                    continue
                txt = f"{name} {r.seconds_median:.3f} s = floor + {r.above_baseline_seconds:.3f} s"
                if r.extra.get("plan_cache"):
                    txt += f" [plan cache {', '.join(sorted(set(r.extra['plan_cache'])))}]"
                if r.baseline == "dcp_floor_planners":
                    txt += f" (its planners' floor; {r.seconds_median - floor.seconds_median:+.3f} s vs DCP's)"
                if stock_own and stock_own > 0 and name != "stock" and r.above_baseline_seconds > 0:
                    f = stock_own / r.above_baseline_seconds
                    txt += (f" ({f:.1f}x less own cost than stock)" if f >= 1 else
                            f" ({1 / f:.1f}x more own cost than stock)")
                parts.append(txt)
            out.append(head + "; " + "; ".join(parts))
        bare = by.get("bare_copy")
        if bare is not None and bare.seconds_median:
            durable = {n: cases.get(_with_phase(some, "durable"), {}).get(n) for n in by}
            parts = []
            for name, r in by.items():
                if r.is_baseline or r.ratio_to_baseline is None:
                    continue
                d = durable.get(name)
                parts.append(f"{name} blocked {r.seconds_median:.3f} s ({r.ratio_to_baseline:.1f}x bare)"
                             + (f", durable {d.seconds_median:.3f} s" if d and d.seconds_median else ""))
            out.append(f"  {some.scenario} {some.label()} {some.where}: bare copy {bare.seconds_median:.3f} s; "
                       + "; ".join(parts))
    return ["floors and baselines (medians):", *out] if out else []


def peer_lines(results: list[Result]) -> list[str]:
    """Per save/load case: each fastdcp system's median GiB/s against the fastest peer (stock_best
    counts as one), next to its ratio to stock, then every peer's median, fastest first."""
    out: list[str] = []
    cases: dict[tuple, list[Result]] = {}
    for r in results:
        if r.scenario in PEER_SCENARIOS and r.config.get("ckpt_writer", r.system) == r.system:
            cases.setdefault(r.case_key(), []).append(r)
    for rs in cases.values():
        some = rs[0]
        mine = [r for r in rs if r.system.startswith("fastdcp") and r.ratio_vs_best_peer is not None]
        peers = sorted((r for r in rs if r.is_peer and r.gibps), key=lambda r: -r.gibps)
        if not mine or not peers:
            continue
        parts = [f"{r.system} {r.gibps:.2f} GiB/s = {r.ratio_vs_best_peer:.2f}x best peer {r.best_peer} "
                 f"({r.best_peer_gibps:.2f} GiB/s)" + (f", {r.ratio_vs_stock:.2f}x stock"
                                                       if r.ratio_vs_stock is not None else "")
                 for r in mine]
        label = ",".join(f"{k}={v}" for k, v in some.config.items() if k not in SYSTEM_SPECIFIC_KEYS)
        out.append(f"  {some.scenario} {label} {some.where}: " + "; ".join(parts)
                   + " | peers: " + ", ".join(f"{r.system} {r.gibps:.2f}" for r in peers))
    return ["fastdcp vs best peer (median GiB/s; stock_best counts as a peer):", *out] if out else []


def _mode_name(io_mode: str) -> str:
    return io_mode.split(" ", 1)[0]   # "O_DIRECT (first save)" -> "O_DIRECT"


def storage_lines(results: list[Result], limits: Limits | None) -> list[str]:
    """Per storage (a markdown table): fastdcp's save and loads against the best peer and the
    limit; the I/O mode fastdcp used in its last run (and why) with its median GiB/s in each mode
    it ran in (fastdcp.io.write_mode / read_mode learn it from these runs); the limit of each mode
    the probe measured."""
    rows: list[str] = []
    # Every fastdcp writer/reader of a case learns from the same history (fastdcp_planners' runs
    # included), so the speed by mode comes from all of them.
    by_case: dict[tuple, dict[str, list[float]]] = {}
    for r in results:
        modes = r.extra.get("io_mode") or []
        if r.system.startswith("fastdcp") and len(modes) == len(r.seconds):
            by_mode = by_case.setdefault(r.case_key(), {})
            for mode, sec in zip(modes, r.seconds):
                by_mode.setdefault(_mode_name(mode), []).append(r.bytes / sec / (1 << 30))
    raw = {r.case_key(): r for r in results if r.system == "raw_io" and r.gibps}
    for r in results:
        if r.system != "fastdcp" or r.scenario not in ("save", "load") or r.gibps is None:
            continue
        if r.scenario == "load" and r.config.get("ckpt_writer") != "fastdcp":
            continue
        case = "save (fsync)" if r.scenario == "save" else f"load, {r.config.get('cache')}"
        modes = r.extra.get("io_mode") or []
        by_mode = by_case.get(r.case_key(), {})
        last = modes[-1] if modes else "-"
        runs = ", ".join(f"{m} {statistics.median(v):.2f} ({len(v)})" for m, v in sorted(by_mode.items())) or "-"
        storage = limits.storage.get(r.where) if limits else None
        per_mode = storage.write_by_mode if storage and r.scenario == "save" else (
            storage.read_by_mode if storage and r.config.get("cache") == "cold" else {})
        limit_modes = " / ".join(f"{m} {v:.2f}" for m, v in sorted(per_mode.items())) or (r.limit or "-")
        peer = f"{r.best_peer} {r.best_peer_gibps:.2f}" if r.best_peer else "-"
        same_loop = raw.get(r.case_key())
        rows.append(f"| {r.where} | {case} | **{r.gibps:.2f}** | {last} | {runs} | {peer} | "
                    f"{_f(r.ratio_vs_best_peer, '{:.2f}x')} | {limit_modes} | "
                    f"{_f(None if r.fraction_of_limit is None else 100 * r.fraction_of_limit, '{:.0f}%')} | "
                    + (f"{same_loop.gibps:.2f} | {100 * r.gibps / same_loop.gibps:.0f}% |" if same_loop else "- | - |"))
    if not rows:
        return []
    return ["per storage (fastdcp; GiB/s; mode = its last run's, with why; by mode: median (runs) of every "
            "fastdcp system's runs; limit: best probe run per mode, warm loads: memory copy; raw_io: the probe's best run again, inside "
            "the same interleaved loop):",
            "| storage | case | fastdcp | mode (last run) | fastdcp by mode | best peer | vs best peer | "
            "limit by mode | of best limit | raw_io, same loop | of raw_io |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def _with_phase(r: Result, phase: str) -> tuple:
    cfg = {k: v for k, v in r.config.items() if k not in SYSTEM_SPECIFIC_KEYS}
    cfg["phase"] = phase
    return (r.scenario, r.where, json.dumps(cfg, sort_keys=True, default=str))


def reader_stats_lines(results: list[Result]) -> list[str]:
    """The reader's own counters (last sample) for loads that report them (fastdcp)."""
    out: list[str] = []
    for r in results:
        samples = r.extra.get("reader_stats")
        if not samples:
            continue
        st = samples[-1]
        needed, read = st.get("bytes_needed", 0), st.get("bytes_read", 0)
        amp = f"{read / needed:.2f}x" if needed else "-"
        out.append(
            f"  {r.scenario} {r.label()} {r.where} {r.system}: read {read / 2**20:.1f} MiB for "
            f"{needed / 2**20:.1f} MiB needed ({amp}), {int(st.get('requests', 0))} requests, "
            f"plan {st.get('plan_seconds', 0):.3f}s, read {st.get('read_seconds', 0):.3f}s, "
            f"place {st.get('place_seconds', 0):.3f}s (bytes from header windows not counted)"
        )
    return ["reader stats (fastdcp FastFileSystemReader.last_stats, last repeat):", *out] if out else []


@dataclass
class TrainLoopRow:
    """One system of a train_loop case (target x device): medians over repeats (loop, slowdown)
    or over all checkpoints of all repeats (staged, durable), the mean and max of `blocked`,
    the highest peak of host memory."""
    where: str
    device: str
    system: str
    repeats: int
    checkpoints_per_loop: int
    steps: int | None
    every: int | None
    batch: int | None
    step_ms: float | None             # calibrated step time, before the loops
    loop_s: float
    slowdown_s: float | None = None
    slowdown_pct: float | None = None  # median of (loop / no_ckpt loop of the same repeat - 1)
    # fastest loop / fastest no_ckpt loop - 1: other processes only ever slow a loop down, so on a
    # busy machine the best-of ratio is the less disturbed estimate
    slowdown_best_pct: float | None = None
    blocked_ms_mean: float | None = None
    blocked_ms_max: float | None = None
    in_call_ms_max: float | None = None
    waited_prev_ms_max: float | None = None
    step_wait_ms_max: float | None = None
    staged_ms: float | None = None
    durable_s: float | None = None
    drain_s: float | None = None
    peak_host_gib: float | None = None
    peak_above_start_gib: float | None = None
    others_cpu_pct_max: float | None = None  # other processes' share of the CPUs, worst loop


def train_loop_rows(results: list[Result]) -> list[TrainLoopRow]:
    from .training_loop import NO_CKPT, SCENARIO, TRAIN_SYSTEMS

    order = {n: i for i, n in enumerate((NO_CKPT, *TRAIN_SYSTEMS))}
    by: dict[tuple[str, str, str], dict[str, Result]] = {}
    for r in results:
        if r.scenario == SCENARIO:
            by.setdefault((r.where, r.config.get("device", "cpu"), r.system), {})[r.config["metric"]] = r
    rows: list[TrainLoopRow] = []
    fastest_base = {(w, d): min(m["loop"].seconds) for (w, d, s), m in by.items()
                    if s == NO_CKPT and "loop" in m and m["loop"].seconds}
    for (where, device, system), m in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                         order.get(kv[0][2], 99))):
        loop = m.get("loop")
        if loop is None:
            continue
        ex = loop.extra
        first = lambda k: (ex.get(k) or [None])[0]  # noqa: E731
        med = lambda name: statistics.median(m[name].seconds) if name in m and m[name].seconds else None  # noqa: E731
        mx = lambda name: max(m[name].seconds) if name in m and m[name].seconds else None  # noqa: E731
        ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
        row = TrainLoopRow(
            where=where, device=device, system=system, repeats=len(loop.seconds),
            checkpoints_per_loop=int(first("checkpoints") or 0), steps=first("steps"), every=first("every"),
            batch=first("batch"), step_ms=ms(first("calibrated_step_seconds")),
            loop_s=statistics.median(loop.seconds),
            drain_s=statistics.median(ex["drain_seconds"]) if ex.get("drain_seconds") else None,
            peak_host_gib=max(ex["peak_host_bytes"]) / 2**30 if ex.get("peak_host_bytes") else None,
            peak_above_start_gib=max(ex["peak_above_start_bytes"]) / 2**30
            if ex.get("peak_above_start_bytes") else None)
        shares = [x for x in ex.get("others_cpu_share", []) if x is not None]
        row.others_cpu_pct_max = 100 * max(shares) if shares else None
        if "slowdown" in m:
            row.slowdown_s = med("slowdown")
            row.slowdown_pct = 100 * (statistics.median(m["slowdown"].extra["ratio"]) - 1)
            if (where, device) in fastest_base:
                row.slowdown_best_pct = 100 * (min(loop.seconds) / fastest_base[(where, device)] - 1)
        if "blocked" in m:
            b = m["blocked"]
            row.blocked_ms_mean = 1e3 * statistics.mean(b.seconds)
            row.blocked_ms_max = 1e3 * max(b.seconds)
            row.in_call_ms_max = 1e3 * max(b.extra["in_call"])
        row.waited_prev_ms_max, row.step_wait_ms_max = ms(mx("waited_prev")), ms(mx("step_wait"))
        row.staged_ms, row.durable_s = ms(med("staged")), med("durable")
        rows.append(row)
    return rows


def train_loop_lines(results: list[Result]) -> list[str]:
    """The train_loop table: per system, the loop's time and slowdown against the same loop
    without checkpoints, blocked time per checkpoint, staged and durable times, peak host memory."""
    rows = train_loop_rows(results)
    if not rows:
        return []
    cols = ["target", "system", "loop s", "slowdown", "best-of", "blocked ms mean/max", "call ms max",
            "waited_prev ms max", "step_wait ms max", "staged ms", "durable s", "peak host GiB (+start)",
            "others CPU%"]
    cells = [[f"{r.where}/{r.device}", r.system, f"{r.loop_s:.3f}",
              "-" if r.slowdown_pct is None else f"{r.slowdown_pct:+.1f}% ({r.slowdown_s:+.3f} s)",
              "-" if r.slowdown_best_pct is None else f"{r.slowdown_best_pct:+.1f}%",
              "-" if r.blocked_ms_mean is None else f"{r.blocked_ms_mean:.1f} / {r.blocked_ms_max:.1f}",
              _f(r.in_call_ms_max, "{:.1f}"), _f(r.waited_prev_ms_max, "{:.1f}"), _f(r.step_wait_ms_max, "{:.1f}"),
              _f(r.staged_ms, "{:.1f}"), _f(r.durable_s, "{:.3f}"),
              "-" if r.peak_host_gib is None else f"{r.peak_host_gib:.2f} (+{r.peak_above_start_gib:.2f})",
              _f(r.others_cpu_pct_max, "{:.0f}")]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    r0 = rows[0]
    per_loop = max(r.checkpoints_per_loop for r in rows)
    head = [
        f"train_loop: {r0.steps} steps, an async_save every {r0.every} ({per_loop} checkpoints per loop, each "
        f"into a new directory with a new writer), batch {r0.batch}, step {_f(r0.step_ms, '{:.0f}')} ms, "
        f"{r0.repeats} repeat(s) interleaved with no_ckpt (the same loop without checkpoints).",
        "  loop = the steps + the wait for the last upload (drain); slowdown = median of loop / no_ckpt loop of "
        "the same repeat - 1; best-of = fastest loop / fastest no_ckpt loop - 1.",
        "  blocked = waited_prev (for the previous upload, at the next checkpoint) + in the async_save call (call) + "
        "step_wait (for staging, before optimizer.step); staged / durable = medians from the call; peak host "
        "= highest VmHWM (+ above the RSS at the loop's start); others CPU = user CPU of other processes "
        "during a loop, as a share of all CPUs (worst loop): above a few %, the loop times are disturbed.",
    ]
    return [*head, fmt(cols), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells)]


@dataclass
class ConcurrencyRow:
    """One system of a concurrency case (writers, loader): the counts summed over its rounds."""
    system: str
    writers: int
    loader: bool
    rounds: int
    loads_ok: int
    loads_mix: int
    loads_failed: int
    top_load_error: str | None         # "count x first line" of the most common failed load
    saves_ok: int
    saves_failed: int
    top_save_error: str | None         # "count x first line" of the most common failed save
    final_one_state: int               # rounds whose directory ended as one committed state
    final_other: list[str]             # what the other rounds' directories loaded as
    loads_during_saves: int
    leftover_files_max: int
    seconds_median: float


def _top(counts: list[dict[str, int]]) -> str | None:
    total: dict[str, int] = {}
    for per_round in counts:
        for key, n in per_round.items():
            total[key] = total.get(key, 0) + n
    if not total:
        return None
    key, n = max(total.items(), key=lambda kv: kv[1])
    return f"{n}x {key}"


def concurrency_rows(results: list[Result]) -> list[ConcurrencyRow]:
    from .concurrency import SCENARIO

    rows = []
    for r in results:
        if r.scenario != SCENARIO:
            continue
        ex = r.extra
        total = lambda k: int(sum(ex.get(k, [])))  # noqa: E731
        finals = ex.get("final_one_committed_state", [])
        rows.append(ConcurrencyRow(
            system=r.system, writers=int(r.config["writers"]), loader=bool(r.config["loader"]),
            rounds=len(r.seconds), loads_ok=total("loads_ok"), loads_mix=total("loads_mix"),
            loads_failed=total("loads_failed"), top_load_error=_top(ex.get("load_errors", [])),
            saves_ok=total("saves_ok"), saves_failed=total("saves_failed"),
            top_save_error=_top(ex.get("save_errors", [])), final_one_state=sum(1 for f in finals if f),
            final_other=[d for f, d in zip(finals, ex.get("final", [])) if not f],
            loads_during_saves=total("loads_during_saves"),
            leftover_files_max=max(ex.get("leftover_files", [0]) or [0]),
            seconds_median=statistics.median(r.seconds)))
    rows.sort(key=lambda row: (row.writers, row.loader, row.system != "stock", row.system))
    return rows


def concurrency_lines(results: list[Result], error_width: int = 110) -> list[str]:
    """The concurrency table: per system and case, what the loads returned, how the saves ended
    and whether the directory ended as one committed state, over all rounds."""
    rows = concurrency_rows(results)
    if not rows:
        return []
    cut = lambda text: "-" if not text else text if len(text) <= error_width else text[:error_width - 3] + "..."  # noqa: E731
    cols = ["system", "writers", "rounds", "loads ok / mix / failed", "saves ok / failed",
            "ends as one committed state", "most common save error", "most common load error"]
    cells = [[r.system, f"{r.writers}" + (" + loader" if r.loader else ""), str(r.rounds),
              f"{r.loads_ok} / {r.loads_mix} / {r.loads_failed}" if r.loader else "-",
              f"{r.saves_ok} / {r.saves_failed}", f"{r.final_one_state} of {r.rounds}",
              cut(r.top_save_error), cut(r.top_load_error)]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    head = [
        "concurrency: writer processes saving into ONE directory (a new storage writer per dcp.save, every state "
        "identifiable), started together; with a loader: one more process loading the directory in a loop "
        "meanwhile.",
        "  load ok = every tensor from one state a writer saved; mix = loaded without an error, but not one state; "
        "failed = raised. ends as one committed state = after the round, both readers (stock and fastdcp) load "
        "the directory as the same state, one a writer saved successfully. Errors: first line, directory and "
        "save tokens blanked, summed over rounds.",
    ]
    out = [*head, fmt(cols), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells)]
    for r in rows:
        for other in dict.fromkeys(r.final_other):
            out.append(f"  {r.system}, {r.writers} writers: a round ended as: {other}")
    return out


def print_report(lines: list[str], stream=None) -> None:
    print("\n".join(lines), file=stream or sys.stdout, flush=True)


def sort_for_report(results: list[Result], system_order: list[str]) -> list[Result]:
    """Group by case (first-seen order), systems in the order given."""
    order: dict[tuple, int] = {}
    for r in results:
        order.setdefault(r.case_key(), len(order))
    rank = {s: i for i, s in enumerate(system_order)}
    return sorted(results, key=lambda r: (order[r.case_key()], rank.get(r.system, 99),
                                          json.dumps(r.config, sort_keys=True)))


def write_json(path: str, machine: dict[str, Any], limits: Limits | None, results: list[Result],
               run: dict[str, Any], notes: list[str]) -> None:
    doc = {
        "machine": machine,
        "limits": limits.to_json() if limits else None,
        "run": run,
        "limit_policy": LIMIT_POLICY,
        "notes": notes,
        "results": [r.to_json() for r in results],
        "train_loop": [asdict(row) for row in train_loop_rows(results)],
        "concurrency": [asdict(row) for row in concurrency_rows(results)],
        "plan_scale": plan_scale_json(results),
        "replicas": [asdict(row) for row in replicas_rows(results)],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def write_plot(path: str, results: list[Result], limits: Limits | None, system_order: list[str]) -> str | None:
    """Bar chart per scenario (median GiB/s, min-max whiskers) with the limit as a line.
    Returns an error message instead of raising when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    scenarios: list[str] = []
    results = [r for r in results if r.scenario not in OWN_TABLE_SCENARIOS]
    if not results:
        return "no GiB/s results to plot (train_loop and concurrency have tables of their own): no plot written"
    for r in results:
        if r.scenario not in scenarios:
            scenarios.append(r.scenario)
    most = max(len({r.case_key() for r in results if r.scenario == sc}) for sc in scenarios)
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(max(12.0, 1.7 * most), 3.6 * len(scenarios)),
                             squeeze=False)
    colors = {"stock": "#999999", "stock_best": "#5b8db8", "fastdcp": "#d9572b",
              "fastdcp_planners": "#8c2d04", "dcp_floor": "#2ca02c", "dcp_floor_planners": "#98df8a",
              "bare_copy": "#2ca02c", "torch_save": "#9467bd", "safetensors": "#e3b505",
              "torchsnapshot": "#17becf", "nvrx_async": "#76b900"}
    rank = {name: i for i, name in enumerate(system_order)}
    for ax, scen in zip(axes[:, 0], scenarios):
        rs = [r for r in results if r.scenario == scen and r.gibps]
        cases: list[tuple] = []
        for r in rs:
            if r.case_key() not in cases:
                cases.append(r.case_key())
        labels, legend_done = [], set()
        for ci, case in enumerate(cases):
            # one bar per result; a run on another system's checkpoint (ckpt_writer) is hatched
            group = sorted((r for r in rs if r.case_key() == case),
                           key=lambda r: (rank.get(r.system, 99), r.config.get("ckpt_writer", "") != r.system))
            first = group[0]
            labels.append(f"{first.where}\n" + "\n".join(
                f"{k}={v}".replace("Shard(", "S").replace(")", "").replace("->", " > ")
                for k, v in first.config.items() if k not in ("ckpt_writer", "cold_method")))
            width = 0.8 / len(group)
            for bi, r in enumerate(group):
                x = ci - 0.4 + width * (bi + 0.5)
                foreign = r.config.get("ckpt_writer", r.system) != r.system
                label = f"{r.system} (reads {r.config['ckpt_writer']}'s files)" if foreign else r.system
                ax.bar(x, r.gibps, width * 0.92, color=colors.get(r.system), hatch="//" if foreign else None,
                       yerr=[[r.gibps - r.gibps_min], [r.gibps_max - r.gibps]], capsize=2,
                       label=None if label in legend_done else label)
                legend_done.add(label)
            lim = first.limit_gibps
            if lim:
                ax.hlines(lim, ci - 0.45, ci + 0.45, colors="black", linestyles="dashed",
                          label=None if "limit" in legend_done else "limit")
                legend_done.add("limit")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("GiB/s")
        ax.set_title(scen)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_description(cfg) -> dict[str, Any]:
    d = asdict(cfg)
    d["probe_configs"] = [list(c) for c in cfg.probe_configs]
    return d
