"""Azure Blob Storage through the same object-store client as S3: ``az://container/prefix`` and
fsspec's ``abfs://container/prefix`` (also ``abfs[s]://container@account.dfs.core.windows.net/prefix``).

Configuration follows Azure's conventions: ``AZURE_STORAGE_CONNECTION_STRING`` (what Azurite and
adlfs use), else ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` or
``AZURE_STORAGE_SAS_TOKEN``, ``AZURE_STORAGE_ENDPOINT`` for a store that is not Azure's cloud, and
the client's own chain (service principal, managed identity, Azure CLI). Explicit
:class:`AzureOptions` fields win over all of it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from .errors import ObjectAccessError, ObjectStoreError, require_obstore
from .location import ObjectLocation
from .settings import check_transfer_fields, client_settings

__all__ = ["AzureOptions", "AZURE_SCHEMES", "azure_store", "AZURE_CREDENTIAL_HELP"]

AZURE_SCHEMES = ("az", "abfs", "abfss")

AZURE_CREDENTIAL_HELP = (
    "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
    "AZURE_STORAGE_SAS_TOKEN, or pass AzureOptions(account_name=..., account_key=...)"
)


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=value;...`` of an Azure Storage connection string (keys as written, values whole:
    an account key may end in ``=``)."""
    fields: dict[str, str] = {}
    for part in text.strip().split(";"):
        if part.strip():
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"AZURE_STORAGE_CONNECTION_STRING: {part!r} is not Key=value")
            fields[key.strip()] = value.strip()
    return fields


@dataclass(frozen=True)
class AzureOptions:
    """How to reach Azure Blob Storage. Unset fields come from the environment (module docstring).

    Args:
        account_name / account_key / sas_token: the storage account and a key or SAS token.
        connection_string: a whole connection string (as ``AZURE_STORAGE_CONNECTION_STRING``).
        endpoint_url: the blob endpoint of a store that is not Azure's cloud (Azurite:
            ``http://127.0.0.1:10000/devstoreaccount1``).
        max_retries / retry_timeout_s / request_timeout_s / connect_timeout_s: as :class:`S3Options`.
        part_bytes: the block size of uploads and the ranged-GET request size.
        concurrency: requests in flight per process. extra_config: further obstore ``AzureConfig`` keys.
    """

    account_name: str | None = None
    account_key: str | None = None
    sas_token: str | None = None
    connection_string: str | None = None
    endpoint_url: str | None = None
    max_retries: int = 10
    retry_timeout_s: float = 180.0
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    part_bytes: int = 16 << 20
    concurrency: int = 16
    extra_config: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        check_transfer_fields(self, 1 << 20, "1 MiB")

    def _connection(self) -> dict[str, str]:
        text = self.connection_string or os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or ""
        return parse_connection_string(text) if text.strip() else {}

    def settings(self, location: ObjectLocation | None = None) -> dict[str, str]:
        """The account, credential and endpoint to configure, explicit fields first, then the
        connection string, then the account named by an ``abfs://container@account...`` URL (the
        client reads the remaining ``AZURE_*`` variables itself)."""
        conn = self._connection()
        found: dict[str, str] = {}
        account = self.account_name or conn.get("AccountName")
        if not account and location is not None and location.host:
            account = location.host.split(".", 1)[0]
        if account:
            found["account_name"] = account
        key = self.account_key or (None if self.sas_token else conn.get("AccountKey"))
        if key:
            found["account_key"] = key
        sas = self.sas_token or (None if self.account_key else conn.get("SharedAccessSignature"))
        if sas:
            found["sas_key"] = sas.lstrip("?")
        endpoint = self.endpoint_url or conn.get("BlobEndpoint")
        if endpoint:
            found["endpoint"] = endpoint.rstrip("/")
        return found

    def endpoint(self) -> str | None:
        """The blob endpoint when one is set (explicit, connection string, ``AZURE_STORAGE_ENDPOINT``)."""
        value = self.settings().get("endpoint") or os.environ.get("AZURE_STORAGE_ENDPOINT") \
            or os.environ.get("AZURE_ENDPOINT")
        return value.strip() if value and value.strip() else None

    def describe(self) -> str:
        """Where requests go, for error messages (never a secret)."""
        endpoint = self.endpoint()
        if endpoint:
            return endpoint
        account = self.settings().get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        return f"Azure Blob Storage (account {account})" if account else "Azure Blob Storage"

    def check_credentials(self) -> str:
        """What an access-denied error asks the user to check."""
        return f"check the credentials: {AZURE_CREDENTIAL_HELP}"


_stores: dict[tuple, Any] = {}
_stores_lock = threading.Lock()
_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT", "AZURE_CLIENT_ID", "AZURE_TENANT_ID")


def azure_store(location: ObjectLocation, options: AzureOptions) -> Any:
    """The obstore Azure store of ``location``'s container with ``options``: one per process,
    container, options and environment. Errors name the URL and the settings to check."""

    obstore = require_obstore()
    from obstore.store import AzureStore

    key = (os.getpid(), location.bucket, location.host, options, tuple(os.environ.get(n) for n in _ENV))
    with _stores_lock:
        store = _stores.get(key)
        if store is not None:
            return store
        try:
            settings = options.settings(location)
        except ValueError as error:
            raise ObjectStoreError(f"cannot set up the Azure client for {location.url()}: {error}") from error
        config: dict[str, Any] = {**dict(options.extra_config), **settings}
        endpoint = settings.get("endpoint")
        client_options, retry_config = client_settings(options, endpoint)
        try:
            store = AzureStore(location.bucket, config=config, client_options=client_options, retry_config=retry_config)
        except obstore.exceptions.BaseError as error:
            text = str(error).strip().splitlines()[0][:400] if str(error).strip() else type(error).__name__
            if any(word in text for word in ("account", "Account", "credential", "Credential", "key", "Key")):
                raise ObjectAccessError(f"cannot set up the Azure client for {location.url()} ({options.describe()}): "
                                        f"{text}; {AZURE_CREDENTIAL_HELP}") from error
            raise ObjectStoreError(f"cannot set up the Azure client for {location.url()} ({options.describe()}): "
                                   f"{text}; check AZURE_STORAGE_ENDPOINT (or AzureOptions.endpoint_url)") from error
        _stores[key] = store
        return store
