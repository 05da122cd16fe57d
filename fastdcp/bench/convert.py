"""Conversion scenario (`convert`): a DCP checkpoint exported for inference.

The suite's LLM-like state is saved once by stock ``FileSystemWriter`` (the common case: a
training run's checkpoint), then converted, interleaved per repeat:

* ``stock``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (stock's way: the
  whole state loaded into memory, then ``torch.save``);
* ``fastdcp``: ``python -m fastdcp convert SRC DST.safetensors`` (``fastdcp.cli.convert_command``,
  streamed through ``fastdcp.open`` within its 1 GiB default budget; tensors stored whole and
  row-major are copied file to file inside the kernel);
* ``fastdcp_pt``: the same to ``DST.pt`` (torch.save's format, one tensor in memory at a time).

Each conversion runs in this process, timed from the call to its return, and the peak extra
resident memory it needed is measured (``host_peak.HostPeak``). The last repeat's outputs are loaded back (``safetensors.torch.load_file`` /
``torch.load``) and compared bit-exact with the state. Both sides share the same interpreter, so
the times exclude Python and torch start-up (about 3 s on a 2-core VM, identical for
both); the command-line numbers are in docs/performance.md next to these.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from .host_peak import HostPeak
from .results import GIB
from .state import VerificationError

MIB = 1 << 20


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _check(state: dict[str, Any], loaded: dict[str, Any], what: str) -> None:
    flat = _flatten(loaded)
    for key, tensor in state.items():
        if not torch.is_tensor(tensor):
            continue
        got = flat.get(key)
        if got is None or got.dtype != tensor.dtype or got.shape != tensor.shape:
            raise VerificationError(f"{what}: '{key}' is missing or has another dtype/shape")
        if not torch.equal(got.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8)):
            raise VerificationError(f"{what}: '{key}' differs from the saved state")


def _stock(source: str, out_dir: str) -> str:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(out_dir, "model.pt")
    dcp_to_torch_save(source, path)
    return path


def _fastdcp(source: str, out_dir: str, suffix: str) -> str:
    from ..cli.convert_command import ConvertOptions, run_convert

    path = os.path.join(out_dir, f"model{suffix}")
    run_convert(ConvertOptions(source=source, destination=path, include_objects=suffix == ".pt"))
    return path


def _load(path: str) -> dict[str, Any]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=False)


def run_convert(ctx: Any, wheres: list[str]) -> None:
    spec, src, _ = ctx.main_state()
    nbytes = spec.tensor_bytes
    systems: list[tuple[str, str, Any]] = [
        ("stock", "format_utils.dcp_to_torch_save -> .pt", lambda s, o: _stock(s, o)),
        ("fastdcp", "python -m fastdcp convert -> .safetensors", lambda s, o: _fastdcp(s, o, ".safetensors")),
        ("fastdcp_pt", "python -m fastdcp convert -> .pt", lambda s, o: _fastdcp(s, o, ".pt")),
    ]
    try:
        import safetensors  # noqa: F401
    except ImportError:
        systems = [s for s in systems if s[0] != "fastdcp"]
        ctx.note("convert: safetensors is not installed, so the .safetensors conversion is left out")
    for where in wheres:
        source = ctx.ckpt_dir(where, "convert", "source")
        shutil.rmtree(source, ignore_errors=True)
        ctx.progress(f"convert  {where:<4} saving the source checkpoint with stock FileSystemWriter")
        dcp.save(src, storage_writer=FileSystemWriter(source), no_dist=True)
        for rep in range(ctx.cfg.repeats):
            last = rep == ctx.cfg.repeats - 1
            for name, description, convert in systems:
                out_dir = ctx.ckpt_dir(where, "convert", name)
                shutil.rmtree(out_dir, ignore_errors=True)
                os.makedirs(out_dir)
                meter = HostPeak()
                meter.start()
                started = time.perf_counter()
                path = convert(source, out_dir)
                seconds = time.perf_counter() - started
                peak = max(0, meter.stop() - meter.start_bytes)
                ctx.recorder.add("convert", where, name, {"source": "stock-written"}, nbytes, seconds,
                                 f"write:{where}", {"convert": description},
                                 peak_extra_bytes=peak)
                ctx.progress(f"convert  {where:<4} {name:<10} {rep + 1}/{ctx.cfg.repeats}: {seconds:7.3f} s  "
                             f"{nbytes / seconds / GIB:6.2f} GiB/s"
                             + f"  peak +{peak / MIB:.0f} MiB")
                if last:
                    _check(src, _load(path), f"convert/{where}/{name}")
                shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(source, ignore_errors=True)
