"""Tiered checkpoints: committed to node-local storage at memory speed, drained to a shared
directory or ``s3://`` in the background, loaded from the newest tier that holds them whole."""

from .drain import TieredDrainError, TieredDrainWarning
from .newest import newest_checkpoint
from .reader import FastTieredReader
from .writer import FastTieredWriter

__all__ = ["FastTieredWriter", "FastTieredReader", "TieredDrainError", "TieredDrainWarning", "newest_checkpoint"]
