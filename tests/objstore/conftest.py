"""A real S3-protocol server for the object storage tests: moto's server (``moto_server``, the
one s3fs's own suite runs against), started on 127.0.0.1 once per session, with its access log
kept so tests can count the requests a save or load sent. Every test gets a fresh bucket and the
usual ``AWS_*`` environment pointing at the server, as a user's job would have it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class S3Server:
    endpoint: str
    log_path: Path
    process: subprocess.Popen

    def log_mark(self) -> int:
        """Where the access log ends now (see :meth:`requests_since`)."""
        return self.log_path.stat().st_size

    def requests_since(self, mark: int) -> list[tuple[str, str]]:
        """(method, path with query) of every request the server logged after ``mark``."""
        deadline = time.time() + 2
        text = ""
        while time.time() < deadline:  # the server logs a request just after answering it
            with open(self.log_path, "rb") as f:
                f.seek(mark)
                text = f.read().decode(errors="replace")
            time.sleep(0.1)
            with open(self.log_path, "rb") as f:
                f.seek(mark)
                if f.read().decode(errors="replace") == text:
                    break
        return re.findall(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.1"', text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(log_path: Path, env: dict[str, str] | None = None) -> S3Server:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.fail("the object storage tests need moto's server: pip install 'moto[server]' (README's test command)")
    port = _free_port()
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return S3Server(f"http://127.0.0.1:{port}", log_path, process)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("moto_server did not start listening within 60 s")


def stop(server: S3Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_moto(tmp_path_factory.mktemp("moto") / "access.log")
    yield server
    stop(server)


def client_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "fastdcp-test",
        "AWS_SECRET_ACCESS_KEY": "fastdcp-test-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in client_env(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    return s3_server


def boto3_client(endpoint: str):
    import boto3

    env = client_env(endpoint)
    return boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture
def s3(s3_env):
    """A boto3 client of the test server (to set up buckets and to look at or damage objects
    the way another program would)."""
    return boto3_client(s3_env.endpoint)


@pytest.fixture
def bucket(s3):
    name = f"fastdcp-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def keys(s3, bucket: str, prefix: str = "") -> set[str]:
    paginator = s3.get_paginator("list_objects_v2")
    return {o["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])}
