"""GPU tensors and S3 (skip without a CUDA device): GPU-resident states saved to the test server,
sync (the device bytes through the pinned upload ring) and with overlapped ``async_save``
staging, read back by stock's fsspec reader and by fastdcp into GPU destinations in place, and
``fastdcp.open(..., device="cuda")`` over S3."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
from fastdcp import S3Options
from fastdcp.io.pinned_pool import pinned_pool_stats
from fastdcp.objstore.reader import FastS3Reader
from fastdcp.objstore.writer import FastS3Writer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tensors to S3)")]


def _gpu_state(seed: int = 0) -> dict[str, torch.Tensor]:
    sd = {k: v.cuda() for k, v in C.zoo_tensors(seed).items()}
    base = C.random_tensor(torch.float32, (300, 200), (seed, "gpu-base")).cuda()
    sd["gpu_transposed"] = base.t()          # non-contiguous on the device
    sd["gpu_every_other_col"] = base[:, ::2]
    sd["gpu_bf16"] = C.random_tensor(torch.bfloat16, (1000, 33), (seed, "gpu-bf16")).cuda()
    return sd


def _on_cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cpu", copy=True) for k, v in sd.items()}


def _load_into_gpu_and_check(reader, expected_cpu: dict[str, torch.Tensor]) -> None:
    dest = {k: C.sentinel_like(v).cuda() for k, v in expected_cpu.items()}
    pointers = {k: v.data_ptr() for k, v in dest.items()}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    for k, expected in expected_cpu.items():
        got = dest[k]
        assert got.device.type == "cuda" and got.data_ptr() == pointers[k], f"{k}: not loaded in place on the GPU"
        C.assert_same(got.cpu(), expected, k, check_stride=False)


def test_a_gpu_state_saved_to_s3_loads_with_stock_and_into_gpu_tensors(bucket, s3_env):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"s3://{bucket}/gpu"
    sd = _gpu_state()
    sd["gpu_big"] = C.random_float((5 << 20,), (0, "gpu-big")).cuda()  # 20 MiB: several parts
    expected = _on_cpu(sd)
    writer = FastS3Writer(url, s3_options=S3Options(part_bytes=5 << 20))
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert writer.last_ring_parts >= 4  # the device bytes went part by part through the pinned ring
    assert pinned_pool_stats().bytes_leased == 0
    dest = C.destination_for(expected)
    dcp.load(dest, storage_reader=FsspecReader(url, endpoint_url=s3_env.endpoint), no_dist=True)
    C.assert_same(dest, expected, check_stride=False)
    _load_into_gpu_and_check(FastS3Reader(url), expected)


def test_overlapped_async_save_of_gpu_tensors_to_s3_saves_the_state_at_the_call(bucket):
    writer = FastS3Writer(f"s3://{bucket}/async/0", async_staging=True)
    for step in range(2):
        sd = _gpu_state(step)
        expected = _on_cpu(sd)
        url = f"s3://{bucket}/async/{step}"
        result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=url, no_dist=True)
        staged = getattr(result, "staging_completion", None)
        if staged is not None:
            staged.result()
        for v in sd.values():  # the optimizer step after fastdcp.guard
            v.zero_() if v.dtype == torch.bool else v.add_(1)
        getattr(result, "upload_completion", result).result()
        _load_into_gpu_and_check(FastS3Reader(url), expected)


def test_fastdcp_open_over_s3_places_on_the_gpu(bucket):
    import fastdcp

    url = f"s3://{bucket}/lazy"
    big = torch.randn(2048, 512)
    dcp.save({"big": big.cuda()}, storage_writer=FastS3Writer(url), no_dist=True)
    with fastdcp.open(url, device="cuda") as ckpt:
        whole = ckpt["big"]
        assert whole.device.type == "cuda"
        C.assert_same(whole.cpu(), big)
        part = ckpt.get_slice("big")[100:300, 7:90]
        assert part.device.type == "cuda"
        C.assert_same(part.cpu(), big[100:300, 7:90].contiguous())
