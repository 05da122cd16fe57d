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
    compat/    the torch internals fastdcp relies on, and how it follows each release
"""

from __future__ import annotations

import logging
import platform

import torch

from .compat.torch_internals import TorchInternalsMissing, require_internals

# First: on a torch that lacks an internal fastdcp relies on, refuse here with one error naming the
# torch version and each missing piece (fastdcp/compat/torch_internals.py), not deep inside a module.
require_internals()


def _acceptance_bootstrap() -> bool:
    """True while ``python -m fastdcp.bench gpu-acceptance`` imports this package: on a fresh
    machine that command builds the extension itself (in a child process), so it must start
    before ``fastdcp._C`` exists. (During ``python -m``'s package import, ``sys.argv`` is
    ``["-m", <the module's arguments>...]``.)"""
    import sys

    return sys.argv[:2] == ["-m", "gpu-acceptance"]


# Every module reaches the extension through fastdcp/_native.py, which says in one ImportError why
# it cannot be loaded (fastdcp/_extension_error.py); here, first, so that `import fastdcp` says it.
try:
    from ._native import _C  # noqa: E402
except ImportError:
    if not _acceptance_bootstrap():
        raise
    _C = None  # the acceptance command orchestrates only; its children import the built package

if _C is not None:  # noqa: E402 - the public API, once the extension is there
    from .default_storage import HookNotFoundError, RestoreOnExit, disable, enable, is_enabled  # noqa: E402
    from .format.blob import BlobFormatError  # noqa: E402
    from .format.checksums import ChecksumError  # noqa: E402
    from .format.metadata import CheckpointFormatError, CheckpointNotFoundError, add_safe_metadata_globals  # noqa: E402
    from .load.lazy import ChunkInfo, LazyCheckpoint, ObjectInfo, TensorInfo, TensorSlice  # noqa: E402
    from .objstore.lazy import open_any as open  # noqa: A001,E402 - fastdcp.open(path or s3:// URL), like safe_open
    from .load.deadline import LoadDeadlineError  # noqa: E402
    from .load.reader import ConcurrentOverwriteError, FastFileSystemReader  # noqa: E402
    from .load.read_once import ReadOnceError  # noqa: E402
    from .planners import FastLoadPlanner, FastSavePlanner, clear_plan_caches  # noqa: E402
    from .save.async_staging import StagingFuture, StagingReport, wait_for_staging  # noqa: E402
    from .save.guard import StagingGuard, guard  # noqa: E402
    from .save.inflight import ConcurrentSaveError  # noqa: E402
    from .save.staging_pool import StagingPoolStats, release_staging, set_staging_pool_limit, staging_pool_stats  # noqa: E402
    from .save.writer import FastFileSystemWriter  # noqa: E402
    from .save.warm_up import WarmUpReport, warm_up  # noqa: E402
    from .io.pinned_pool import PinnedPoolStats, pinned_pool_stats, set_pinned_pool_limit  # noqa: E402
    from .io.backends import Backend, backends, register_backend  # noqa: E402
    from .objstore.client import (AzureOptions, ObjectAccessError, ObjectExistsError, ObjectNotFoundError,  # noqa: E402
                                  ObjectStoreError, S3Options)
    from .objstore.reader import FastAzureReader, FastObjectReader, FastS3Reader  # noqa: E402
    from .objstore.writer import FastAzureWriter, FastObjectWriter, FastS3Writer  # noqa: E402
    from .tiered import (FastTieredReader, FastTieredWriter, RecoveryWarning, ReplicaError,  # noqa: E402
                         ReplicaWarning, TieredDrainError, TieredDrainWarning)

# The library logs through this one logger and never prints: without a handler configured by the
# application, nothing appears (not even warnings through logging's last-resort handler).
logging.getLogger("fastdcp").addHandler(logging.NullHandler())

__version__ = "0.1.0"
# `fastdcp.open` is public but not in __all__: `from fastdcp import *` must not shadow the builtin open.
__all__ = [
    "FastFileSystemWriter",
    "FastFileSystemReader",
    "FastS3Writer",
    "FastS3Reader",
    "FastAzureWriter",
    "FastAzureReader",
    "FastObjectWriter",
    "FastObjectReader",
    "AzureOptions",
    "Backend",
    "register_backend",
    "backends",
    "FastTieredWriter",
    "FastTieredReader",
    "TieredDrainError",
    "TieredDrainWarning",
    "ReplicaError",
    "ReplicaWarning",
    "RecoveryWarning",
    "S3Options",
    "ObjectStoreError",
    "ObjectNotFoundError",
    "ObjectAccessError",
    "ObjectExistsError",
    "FastSavePlanner",
    "FastLoadPlanner",
    "clear_plan_caches",
    "BlobFormatError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ConcurrentSaveError",
    "ConcurrentOverwriteError",
    "ReadOnceError",
    "LoadDeadlineError",
    "add_safe_metadata_globals",
    "set_staging_pool_limit",
    "release_staging",
    "staging_pool_stats",
    "StagingPoolStats",
    "warm_up",
    "WarmUpReport",
    "set_pinned_pool_limit",
    "pinned_pool_stats",
    "PinnedPoolStats",
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
    "TorchInternalsMissing",
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
