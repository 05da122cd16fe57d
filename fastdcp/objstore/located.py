"""What an object storage writer and reader share: being at one checkpoint location, moved by
DCP's ``reset(checkpoint_id)``, with the client and the object streams of that location."""

from __future__ import annotations

import os
from typing import Any

from .client import S3Options, store_for
from .location import ObjectLocation, is_object_url
from .streams import ObjectStreams

__all__ = ["AtObjectLocation"]


class AtObjectLocation:
    """Mixin placed before a stock-derived writer or reader class. ``_settle`` is called once the
    stock constructor ran (which set ``path`` to a ``pathlib.Path`` that folds ``s3://`` into
    ``s3:/``)."""

    location: ObjectLocation
    s3_options: S3Options

    def _settle(self, location: ObjectLocation, s3_options: S3Options | None) -> None:
        self.location = location
        self.s3_options = s3_options if s3_options is not None else S3Options()
        self.path = location.url()
        # Items fastdcp leaves to stock code are read and written by it through object streams.
        self.fs = ObjectStreams(location, self.s3_options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_object_url(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return self.location.url()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        location = ObjectLocation.parse(checkpoint_id) if checkpoint_id else self.location
        super().reset(None)  # type: ignore[misc]
        self._settle(location, self.s3_options)

    def _store(self) -> Any:
        return store_for(self.location, self.s3_options)
