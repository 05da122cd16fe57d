"""pytest configuration for the fastdcp test-suite.

* puts the repository root (for ``import fastdcp`` without installing) and this
  directory (for ``import dcp_cases``) on ``sys.path`` -- also inherited by
  worker processes started with the ``spawn`` method;
* a per-test wall-clock limit (SIGALRM) so that a hang fails instead of blocking
  forever.  Default 300 s, override with ``FASTDCP_TEST_TIMEOUT`` (seconds, 0 =
  off) or ``@pytest.mark.fastdcp_timeout(seconds)``.  Disabled when the
  ``pytest-timeout`` plugin is active;
* a real S3-protocol endpoint for the tests that ask for it (``s3_endpoint``, ``s3_env``, ``s3``,
  ``bucket``; :mod:`fastdcp.bench.s3_endpoint`): a SeaweedFS server on 127.0.0.1 (``weed mini``,
  telemetry off; ``FASTDCP_S3_SERVER=moto`` runs the same tests against moto's server) behind a
  proxy process that counts requests by S3 operation and injects error responses on demand,
  started once per session when first asked for. Tests that check moto's own behaviour start
  moto's server themselves. Every test gets a
  fresh bucket and the usual ``AWS_*`` environment pointing at the endpoint, as a user's job
  would have it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
for _p in (_TESTS_DIR, _REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)


_XDIST_WORKER = False  # this pytest process is a pytest-xdist worker (its reports reach a controller)


def pytest_configure(config):
    global _XDIST_WORKER
    # Asked of this process's own config: a pytest started from inside a worker (a test that runs
    # a suite) inherits the worker's PYTEST_XDIST_WORKER environment but is not a worker.
    _XDIST_WORKER = hasattr(config, "workerinput")
    config.addinivalue_line(
        "markers",
        "fastdcp_timeout(seconds): per-test wall-clock limit enforced with SIGALRM",
    )
    config.addinivalue_line(
        "markers",
        "cuda: runs a GPU code path (skips without a CUDA device); `pytest -m cuda` is the GPU "
        "acceptance command's test step",
    )
    # Stock DCP warns on every no_dist save/load; keep the output readable.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning",
    )


def pytest_runtest_logreport(report):
    """With FASTDCP_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens (under pytest-xdist, by the controlling process): a run cut off by a time limit, as a
    lent GPU machine's is, still says why what failed failed (xdist prints tracebacks only at the
    end)."""
    _log_failure(report, report.when)


def pytest_collectreport(report):
    """A module that cannot even be collected (an import error) is logged the same way."""
    _log_failure(report, "collect")


def _log_failure(report, when: str) -> None:
    path = os.environ.get("FASTDCP_FAILURE_LOG")
    if not path or not report.failed or _XDIST_WORKER:
        return  # an xdist worker's reports reach the controlling process, which logs them
    with open(path, "a") as log:
        log.write(f"=== {report.nodeid} ({when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def _fastdcp_per_test_timeout(request):
    if (
        request.config.pluginmanager.hasplugin("timeout")
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGALRM")
    ):
        yield
        return
    marker = request.node.get_closest_marker("fastdcp_timeout")
    seconds = int(marker.args[0]) if marker else int(os.environ.get("FASTDCP_TEST_TIMEOUT", "300"))
    if seconds <= 0:
        yield
        return

    def _on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded its {seconds}s wall-clock limit (hang?)")

    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    from fastdcp.bench.s3_endpoint import S3Endpoint, S3EndpointUnavailable

    endpoint = S3Endpoint(workdir=tmp_path_factory.mktemp("s3"))
    try:
        endpoint.start()
    except S3EndpointUnavailable as error:
        pytest.fail(f"{error} (README's test command installs it)")
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="session")
def azure_endpoint(tmp_path_factory):
    """Azurite's blob service for the session (README's test command installs it)."""
    from fastdcp.bench.azure_endpoint import AzureEndpoint, AzureEndpointUnavailable

    endpoint = AzureEndpoint(workdir=tmp_path_factory.mktemp("azure"))
    try:
        endpoint.start()
    except AzureEndpointUnavailable as error:
        pytest.fail(f"{error} (README's test command installs it)")
    yield endpoint
    endpoint.stop()


@pytest.fixture
def azure_env(azure_endpoint, monkeypatch):
    """The ``AZURE_STORAGE_*`` environment of the session's Azurite, and nothing else of Azure's."""
    for name in list(os.environ):
        if name.startswith("AZURE_"):
            monkeypatch.delenv(name)
    for name, value in azure_endpoint.env().items():
        monkeypatch.setenv(name, value)
    return azure_endpoint


@pytest.fixture
def container(azure_env):
    name = f"fastdcp-{uuid.uuid4().hex[:12]}"
    azure_env.create_container(name)
    return name


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
