"""Helpers of the object storage tests (a module of its own: ``conftest`` is a name every test
folder has, so ``from conftest import`` finds whichever was imported first)."""

from __future__ import annotations


def keys(s3, bucket: str, prefix: str = "") -> set[str]:
    """Every object key in ``bucket`` under ``prefix``, listed by a boto3 client of the server."""
    paginator = s3.get_paginator("list_objects_v2")
    return {o["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])}
