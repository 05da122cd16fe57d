"""A real S3-protocol endpoint for the object storage tests (:mod:`fastdcp.bench.s3_endpoint`):
moto's server on 127.0.0.1 (the one s3fs's own suite runs against) behind a proxy process that
counts requests by S3 operation and injects error responses on demand, started once per session.
Every test gets a fresh bucket and the usual ``AWS_*`` environment pointing at the endpoint, as a
user's job would have it."""

from __future__ import annotations

import uuid

import pytest

from fastdcp.bench.s3_endpoint import S3Endpoint, S3EndpointUnavailable


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    endpoint = S3Endpoint(workdir=tmp_path_factory.mktemp("s3"))
    try:
        endpoint.start()
    except S3EndpointUnavailable as error:
        pytest.fail(f"{error} (README's test command installs it)")
    yield endpoint
    endpoint.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_endpoint.env().items():
        monkeypatch.setenv(name, value)
    if s3_endpoint.proxy is None:  # a test cut the network: give the next one a working endpoint
        s3_endpoint.start_proxy(s3_endpoint.proxy_port)
    s3_endpoint.reset()
    return s3_endpoint


def boto3_client(endpoint: str):
    import boto3

    from fastdcp.bench.s3_endpoint import client_env

    env = client_env(endpoint)
    return boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture
def s3(s3_env):
    """A boto3 client of the test server itself (not through the proxy, so it is not counted):
    to look at or damage objects the way another program would."""
    return boto3_client(s3_env.server_endpoint)


@pytest.fixture
def bucket(s3_env):
    name = f"fastdcp-{uuid.uuid4().hex[:12]}"
    s3_env.create_bucket(name)
    return name
