"""Builds and runs the native C++ tests without the Python extension.

The CPU tests compile a tests/io/cpp/test_*.cpp with the csrc/ units it exercises (plain C++17, no
torch) and run it: the box copy (with the thread pool), the streaming copy, prefaulting and CRC-32C. The CUDA
tests need nvcc, not a GPU: one compiles csrc/cuda/box_copy_cuda.cu for sm_80 and sm_90, the other
runs the kernel's per-thread code on the CPU (tests/io/cpp/test_box_copy_cuda_host.cu) against the CPU
box copy, with UBSan where the host compiler has it (a misaligned word access is then an error).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize(
    "test_source,units",
    [
        ("test_box_copy.cpp", ["box_copy.cpp", "prefault.cpp", "stream_copy.cpp", "thread_pool.cpp"]),
        ("test_stream_copy.cpp", ["stream_copy.cpp"]),
        ("test_prefault.cpp", ["prefault.cpp"]),
        ("test_crc32c.cpp", ["crc32c.cpp"]),
    ],
)
def test_cpu_native(tmp_path: Path, test_source: str, units: list[str]) -> None:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    exe = tmp_path / Path(test_source).stem
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
            str(REPO / "tests" / "io" / "cpp" / test_source),
            *(str(CSRC / unit) for unit in units),
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


def test_cuda_box_copy_per_thread_code_on_the_host(tmp_path: Path) -> None:
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME to the CUDA toolkit root)")
    exe = tmp_path / "test_box_copy_cuda_host"
    sources = [
        str(REPO / "tests" / "io" / "cpp" / "test_box_copy_cuda_host.cu"),
        *(str(CSRC / unit) for unit in ("box_copy.cpp", "prefault.cpp", "stream_copy.cpp", "thread_pool.cpp")),
    ]
    base = [nvcc, "-std=c++17", "-O2", "-I", str(CSRC), *sources, "-o", str(exe)]
    sanitized = ["-Xcompiler", "-fsanitize=undefined", "-Xcompiler", "-fno-sanitize-recover=all", "-lubsan"]
    build = _run(base[:1] + sanitized + base[1:], timeout=900)
    if build.returncode != 0:  # a host compiler without UBSan: the same test, unsanitised
        build = _run(base, timeout=900)
    assert build.returncode == 0, f"nvcc failed:\n{build.stdout}\n{build.stderr}"
    result = _run([str(exe)], timeout=600)
    assert result.returncode == 0, f"host run of the kernel code failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip().endswith(" passed, 0 failed"), result.stdout
