"""What an object storage writer and reader share: being at one checkpoint location, moved by
DCP's ``reset(checkpoint_id)``, with the client and the object streams of that location."""

from __future__ import annotations

import inspect
import os
from typing import Any

from .client import AzureOptions, S3Options, default_options, store_for
from .location import SCHEMES, ObjectLocation, is_object_url
from .streams import ObjectStreams

__all__ = ["AtObjectLocation", "options_signature"]


class AtObjectLocation:
    """Mixin placed before a stock-derived writer or reader class. ``_settle`` is called once the
    stock constructor ran (which set ``path`` to a ``pathlib.Path`` that folds ``s3://`` into
    ``s3:/``)."""

    location: ObjectLocation
    store_options: S3Options | AzureOptions

    def _settle(self, location: ObjectLocation, options: S3Options | AzureOptions | None) -> None:
        self.location = location
        self.store_options = options if options is not None else default_options(location)
        self.path = location.url()
        # Items fastdcp leaves to stock code are read and written by it through object streams.
        self.fs = ObjectStreams(location, self.store_options)

    @property
    def s3_options(self) -> S3Options | AzureOptions:
        """The store's options (:class:`S3Options`, or :class:`AzureOptions` for Azure Blob)."""
        return self.store_options

    # The URL schemes the class serves (its subclasses narrow them to one store).
    schemes: tuple[str, ...] = SCHEMES

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_object_url(checkpoint_id) and str(checkpoint_id).split("://", 1)[0].lower() in cls.schemes

    @property
    def checkpoint_id(self) -> str:
        return self.location.url()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        location = ObjectLocation.parse(checkpoint_id) if checkpoint_id else self.location
        super().reset(None)  # type: ignore[misc]
        self._settle(location, self.store_options)

    def _store(self) -> Any:
        return store_for(self.location, self.store_options)


def options_signature(init: Any, keyword: str, options_type: type) -> inspect.Signature:
    """``init``'s signature with its ``store_options`` parameter named ``keyword`` (typed
    ``options_type``): what a store's writer or reader class shows for its one-keyword constructor."""
    signature = inspect.signature(init)
    parameters = [p.replace(name=keyword, annotation=f"{options_type.__name__} | None") if p.name == "store_options"
                  else p for p in signature.parameters.values()]
    return signature.replace(parameters=parameters)
