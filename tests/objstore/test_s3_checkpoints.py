"""Checkpoints in S3 through a real S3-protocol server (moto's, on 127.0.0.1): bit-exact round
trips, both directions with stock's fsspec classes, the commit protocol's requests, overwrites,
failures that leave the previous checkpoint loadable, and errors that name the object."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from s3_cases import keys
from fastdcp.objstore import transfer
from fastdcp.objstore.reader import FastS3Reader
from fastdcp.objstore.writer import FastS3Writer


def _state(seed: int = 0) -> dict:
    sd = dict(C.zoo_tensors(seed))
    # Every dtype stock DCP can save (quantized ones are stored as stock torch.save blobs, which
    # the readers hand to stock's own code: here through object streams).
    sd["every_dtype"] = {C.dtype_name(dt): C.random_tensor(dt, (5, 3), (seed, "dt", str(dt))) for dt in C.all_torch_dtypes()
                         if C.dtype_name(dt) not in C.STOCK_UNSUPPORTED_DTYPES and C.dtype_name(dt) not in C.UNCOPYABLE_DTYPES}
    sd["objects"] = C.object_state_dict(seed)
    return sd


def _fsspec_reader(url: str, endpoint: str):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, endpoint_url=endpoint)


def _fsspec_writer(url: str, endpoint: str):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, endpoint_url=endpoint, sync_files=False)


def test_a_state_round_trips_bit_exact(bucket):
    url = f"s3://{bucket}/run/step1"
    sd = _state()
    dcp.save(sd, storage_writer=FastS3Writer(url), no_dist=True)
    C.load_in_place_and_check(FastS3Reader(url), C.deepcopy_state_dict(sd), C.destination_for(sd))


def test_stock_fsspec_reader_loads_what_fastdcp_wrote(bucket, s3_env):
    url = f"s3://{bucket}/fast"
    sd = _state(1)
    dcp.save(sd, storage_writer=FastS3Writer(url), no_dist=True)
    C.load_in_place_and_check(_fsspec_reader(url, s3_env.endpoint), C.deepcopy_state_dict(sd), C.destination_for(sd))


@pytest.mark.parametrize("thread_count", [1, 3])
def test_fastdcp_loads_what_stock_fsspec_writer_wrote(bucket, s3_env, thread_count):
    url = f"s3://{bucket}/stock{thread_count}"
    sd = _state(2)
    writer = _fsspec_writer(url, s3_env.endpoint)
    writer.thread_count = thread_count
    dcp.save(sd, storage_writer=writer, no_dist=True)
    C.load_in_place_and_check(FastS3Reader(url), C.deepcopy_state_dict(sd), C.destination_for(sd))


def test_a_save_sends_no_list_copy_or_rename_and_puts_metadata_last(bucket, s3_env, s3):
    url = f"s3://{bucket}/proto"
    sd = {"big": torch.randn(6 << 20), "small": torch.arange(10)}  # 24 MiB: a multipart upload
    s3_env.reset()
    dcp.save(sd, storage_writer=FastS3Writer(url), no_dist=True)
    counts = s3_env.stats()
    assert counts.get("LIST", 0) == 0 and counts.get("COPY", 0) == 0 and counts.get("DELETE", 0) == 0, counts
    assert counts["CREATE_MULTIPART"] == counts["COMPLETE_MULTIPART"] >= 1 and counts["PUT_PART"] >= 2, counts
    assert counts["PUT"] == 1, counts  # .metadata: one file of 24 MiB went as a multipart upload
    (data,) = keys(s3, bucket) - {"proto/.metadata"}  # no temp object
    assert data.endswith(".distcp")


def test_a_load_sends_ranged_gets_only(bucket, s3_env):
    url = f"s3://{bucket}/loadreq"
    sd = {f"t{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MiB
    dcp.save(sd, storage_writer=FastS3Writer(url), no_dist=True)
    s3_env.reset()
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = FastS3Reader(url)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    counts = s3_env.stats()
    assert set(counts) == {"GET"}, counts  # .metadata and ranges: no LIST, no HEAD
    assert counts["GET"] == 1 + reader.last_stats["object_requests"]


def test_an_overwrite_replaces_the_checkpoint_and_deletes_the_old_objects(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    first, second = {"w": torch.randn(1000), "step": 1}, {"w": torch.randn(1000), "step": 2}
    dcp.save(first, storage_writer=FastS3Writer(url), no_dist=True)
    old = keys(s3, bucket)
    dcp.save(second, storage_writer=FastS3Writer(url), no_dist=True)
    new = keys(s3, bucket)
    assert not (old - {"ckpt/.metadata"}) & new  # save-unique names, the replaced objects deleted
    dest = {"w": torch.zeros(1000), "step": 0}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    assert torch.equal(dest["w"], second["w"]) and dest["step"] == 2


def test_overwrite_false_refuses_an_existing_checkpoint_naming_it(bucket):
    url = f"s3://{bucket}/once"
    dcp.save({"w": torch.ones(4)}, storage_writer=FastS3Writer(url, overwrite=False), no_dist=True)
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/once/\.metadata"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=FastS3Writer(url, overwrite=False), no_dist=True)
    dest = {"w": torch.zeros(4)}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    assert torch.equal(dest["w"], torch.ones(4))


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_new_objects(bucket, s3, monkeypatch):
    url = f"s3://{bucket}/safe"
    previous = {f"t{i}": torch.randn(3 << 20) for i in range(3)}
    dcp.save(previous, storage_writer=FastS3Writer(url), no_dist=True)
    before = keys(s3, bucket)
    real_upload = transfer.upload_image
    calls = []

    def second_upload_fails(store, location, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(f"injected failure uploading {name}")
        return real_upload(store, location, name, *args, **kwargs)

    monkeypatch.setattr("fastdcp.objstore.writer.upload_image", second_upload_fails)
    with pytest.raises(CheckpointException, match="injected failure"):
        dcp.save({k: torch.zeros_like(v) for k, v in previous.items()}, storage_writer=FastS3Writer(url, thread_count=3),
                 no_dist=True)
    assert len(calls) == 3
    assert keys(s3, bucket) == before  # the uploads that completed were deleted again
    dest = {k: torch.zeros_like(v) for k, v in previous.items()}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, previous)


def test_a_truncated_object_is_an_error_naming_it(bucket, s3):
    url = f"s3://{bucket}/trunc"
    dcp.save({"w": torch.randn(1 << 20)}, storage_writer=FastS3Writer(url), no_dist=True)
    (data_key,) = [k for k in keys(s3, bucket) if k.endswith(".distcp")]
    body = s3.get_object(Bucket=bucket, Key=data_key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=data_key, Body=body[: len(body) // 2])
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/{data_key}.*(shorter|ends before|range)"):
        dcp.load({"w": torch.zeros(1 << 20)}, storage_reader=FastS3Reader(url), no_dist=True)


def test_a_deleted_object_is_an_error_naming_it(bucket, s3):
    url = f"s3://{bucket}/gone"
    dcp.save({"w": torch.randn(1000)}, storage_writer=FastS3Writer(url), no_dist=True)
    (data_key,) = [k for k in keys(s3, bucket) if k.endswith(".distcp")]
    s3.delete_object(Bucket=bucket, Key=data_key)
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/{data_key}: no such object"):
        dcp.load({"w": torch.zeros(1000)}, storage_reader=FastS3Reader(url), no_dist=True)


def test_a_missing_checkpoint_and_a_missing_bucket_are_named(bucket):
    with pytest.raises(CheckpointException, match=rf"s3://{bucket}/nothing.*not a DCP checkpoint"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=FastS3Reader(f"s3://{bucket}/nothing"), no_dist=True)
    with pytest.raises(CheckpointException, match="bucket 'no-such-bucket-fastdcp' does not exist"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=FastS3Writer("s3://no-such-bucket-fastdcp/x"), no_dist=True)


def test_a_load_fetches_each_stored_byte_about_once(bucket):
    url = f"s3://{bucket}/rows"
    full = torch.randn(4096, 1024)  # 16 MiB
    dcp.save({"w": full}, storage_writer=FastS3Writer(url), no_dist=True)
    reader = FastS3Reader(url)
    dest = {"w": torch.zeros(4096, 1024)}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert torch.equal(dest["w"], full)
    # The header pass's windows and the data runs: no byte fetched twice beyond the blob header.
    assert reader.last_stats["object_bytes"] <= full.numel() * 4 + (1 << 20)


def test_async_save_to_s3_every_step_with_a_reused_writer(bucket):
    writer = FastS3Writer(f"s3://{bucket}/async/0", async_staging=True)
    states = []
    for step in range(3):
        sd = {"w": torch.randn(2 << 20), "step": step}
        states.append(C.deepcopy_state_dict(sd))
        result = dcp.async_save(sd, storage_writer=writer, checkpoint_id=f"s3://{bucket}/async/{step}", no_dist=True)
        future = getattr(result, "upload_completion", result)
        staged = getattr(result, "staging_completion", None)
        if staged is not None:
            staged.result()  # what fastdcp.guard waits for before the optimizer step
        sd["w"].add_(1)  # training goes on; the staged copy is what is saved
        future.result()
    for step, expected in enumerate(states):
        dest = {"w": torch.zeros(2 << 20), "step": -1}
        dcp.load(dest, storage_reader=FastS3Reader(f"s3://{bucket}/async/{step}"), no_dist=True)
        C.assert_same(dest, expected)


def test_stream_transforms_are_written_and_read_by_stock_code_through_object_streams(bucket):
    url = f"s3://{bucket}/xor"
    sd = {"w": torch.randn(1000), "i": torch.arange(7)}
    dcp.save(sd, storage_writer=FastS3Writer(url, _extensions=[C.XorTransform()]), no_dist=True)
    dest = {"w": torch.zeros(1000), "i": torch.zeros(7, dtype=torch.long)}
    reader = FastS3Reader(url, C.xor_registry())
    dcp.load(dest, storage_reader=reader, no_dist=True)
    C.assert_same(dest, sd)


def test_enable_routes_s3_checkpoint_ids_to_fastdcp_and_stock_reads_the_result(bucket, s3_env):
    import fastdcp

    url = f"s3://{bucket}/enabled"
    sd = {"w": torch.randn(1000), "step": 3}
    with fastdcp.enable():
        from torch.distributed.checkpoint import _storage_utils

        assert isinstance(_storage_utils._storage_setup(None, url, reader=False), FastS3Writer)
        assert isinstance(_storage_utils._storage_setup(None, url, reader=True), FastS3Reader)
        dcp.save(sd, checkpoint_id=url, no_dist=True)
        dest = {"w": torch.zeros(1000), "step": 0}
        dcp.load(dest, checkpoint_id=url, no_dist=True)
        C.assert_same(dest, sd)
    dest = {"w": torch.zeros(1000), "step": 0}
    dcp.load(dest, storage_reader=_fsspec_reader(url, s3_env.endpoint), no_dist=True)
    C.assert_same(dest, sd)


def test_two_saves_racing_to_create_one_checkpoint_with_overwrite_false_commit_once(bucket, s3):
    import threading

    url = f"s3://{bucket}/race"
    states = [{"w": torch.full((1 << 20,), float(i)), "who": i} for i in range(2)]
    barrier = threading.Barrier(2)
    outcomes: list[tuple[int, BaseException | None]] = []

    class _Writer(FastS3Writer):
        def finish(self, metadata, results):  # both have planned and uploaded: commit together
            barrier.wait(30)
            return super().finish(metadata, results)

    def save(i: int) -> None:
        try:
            dcp.save(states[i], storage_writer=_Writer(url, overwrite=False), no_dist=True)
            outcomes.append((i, None))
        except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
            outcomes.append((i, error))

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [i for i, error in outcomes if error is None]
    losers = [error for _, error in outcomes if error is not None]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert "committed there while this save ran" in str(losers[0])
    dest = {"w": torch.zeros(1 << 20), "who": -1}
    dcp.load(dest, storage_reader=FastS3Reader(url), no_dist=True)
    C.assert_same(dest, states[winners[0]])
    assert len([k for k in keys(s3, bucket) if k.endswith(".distcp")]) == 1  # the loser's objects went


def test_a_writer_travels_pickled_as_process_mode_async_save_sends_it(bucket):
    import pickle

    url = f"s3://{bucket}/pickled"
    writer = pickle.loads(pickle.dumps(FastS3Writer(url, async_staging=True)))
    sd = {"w": torch.randn(1 << 20), "step": 5}
    dcp.save(sd, storage_writer=writer, no_dist=True)
    reader = pickle.loads(pickle.dumps(FastS3Reader(url)))
    dest = {"w": torch.zeros(1 << 20), "step": 0}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    C.assert_same(dest, sd)


def test_fastdcp_open_reads_one_tensor_or_a_slice_of_it_without_the_rest(bucket):
    import fastdcp

    url = f"s3://{bucket}/lazy"
    sd = {"big": torch.randn(2048, 1024), "other": torch.randn(4 << 20), "step": 9}
    dcp.save(sd, storage_writer=FastS3Writer(url), no_dist=True)
    with fastdcp.open(url) as ckpt:
        assert set(ckpt) == {"big", "other", "step"} and ckpt["step"] == 9
        rows = ckpt.get_slice("big")[100:110]
        C.assert_same(rows, sd["big"][100:110])
        assert ckpt._engine.bytes_fetched < (1 << 20)  # ten rows (40 KiB) and a blob header, not 24 MiB
        C.assert_same(ckpt["other"], sd["other"])


def test_convert_from_s3_to_safetensors(bucket, tmp_path):
    from safetensors.torch import load_file

    from fastdcp.cli.convert_command import ConvertOptions, run_convert

    url = f"s3://{bucket}/conv"
    sd = {"a": torch.randn(300, 40), "b": torch.arange(50, dtype=torch.int32)}
    dcp.save(sd, storage_writer=FastS3Writer(url), no_dist=True)
    run_convert(ConvertOptions(source=url, destination=str(tmp_path / "model.safetensors")))
    C.assert_same(load_file(str(tmp_path / "model.safetensors")), sd)


def test_a_missing_object_behind_a_port_with_416_in_it_is_not_read_as_a_truncated_one():
    """A ranged GET's 404 names the endpoint, whose port can hold the digits 416 (41623 once made
    a deleted object read as a truncated one); only a real 416 / InvalidRange is "truncated"."""
    from fastdcp.objstore.transfer import _range_not_satisfiable

    assert not _range_not_satisfiable(Exception("Generic S3 error: 404 Not Found at http://127.0.0.1:41623/b/k"))
    assert not _range_not_satisfiable(Exception("request id 4A416B, status 404"))
    assert _range_not_satisfiable(Exception("Client error with status 416 Range Not Satisfiable"))
    assert _range_not_satisfiable(Exception("<Error><Code>InvalidRange</Code></Error>"))
