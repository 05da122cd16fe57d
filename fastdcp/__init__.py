"""fastdcp: a fast, drop-in storage layer for PyTorch Distributed Checkpoint.

    import torch.distributed.checkpoint as dcp
    from fastdcp import FastFileSystemWriter, FastFileSystemReader
    dcp.save(state_dict, storage_writer=FastFileSystemWriter(path))
    dcp.load(state_dict, storage_reader=FastFileSystemReader(path))
"""

from __future__ import annotations

import platform

import torch

from . import _C
from ._blob import BlobFormatError
from ._integrity import ChecksumError
from ._metadata import CheckpointFormatError, CheckpointNotFoundError, add_safe_metadata_globals
from .planner import FastLoadPlanner, FastSavePlanner
from .reader import FastFileSystemReader
from .writer import FastFileSystemWriter

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
    "add_safe_metadata_globals",
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
