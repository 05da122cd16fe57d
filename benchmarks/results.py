"""Result records: raw samples per (scenario, where, config, system), then medians, ratios and
fractions of the hardware limit."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from .limits import Limits

GIB = float(1 << 30)

# Config keys that describe which system produced the input rather than the case itself;
# they are ignored when pairing a result with stock's result for a ratio.
SYSTEM_SPECIFIC_KEYS = frozenset({"ckpt_writer"})


@dataclass
class Result:
    scenario: str
    system: str                      # "stock" | "stock_best" | "fastdcp"
    config: dict[str, Any]           # the case: op, cache, layout, ...
    where: str                       # target name: "dir", "shm", "checkpoint"
    bytes: int                       # logical bytes moved per run (tensor payload)
    seconds: list[float] = field(default_factory=list)
    limit: str | None = None         # limit key, see Limits.value
    system_config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # filled by finalize()
    gibps: float | None = None       # median
    gibps_min: float | None = None
    gibps_max: float | None = None
    seconds_median: float | None = None
    ratio_vs_stock: float | None = None
    ratio_vs_stock_best: float | None = None
    limit_gibps: float | None = None
    fraction_of_limit: float | None = None

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
        for ref_name, attr in (("stock", "ratio_vs_stock"), ("stock_best", "ratio_vs_stock_best")):
            ref = refs.get(ref_name)
            if ref is not None and ref.gibps and r.gibps:
                setattr(r, attr, r.gibps / ref.gibps)
    return results
