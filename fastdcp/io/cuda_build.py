"""The one warning of an extension built without CUDA on a machine that has a GPU.

Such a build still saves and loads CUDA tensors correctly, but by the slow paths: loads copy
every piece from host memory with ``Tensor.copy_`` instead of the CUDA box-copy kernel, saves
enqueue one ``copy_`` per tensor instead of one batched native call. Nothing else tells the user,
so the first save or load that takes such a path warns, once per process, saying how to rebuild.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch

__all__ = ["REBUILD_WITH_CUDA", "slow_gpu_path", "slow_gpu_path_message", "warn_if_slow_gpu_path"]

REBUILD_WITH_CUDA = "FASTDCP_BUILD_CUDA=1 pip install --no-build-isolation ."

_lock = threading.Lock()
_warned = False


def slow_gpu_path(built_with_cuda: bool, torch_cuda_available: bool, destination_is_cuda: bool) -> bool:
    """Whether a copy to or from a CUDA tensor takes the slow path for want of the CUDA build: torch
    sees a GPU, the tensor is on it, and ``fastdcp._C`` was compiled without CUDA."""
    return destination_is_cuda and torch_cuda_available and not built_with_cuda


def slow_gpu_path_message() -> str:
    """The warning's text: what happens, the build setting that shows it, and how to rebuild."""
    return (
        "fastdcp: torch has CUDA, but the extension fastdcp._C was built without it "
        "(fastdcp.build_info()['cuda'] is False): CUDA tensors are loaded with Tensor.copy_ from host "
        "memory instead of the CUDA box-copy kernel, and saved with one copy_ per tensor instead of "
        "batched native copies, which is correct but slower. Rebuild the extension with CUDA where a "
        f"CUDA toolkit is installed (CUDA_HOME): `{REBUILD_WITH_CUDA}` in the source tree."
    )


@functools.cache
def _built_with_cuda() -> bool:
    """``fastdcp.build_info()["cuda"]`` of this process's extension (it cannot change)."""
    from .._native import _C

    return bool(_C.build_info().get("cuda"))


def _torch_cuda_available() -> bool:
    return torch.cuda.is_available()


def warn_if_slow_gpu_path(destination_is_cuda: bool, *, built_with_cuda: bool | None = None,
                          torch_cuda_available: bool | None = None) -> bool:
    """Warn (``warnings.warn``, once per process) when a copy to or from a CUDA tensor takes the
    slow path (:func:`slow_gpu_path`); returns whether it does. ``built_with_cuda`` and
    ``torch_cuda_available`` default to this process's extension and torch."""
    global _warned
    if not destination_is_cuda:
        return False
    built = _built_with_cuda() if built_with_cuda is None else built_with_cuda
    available = _torch_cuda_available() if torch_cuda_available is None else torch_cuda_available
    if not slow_gpu_path(built, available, destination_is_cuda):
        return False
    with _lock:
        first, _warned = not _warned, True
    if first:
        warnings.warn(slow_gpu_path_message(), stacklevel=3)
    return True
