"""Bounded fuzzing of the two parsers that read untrusted checkpoint bytes (issue 6):
``fastdcp.format.metadata.parse_metadata`` (``.metadata`` pickles) and ``fastdcp.format.blob_parse.parse_tensor_blob``
(torch.save zip blobs). Inputs are real files from both writers, mutated by hypothesis (flips,
overwrites, truncation, insertion, deletion, duplication). Each call must return a valid result or
raise the documented error type, never anything else, and finish within 2 s. Derandomized so CI
runs the same examples every time."""

from __future__ import annotations

import io
import pathlib
import pickle
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from fastdcp import FastFileSystemWriter
from fastdcp.format.blob import BlobFormatError, tensor_blob_layout
from fastdcp.format.blob_parse import TensorBlobInfo, parse_tensor_blob
from fastdcp.format.metadata import CheckpointFormatError, parse_metadata

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TIME_LIMIT = 2.0


def _build_inputs() -> tuple[dict[str, bytes], dict[str, bytes]]:
    import tempfile

    metadata, blobs = {}, {}
    state = {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "h": torch.ones(3, dtype=torch.float16),
        "step": 3,
        "raw": io.BytesIO(b"abc"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for kind, writer in (("stock", FileSystemWriter), ("fast", FastFileSystemWriter)):
            path = pathlib.Path(tmp) / kind
            dcp.save(state, storage_writer=writer(path), no_dist=True)  # a Path: pathlib in .metadata
            metadata[kind] = (path / ".metadata").read_bytes()
            md = pickle.loads(metadata[kind])
            if kind == "stock":
                # Protocol 2 has no frames: length-changing mutations then get past the framing.
                metadata["stock_protocol2"] = pickle.dumps(md, protocol=2)
            info = md.storage_data[MetadataIndex("w", (0, 0))]
            data = (path / info.relative_path).read_bytes()
            blobs[f"{kind}_dcp"] = data[info.offset : info.offset + info.length]
    buf = io.BytesIO()
    torch.save(torch.arange(12, dtype=torch.int64).reshape(3, 4).T, buf)  # non-contiguous stride
    blobs["stock_strided"] = buf.getvalue()
    t = torch.arange(5, dtype=torch.bfloat16)
    layout = tensor_blob_layout(t, 0, force_zip64=True)
    blobs["fast_zip64"] = layout.head + t.view(torch.uint8).numpy().tobytes() + layout.tail
    return metadata, blobs


METADATA, BLOBS = _build_inputs()


@st.composite
def _mutated(draw, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "byte", "int", "truncate", "insert", "delete", "duplicate"]))
        n = len(data)
        pos = draw(st.integers(0, max(0, n - 1)))
        if op == "flip" and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and n:
            data[pos] = draw(st.integers(0, 255))
        elif op == "int" and n >= 4:  # an interesting little-endian number (lengths, offsets, counts)
            value = draw(st.sampled_from([0, 1, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, n, n + 1]))
            pos = min(pos, n - 4)
            data[pos : pos + 4] = value.to_bytes(4, "little")
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 64))]
        elif op == "duplicate":
            end = min(n, pos + draw(st.integers(1, 64)))
            data[pos:pos] = data[pos:end]
    return bytes(data)


def _check_metadata(data: bytes) -> None:
    started = time.perf_counter()
    try:
        md = parse_metadata(data, "fuzzed.metadata")
    except CheckpointFormatError as e:
        assert "fuzzed.metadata" in str(e)
    else:
        # Whatever loads is real, validated metadata made of the stock classes.
        assert type(md) is Metadata
        for key, info in md.storage_data.items():
            assert type(key) is MetadataIndex and type(info) is _StorageInfo
            assert type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
            assert type(info.relative_path) is str
    assert time.perf_counter() - started < TIME_LIMIT


@pytest.mark.parametrize("kind", sorted(METADATA))
@FUZZ
@given(data=st.data())
def test_fuzz_metadata(kind, data):
    _check_metadata(data.draw(_mutated(METADATA[kind])))


@FUZZ
@given(data=st.binary(max_size=512))
def test_fuzz_metadata_random_bytes(data):
    _check_metadata(b"\x80\x04" + data)


def _check_blob(blob: bytes, head_len: int, tail_len: int) -> None:
    n = len(blob)
    head = blob[:head_len]
    tail = blob[max(0, n - tail_len) :]

    def read_more(offset: int, nbytes: int) -> bytes:
        assert 0 <= offset and 0 <= nbytes and offset + nbytes <= n, (offset, nbytes, n)
        return blob[offset : offset + nbytes]

    started = time.perf_counter()
    try:
        info = parse_tensor_blob(head, tail, n, read_more, "fuzzed.distcp")
    except BlobFormatError as e:
        assert "fuzzed.distcp" in str(e)
    else:
        assert type(info) is TensorBlobInfo
        assert 0 <= info.data_offset and info.data_offset + info.storage_nbytes <= n
        if info.numel:  # every addressed element lies inside the storage
            last = info.storage_offset + sum((s - 1) * st_ for s, st_ in zip(info.size, info.stride))
            assert (last + 1) * info.itemsize <= info.storage_nbytes
    assert time.perf_counter() - started < TIME_LIMIT


@pytest.mark.parametrize("kind", sorted(BLOBS))
@FUZZ
@given(data=st.data())
def test_fuzz_tensor_blob(kind, data):
    blob = data.draw(_mutated(BLOBS[kind]))
    head_len = data.draw(st.sampled_from([0, 64, 512, 8192, len(blob)]))
    tail_len = data.draw(st.sampled_from([0, 22, 4096, len(blob)]))
    _check_blob(blob, min(head_len, len(blob)), min(tail_len, len(blob)))


@FUZZ
@given(data=st.binary(max_size=1024))
def test_fuzz_tensor_blob_random_bytes(data):
    _check_blob(data, len(data), len(data))


def test_unmutated_inputs_parse():
    """The fuzz bases are valid: the fuzzers start from inputs that get deep into both parsers."""
    for data in METADATA.values():
        assert type(parse_metadata(data, "m")) is Metadata
    for blob in BLOBS.values():
        assert parse_tensor_blob(blob, blob, len(blob), None, "b").numel > 0
