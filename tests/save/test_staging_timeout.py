"""A stage that does not complete within the timeout given to its Future: the error names the
checkpoint, the timeout and the argument that set it, what was still running and what to do;
the stage still completes afterwards."""

from __future__ import annotations

import threading

import pytest
import torch

from fastdcp import FastFileSystemWriter
from fastdcp.io.copy_engine import StandInCopier, to_standin_device
from fastdcp.save import staging
from fastdcp.save.async_staging import StagingReport, staging_timeout_message


class _GatedCopier(StandInCopier):
    """The stand-in device's copier, whose copies land only once ``gate`` is set (a device busy
    with other work)."""

    gate = threading.Event()

    def wait(self, token: threading.Event) -> None:
        assert self.gate.wait(60), "the test never opened the gate"
        super().wait(token)


def test_a_stage_past_its_timeout_names_the_checkpoint_the_timeout_and_what_to_do(tmp_path, monkeypatch):
    _GatedCopier.gate.clear()
    monkeypatch.setattr(staging, "_new_copier", _GatedCopier)
    path = tmp_path / "ckpt"
    writer = FastFileSystemWriter(path, async_staging=True)
    source = torch.arange(4096, dtype=torch.float32)
    future = writer.stage({"w": to_standin_device(source)})
    try:
        with pytest.raises(TimeoutError) as info:
            future.result(timeout=0.25)
    finally:
        _GatedCopier.gate.set()
    message = str(info.value)
    assert f"checkpoint at {path}" in message, message
    assert "within 0.25 s" in message and "StagingFuture.result(timeout)" in message, message
    assert f"{source.numel() * 4} bytes" in message and "still running" in message, message
    assert "fastdcp.wait_for_staging()" in message, message
    assert torch.equal(future.result(timeout=60)["w"], source)  # the stage completes all the same


def test_the_message_of_a_stage_waiting_for_its_streamed_tensors():
    report = StagingReport(state_bytes=3000, snapshot_bytes=1000, streamed_bytes=2000, peak_host_bytes=1000,
                           blocked_s=0.0)
    message = staging_timeout_message("s3://bucket/run/step_7", 1.5, report, copied=True)
    assert "staging 3000 bytes for the checkpoint at s3://bucket/run/step_7" in message, message
    assert "within 1.5 s" in message and "2000 bytes streamed" in message, message
    assert "snapshot_limit_bytes" in message, message
