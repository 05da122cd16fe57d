"""Object storage errors: each names the object (or bucket, or container), what was being done and
what is wrong, whatever the store (S3, Azure Blob)."""

from __future__ import annotations

from typing import Any

__all__ = ["ObjectStoreError", "ObjectNotFoundError", "BucketNotFoundError", "ObjectAccessError",
           "ObjectExistsError", "object_error", "require_obstore"]

# What a user sets to give the S3 client credentials: said by every S3 credential error.
CREDENTIAL_HELP = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary credentials), "
    "or AWS_PROFILE naming a profile of ~/.aws/config, or pass "
    "S3Options(access_key_id=..., secret_access_key=...)"
)


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



# Paths of the instance metadata service: obstore's last resort for credentials. A request to one
# of them failing means that no credentials were found anywhere before it.
_METADATA_PATHS = ("/latest/api/token", "/latest/meta-data/")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # obstore's messages carry the server's XML body and a debug dump: keep what a user reads.
    if "<Code>" in text:
        code = text.split("<Code>", 1)[1].split("<", 1)[0]
        return f"{code} ({text.splitlines()[0][:300]})"
    return text.splitlines()[0][:400] if text else type(error).__name__


def object_error(error: BaseException, url: str, action: str, options: Any = None) -> BaseException:
    """``error`` from a request on ``url`` as a fastdcp error naming the object, what was being
    done and what is wrong. Not an obstore error: returned unchanged."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover
        return error
    where = f" at {options.describe()}" if options is not None else ""
    check = options.check_credentials() if options is not None else "check the credentials"
    detail = _first_line(error)
    text = str(error)
    if "NoSuchBucket" in text and isinstance(error, (ox.BaseError, FileNotFoundError)):
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return BucketNotFoundError(f"{action} {url}: the bucket '{bucket}' does not exist{where}")
    if "ContainerNotFound" in text and isinstance(error, (ox.BaseError, FileNotFoundError)):
        container = url.split("://", 1)[-1].split("/", 1)[0].split("@", 1)[0]
        return BucketNotFoundError(f"{action} {url}: the container '{container}' does not exist{where}")
    if isinstance(error, (ox.NotFoundError, FileNotFoundError)):
        return ObjectNotFoundError(f"{action} {url}: no such object{where}")
    if isinstance(error, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)):
        return ObjectAccessError(f"{action} {url}: access denied{where}: {check}: {detail}")
    if any(path in text for path in _METADATA_PATHS) and url.startswith("s3://"):
        return ObjectAccessError(f"{action} {url}: no S3 credentials were found{where} (not in S3Options, the "
                                 f"environment, the AWS config files, nor the instance metadata service, "
                                 f"which failed: {detail}); {CREDENTIAL_HELP}")
    if isinstance(error, (ox.AlreadyExistsError, ox.PreconditionError, FileExistsError)):
        return ObjectExistsError(f"{action} {url}: the object already exists{where}")
    if isinstance(error, ox.BaseError):
        if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                                        "AuthenticationFailed", "AuthorizationFailure")):
            return ObjectAccessError(f"{action} {url}: access denied{where}: {check}: {detail}")
        return ObjectStoreError(f"{action} {url} failed{where}: {detail}")
    return error
