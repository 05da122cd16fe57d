"""Checkpoints in Azure Blob Storage through a real Azure Storage server (Azurite, on 127.0.0.1,
behind the counting proxy): bit-exact round trips, both directions with stock's fsspec classes
(adlfs), ``enable()`` with ``az://`` and ``abfs://`` ids, ``dcp.async_save``, a tiered drain,
``fastdcp.open`` and the CLI, the commit's requests, create-only commits, and errors that name the
blob or the container."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
import fastdcp
from fastdcp import AzureOptions, FastAzureReader, FastAzureWriter, FastTieredReader, FastTieredWriter
from fastdcp.cli import main as cli_main
from fastdcp.objstore.client import BucketNotFoundError, ObjectAccessError


def _state(seed: int = 0) -> dict:
    sd = dict(C.zoo_tensors(seed))
    sd["objects"] = C.object_state_dict(seed)
    return sd


def _errors(exception: CheckpointException) -> list[BaseException]:
    """The errors DCP wrapped, one per failed rank."""
    return [failure[0] if isinstance(failure, tuple) else failure for failure in exception.failures.values()]


def test_a_state_round_trips_bit_exact(container):
    url = f"az://{container}/run/step1"
    sd = _state()
    dcp.save(sd, storage_writer=FastAzureWriter(url), no_dist=True)
    C.load_in_place_and_check(FastAzureReader(url), C.deepcopy_state_dict(sd), C.destination_for(sd))


def test_stock_fsspec_reader_loads_what_fastdcp_wrote(container):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"abfs://{container}/fast"
    sd = _state(1)
    dcp.save(sd, storage_writer=FastAzureWriter(url), no_dist=True)
    C.load_in_place_and_check(FsspecReader(url), C.deepcopy_state_dict(sd), C.destination_for(sd))


def test_fastdcp_loads_what_stock_fsspec_writer_wrote(container):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"abfs://{container}/stock"
    sd = _state(2)
    dcp.save(sd, storage_writer=FsspecWriter(url, sync_files=False), no_dist=True)
    C.load_in_place_and_check(FastAzureReader(url), C.deepcopy_state_dict(sd), C.destination_for(sd))


@pytest.mark.parametrize("scheme", ["az", "abfs"])
def test_enable_saves_and_loads_azure_urls_with_fastdcp(container, scheme):
    url = f"{scheme}://{container}/enabled"
    sd = {"w": torch.randn(1000, 33), "step": 7}
    with fastdcp.enable():
        dcp.save(sd, checkpoint_id=url, no_dist=True)
        loaded = {"w": torch.zeros(1000, 33), "step": 0}
        dcp.load(loaded, checkpoint_id=url, no_dist=True)
    C.assert_same(loaded, sd)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    stock = {"w": torch.zeros(1000, 33), "step": 0}
    dcp.load(stock, storage_reader=FsspecReader(f"abfs://{container}/enabled"), no_dist=True)
    C.assert_same(stock, sd)


def test_a_save_sends_no_list_or_copy_and_puts_metadata_last(container, azure_env):
    url = f"az://{container}/proto"
    sd = {"big": torch.randn(6 << 20), "small": torch.arange(10)}  # 24 MiB: uploaded in blocks
    azure_env.reset()
    dcp.save(sd, storage_writer=FastAzureWriter(url), no_dist=True)
    counts = azure_env.stats()
    assert counts.get("LIST", 0) == 0 and counts.get("COPY", 0) == 0 and counts.get("DELETE", 0) == 0, counts
    assert counts["COMPLETE_MULTIPART"] >= 1 and counts["PUT_PART"] >= 2, counts
    assert counts["PUT"] == 1, counts  # .metadata, after the data blob's block list
    names = azure_env.blob_names(container, "proto/")
    assert "proto/.metadata" in names and all(n.endswith(".distcp") for n in names - {"proto/.metadata"}), names


def test_a_resharded_load_reads_only_the_ranges_it_needs(container, azure_env):
    url = f"az://{container}/ranged"
    sd = {"w": torch.randn(4096, 1024)}  # 16 MiB
    dcp.save(sd, storage_writer=FastAzureWriter(url), no_dist=True)
    ckpt = fastdcp.open(url)
    azure_env.reset()
    rows = ckpt["w"][100:108]
    assert torch.equal(rows, sd["w"][100:108])
    counts = azure_env.stats()
    assert counts.get("LIST", 0) == 0 and counts.get("GET", 0) >= 1, counts


def test_async_save_to_azure(container):
    url = f"az://{container}/async"
    sd = _state(3)
    expected = C.deepcopy_state_dict(sd)
    result = dcp.async_save(sd, storage_writer=FastAzureWriter(url, async_staging=True), no_dist=True)
    getattr(result, "upload_completion", result).result()
    C.load_in_place_and_check(FastAzureReader(url), C.deepcopy_state_dict(expected), C.destination_for(expected))


def test_a_create_only_save_refuses_an_existing_checkpoint_naming_it(container):
    url = f"az://{container}/once"
    dcp.save({"a": torch.ones(4)}, storage_writer=FastAzureWriter(url, overwrite=False), no_dist=True)
    with pytest.raises((CheckpointException, RuntimeError)) as info:
        dcp.save({"a": torch.zeros(4)}, storage_writer=FastAzureWriter(url, overwrite=False), no_dist=True)
    assert f"az://{container}/once" in str(info.value)
    loaded = {"a": torch.zeros(4)}
    dcp.load(loaded, storage_reader=FastAzureReader(url), no_dist=True)
    assert torch.equal(loaded["a"], torch.ones(4))


def test_a_tiered_checkpoint_drains_to_azure_and_loads_from_it(container, tmp_path):
    url = f"az://{container}/tiered/step1"
    sd = _state(4)
    writer = FastTieredWriter(url, local_root=tmp_path / "local")
    dcp.save(sd, storage_writer=writer, no_dist=True)
    writer.wait_durable(120)
    shutil.rmtree(tmp_path / "local")  # the node is gone: the load must come from Azure
    reader = FastTieredReader(url, local_root=tmp_path / "local")
    C.load_in_place_and_check(reader, C.deepcopy_state_dict(sd), C.destination_for(sd))
    assert reader.tier == "shared"
    newest = fastdcp.tiered.newest_checkpoint(f"az://{container}/tiered", local_root=tmp_path / "local")
    assert newest == url


def test_open_and_the_cli_read_an_azure_checkpoint(container, capsys):
    url = f"az://{container}/cli"
    sd = {"w": torch.randn(64, 8), "b": torch.arange(5)}
    dcp.save(sd, storage_writer=FastAzureWriter(url), no_dist=True)
    with fastdcp.open(url) as ckpt:
        assert torch.equal(ckpt["w"][:], sd["w"]) and torch.equal(ckpt["b"][:], sd["b"])
    assert cli_main(["inspect", "--json", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {t["fqn"] for t in report["tensors"]} >= {"w", "b"}, report
    assert cli_main(["verify", url]) == 0


def test_a_missing_container_is_named(azure_env):
    url = "az://fastdcp-no-such-container/run"
    with pytest.raises(CheckpointException) as info:
        dcp.save({"a": torch.ones(4)}, storage_writer=FastAzureWriter(url, azure_options=AzureOptions(max_retries=0)),
                 no_dist=True)
    errors = _errors(info.value)
    assert any(isinstance(e, BucketNotFoundError) and "the container 'fastdcp-no-such-container' does not exist"
               in str(e) for e in errors), errors


def test_a_wrong_account_key_is_an_access_error_saying_what_to_set(container, azure_env, monkeypatch):
    wrong = azure_env.connection_string.replace("AccountKey=Eby8", "AccountKey=Zby8")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    url = f"az://{container}/denied"
    with pytest.raises(CheckpointException) as info:
        dcp.save({"a": torch.ones(4)}, storage_writer=FastAzureWriter(url, azure_options=AzureOptions(max_retries=0)),
                 no_dist=True)
    errors = _errors(info.value)
    assert any(isinstance(e, ObjectAccessError) and url in str(e) and "AZURE_STORAGE_CONNECTION_STRING" in str(e)
               for e in errors), errors


def test_options_of_the_other_store_are_refused_naming_the_url(container):
    with pytest.raises(ValueError, match="s3_options was given for az://"):
        fastdcp.open(f"az://{container}/x", s3_options=fastdcp.S3Options())


def test_gc_lists_and_removes_a_data_blob_no_metadata_names(container, azure_env, capsys):
    url = f"az://{container}/gc"
    sd = {"w": torch.randn(256, 4)}
    dcp.save(sd, storage_writer=FastAzureWriter(url), no_dist=True)
    committed = azure_env.blob_names(container, "gc/")
    stray = "gc/__0_0123456789abcdef_0.distcp"  # what a save cut before its commit leaves
    azure_env.service().get_blob_client(container, stray).upload_blob(b"x" * 1000)
    assert cli_main(["gc", url, "--min-age-s", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["committed"] and [o["name"] for o in report["leftover"]] == [stray.removeprefix("gc/")], report
    assert azure_env.blob_names(container, "gc/") == committed | {stray}  # a dry run deletes nothing
    assert cli_main(["gc", url, "--min-age-s", "0", "--delete", "--json"]) == 0
    capsys.readouterr()
    assert azure_env.blob_names(container, "gc/") == committed
    loaded = {"w": torch.zeros(256, 4)}
    dcp.load(loaded, storage_reader=FastAzureReader(url), no_dist=True)
    assert torch.equal(loaded["w"], sd["w"])


def test_azure_options_read_the_connection_string_and_the_account_of_an_abfs_url(monkeypatch):
    from fastdcp.objstore.location import ObjectLocation

    for name in [n for n in __import__("os").environ if n.startswith("AZURE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5PQ==;EndpointSuffix=core.windows.net")
    settings = AzureOptions().settings()
    assert settings == {"account_name": "acct", "account_key": "a2V5PQ=="}  # a key ending in '=' kept whole
    assert AzureOptions(account_name="other", sas_token="?sv=1").settings() == {"account_name": "other",
                                                                                 "sas_key": "sv=1"}
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    location = ObjectLocation.parse("abfss://box@mine.dfs.core.windows.net/run/step1")
    assert (location.bucket, location.host, location.key("x")) == ("box", "mine.dfs.core.windows.net", "run/step1/x")
    assert location.url("x") == "abfss://box@mine.dfs.core.windows.net/run/step1/x"
    assert AzureOptions().settings(location) == {"account_name": "mine"}
    with pytest.raises(ValueError, match="AzureOptions.part_bytes must be at least 1 MiB"):
        AzureOptions(part_bytes=1000)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName")
    with pytest.raises(ValueError, match="is not Key=value"):
        AzureOptions().settings()
