"""The `plan_scale` report (fastdcp/bench/plan_scale.py): per N, every step of both systems side
by side (seconds, peak memory, stock/fastdcp, growth exponent since the previous N), the
protocol's totals, with ``--plan-replicas`` the replicated load's storage bytes, the checks, and
at the largest N the targets, each marked; and the same as one JSON document.

Rank-side steps show the slowest of the measured sample ranks; coordinator steps the one
coordinator. Peaks are the resident memory a step needed above what the process held before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .plan_scale import (
    BROADCAST_RECEIVE,
    BROADCAST_SEND,
    COORDINATOR,
    FINISH,
    FINISH_PLAN,
    GATHER_RECEIVE,
    GATHER_SEND,
    GLOBAL_PLAN,
    LOAD_HALF,
    LOAD_SAME,
    LOCAL_PLAN,
    PREPARE_GLOBAL,
    PREPARE_LOCAL,
    RANK,
    READ,
    READ_METADATA,
    REPEAT,
    RESULTS_RECEIVE,
    SAVE,
    SCATTER_RECEIVE,
    SCATTER_SEND,
    SCENARIO,
    SET_UP_PLANNER,
    SET_UP_READER,
    SET_UP_WRITER,
    growth_exponent,
    n_log_n_exponent,
)
from .results import Result

MIB, GIB = 1 << 20, 1 << 30

SAVE_LOCAL = (SET_UP_PLANNER, SET_UP_WRITER, LOCAL_PLAN, PREPARE_LOCAL, GATHER_SEND)
LOAD_LOCAL = (SET_UP_PLANNER, SET_UP_READER, LOCAL_PLAN, PREPARE_LOCAL)
COORDINATOR_PLAN = (GATHER_RECEIVE, GLOBAL_PLAN, PREPARE_GLOBAL, SCATTER_SEND)
RECEIVE = (SCATTER_RECEIVE, FINISH_PLAN)

# Totals: name -> what it sums (explained under the table).
TOTALS = (
    ("save: coordinator (gather+plan+scatter+results+finish)", "s"),
    ("save: metadata broadcast (send + a rank's receive)", "s"),
    ("save: a rank's local plan + send (slowest)", "s"),
    ("repeat save: critical path (rank local + coordinator + rank receive)", "s"),
    ("repeat save: coordinator (gather+plan+scatter)", "s"),
    ("read_metadata: a rank's first", "s"),
    ("load same N: coordinator (gather+plan+scatter)", "s"),
    ("load N/2: coordinator (gather+plan+scatter)", "s"),
    ("load: a rank's local plan (slowest, both destinations)", "s"),
    ("coordinator peak (est., largest phase)", "bytes"),
    ("read_metadata: peak", "bytes"),
)


@dataclasses.dataclass
class StepSummary:
    """One step of one system at one N."""

    phase: str
    side: str
    step: str
    seconds: float                      # the coordinator's; for ranks, the slowest sample rank's
    peak_bytes: int | None
    held_bytes: int | None
    received_bytes: int
    rank: int | None                    # the slowest rank (rank side)
    ranks_measured: int
    note: str
    per_rank: dict[int, float]          # rank -> seconds (rank side)

    def key(self) -> tuple[str, str, str]:
        return (self.phase, self.side, self.step)


@dataclasses.dataclass
class SystemSummary:
    system: str
    ranks: int
    steps: dict[tuple[str, str, str], StepSummary]
    info: dict[str, Any]
    notes: list[str]
    totals: dict[str, float | None] = dataclasses.field(default_factory=dict)


def _max_or_none(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize(results: list[Result]) -> tuple[dict[tuple[str, int], SystemSummary], list[dict[str, Any]]]:
    """The plan_scale rows of ``results``: per (system, N) its steps and totals; and the checks."""
    systems: dict[tuple[str, int], SystemSummary] = {}
    checks: list[dict[str, Any]] = []
    for r in results:
        if r.scenario != SCENARIO:
            continue
        n = int(r.config["ranks"])
        phase = r.config["phase"]
        if phase == "check":
            checks.append({"ranks": n, "check": r.config["step"], "passed": bool(r.extra["passed"][-1]),
                           "detail": r.extra.get("detail", [""])[-1]})
            continue
        summary = systems.setdefault((r.system, n), SystemSummary(r.system, n, {}, {}, []))
        if phase == "info":
            summary.info = dict(r.extra["info"][-1])
            summary.notes = list(r.extra.get("notes", [[]])[-1])
            continue
        ranks = r.extra.get("rank", [None] * len(r.seconds))
        per_rank = {rank: s for rank, s in zip(ranks, r.seconds) if rank is not None}
        slowest = max(range(len(r.seconds)), key=lambda i: r.seconds[i])
        step = StepSummary(
            phase=phase, side=r.config["side"], step=r.config["step"], seconds=r.seconds[slowest],
            peak_bytes=_max_or_none(r.extra.get("peak_bytes", [])),
            held_bytes=_max_or_none(r.extra.get("held_bytes", [])),
            received_bytes=max(r.extra.get("received_bytes", [0]) or [0]),
            rank=ranks[slowest], ranks_measured=len(r.seconds), note=(r.extra.get("note") or [""])[-1],
            per_rank=per_rank)
        summary.steps[step.key()] = step
    for summary in systems.values():
        summary.totals = _totals(summary)
    return systems, checks


def _sum(summary: SystemSummary, phase: str, side: str, steps: tuple[str, ...]) -> float | None:
    found = [summary.steps.get((phase, side, s)) for s in steps]
    if any(f is None for f in found):
        return None
    return sum(f.seconds for f in found)  # type: ignore[union-attr]


def _slowest_rank_sum(summary: SystemSummary, phase: str, steps: tuple[str, ...]) -> float | None:
    """The largest per-rank sum of ``steps`` (each rank's own steps added up)."""
    found = [summary.steps.get((phase, RANK, s)) for s in steps]
    if any(f is None for f in found):
        return None
    ranks = set.intersection(*(set(f.per_rank) for f in found))  # type: ignore[union-attr]
    if not ranks:
        return sum(f.seconds for f in found)  # type: ignore[union-attr]
    return max(sum(f.per_rank[r] for f in found) for r in ranks)  # type: ignore[union-attr]


def coordinator_peak(summary: SystemSummary, phase: str) -> int | None:
    """The coordinator's estimated peak in ``phase``: the largest (memory its earlier steps of the
    phase left held + the step's peak + the bytes it received for the step)."""
    held, best = 0, None
    for step in summary.steps.values():
        if step.phase != phase or step.side != COORDINATOR or step.peak_bytes is None:
            continue
        estimate = held + step.peak_bytes + step.received_bytes
        best = estimate if best is None else max(best, estimate)
        held += step.held_bytes or 0
    return best


def _totals(s: SystemSummary) -> dict[str, float | None]:
    def add(*parts: float | None) -> float | None:
        return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]

    save_coordinator = _sum(s, SAVE, COORDINATOR, COORDINATOR_PLAN + (RESULTS_RECEIVE, FINISH))
    broadcast = add(_sum(s, SAVE, COORDINATOR, (BROADCAST_SEND,)), _sum(s, SAVE, RANK, (BROADCAST_RECEIVE,)))
    repeat_coordinator = _sum(s, REPEAT, COORDINATOR, COORDINATOR_PLAN)
    repeat = add(_slowest_rank_sum(s, REPEAT, SAVE_LOCAL), repeat_coordinator, _slowest_rank_sum(s, REPEAT, RECEIVE))
    load_plans = [_slowest_rank_sum(s, phase, LOAD_LOCAL) for phase in (LOAD_SAME, LOAD_HALF)]
    peaks = [coordinator_peak(s, phase) for phase in (SAVE, REPEAT, LOAD_SAME, LOAD_HALF)]
    read = s.steps.get((READ, RANK, READ_METADATA))
    values = [
        save_coordinator, broadcast, _slowest_rank_sum(s, SAVE, SAVE_LOCAL), repeat, repeat_coordinator,
        read.seconds if read else None,
        _sum(s, LOAD_SAME, COORDINATOR, COORDINATOR_PLAN), _sum(s, LOAD_HALF, COORDINATOR, COORDINATOR_PLAN),
        _max_or_none(load_plans) if all(v is not None for v in load_plans) else None,  # type: ignore[arg-type]
        _max_or_none(peaks), read.peak_bytes if read else None,
    ]
    return {name: value for (name, _), value in zip(TOTALS, values)}


