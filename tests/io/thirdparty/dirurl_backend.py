"""A storage backend as a third-party package would write one: ``dirurl:///abs/path`` names a
local directory, served by fastdcp's own directory classes. Registered by a call
(:func:`fastdcp.register_backend`) or by the ``fastdcp.backends`` entry point of its distribution."""

from __future__ import annotations

import os

import fastdcp
from fastdcp.tiered.shared_tier import DirectoryTier

SCHEME = "dirurl"


def to_path(checkpoint_id: str | os.PathLike) -> str:
    text = os.fspath(checkpoint_id)
    return text[len(SCHEME) + 3:] if text.startswith(f"{SCHEME}://") else text


class DirUrlWriter(fastdcp.FastFileSystemWriter):
    def __init__(self, path: str, **kwargs):
        super().__init__(to_path(path), **kwargs)

    def reset(self, checkpoint_id=None):
        super().reset(to_path(checkpoint_id) if checkpoint_id else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith(f"{SCHEME}://")


class DirUrlReader(fastdcp.FastFileSystemReader):
    def __init__(self, path: str, **kwargs):
        super().__init__(to_path(path), **kwargs)

    def reset(self, checkpoint_id=None):
        super().reset(to_path(checkpoint_id) if checkpoint_id else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith(f"{SCHEME}://")


def open_checkpoint(url: str, **kwargs):
    return fastdcp.open(to_path(url), **kwargs)


def file_store(url: str, **options) -> DirectoryTier:
    return DirectoryTier(to_path(url))


BACKEND = fastdcp.Backend(
    "dirurl", (SCHEME,), writer="dirurl_backend:DirUrlWriter", reader="dirurl_backend:DirUrlReader",
    opener="dirurl_backend:open_checkpoint", file_store="dirurl_backend:file_store")
