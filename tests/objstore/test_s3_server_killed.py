"""The S3 server itself killed (SIGKILL) in the middle of a save, then started again on its data:
the save fails naming an object, the previous checkpoint is unchanged and loads bit-exact, and
``gc`` removes whatever the cut-off save completed, leaving exactly the checkpoint. The test runs
its own SeaweedFS server (the session's is shared by the other tests)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from s3_cases import keys
from fastdcp import FastS3Reader, FastS3Writer, S3Options
from fastdcp.bench.s3_endpoint import S3Endpoint
from fastdcp.cli import main as cli_main
from fastdcp.format.metadata import parse_metadata

IMPATIENT = S3Options(max_retries=2, retry_timeout_s=3, connect_timeout_s=2, request_timeout_s=10)


def _state(seed: int, n: int) -> dict:
    return {f"t{i}": C.random_float((3 << 20,), (seed, i)) for i in range(n)}  # 12 MiB each


@pytest.mark.fastdcp_timeout(400)
def test_the_server_killed_mid_save_leaves_the_previous_checkpoint_and_gc_the_rest(tmp_path, monkeypatch):
    with S3Endpoint(workdir=tmp_path, server="seaweedfs") as endpoint:
        for name, value in endpoint.env().items():
            monkeypatch.setenv(name, value)
        s3 = endpoint._client()
        endpoint.create_bucket("killed")
        url = "s3://killed/ckpt"
        previous = _state(1, 2)
        dcp.save(previous, storage_writer=FastS3Writer(url), no_dist=True)
        metadata_before = s3.get_object(Bucket="killed", Key="ckpt/.metadata")["Body"].read()

        failure: list[BaseException] = []

        def save() -> None:
            try:
                dcp.save(_state(2, 8), storage_writer=FastS3Writer(url, thread_count=4, s3_options=IMPATIENT),
                         no_dist=True)
            except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
                failure.append(error)

        endpoint.reset()
        thread = threading.Thread(target=save)
        thread.start()
        deadline = time.time() + 60
        while endpoint.stats().get("PUT_PART", 0) < 3 and thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        endpoint.kill_server()
        thread.join(120)
        assert not thread.is_alive()
        assert failure and isinstance(failure[0], CheckpointException), failure
        assert "s3://killed/ckpt/" in str(failure[0])

        endpoint.restart_server()
        assert s3.get_object(Bucket="killed", Key="ckpt/.metadata")["Body"].read() == metadata_before
        dest = {k: torch.zeros_like(v) for k, v in previous.items()}
        dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
        C.assert_same(dest, previous)

        assert cli_main(["gc", url, "--min-age-s", "0", "--delete"]) == 0
        named = {f"ckpt/{info.relative_path}" for info in parse_metadata(metadata_before, "ckpt").storage_data.values()}
        assert keys(s3, "killed", "ckpt/") == named | {"ckpt/.metadata"}
