"""Facts about the machine a benchmark ran on (recorded in the JSON and the report header)."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from typing import Any

import torch

from .pagecache import fs_info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / (1 << 30)
    except OSError:
        pass
    return None


def _gpu_facts() -> list[dict[str, Any]] | None:
    if not torch.cuda.is_available():
        return None
    gpus: list[dict[str, Any]] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / (1 << 30), 1)})
    try:
        import pynvml  # package nvidia-ml-py

        pynvml.nvmlInit()
        for g in gpus:
            h = pynvml.nvmlDeviceGetHandleByIndex(g["index"])
            g["pcie_link"] = {
                "gen_current": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                "width_current": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                "gen_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                "width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            }
        pynvml.nvmlShutdown()
    except ImportError:
        for g in gpus:
            g["pcie_link"] = "unknown (pip install nvidia-ml-py for PCIe link facts)"
    except Exception as exc:  # NVML missing / not permitted
        for g in gpus:
            g["pcie_link"] = f"unknown ({type(exc).__name__}: {exc})"
    return gpus


def collect_machine(targets: dict[str, str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    facts: dict[str, Any] = {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(_mem_total_gib() or 0.0, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": _gpu_facts(),
        "targets": {w: asdict(fs_info(p)) for w, p in targets.items()},
    }
    try:
        import numpy

        facts["numpy"] = numpy.__version__
    except ImportError:
        pass
    facts.update(extra or {})
    return facts
