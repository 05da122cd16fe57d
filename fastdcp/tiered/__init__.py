"""Tiered checkpoints: committed to node-local storage at memory speed, drained to a shared
directory or ``s3://`` in the background, replicated to peer nodes when asked, loaded from the
newest tier that holds them whole (or rebuilt from the nodes that survived)."""

from .drain import TieredDrainError, TieredDrainWarning
from .newest import newest_checkpoint
from .reader import FastTieredReader
from .recovery import RecoveryWarning
from .replicas import ReplicaError, ReplicaWarning
from .writer import FastTieredWriter

__all__ = ["FastTieredWriter", "FastTieredReader", "TieredDrainError", "TieredDrainWarning", "newest_checkpoint",
           "ReplicaError", "ReplicaWarning", "RecoveryWarning"]
