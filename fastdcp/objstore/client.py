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
from datetime import timedelta
from typing import Any

from .location import ObjectLocation

__all__ = [
    "S3Options",
    "ObjectStoreError",
    "ObjectNotFoundError",
    "BucketNotFoundError",
    "ObjectAccessError",
    "ObjectExistsError",
    "store_for",
    "object_error",
    "require_obstore",
]


class ObjectStoreError(OSError):
    """An object storage request failed; the message names the object (or bucket) and why."""


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """The object (or its bucket) does not exist."""


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket itself does not exist."""


class ObjectAccessError(ObjectStoreError, PermissionError):
    """The store refused the credentials, or they grant no access to the object."""


class ObjectExistsError(ObjectStoreError, FileExistsError):
    """A create-only write found the object already there."""


def require_obstore() -> Any:
    """The ``obstore`` module, or an ImportError saying how to install it."""
    try:
        import obstore
    except ImportError as error:  # pragma: no cover - the test environment has it
        raise ImportError(
            "object storage paths (s3://...) need the 'obstore' package: pip install obstore "
            "(or pip install 'fastdcp[s3]')"
        ) from error
    return obstore


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
        for name in ("max_retries",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"S3Options.{name} must be an int >= 0, got {value!r}")
        for name in ("part_bytes", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"S3Options.{name} must be a positive int, got {value!r}")
        if self.part_bytes < (5 << 20):
            raise ValueError(f"S3Options.part_bytes must be at least 5 MiB (S3's smallest part), got {self.part_bytes}")
        for name in ("retry_timeout_s", "request_timeout_s", "connect_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"S3Options.{name} must be positive, got {getattr(self, name)!r}")

    def endpoint(self) -> str | None:
        """The endpoint to use: explicit, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
        for value in (self.endpoint_url, os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")):
            if value and value.strip():
                return value.strip()
        return None

    def describe(self) -> str:
        """Where requests go, for error messages (never a secret)."""
        return self.endpoint() or "AWS S3"


_stores: dict[tuple, Any] = {}
_stores_lock = threading.Lock()


# What a user sets to give the client credentials: said by every credential error.
CREDENTIAL_HELP = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary credentials), "
    "or AWS_PROFILE naming a profile of ~/.aws/config, or pass "
    "S3Options(access_key_id=..., secret_access_key=...)"
)
# What an access-denied error asks the user to check.
_CHECK_CREDENTIALS = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE, or "
                      "S3Options.access_key_id / secret_access_key)")
# Paths of the instance metadata service: obstore's last resort for credentials. A request to one
# of them failing means that no credentials were found anywhere before it.
_METADATA_PATHS = ("/latest/api/token", "/latest/meta-data/")


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


def store_for(location: ObjectLocation, options: S3Options) -> Any:
    """The obstore store of ``location``'s bucket with ``options``: one per process, bucket, options
    and environment (client connections are pooled inside it)."""
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
        client_options: dict[str, Any] = {
            "timeout": timedelta(seconds=options.request_timeout_s),
            "connect_timeout": timedelta(seconds=options.connect_timeout_s),
            "pool_max_idle_per_host": str(max(16, options.concurrency)),
        }
        if endpoint and endpoint.startswith("http://"):
            client_options["allow_http"] = True
        retry_config = {
            "max_retries": options.max_retries,
            "retry_timeout": timedelta(seconds=options.retry_timeout_s),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
        }
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # obstore's messages carry the server's XML body and a debug dump: keep what a user reads.
    if "<Code>" in text:
        code = text.split("<Code>", 1)[1].split("<", 1)[0]
        return f"{code} ({text.splitlines()[0][:300]})"
    return text.splitlines()[0][:400] if text else type(error).__name__


def object_error(error: BaseException, url: str, action: str, options: S3Options | None = None) -> BaseException:
    """``error`` from a request on ``url`` as a fastdcp error naming the object, what was being
    done and what is wrong. Not an obstore error: returned unchanged."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover
        return error
    where = f" at {options.describe()}" if options is not None else ""
    detail = _first_line(error)
    text = str(error)
    if "NoSuchBucket" in text and isinstance(error, (ox.BaseError, FileNotFoundError)):
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return BucketNotFoundError(f"{action} {url}: the bucket '{bucket}' does not exist{where}")
    if isinstance(error, (ox.NotFoundError, FileNotFoundError)):
        return ObjectNotFoundError(f"{action} {url}: no such object{where}")
    if isinstance(error, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)):
        return ObjectAccessError(f"{action} {url}: access denied{where}: {_CHECK_CREDENTIALS}: {detail}")
    if any(path in text for path in _METADATA_PATHS):
        return ObjectAccessError(f"{action} {url}: no S3 credentials were found{where} (not in S3Options, the "
                                 f"environment, the AWS config files, nor the instance metadata service, "
                                 f"which failed: {detail}); {CREDENTIAL_HELP}")
    if isinstance(error, (ox.AlreadyExistsError, ox.PreconditionError, FileExistsError)):
        return ObjectExistsError(f"{action} {url}: the object already exists{where}")
    if isinstance(error, ox.BaseError):
        if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text or "AccessDenied" in text:
            return ObjectAccessError(f"{action} {url}: access denied{where}: {_CHECK_CREDENTIALS}: {detail}")
        return ObjectStoreError(f"{action} {url} failed{where}: {detail}")
    return error
