"""Data objects spread over sub-prefixes (``FastS3Writer(key_prefixes=N)``): two ranks' objects
under their own hex sub-prefix, the checkpoint loaded by stock's fsspec reader and by fastdcp
resharded, an overwrite deleting the replaced objects under their sub-prefixes, ``gc`` finding
what a cut-off save left there, and bad values refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from s3_cases import keys
from fastdcp import FastS3Reader, FastS3Writer
from fastdcp.cli import main as cli_main
from fastdcp.objstore.commit import is_object_name

ROWS, COLS = 64, 48


def _full() -> dict[str, torch.Tensor]:
    return {"w": C.random_tensor(torch.float32, (ROWS, COLS), ("prefixes", "w")),
            "b": C.random_tensor(torch.bfloat16, (ROWS,), ("prefixes", "b"))}


def _rank_main(rank: int, store: str, url: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with C.gloo_rank_mesh(rank, store, 2) as mesh:
        full = _full()
        state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                 "b": distribute_tensor(full["b"], mesh, [Replicate()]), "step": 5}
        dcp.save(state, storage_writer=FastS3Writer(url, key_prefixes=16))
        dest = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
                "b": distribute_tensor(torch.zeros(ROWS, dtype=torch.bfloat16), mesh, [Shard(0)]), "step": 0}
        dcp.load(dest, storage_reader=FastS3Reader(url))
        C.assert_same({"w": dest["w"].full_tensor(), "b": dest["b"].full_tensor()}, full, f"rank {rank}")
        assert dest["step"] == 5


def _data_keys(s3, bucket: str, prefix: str) -> set[str]:
    return {k[len(prefix) + 1:] for k in keys(s3, bucket, prefix + "/") if k.endswith(".distcp")}


def test_two_ranks_objects_go_under_their_sub_prefixes_and_load_with_stock(tmp_path, bucket, s3_env, s3):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"s3://{bucket}/spread"
    mp.spawn(_rank_main, args=(str(tmp_path / "pg"), url), nprocs=2, join=True)
    data = _data_keys(s3, bucket, "spread")
    assert {k.split("/")[0] for k in data} == {"0", "1"}, data
    assert all(k.split("/")[1].startswith(f"__{k.split('/')[0]}_") for k in data), data
    dest = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS, dtype=torch.bfloat16), "step": 0}
    dcp.load(dest, storage_reader=FsspecReader(url, endpoint_url=s3_env.endpoint), no_dist=True)
    C.assert_same({k: dest[k] for k in ("w", "b")}, _full())
    assert dest["step"] == 5


def test_an_overwrite_deletes_the_replaced_objects_under_their_sub_prefix(bucket, s3_env, s3, monkeypatch):
    url = f"s3://{bucket}/again"
    monkeypatch.setenv("FASTDCP_S3_KEY_PREFIXES", "256")
    first = {"t": C.random_float((1000,), (1, "t"))}
    dcp.save(first, storage_writer=FastS3Writer(url), no_dist=True)
    before = _data_keys(s3, bucket, "again")
    assert before and all(k.startswith("00/") for k in before), before
    second = {"t": C.random_float((1000,), (2, "t"))}
    dcp.save(second, storage_writer=FastS3Writer(url), no_dist=True)
    after = _data_keys(s3, bucket, "again")
    assert after and not after & before, (before, after)
    dest = {"t": torch.zeros(1000)}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, second)


def test_gc_finds_what_a_cut_off_save_left_under_a_sub_prefix(bucket, s3_env, s3, capsys):
    url = f"s3://{bucket}/cut"
    dcp.save({"t": torch.ones(10)}, storage_writer=FastS3Writer(url, key_prefixes=4), no_dist=True)
    named = _data_keys(s3, bucket, "cut")
    s3.put_object(Bucket=bucket, Key="cut/0/__0_0123456789abcdef_0.distcp", Body=b"left behind")
    s3.put_object(Bucket=bucket, Key="cut/notes/readme.txt", Body=b"not ours")
    assert cli_main(["gc", url, "--min-age-s", "0", "--delete"]) == 0
    out = capsys.readouterr().out
    assert "0/__0_0123456789abcdef_0.distcp" in out
    assert _data_keys(s3, bucket, "cut") == named
    assert "cut/notes/readme.txt" in keys(s3, bucket, "cut/")
    assert cli_main(["verify", url]) == 0
    dest = {"t": torch.zeros(10)}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, {"t": torch.ones(10)})


@pytest.mark.parametrize("value", [0, -1, 1 << 17, True, 2.0])
def test_a_bad_key_prefixes_value_is_refused(value):
    with pytest.raises(ValueError, match="key_prefixes must be an integer from 1 to 65536"):
        FastS3Writer("s3://b/p", key_prefixes=value)


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FASTDCP_S3_KEY_PREFIXES", "many")
    with pytest.raises(ValueError, match="FASTDCP_S3_KEY_PREFIXES must be an integer"):
        FastS3Writer("s3://b/p")


def test_object_names_stay_inside_the_checkpoint():
    assert is_object_name("__0_ab_0.distcp") and is_object_name("0f/__0_ab_0.distcp")
    for bad in ("", "/x", "x/", "../x", "a/../x", "a/b/c", ".", "a\\b", None, 3):
        assert not is_object_name(bad), bad


def test_a_metadata_naming_an_object_outside_the_checkpoint_is_refused(bucket, s3_env, s3):
    import io
    import pickle

    url = f"s3://{bucket}/evil"
    dcp.save({"t": torch.ones(3)}, storage_writer=FastS3Writer(url), no_dist=True)
    body = s3.get_object(Bucket=bucket, Key="evil/.metadata")["Body"].read()
    metadata = pickle.loads(body)
    for info in metadata.storage_data.values():
        info.relative_path = "../other/__0_0.distcp"
    out = io.BytesIO()
    pickle.dump(metadata, out)
    s3.put_object(Bucket=bucket, Key="evil/.metadata", Body=out.getvalue())
    with pytest.raises(CheckpointException, match=r"names a data object '\.\./other/__0_0\.distcp' outside"):
        dcp.load({"t": torch.zeros(3)}, storage_reader=FastS3Reader(url), no_dist=True)
