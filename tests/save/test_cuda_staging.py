"""GPU-resident state through fastdcp's async staging: the blocking path (pinned host copies filled
by stream-ordered device-to-host copies), overlapped staging (side-stream copies, the call returns
before they finish) with ``fastdcp.guard`` holding the optimizer step, and overlapped staging under
a staging budget (the rest written from the live GPU tensors while the guard waits). Every
checkpoint is read back by stock DCP's reader and must hold exactly the state of its call, though
training went on right after the call returned.

These run only with a CUDA device (marker ``cuda``: the GPU acceptance command's test step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import dcp_cases as C
import fastdcp
from fastdcp import FastFileSystemWriter

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    return obj


class _Training:
    """Linear + BatchNorm1d (buffers change in forward) + AdamW on the GPU."""

    def __init__(self, width: int = 256) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, width)).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.x = torch.randn(16, width, device="cuda")
        for _ in range(2):
            self.step()

    def step(self) -> None:
        self.model(self.x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}


def _load_with_stock(path, expected):
    dest = C.destination_for(expected)
    dcp.load(dest, storage_reader=FileSystemReader(path), no_dist=True)
    C.assert_same(dest, expected, check_stride=False)


def test_blocking_async_save_of_gpu_tensors_of_every_dtype(tmp_path):
    sd = {k: v.cuda() for k, v in C.zoo_tensors(seed=5, large=True).items() if v.dtype not in C.UNCOPYABLE_DTYPES}
    sd["step"] = 7
    expected = _cpu_copy(sd)
    resp = dcp.async_save(sd, checkpoint_id=tmp_path, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
    staging = getattr(resp, "staging_completion", None)
    if staging is not None:
        staging.result()
    for v in sd.values():  # the caller is free: the checkpoint must not see this
        if isinstance(v, torch.Tensor) and v.numel():
            v.untyped_storage().fill_(0xA5)
    getattr(resp, "upload_completion", resp).result()
    _load_with_stock(tmp_path, expected)


@pytest.mark.parametrize("budget", [None, 64 << 10], ids=["whole-state", "budget-64KiB"])
def test_overlapped_staging_with_guard_holds_the_state_of_the_call(tmp_path, budget):
    train = _Training()
    kwargs = {"async_staging": True}
    if budget is not None:
        kwargs["snapshot_limit_bytes"] = budget
    paths = []
    with fastdcp.guard(train.opt, train.model):
        for i in range(3):
            sd = train.state_dict()
            expected = _cpu_copy(sd)
            path = tmp_path / f"ckpt{i}"
            resp = dcp.async_save(sd, checkpoint_id=path, storage_writer=FastFileSystemWriter(path, **kwargs),
                                  no_dist=True)
            for _ in range(2):  # training goes on at once: forward changes BatchNorm, step the weights
                train.step()
            getattr(resp, "upload_completion", resp).result()
            paths.append((path, expected))
    torch.cuda.synchronize()
    for path, expected in paths:
        _load_with_stock(path, expected)
    assert not torch.equal(expected["model"]["0.weight"], train.model[0].weight.cpu()), "training did not move"
