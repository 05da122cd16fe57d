"""A local Azure Blob Storage server for the benchmark and the tests: Azurite (Microsoft's Azure
Storage emulator, ``npm install -g azurite``), its blob service bound to 127.0.0.1 on a free port,
telemetry off, data in a working directory; stopped with the endpoint.

Clients reach it through the counting proxy of the S3 server (:mod:`fastdcp.bench.s3_proxy`, which
names Azure's operations as S3's: Put Block is ``PUT_PART``, List Blobs ``LIST``) and the usual
environment, a connection string with Azurite's well-known development account
(:meth:`AzureEndpoint.env`), which fastdcp, adlfs (stock's fsspec path) and the Azure SDK read."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from .s3_endpoint import ProxiedServer, _free_port, _wait_listening

__all__ = ["AzureEndpoint", "AzureEndpointUnavailable", "ACCOUNT", "azurite_binary"]

# Azurite's development account: a published name and key, valid against the emulator only.
ACCOUNT = "devstoreaccount1"
_ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class AzureEndpointUnavailable(RuntimeError):
    """Azurite is not installed or did not start."""


def azurite_binary() -> str | None:
    """The path of Azurite's blob service (``azurite-blob``), or None."""
    return shutil.which("azurite-blob")


class AzureEndpoint(ProxiedServer):
    """An Azurite blob service on 127.0.0.1. ``endpoint``: its blob endpoint URL."""

    def __init__(self, workdir: str | os.PathLike | None = None, delay_ms: float = 0.0) -> None:
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="fastdcp_azure_"))
        self.delay_ms = float(delay_ms)  # the proxy's one-way delay
        self.server: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None
        self.port = 0
        self.proxy_port = 0

    @property
    def upstream_port(self) -> int:
        return self.port

    def start(self) -> "AzureEndpoint":
        binary = azurite_binary()
        if binary is None:
            raise AzureEndpointUnavailable("Azurite is not installed: npm install -g azurite")
        data = self.workdir / "azurite"
        data.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "azurite.log"
        self.port = _free_port()
        command = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", str(data),
                   "--disableTelemetry",  # by default it reports usage to a public address
                   "--skipApiVersionCheck", "--loose", "--silent"]
        self.server = subprocess.Popen(command, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=data, start_new_session=True)
        try:
            _wait_listening(self.port, self.server, log, "Azurite's blob service", timeout=120)
            self.start_proxy()
        except Exception as error:
            self.stop()
            raise AzureEndpointUnavailable(str(error)) from error
        return self

    def version(self) -> str | None:
        """Azurite's version (``azurite-blob --version``), or None."""
        binary = azurite_binary()
        if binary is None:
            return None
        try:
            done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        text = done.stdout.strip()
        return text.splitlines()[-1] if done.returncode == 0 and text else None

    @property
    def endpoint(self) -> str:
        """The blob endpoint clients use (through the proxy)."""
        return f"http://127.0.0.1:{self.proxy_port}/{ACCOUNT}"

    @property
    def server_endpoint(self) -> str:
        """Azurite's own blob endpoint (not counted)."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def _connection(self, endpoint: str) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={_ACCOUNT_KEY};"
                f"BlobEndpoint={endpoint};")

    @property
    def connection_string(self) -> str:
        return self._connection(self.endpoint)

    def env(self) -> dict[str, str]:
        """The environment a client of this server uses."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    @contextlib.contextmanager
    def exported(self) -> Iterator["AzureEndpoint"]:
        """:meth:`env` in ``os.environ`` while the block runs, the previous values restored after."""
        saved = {name: os.environ.get(name) for name in self.env()}
        os.environ.update(self.env())
        try:
            yield self
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def service(self):
        """An Azure SDK client of the server (to create containers, or look at blobs as another
        program would)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self._connection(self.server_endpoint))

    def create_container(self, name: str) -> None:
        self.service().create_container(name)

    def blob_names(self, container: str, prefix: str = "") -> set[str]:
        return {b.name for b in self.service().get_container_client(container).list_blobs(name_starts_with=prefix)}
