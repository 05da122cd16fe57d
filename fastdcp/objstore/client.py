"""The object storage client: an ``obstore`` S3 store configured the way AWS tools are, and its
errors turned into ones that name the object and what is wrong.

Configuration follows the ecosystem's conventions, so an S3-compatible store works with no code
change: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_REGION``
(or ``AWS_DEFAULT_REGION``), ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for a store that is not
AWS (``http://`` endpoints are allowed for that endpoint only), web identity and instance
credentials through obstore's own chain, and, when no key is in the environment and ``boto3`` is
installed, boto3's credential chain (``AWS_PROFILE``, ``~/.aws/config``, SSO). Explicit
:class:`S3Options` fields win over all of it.

Retries: the client retries throttling (503 SlowDown), server errors and timeouts with
exponential backoff and jitter, up to ``max_retries`` within ``retry_timeout_s``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from .azure import AZURE_SCHEMES, AzureOptions, azure_store
from .errors import (CREDENTIAL_HELP, BucketNotFoundError, _first_line, ObjectAccessError, ObjectExistsError, ObjectNotFoundError,
                     ObjectStoreError, object_error, require_obstore)
from .location import ObjectLocation
from .settings import check_transfer_fields, client_settings

__all__ = [
    "S3Options",
    "AzureOptions",
    "default_options",
    "options_for",
    "ObjectStoreError",
    "ObjectNotFoundError",
    "BucketNotFoundError",
    "ObjectAccessError",
    "ObjectExistsError",
    "store_for",
    "object_error",
    "require_obstore",
]


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store. Unset fields come from the environment (see the module
    docstring).

    ``endpoint_url``: a store that is not AWS (``http://127.0.0.1:9000``); ``region``;
    ``access_key_id`` / ``secret_access_key`` / ``session_token``: explicit credentials;
    ``max_retries`` / ``retry_timeout_s``: retries of throttled, failed and timed-out requests;
    ``request_timeout_s``: one request's limit; ``connect_timeout_s``.
    ``part_bytes``: the multipart upload part and the ranged-GET request size (16 MiB: the top
    of S3's recommended 8-16 MB ranges, so a round trip is paid per 16 MiB; ``concurrency`` such
    requests' responses are in memory at once during a load).
    ``concurrency``: requests in flight per process (one S3 connection carries ~90 MB/s; 16
    fill ~10 Gb/s). ``extra_config``: further obstore ``S3Config`` keys."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    max_retries: int = 10
    retry_timeout_s: float = 180.0
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    part_bytes: int = 16 << 20
    concurrency: int = 16
    extra_config: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        check_transfer_fields(self, 5 << 20, "5 MiB (S3's smallest part)")

    def endpoint(self) -> str | None:
        """The endpoint to use: explicit, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
        for value in (self.endpoint_url, os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")):
            if value and value.strip():
                return value.strip()
        return None

    def describe(self) -> str:
        """Where requests go, for error messages (never a secret)."""
        return self.endpoint() or "AWS S3"

    def check_credentials(self) -> str:
        """What an access-denied error asks the user to check."""
        return _CHECK_CREDENTIALS


_stores: dict[tuple, Any] = {}
_stores_lock = threading.Lock()


_CHECK_CREDENTIALS = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE, or "
                      "S3Options.access_key_id / secret_access_key)")


def _credential_provider(location: ObjectLocation, options: S3Options) -> Any:
    """boto3's credential chain when no key is given or in the environment and boto3 is installed
    (profiles, SSO, ``~/.aws``), else None (obstore's own chain: environment, web identity,
    container and instance credentials). A broken AWS configuration (a missing profile, a
    half-written or unparsable config file) raises :class:`ObjectAccessError` naming ``location``."""
    if options.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    try:
        import boto3  # noqa: F401
        from botocore.exceptions import BotoCoreError
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    try:
        return Boto3CredentialProvider()
    except ValueError:  # boto3's chain found no credentials at all: obstore's own chain may
        return None
    except BotoCoreError as error:
        raise ObjectAccessError(_aws_config_message(location, options, error)) from error


def _aws_config_message(location: ObjectLocation, options: S3Options, error: BaseException) -> str:
    """What is wrong with the AWS configuration boto3 read for ``location``, and how to fix it."""
    profile = os.environ.get("AWS_PROFILE")
    config_file = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    credentials_file = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    source = f"AWS_PROFILE={profile!r}" if profile else "the default profile"
    return (f"cannot get S3 credentials for {location.url()} ({options.describe()}): the AWS configuration "
            f"({source}, {config_file}, {credentials_file}) is invalid: {error}. Fix that profile or file, "
            f"or {CREDENTIAL_HELP}")


