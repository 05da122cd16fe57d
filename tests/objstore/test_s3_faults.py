"""Object storage faults, through the real server and a proxy process between it and the client:
throttling (503 SlowDown) retried, the endpoint unreachable or cut mid-save, wrong credentials.
Each fails with an error naming the object, leaves nothing that loads as a new checkpoint, and
the previous checkpoint still loads."""

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

# Fail fast where the endpoint stays down (the default retries for three minutes).
IMPATIENT = S3Options(max_retries=2, retry_timeout_s=3, connect_timeout_s=2, request_timeout_s=10)


def _state(seed: int, n: int = 4) -> dict:
    return {f"t{i}": C.random_float((3 << 20,), (seed, i)) for i in range(n)}  # 12 MiB each


def _loads(url: str, expected: dict) -> None:
    dest = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, expected)


def _named(s3, bucket: str, prefix: str) -> set[str]:
    """The objects the checkpoint's .metadata names."""
    from fastdcp.format.metadata import parse_metadata

    data = s3.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    return {f"{prefix}/{info.relative_path}" for info in parse_metadata(data, "test").storage_data.values()}


def _open_uploads(s3, bucket: str) -> list:
    return s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_throttled_requests_are_retried_and_the_checkpoint_is_whole(bucket, s3_env):
    url = f"s3://{bucket}/throttled"
    sd = _state(1)
    s3_env.fault("PUT_PART", count=3, status=503)
    s3_env.fault("PUT", count=1, status=503)  # the .metadata commit
    # 8 MiB parts: the 48 MiB state goes up in at least 6 parts, 3 of them refused first.
    dcp.save(sd, storage_writer=FastS3Writer(url, s3_options=S3Options(part_bytes=8 << 20)), no_dist=True)
    counts = s3_env.stats()
    s3_env.fault("GET", count=3, status=503)
    _loads(url, sd)
    assert counts["PUT"] >= 2 and counts["PUT_PART"] >= 3 + 6, counts  # the refused ones were sent again


def test_an_unavailable_endpoint_fails_the_save_naming_the_object_and_keeps_the_previous(bucket, s3_env, s3):
    url = f"s3://{bucket}/down"
    previous = _state(2)
    dcp.save(previous, storage_writer=FastS3Writer(url), no_dist=True)
    before = keys(s3, bucket)
    s3_env.fault("ANY", count=10_000, status=500)
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/down/__0_\w+_\d+\.distcp"):
        dcp.save(_state(3), storage_writer=FastS3Writer(url, s3_options=IMPATIENT), no_dist=True)
    s3_env.reset()
    assert keys(s3, bucket) == before
    assert _open_uploads(s3, bucket) == []
    _loads(url, previous)


def test_the_network_cut_mid_save_leaves_the_previous_checkpoint(bucket, s3_env, s3):
    url = f"s3://{bucket}/cut"
    previous = _state(4)
    dcp.save(previous, storage_writer=FastS3Writer(url), no_dist=True)
    metadata_before = s3.get_object(Bucket=bucket, Key="cut/.metadata")["Body"].read()
    s3_env.reset()
    failure: list[BaseException] = []

    def save() -> None:
        try:
            dcp.save(_state(5, n=8), storage_writer=FastS3Writer(url, s3_options=IMPATIENT), no_dist=True)
        except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
            failure.append(error)

    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.time() + 60
    while s3_env.stats().get("PUT_PART", 0) < 2 and time.time() < deadline:
        time.sleep(0.01)
    s3_env.kill_proxy()
    thread.join(120)
    assert not thread.is_alive()
    assert failure and isinstance(failure[0], CheckpointException), failure
    assert f"s3://{bucket}/cut/" in str(failure[0])
    s3_env.start_proxy(s3_env.proxy_port)
    # Uploads in flight when the network went are left open on the server, and objects completed
    # before it cannot be deleted either: none is named by a .metadata (save-unique names), so
    # they never load; a bucket lifecycle rule (AbortIncompleteMultipartUpload) clears the uploads.
    assert s3.get_object(Bucket=bucket, Key="cut/.metadata")["Body"].read() == metadata_before
    _loads(url, previous)


def test_wrong_credentials_are_an_error_saying_so(tmp_path, monkeypatch):
    with S3Endpoint(workdir=tmp_path, server_env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}, server="moto") as guarded:
        for name, value in guarded.env().items():
            monkeypatch.setenv(name, value)
        url = "s3://guarded/ckpt"
        with pytest.raises(CheckpointException, match=r"s3://guarded/ckpt/.*access denied.*credentials"):
            dcp.save({"w": torch.ones(4)}, storage_writer=FastS3Writer(url, s3_options=IMPATIENT), no_dist=True)
        with pytest.raises(CheckpointException, match=r"s3://guarded/ckpt/\.metadata.*access denied"):
            dcp.load({"w": torch.ones(4)}, storage_reader=FastS3Reader(url, s3_options=IMPATIENT), no_dist=True)


def test_a_failed_upload_aborts_its_multipart_upload(bucket, s3_env, s3):
    url = f"s3://{bucket}/abort"
    s3_env.fault("PUT_PART", count=10_000, status=500)
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/abort/__0_\w+_\d+\.distcp"):
        dcp.save(_state(6), storage_writer=FastS3Writer(url, s3_options=IMPATIENT), no_dist=True)
    counts = s3_env.stats()
    s3_env.reset()
    assert counts["CREATE_MULTIPART"] >= 1, counts
    assert _open_uploads(s3, bucket) == []
    assert keys(s3, bucket) == set()
