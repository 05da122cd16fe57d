"""Credential and configuration errors of the S3 client, against the real local server: each one
fails the save with fastdcp's error naming the checkpoint URL and the settings that fix it (no
error swallowed on the way, no internal panic, no lookup of a metadata service reported raw)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fastdcp import FastS3Writer, ObjectAccessError, ObjectStoreError, S3Options

# Nothing answers on port 9 of the loopback: the instance metadata service is refused at once
# (whatever machine the test runs on), and the client gives up quickly.
NO_METADATA = (("metadata_endpoint", "http://127.0.0.1:9"),)
IMPATIENT = S3Options(max_retries=1, retry_timeout_s=3, connect_timeout_s=2, request_timeout_s=10,
                      extra_config=NO_METADATA)

_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                         "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                         "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def _without_credentials(monkeypatch, tmp_path) -> None:
    """An environment with no credential anywhere: no key variables, empty AWS config files,
    boto3's instance metadata lookup off."""
    for name in _CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "aws_config"
    config.write_text("[profile other]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no_credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _save_error(url: str, options: S3Options = IMPATIENT) -> BaseException:
    """The exception rank 0's save of a small state failed with."""
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(4)}, storage_writer=FastS3Writer(url, s3_options=options), no_dist=True)
    error, _trace = info.value.failures[0]
    return error


def _says_how_to_set_credentials(message: str) -> None:
    for setting in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "S3Options(access_key_id="):
        assert setting in message, (setting, message)


def test_no_credentials_at_all_is_an_access_error_saying_what_to_set(bucket, s3_env, monkeypatch, tmp_path):
    _without_credentials(monkeypatch, tmp_path)
    url = f"s3://{bucket}/nocreds"
    error = _save_error(url)
    assert isinstance(error, ObjectAccessError), repr(error)
    message = str(error)
    assert url in message and "no S3 credentials were found" in message, message
    _says_how_to_set_credentials(message)


def test_a_missing_profile_is_an_access_error_naming_the_profile(bucket, s3_env, monkeypatch, tmp_path):
    _without_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_PROFILE", "fastdcp-no-such-profile")
    url = f"s3://{bucket}/profile"
    error = _save_error(url)
    assert isinstance(error, ObjectAccessError), repr(error)
    message = str(error)
    assert url in message and "AWS_PROFILE='fastdcp-no-such-profile'" in message, message
    assert str(tmp_path / "aws_config") in message, message
    _says_how_to_set_credentials(message)


def test_a_key_without_its_secret_is_an_access_error(bucket, s3_env, monkeypatch, tmp_path):
    _without_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fastdcp-test")
    url = f"s3://{bucket}/half"
    error = _save_error(url)
    assert isinstance(error, ObjectAccessError), repr(error)
    message = str(error)
    assert f"s3://{bucket}/half" in message and "incomplete credentials" in message, message
    _says_how_to_set_credentials(message)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "ftp://127.0.0.1:9000", "http://"])
def test_an_endpoint_that_is_not_a_url_names_the_variable(bucket, s3_env, monkeypatch, endpoint):
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    url = f"s3://{bucket}/endpoint"
    error = _save_error(url)
    assert type(error) is ObjectStoreError, repr(error)
    message = str(error)
    assert url in message and repr(endpoint) in message and "set AWS_ENDPOINT_URL to" in message, message


def test_an_explicit_endpoint_option_is_named_as_the_source(bucket, s3_env):
    url = f"s3://{bucket}/option"
    options = S3Options(endpoint_url="localhost:9000", max_retries=0, extra_config=NO_METADATA)
    error = _save_error(url, options)
    assert type(error) is ObjectStoreError and "S3Options.endpoint_url" in str(error), repr(error)


def test_the_right_credentials_still_save(bucket, s3_env):
    """The narrowed error handling keeps the working configuration working."""
    url = f"s3://{bucket}/fine"
    dcp.save({"w": torch.ones(4)}, storage_writer=FastS3Writer(url, s3_options=IMPATIENT), no_dist=True)