def _endpoint_source(options: S3Options) -> str:
    """Which setting :meth:`S3Options.endpoint` took the endpoint from."""
    if options.endpoint_url and options.endpoint_url.strip():
        return "S3Options.endpoint_url"
    if (os.environ.get("AWS_ENDPOINT_URL_S3") or "").strip():
        return "AWS_ENDPOINT_URL_S3"
    return "AWS_ENDPOINT_URL"


def _check_endpoint(location: ObjectLocation, options: S3Options, endpoint: str) -> None:
    """Raise :class:`ObjectStoreError` unless ``endpoint`` is an http:// or https:// URL with a host
    (the client would otherwise fail each request with an internal panic)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise ObjectStoreError(
            f"cannot set up the S3 client for {location.url()}: the endpoint {endpoint!r} (from "
            f"{_endpoint_source(options)}) is not an http:// or https:// URL with a host; set "
            f"{_endpoint_source(options)} to one, such as http://127.0.0.1:9000, or unset it for AWS S3")


def _setup_error(location: ObjectLocation, options: S3Options, error: BaseException) -> ObjectStoreError:
    """The client refused its configuration: :class:`ObjectAccessError` for credentials, else
    :class:`ObjectStoreError` naming the settings that configure it."""
    detail = _first_line(error)
    where = f"{location.url()} ({options.describe()})"
    if any(word in str(error) for word in ("AccessKey", "SecretAccessKey", "Credential", "credential", "Token")):
        return ObjectAccessError(f"cannot set up the S3 client for {where}: incomplete credentials ({detail}); "
                                 f"{CREDENTIAL_HELP}")
    return ObjectStoreError(f"cannot set up the S3 client for {where}: {detail}; check AWS_REGION / "
                            f"AWS_ENDPOINT_URL (or S3Options.region / endpoint_url / extra_config)")


def default_options(location: ObjectLocation) -> S3Options | AzureOptions:
    """The options of a store reached through its environment alone: :class:`AzureOptions` for
    ``az://`` and ``abfs://``, else :class:`S3Options`."""
    return AzureOptions() if location.scheme in AZURE_SCHEMES else S3Options()


def options_for(location: ObjectLocation, s3_options: S3Options | None = None,
                azure_options: AzureOptions | None = None) -> S3Options | AzureOptions:
    """The options for ``location``'s store from a call's ``s3_options`` / ``azure_options`` (the one
    of the other store is an error naming the URL), else from the environment alone."""
    azure = location.scheme in AZURE_SCHEMES
    wrong, right = ("s3_options", "azure_options") if azure else ("azure_options", "s3_options")
    if (s3_options if azure else azure_options) is not None:
        raise ValueError(f"{wrong} was given for {location.url()}, which is "
                         f"{'Azure Blob Storage' if azure else 'S3'}: pass {right}")
    chosen = azure_options if azure else s3_options
    return chosen if chosen is not None else default_options(location)


def store_for(location: ObjectLocation, options: S3Options | AzureOptions | None) -> Any:
    """The obstore store of ``location``'s bucket or container with ``options`` (None: from the
    environment): one per process, bucket, options and environment (connections pooled inside)."""
    if options is None:
        options = default_options(location)
    if location.scheme in AZURE_SCHEMES:
        if not isinstance(options, AzureOptions):
            raise TypeError(f"{location.url()} is Azure Blob Storage: pass AzureOptions, not {type(options).__name__}")
        return azure_store(location, options)
    if not isinstance(options, S3Options):
        raise TypeError(f"{location.url()} is S3: pass S3Options, not {type(options).__name__}")
    return _s3_store(location, options)


def _s3_store(location: ObjectLocation, options: S3Options) -> Any:
    obstore = require_obstore()
    from obstore.store import S3Store

    endpoint = options.endpoint()
    env_key = tuple(os.environ.get(name) for name in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"))
    key = (os.getpid(), location.scheme, location.bucket, options, env_key)
    with _stores_lock:
        store = _stores.get(key)
        if store is not None:
            return store
        config: dict[str, Any] = dict(options.extra_config)
        if endpoint:
            _check_endpoint(location, options, endpoint)
            config["endpoint"] = endpoint
        region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        config["region"] = region or "us-east-1"
        for name in ("access_key_id", "secret_access_key", "session_token"):
            value = getattr(options, name)
            if value:
                config[name] = value
        client_options, retry_config = client_settings(options, endpoint)
        provider = _credential_provider(location, options)
        kwargs: dict[str, Any] = dict(config=config, client_options=client_options, retry_config=retry_config)
        if provider is not None:
            kwargs["credential_provider"] = provider
        try:
            store = S3Store(location.bucket, **kwargs)
        except obstore.exceptions.BaseError as error:
            raise _setup_error(location, options, error) from error
        _stores[key] = store
        return store
