"""fastdcp: a fast, drop-in storage layer for PyTorch Distributed Checkpoint.

    import torch.distributed.checkpoint as dcp
    from fastdcp import FastFileSystemWriter, FastFileSystemReader
    dcp.save(state_dict, storage_writer=FastFileSystemWriter(path))
    dcp.load(state_dict, storage_reader=FastFileSystemReader(path))

The package, one stage a folder (docs/ARCHITECTURE.md walks one save and one load through it):

    format/    the on-disk form, pure: tensor blobs, .metadata, checksums
    io/        the machine: native engine options, host memory, checkpoint files, GC pauses
    save/      FastFileSystemWriter: file images, GPU ring, async staging, commit
    load/      FastFileSystemReader: header pass, pieces, CPU and GPU placement, verification
    planners/  FastSavePlanner / FastLoadPlanner: cached, bulk-built plans
    cli/       python -m fastdcp inspect | verify
"""

from __future__ import annotations

import logging
import platform

import torch

from . import _C
from .default_storage import HookNotFoundError, RestoreOnExit, disable, enable, is_enabled
from .format.blob import BlobFormatError
from .format.checksums import ChecksumError
from .format.metadata import CheckpointFormatError, CheckpointNotFoundError, add_safe_metadata_globals
from .load.lazy import ChunkInfo, LazyCheckpoint, ObjectInfo, TensorInfo, TensorSlice
from .load.lazy import open_checkpoint as open  # noqa: A001 - fastdcp.open(path), like safetensors' safe_open
from .load.reader import ConcurrentOverwriteError, FastFileSystemReader
from .planners import FastLoadPlanner, FastSavePlanner
from .save.async_staging import StagingFuture, StagingReport, wait_for_staging
from .save.guard import StagingGuard, guard
from .save.inflight import ConcurrentSaveError
from .save.staging_pool import StagingPoolStats, release_staging, set_staging_pool_limit, staging_pool_stats
from .save.writer import FastFileSystemWriter

# The library logs through this one logger and never prints: without a handler configured by the
# application, nothing appears (not even warnings through logging's last-resort handler).
logging.getLogger("fastdcp").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "FastFileSystemWriter",
    "FastFileSystemReader",
    "FastSavePlanner",
    "FastLoadPlanner",
    "BlobFormatError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ConcurrentSaveError",
    "ConcurrentOverwriteError",
    "add_safe_metadata_globals",
    "set_staging_pool_limit",
    "release_staging",
    "staging_pool_stats",
    "StagingPoolStats",
    "guard",
    "StagingGuard",
    "StagingFuture",
    "StagingReport",
    "wait_for_staging",
    "enable",
    "disable",
    "is_enabled",
    "RestoreOnExit",
    "HookNotFoundError",
    "open",
    "LazyCheckpoint",
    "TensorSlice",
    "TensorInfo",
    "ChunkInfo",
    "ObjectInfo",
    "build_info",
    "__version__",
]


def build_info() -> dict:
    """What the native extension was compiled with, and the versions around it."""
    info = dict(_C.build_info())
    info.update(
        fastdcp=__version__,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=bool(info["cuda"]) and torch.cuda.is_available(),
        python=platform.python_version(),
    )
    return info
