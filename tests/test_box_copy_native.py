"""Builds and runs the native box-copy tests without the Python extension.

The CPU test compiles tests/cpp/test_box_copy.cpp with csrc/box_copy.cpp and csrc/thread_pool.cpp
(plain C++17, no torch) and runs it. The CUDA test only compiles csrc/cuda/box_copy_cuda.cu for
sm_80 and sm_90: it needs nvcc, not a GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"


def _find_nvcc() -> str | None:
    """nvcc from CUDA_HOME/CUDA_PATH, then PATH, then the default toolkit location."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_cpu_box_copy(tmp_path: Path) -> None:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    exe = tmp_path / "test_box_copy"
    build = _run(
        [
            gxx,
            "-std=c++17",
            "-O2",
            "-pthread",
            "-Wall",
            "-Wextra",
            "-I",
            str(CSRC),
            str(REPO / "tests" / "cpp" / "test_box_copy.cpp"),
            str(CSRC / "box_copy.cpp"),
            str(CSRC / "thread_pool.cpp"),
            "-o",
            str(exe),
        ],
        timeout=600,
    )
    assert build.returncode == 0, f"build failed:\n{build.stdout}\n{build.stderr}"
    result = _run([str(exe)], timeout=600)
    assert result.returncode == 0, f"native test failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip().endswith(" passed, 0 failed"), result.stdout


def test_cuda_box_copy_compiles(tmp_path: Path) -> None:
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME to the CUDA toolkit root)")
    obj = tmp_path / "box_copy_cuda.o"
    build = _run(
        [
            nvcc,
            "-std=c++17",
            "-O2",
            "-c",
            str(CSRC / "cuda" / "box_copy_cuda.cu"),
            "-I",
            str(CSRC),
            "-gencode",
            "arch=compute_80,code=sm_80",
            "-gencode",
            "arch=compute_90,code=sm_90",
            "-o",
            str(obj),
        ],
        timeout=900,
    )
    assert build.returncode == 0, f"nvcc failed:\n{build.stdout}\n{build.stderr}"
    assert obj.stat().st_size > 0
