"""``python -m fastdcp gc s3://...``: what a save cut off before it could clean up leaves in the
bucket, listed (a dry run), then removed with ``--delete``; the committed checkpoint, objects a
save may still own and objects DCP would not write are kept. Against the real S3 server of the
suite, the save made to fail by the proxy in front of it (its commit and its cleanup refused)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from s3_cases import keys
from fastdcp import FastS3Reader, FastS3Writer, S3Options
from fastdcp.cli import main

IMPATIENT = S3Options(max_retries=1, retry_timeout_s=2, connect_timeout_s=2, request_timeout_s=10)


def _state(seed: int) -> dict:
    # 12 MiB tensors: every data object goes up as a multipart upload, so a refused PUT is the commit's
    return {f"t{i}": C.random_float((3 << 20,), (seed, i)) for i in range(4)}


def _save_cut_before_commit(s3_env, url: str, seed: int) -> None:
    """A save whose data objects are stored, whose commit (the .metadata PUT) fails, and whose
    cleanup of its objects fails too: what a save cut off by the network leaves."""
    s3_env.fault("PUT", count=10_000, status=500)
    s3_env.fault("DELETE", count=10_000, status=500)
    try:
        with pytest.raises(CheckpointException, match=r"\.metadata"):
            dcp.save(_state(seed), storage_writer=FastS3Writer(url, s3_options=IMPATIENT), no_dist=True)
    finally:
        s3_env.reset()


def _gc(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["gc", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _names(rows: list[dict]) -> set[str]:
    return {row["name"] for row in rows}


def test_gc_lists_then_removes_what_a_cut_save_left_and_keeps_the_checkpoint(bucket, s3_env, s3, capsys):
    url = f"s3://{bucket}/ckpt"
    previous = _state(1)
    dcp.save(previous, storage_writer=FastS3Writer(url), no_dist=True)
    committed = keys(s3, bucket)
    s3.put_object(Bucket=bucket, Key="ckpt/notes.txt", Body=b"a person's notes")
    _save_cut_before_commit(s3_env, url, seed=2)
    left = {k.removeprefix("ckpt/") for k in keys(s3, bucket) - committed} - {"notes.txt"}
    assert left and all(name.startswith("__0_") and name.endswith(".distcp") for name in left), left

    # Within the minimum age the objects may belong to a save still running: kept.
    rc, report = _gc(capsys, url)
    assert rc == 0 and report["committed"] and not report["leftover"], report
    assert _names(report["recent"]) == left and _names(report["other"]) == {"notes.txt"}
    assert _names(report["named"]) == {k.removeprefix("ckpt/") for k in committed}

    # Older than the minimum age: listed, nothing deleted without --delete.
    rc, report = _gc(capsys, url, "--min-age-s", "0")
    assert rc == 0 and _names(report["leftover"]) == left and report["deleted"] is False, report
    assert keys(s3, bucket) == committed | {"ckpt/notes.txt"} | {f"ckpt/{n}" for n in left}

    rc, report = _gc(capsys, url, "--min-age-s", "0", "--delete")
    assert rc == 0 and report["failed"] == [], report
    assert keys(s3, bucket) == committed | {"ckpt/notes.txt"}
    dest = {k: torch.zeros_like(v) for k, v in previous.items()}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, previous)

    # The command's own output, as a user runs it: nothing is left to delete.
    run = subprocess.run([sys.executable, "-m", "fastdcp", "gc", url, "--min-age-s", "0"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{url}: a committed checkpoint" in run.stdout and "nothing to delete" in run.stdout, run.stdout


def test_without_a_committed_checkpoint_every_old_data_object_is_left_over(bucket, s3_env, s3, capsys):
    url = f"s3://{bucket}/never"
    _save_cut_before_commit(s3_env, url, seed=3)
    stored = {k.removeprefix("never/") for k in keys(s3, bucket, "never/")}
    assert stored
    rc, report = _gc(capsys, url, "--min-age-s", "0", "--delete")
    assert rc == 0 and not report["committed"] and _names(report["leftover"]) == stored, report
    assert keys(s3, bucket, "never/") == set()


def test_a_damaged_metadata_collects_nothing(bucket, s3_env, s3, capsys):
    url = f"s3://{bucket}/damaged"
    _save_cut_before_commit(s3_env, url, seed=4)
    s3.put_object(Bucket=bucket, Key="damaged/.metadata", Body=b"not a pickle")
    before = keys(s3, bucket)
    assert main(["gc", url, "--min-age-s", "0", "--delete"]) == 1
    err = capsys.readouterr().err
    assert "DAMAGED" in err and "damaged/.metadata" in err and "none is collected" in err, err
    assert keys(s3, bucket) == before


def test_gc_is_for_object_storage(tmp_path, capsys):
    assert main(["gc", str(tmp_path)]) == 2
    assert "A local directory needs no gc" in capsys.readouterr().err
