"""Helpers of the object storage tests (a module of its own: ``conftest`` is a name every test
folder has, so ``from conftest import`` finds whichever was imported first)."""

from __future__ import annotations


def keys(s3, bucket: str, prefix: str = "") -> set[str]:
    """Every object key in ``bucket`` under ``prefix``, listed by a boto3 client of the server."""
    paginator = s3.get_paginator("list_objects_v2")
    return {o["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])}


def client(endpoint: str):
    """A boto3 client of ``endpoint`` with the test server's credentials (for spawned ranks, which
    have no fixtures)."""
    import boto3

    from fastdcp.bench.s3_endpoint import client_env

    env = client_env(endpoint)
    return boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


def index_name(s3, bucket: str, prefix: str) -> str:
    """The chunk index object the checkpoint's ``.metadata`` names in its first bytes."""
    from fastdcp.format.index_link import find_chunk_index_name

    head = s3.get_object(Bucket=bucket, Key=f"{prefix}/.metadata", Range="bytes=0-4095")["Body"].read()
    name = find_chunk_index_name(head)
    assert name is not None, "the .metadata names no chunk index"
    return name


def section_span(index: bytes, rank: int) -> tuple[int, int]:
    """(offset, length) of rank ``rank``'s section in a version 2 chunk index."""
    from fastdcp.format.index_layout import DIRECTORY_ENTRY
    from fastdcp.format.index_sections import read_index_header
    from fastdcp.format.sources import BufferSource

    header = read_index_header(BufferSource(index), "test")
    at = header.v2.directory_offset + rank * DIRECTORY_ENTRY.size
    offset, length, _, _ = DIRECTORY_ENTRY.unpack(index[at:at + DIRECTORY_ENTRY.size])
    return offset, length


def flipped(data: bytes, at: int) -> bytes:
    """``data`` with one bit of byte ``at`` flipped."""
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)
