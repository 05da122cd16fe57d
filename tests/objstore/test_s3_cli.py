"""``python -m fastdcp inspect`` and ``verify`` of checkpoints in S3 (the test server): what they
report for fastdcp's and stock's checkpoints, and the damage they name by object URL."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3_cases import keys
from fastdcp.cli import main
from fastdcp.objstore.writer import FastS3Writer


def _state() -> dict:
    g = torch.Generator().manual_seed(4)
    return {"layer.weight": torch.randn(64, 32, generator=g), "layer.bias": torch.randn(64, generator=g).bfloat16(),
            "scalar": torch.tensor(3.5), "step": 7}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _data_key(s3, bucket: str, prefix: str) -> str:
    (key,) = [k for k in keys(s3, bucket, prefix) if k.endswith(".distcp")]
    return key


@pytest.mark.parametrize("writer", ["fastdcp", "stock"])
def test_inspect_reports_tensors_objects_and_leftovers(bucket, s3, s3_env, capsys, writer):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"s3://{bucket}/run/{writer}"
    storage_writer = (FastS3Writer(url) if writer == "fastdcp"
                      else FsspecWriter(url, endpoint_url=s3_env.endpoint, sync_files=False, single_file_per_rank=True))
    dcp.save(_state(), storage_writer=storage_writer, no_dist=True)
    data_key = _data_key(s3, bucket, f"run/{writer}/")
    s3.put_object(Bucket=bucket, Key=f"run/{writer}/left_over.distcp", Body=b"x")
    code, out, err = _run(capsys, "inspect", url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["path"] == url and report["metadata_files"] == [".metadata"]
    tensors = {t["fqn"]: t for t in report["tensors"]}
    assert tensors["layer.weight"]["shape"] == [64, 32] and tensors["layer.bias"]["dtype"] == "bfloat16"
    assert [b["fqn"] for b in report["byte_items"]] == ["step"]
    (f,) = report["files"]
    assert f["name"] == data_key.rsplit("/", 1)[1]
    assert f["size"] == s3.head_object(Bucket=bucket, Key=data_key)["ContentLength"]
    assert report["unreferenced_files"] == ["left_over.distcp"]
    assert report["writer"].startswith("fastdcp" if writer == "fastdcp" else "torch.save")


def test_verify_checks_recorded_checksums_and_names_the_damaged_object(bucket, s3, capsys):
    url = f"s3://{bucket}/sums"
    dcp.save(_state(), storage_writer=FastS3Writer(url, checksums=True), no_dist=True)
    code, out, _ = _run(capsys, "verify", url)
    assert code == 0 and "OK" in out and "4 of 4 recorded checksums match" in out, out
    data_key = _data_key(s3, bucket, "sums/")
    body = bytearray(s3.get_object(Bucket=bucket, Key=data_key)["Body"].read())
    report = json.loads(_run(capsys, "inspect", url, "--json")[1])
    assert report["files"][0]["size"] == len(body)
    # a byte of the largest tensor's data (its blob is at least 8 KiB, its data in the middle)
    body[len(body) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=data_key, Body=bytes(body))
    code, out, _ = _run(capsys, "verify", url)
    assert code == 1 and "checksum mismatch" in out and f"s3://{bucket}/{data_key}" in out, out
    assert "3 of 4 recorded checksums match" in out


def test_verify_names_a_truncated_and_a_missing_object(bucket, s3, capsys):
    url = f"s3://{bucket}/cut"
    dcp.save(_state(), storage_writer=FastS3Writer(url), no_dist=True)
    data_key = _data_key(s3, bucket, "cut/")
    body = s3.get_object(Bucket=bucket, Key=data_key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=data_key, Body=body[: len(body) // 2])
    code, out, _ = _run(capsys, "verify", url)
    assert code == 1 and "DAMAGED" in out and f"s3://{bucket}/{data_key}" in out and "past the end" in out, out
    s3.delete_object(Bucket=bucket, Key=data_key)
    code, out, _ = _run(capsys, "verify", url)
    assert code == 1 and f"s3://{bucket}/{data_key}" in out and "no such object" in out, out


def test_no_checkpoint_and_no_bucket_are_usage_errors_naming_the_url(bucket, capsys):
    for url in (f"s3://{bucket}/nothing", "s3://fastdcp-no-such-bucket/x"):
        for command in ("inspect", "verify"):
            code, _, err = _run(capsys, command, url)
            assert code == 2 and url.split("/x")[0] in err and "error:" in err, (command, err)
