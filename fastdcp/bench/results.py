"""Result records: raw samples per (scenario, where, config, system), then medians, ratios and
fractions of the hardware limit."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from .floor import BASELINE_SYSTEMS, FLOOR, FLOOR_PLANNERS
from .limits import Limits
from .peers import is_peer
from .systems import PLANNER_SYSTEMS

GIB = float(1 << 30)
BARE_COPY = "bare_copy"

# Config keys that describe which system produced the input rather than the case itself;
# they are ignored when pairing a result with stock's result for a ratio.
SYSTEM_SPECIFIC_KEYS = frozenset({"ckpt_writer"})


@dataclass
class Result:
    scenario: str
    system: str                      # "stock" | "stock_best" | "fastdcp" | "fastdcp_planners", a peer:
                                     # "torch_save" | "safetensors" | "torchsnapshot" | "nvrx_async", or
                                     # a baseline: "dcp_floor", "dcp_floor_planners", "bare_copy"
    config: dict[str, Any]           # the case: op, cache, layout, ...
    where: str                       # target name: "dir", "shm", "checkpoint"
    bytes: int                       # logical bytes moved per run (tensor payload)
    seconds: list[float] = field(default_factory=list)
    limit: str | None = None         # limit key, see Limits.value; "case:<system>": that system's median
                                     # in the same case of the same run (e.g. an S3 server's own speed)
    system_config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # filled by finalize()
    gibps: float | None = None       # median
    gibps_min: float | None = None
    gibps_max: float | None = None
    seconds_median: float | None = None
    ratio_vs_stock: float | None = None
    ratio_vs_stock_best: float | None = None
    # the fastest peer of the case (peers.py's peers and stock_best) and the ratio to it (GiB/s);
    # for the DCP systems that are not peers themselves (stock, fastdcp, fastdcp_planners)
    best_peer: str | None = None
    best_peer_gibps: float | None = None
    ratio_vs_best_peer: float | None = None
    limit_gibps: float | None = None
    fraction_of_limit: float | None = None
    # the baseline of the same case (DCP's floor in `small`, the bare copy for async `blocked`)
    baseline: str | None = None
    baseline_seconds: float | None = None
    above_baseline_seconds: float | None = None   # own cost: median - baseline median
    ratio_to_baseline: float | None = None        # median seconds / baseline median seconds

    @property
    def is_baseline(self) -> bool:
        return self.system in BASELINE_SYSTEMS

    @property
    def is_peer(self) -> bool:
        """A peer in "fastdcp vs best peer": peers.py's peers and stock_best."""
        return is_peer(self.system)
    def case_key(self) -> tuple[str, str, str]:
        cfg = {k: v for k, v in self.config.items() if k not in SYSTEM_SPECIFIC_KEYS}
        return (self.scenario, self.where, json.dumps(cfg, sort_keys=True, default=str))

    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.config.items())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Collects samples; keeps first-seen order of cases for the report."""

    def __init__(self) -> None:
        self._results: dict[tuple, Result] = {}

    def add(self, scenario: str, where: str, system: str, config: dict[str, Any], nbytes: int,
            seconds: float, limit: str | None, system_config: dict[str, Any] | None = None,
            **extra: Any) -> Result:
        key = (scenario, where, json.dumps(config, sort_keys=True, default=str), system)
        r = self._results.get(key)
        if r is None:
            r = Result(scenario=scenario, system=system, config=dict(config), where=where,
                       bytes=int(nbytes), limit=limit, system_config=dict(system_config or {}))
            self._results[key] = r
        r.seconds.append(float(seconds))
        for k, v in extra.items():  # one value per sample, e.g. file_bytes, bytes_read
            r.extra.setdefault(k, []).append(v)
        return r

    @property
    def results(self) -> list[Result]:
        return list(self._results.values())


def finalize(results: list[Result], limits: Limits | None) -> list[Result]:
    for r in results:
        speeds = [r.bytes / s / GIB for s in r.seconds if s > 0]
        if speeds:
            r.gibps = statistics.median(speeds)
            r.gibps_min, r.gibps_max = min(speeds), max(speeds)
        r.seconds_median = statistics.median(r.seconds) if r.seconds else None
        r.limit_gibps = limits.value(r.limit) if limits else None
        if r.gibps and r.limit_gibps:
            r.fraction_of_limit = r.gibps / r.limit_gibps
    by_case: dict[tuple, dict[str, Result]] = {}
    for r in results:
        # the reference for a ratio is the system's own-format run (config ckpt_writer == system)
        if r.config.get("ckpt_writer", r.system) == r.system:
            by_case.setdefault(r.case_key(), {})[r.system] = r
    for r in results:
        refs = by_case.get(r.case_key(), {})
        if r.limit and r.limit.startswith("case:"):
            ref = refs.get(r.limit.removeprefix("case:"))
            r.limit_gibps = ref.gibps if ref is not None else None
            if r.gibps and r.limit_gibps:
                r.fraction_of_limit = r.gibps / r.limit_gibps
        if r.is_baseline:
            continue
        for ref_name, attr in (("stock", "ratio_vs_stock"), ("stock_best", "ratio_vs_stock_best")):
            ref = refs.get(ref_name)
            if ref is not None and ref.gibps and r.gibps:
                setattr(r, attr, r.gibps / ref.gibps)
        if not r.is_peer:
            best = best_peer(refs)
            if best is not None and r.gibps:
                r.best_peer, r.best_peer_gibps = best.system, best.gibps
                r.ratio_vs_best_peer = r.gibps / best.gibps
        base = refs.get(baseline_name(r.system, refs))
        if base is not None and base.seconds_median and r.seconds_median is not None:
            r.baseline = base.system
            r.baseline_seconds = base.seconds_median
            r.above_baseline_seconds = r.seconds_median - base.seconds_median
            r.ratio_to_baseline = r.seconds_median / base.seconds_median
    return results


def best_peer(refs: dict[str, Result]) -> Result | None:
    """The fastest (median GiB/s) peer among a case's own-format results, or None."""
    peers = [r for r in refs.values() if r.is_peer and r.gibps]
    return max(peers, key=lambda r: r.gibps) if peers else None


def baseline_name(system: str, refs: dict[str, Any]) -> str | None:
    """The baseline a system is compared with in a case: the bare copy when the case has one
    (async `blocked`), else DCP's floor measured with the same planners (fastdcp's planners for
    planner systems when that floor was measured, DCP's defaults otherwise)."""
    if BARE_COPY in refs:
        return BARE_COPY
    if system in PLANNER_SYSTEMS and FLOOR_PLANNERS in refs:
        return FLOOR_PLANNERS
    return FLOOR if FLOOR in refs else None