# --------------------------------------------------------------------------- metadata reads


def metadata_reads(summary: SystemSummary) -> dict[str, dict[str, Any]]:
    """Per load phase, what a rank's own process read of the checkpoint's metadata (fastdcp's
    ``OWN_LOAD`` step on the sample ranks): the most bytes a rank read
    (``rank_metadata_read_bytes``), its peak memory for read + plan (``rank_metadata_peak_bytes``),
    the total across the load's ranks (``total_metadata_read_bytes``: the load's rank count times
    the sample ranks' mean, every rank reading the same parts), and the slowest read + plan; from
    object storage also the most requests a rank sent for it (``rank_metadata_requests``)."""
    out: dict[str, dict[str, Any]] = {}
    for phase, world in ((LOAD_SAME, summary.ranks), (LOAD_HALF, summary.ranks // 2)):
        reads = summary.info.get(f"{phase}_metadata_reads")
        if not reads:
            continue
        rows = list(reads.values())
        read = [int(r["read_bytes"]) for r in rows]
        peaks = [r["peak_bytes"] for r in rows if r.get("peak_bytes") is not None]
        out[phase] = {
            "ranks": world,
            "rank_metadata_read_bytes": max(read),
            "rank_metadata_peak_bytes": max(peaks) if peaks else None,
            "total_metadata_read_bytes": int(world * sum(read) / len(read)),
            "rank_load_plan_seconds": max(float(r["seconds"]) for r in rows),
            "from_section": all(bool(r.get("from_section")) for r in rows),
            "sample_ranks": sorted(int(k) for k in reads),
        }
        if all("requests" in r for r in rows):
            out[phase]["rank_metadata_requests"] = max(int(r["requests"]) for r in rows)
    return out


def replicated_load(summary: SystemSummary) -> dict[str, Any] | None:
    """What the job reads from storage in the replicated layout (``--plan-replicas R``, R > 1;
    :class:`fastdcp.bench.plan_scale.ReplicatedLoadReads`): per sample group, the tensor bytes a
    rank's plan reads (``plan_tensor_bytes``) and each member's share with read-once
    (``member_bytes``, the largest ``read_once_bytes``); the largest of them
    (``rank_plan_tensor_bytes``, ``rank_read_once_bytes``); the job's totals without and with
    read-once and the checkpoint's tensor bytes (``needed_bytes``). None without a replicated load."""
    return summary.info.get("replicated_load")


def _replicated_load_line(name: str, r: dict[str, Any]) -> str:
    def gib(x: int | None) -> str:
        return "-" if x is None else f"{x / GIB:.2f} GiB"

    without, with_, needed = (r["storage_bytes_without_read_once"], r["storage_bytes_with_read_once"],
                              r["needed_bytes"])
    if without is None:
        job = "the job's totals not counted (see the note)"
    else:
        ratios = f" ({without / needed:.3f}x and {with_ / needed:.3f}x the checkpoint's tensors)" if needed else ""
        job = f"the job reads {gib(without)} without read-once, {gib(with_)} with it{ratios}"
    return (f"  {name}: replicated load, {r['replicas']} replicas x {r['shard_ranks']:,} shards ({r['layout']}; "
            f"plans of {r['phase']}): a rank reads {_mib(r['rank_plan_tensor_bytes'])} MiB of tensors from storage "
            f"without read-once, {_mib(r['rank_read_once_bytes'])} MiB with it (largest member share of the sample "
            f"groups); {job}; the checkpoint's tensors: {gib(needed)} (data bytes, no headers)")


SCALE_BARS_AT_RANKS = 16384  # the rank count the resume-at-scale targets are set at


def scale_bars(systems: dict[tuple[str, int], SystemSummary]) -> tuple[int | None, list[Bar]]:
    """The resume-at-scale bars for fastdcp at its largest N."""
    ns = sorted({n for (name, n) in systems if name == "fastdcp"})
    if not ns:
        return None, []
    n = ns[-1]
    run = systems[("fastdcp", n)]
    reads = metadata_reads(run)
    md = run.info.get("metadata_file_bytes")
    out = []

    def limit_bar(name: str, value: float | None, limit: float, unit: str) -> Bar:
        if value is None:
            return Bar(name, "-", None)
        shown = f"{value / MIB:.2f} MiB" if unit == "MiB" else f"{value:.3f} s"
        return Bar(name, shown, value <= limit)

    same, half = reads.get(LOAD_SAME, {}), reads.get(LOAD_HALF, {})
    out.append(limit_bar("same-layout resume: a rank reads <= 16 MiB of metadata", same.get("rank_metadata_read_bytes"),
                         16 * MIB, "MiB"))
    out.append(limit_bar("resharded resume (N/2 ranks): a rank reads <= 64 MiB", half.get("rank_metadata_read_bytes"),
                         64 * MIB, "MiB"))
    peaks = [r.get("rank_metadata_peak_bytes") for r in (same, half)]
    peak = max(p for p in peaks if p is not None) if any(p is not None for p in peaks) else None
    out.append(limit_bar("a rank holds <= 256 MiB for it (peak, both loads)", peak, 256 * MIB, "MiB"))
    for phase, label in ((LOAD_SAME, "same layout"), (LOAD_HALF, "resharded")):
        total = reads.get(phase, {}).get("total_metadata_read_bytes")
        if total is None or not md:
            out.append(Bar(f"total read across ranks <= 4x .metadata ({label})", "-", None))
        else:
            out.append(Bar(f"total read across ranks <= 4x .metadata ({label})",
                           f"{total / GIB:.2f} GiB = {total / md:.2f}x the {md / GIB:.2f} GiB .metadata", total <= 4 * md))
    t = run.totals
    out.append(limit_bar("first-save coordinator <= 15 s", t.get(TOTALS[0][0]), 15.0, "s"))
    coordinator = t.get(TOTALS[9][0])
    out.append(Bar("first-save coordinator memory <= 4 GiB (est. peak, largest phase)",
                   "-" if coordinator is None else f"{coordinator / GIB:.3f} GiB",
                   None if coordinator is None else coordinator <= 4 * GIB))
    out.append(limit_bar("repeat save <= 1 s", t.get(TOTALS[3][0]), 1.0, "s"))
    out.append(limit_bar("a rank's load plan (own process: read_metadata + plan) <= 0.1 s, same layout",
                         same.get("rank_load_plan_seconds"), 0.1, "s"))
    out.append(limit_bar("the same, resharded", half.get("rank_load_plan_seconds"), 0.1, "s"))
    return n, out


# --------------------------------------------------------------------------- bars

BARS_AT_RANKS = 4096  # the rank count the planning targets are set at


@dataclasses.dataclass
class Bar:
    """One of the targets, checked at the run's largest N."""

    name: str
    value: str
    passed: bool | None   # None: not measurable in this run (a system or an N missing)


def _ratio_bar(name: str, fast: float | None, stock: float | None, limit: float) -> Bar:
    if fast is None or stock is None or stock <= 0:
        return Bar(name, "-", None)
    return Bar(name, f"{fast:.3f} s vs stock {stock:.3f} s = {100 * fast / stock:.1f}%", fast <= limit * stock)


def bars(systems: dict[tuple[str, int], SystemSummary]) -> tuple[int | None, list[Bar]]:
    """The targets for fastdcp at the largest N measured (with stock's run at that N where
    a bar compares with stock); the growth bar between the two largest N."""
    ns = sorted({n for (name, n) in systems if name == "fastdcp"})
    if not ns:
        return None, []
    n = ns[-1]
    fast = systems[("fastdcp", n)].totals
    stock_summary = systems.get(("stock", n))
    stock = stock_summary.totals if stock_summary else {}
    t = lambda totals, i: totals.get(TOTALS[i][0])  # noqa: E731
    out = [_ratio_bar("first-save coordinator total <= 10% of stock's", t(fast, 0), t(stock, 0), 0.10)]
    if len(ns) >= 2:
        n1 = ns[-2]
        g = growth_exponent(t(systems[("fastdcp", n1)].totals, 0), t(fast, 0), n1, n)
        bound = n_log_n_exponent(n1, n)
        out.append(Bar(f"first-save coordinator growth {n1:,}->{n:,} <= N log N (exponent {bound:.2f})",
                       "-" if g is None else f"exponent {g:.2f}", None if g is None else g <= bound))
    else:
        out.append(Bar("first-save coordinator growth <= N log N", "- (one N only)", None))
    repeat = t(fast, 3)
    out.append(Bar("repeat save <= 1 s", "-" if repeat is None else f"{repeat:.3f} s",
                   None if repeat is None else repeat <= 1.0))
    out.append(_ratio_bar("load coordinator (same N) <= 25% of stock's", t(fast, 6), t(stock, 6), 0.25))
    out.append(_ratio_bar("load coordinator (N/2) <= 25% of stock's", t(fast, 7), t(stock, 7), 0.25))
    read_bar = _ratio_bar("rank .metadata read <= 10% of stock's", t(fast, 5), t(stock, 5), 0.10)
    out.append(read_bar)
    peak = t(fast, 10)
    out.append(Bar("rank .metadata read peak <= 1 GiB", "-" if peak is None else f"{peak / GIB:.3f} GiB",
                   None if peak is None else peak <= GIB))
    plan = t(fast, 8)
    out.append(Bar("rank load plan <= 0.1 s", "-" if plan is None else f"{plan:.3f} s",
                   None if plan is None else plan <= 0.1))
    coordinator = t(fast, 9)
    out.append(Bar("coordinator peak <= 2 GiB", "-" if coordinator is None else f"{coordinator / GIB:.3f} GiB",
                   None if coordinator is None else coordinator <= 2 * GIB))
    return n, out


# --------------------------------------------------------------------------- table


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if x < 1 else f"{x:.2f}"


def _mib(x: int | float | None) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _ratio(stock: float | None, fast: float | None) -> str:
    if not stock or not fast:
        return "-"
    return f"{stock / fast:.1f}x"


def _growth(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _format(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(row) for row in rows)]


def _side_label(steps: list[StepSummary]) -> str:
    """"coordinator", or for rank steps how many ranks were measured (or which one)."""
    if steps[0].side != RANK:
        return "coordinator"
    measured = max(s.ranks_measured for s in steps)
    return f"rank (slowest of {measured})" if measured > 1 else f"rank {steps[0].rank}"


def plan_scale_lines(results: list[Result]) -> list[str]:
    """The plan_scale section of the terminal report (empty when the scenario did not run)."""
    systems, checks = summarize(results)
    if not systems:
        return []
    names = [name for name in ("stock", "fastdcp") if any(k[0] == name for k in systems)]
    ns = sorted({n for _, n in systems})
    out = [
        "plan_scale: DCP's planning protocol for N ranks simulated in one process (a Llama-7B-shaped FSDP2 state "
        "with AdamW, Shard(0) over N ranks): every coordinator step, and every rank step on sample ranks "
        "(0, 1, N/2, N-1; the slowest shown).",
        "  s = wall seconds; MiB = peak resident memory above what the process held before the step; growth = "
        "log(t/t_prev)/log(N/N_prev) since the previous N (1 linear, 2 quadratic); stock/fastdcp = time ratio.",
    ]
    header = ["phase", "side", "step"]
    for name in names:
        header += [f"{name} s", f"{name} MiB"]
    if len(names) == 2:
        header.append("stock/fastdcp")
    header += [f"growth {name}" for name in names] + ["note"]
    for i, n in enumerate(ns):
        previous = ns[i - 1] if i else None
        runs = {name: systems.get((name, n)) for name in names}
        some = next(s for s in runs.values() if s is not None)
        info = some.info
        out.append("")
        out.append(f"plan_scale N={n:,}: {info.get('items_per_rank', '?')} items per rank, "
                   f"{info.get('chunks', 0):,} chunks in .metadata; target {info.get('where', '?')}")
        for name, run in runs.items():
            if run is None:
                continue
            inf = run.info
            out.append(f"  {name}: .metadata {_mib(inf.get('metadata_file_bytes'))} MiB, broadcast "
                       f"{_mib(inf.get('metadata_broadcast_bytes'))} MiB, local plans {_mib(inf.get('local_plan_bytes'))} MiB "
                       f"gathered, global plans {_mib(inf.get('global_plan_bytes'))} MiB scattered; simulated in "
                       f"{inf.get('simulation_seconds', 0):.0f} s")
            for note in run.notes:
                out.append(f"  {name}: {note}")
            replicated = replicated_load(run)
            if replicated is not None:
                out.append(_replicated_load_line(name, replicated))
            for phase, r in metadata_reads(run).items():
                md = inf.get("metadata_file_bytes") or 0
                gets = f"in {r['rank_metadata_requests']} GETs " if "rank_metadata_requests" in r else ""
                out.append(
                    f"  {name}: {phase} ({r['ranks']:,} ranks), a rank's own process: reads "
                    f"{_mib(r['rank_metadata_read_bytes'])} MiB of metadata {gets}"
                    f"({'its section of the chunk index' if r['from_section'] else 'the whole chunk index'}; "
                    f"index {_mib(inf.get('chunk_index_bytes'))} MiB), peak {_mib(r['rank_metadata_peak_bytes'])} MiB, "
                    f"read + plan {_s(r['rank_load_plan_seconds'])} s; all ranks read "
                    f"{r['total_metadata_read_bytes'] / GIB:.2f} GiB"
                    + (f" = {r['total_metadata_read_bytes'] / md:.2f}x .metadata" if md else ""))
        keys: list[tuple[str, str, str]] = []
        for run in runs.values():
            if run is not None:
                keys += [k for k in run.steps if k not in keys]
        rows = []
        for key in keys:
            steps = {name: (run.steps.get(key) if run else None) for name, run in runs.items()}
            row = [key[0], _side_label([s for s in steps.values() if s is not None]), key[2]]
            for name in names:
                st = steps[name]
                row += [_s(st.seconds if st else None), _mib(st.peak_bytes if st else None)]
            if len(names) == 2:
                row.append(_ratio(*(steps[name].seconds if steps[name] else None for name in names)))
            for name in names:
                st = steps[name]
                prev = systems.get((name, previous)) if previous else None
                before = prev.steps.get(key) if prev else None
                row.append(_growth(growth_exponent(before.seconds if before else None, st.seconds if st else None,
                                                   previous or n, n)))
            row.append("; ".join(dict.fromkeys(s.note for s in steps.values() if s is not None and s.note)))
            rows.append(row)
        out += ["  " + line for line in _format(rows, header)]
        total_rows = []
        for total, unit in TOTALS:
            row = ["total", "", total]
            values = {}
            for name in names:
                v = runs[name].totals.get(total) if runs[name] else None
                values[name] = v
                row += ([_s(v), ""] if unit == "s" else ["", _mib(v)])
            if len(names) == 2:
                row.append(_ratio(values["stock"], values["fastdcp"]))
            for name in names:
                prev = systems.get((name, previous)) if previous else None
                row.append(_growth(growth_exponent(prev.totals.get(total) if prev else None, values[name],
                                                   previous or n, n)) if unit == "s" else "-")
            row.append("")
            total_rows.append(row)
        out += ["  " + line for line in _format(total_rows, header)[2:]]
    out.append("  totals: coordinator = the coordinator's steps of the phase added; a rank's = its own steps added "
               "(slowest sample rank); repeat critical path = slowest rank's local plan + send, the coordinator's "
               "gather+plan+scatter, slowest rank's receive + finish_plan; coordinator peak (est.) = memory held by "
               "its earlier steps of the phase + the step's peak + bytes received.")
    n, bar_list = bars(systems)
    if bar_list and n is not None and n < BARS_AT_RANKS:
        # Ratios and growth at a few ranks say nothing about thousands: the bars belong to the
        # scale they were set at (a quick run's N=16 would print failures that are not failures).
        out.append("")
        out.append(f"plan_scale: development targets are judged at N >= {BARS_AT_RANKS:,} (this run's largest N is "
                   f"{n:,}; the JSON records them): --plan-ranks {BARS_AT_RANKS} runs them")
    elif bar_list:
        out.append("")
        out.append(f"plan_scale targets (for fastdcp at N={n:,}):")
        for bar in bar_list:
            mark = "n/a " if bar.passed is None else ("PASS" if bar.passed else "FAIL")
            out.append(f"  [{mark}] {bar.name}: {bar.value}")
    n, scale = scale_bars(systems)
    if scale and n is not None and n >= SCALE_BARS_AT_RANKS:
        out.append("")
        out.append(f"plan_scale resume-at-scale bars (fastdcp at N={n:,}):")
        for bar in scale:
            mark = "n/a " if bar.passed is None else ("PASS" if bar.passed else "FAIL")
            out.append(f"  [{mark}] {bar.name}: {bar.value}")
    if checks:
        out.append("")
        out.append("plan_scale checks:")
        for c in checks:
            out.append(f"  [{'ok' if c['passed'] else 'FAILED'}] N={c['ranks']:,}: {c['check']}"
                       + (f" ({c['detail']})" if c["detail"] else ""))
    return out


def plan_scale_json(results: list[Result]) -> dict[str, Any] | None:
    """The plan_scale summary for the JSON report: per (system, N) every step (with its growth
    exponent since the previous N), the totals and their growth, the info; the bars and checks."""
    systems, checks = summarize(results)
    if not systems:
        return None
    runs = []
    for (name, n), summary in sorted(systems.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        earlier = sorted(m for (other, m) in systems if other == name and m < n)
        prev = systems[(name, earlier[-1])] if earlier else None
        steps = []
        for key, st in summary.steps.items():
            before = prev.steps.get(key) if prev else None
            row = dataclasses.asdict(st)
            row["per_rank"] = {str(k): v for k, v in st.per_rank.items()}
            row["growth_exponent"] = growth_exponent(before.seconds if before else None, st.seconds,
                                                     prev.ranks if prev else n, n)
            steps.append(row)
        totals_growth = {
            total: growth_exponent(prev.totals.get(total) if prev else None, summary.totals.get(total),
                                   prev.ranks if prev else n, n) if unit == "s" else None
            for total, unit in TOTALS}
        run = {"system": name, "ranks": n, "steps": steps, "totals": summary.totals,
               "totals_growth_exponent": totals_growth, "info": summary.info, "notes": summary.notes,
               "metadata_reads": metadata_reads(summary)}
        replicated = replicated_load(summary)
        if replicated is not None:
            run["replicated_load"] = replicated
        runs.append(run)
    n, bar_list = bars(systems)
    scale_n, scale = scale_bars(systems)
    return {"runs": runs, "bars_at_ranks": n, "bars": [dataclasses.asdict(b) for b in bar_list],
            "scale_bars_at_ranks": scale_n, "scale_bars": [dataclasses.asdict(b) for b in scale], "checks": checks}
