"""Build fastdcp and its native extension fastdcp._C.

CUDA sources are compiled when torch was built with CUDA and a CUDA toolkit is found;
FASTDCP_BUILD_CUDA=1 forces them (and fails clearly when impossible), FASTDCP_BUILD_CUDA=0 skips them.
The GPU architectures come from TORCH_CUDA_ARCH_LIST when set; otherwise from the visible GPUs, and
on a build host without one (where wheels are usually built) from a portable default list
(Ampere, Ada, Hopper, Blackwell, as the toolkit supports them, plus PTX of the newest).
Install with `pip install --no-build-isolation -e .`: an isolated build would fetch another torch.
"""
import glob
import os
import re
import shutil
import subprocess
import sys


def _find_cuda_home():
    """The toolkit root (the folder holding include/cuda_runtime.h), or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        # The nvcc on PATH may be a wrapper script: resolve symlinks, then also try the script's target.
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) and os.path.isfile(
            os.path.join(root, "bin", "nvcc")
        ):
            return root
    return None


_cuda_home = _find_cuda_home()
if _cuda_home:
    # torch.utils.cpp_extension reads CUDA_HOME at import time.
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

_force = os.environ.get("FASTDCP_BUILD_CUDA", "").strip().lower()
if _force in ("1", "true", "yes", "on"):
    if torch.version.cuda is None:
        sys.exit(f"FASTDCP_BUILD_CUDA=1 but the installed torch {torch.__version__} has no CUDA support.")
    if _cuda_home is None:
        sys.exit("FASTDCP_BUILD_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME to the folder with include/cuda_runtime.h).")
    with_cuda = True
elif _force in ("0", "false", "no", "off"):
    with_cuda = False
else:
    with_cuda = torch.version.cuda is not None and _cuda_home is not None

# Ampere (A100, RTX 30), Ada (L4, L40, RTX 40), Hopper (H100, H200), Blackwell (B200, RTX 50).
# A GPU newer than all of them runs the PTX of the newest, JIT-compiled by its driver.
_PORTABLE_CUDA_ARCHES = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")


def _toolkit_arches(cuda_home: str) -> set[str] | None:
    """The real architectures (as "9.0") the toolkit's nvcc can compile for, or None when nvcc
    cannot list them (toolkits before 11.0): then the portable list is used as it is."""
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    arches = {f"{int(m[:-1])}.{m[-1]}" for m in re.findall(r"compute_(\d+)", out)}
    return arches or None


def _choose_cuda_arch_list(cuda_home: str) -> tuple[str, str]:
    """(TORCH_CUDA_ARCH_LIST to build with, where it came from). Precondition: CUDA is being built.

    An explicit TORCH_CUDA_ARCH_LIST wins. Without it torch would build for the visible GPUs only,
    and fail with an IndexError where none is visible; there we choose the portable list instead.
    """
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given:
        return given, "TORCH_CUDA_ARCH_LIST"
    supported = _toolkit_arches(cuda_home)
    visible = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    if visible:
        arches = [f"{major}.{minor}" for major, minor in visible]
        source = "the visible GPUs"
        if supported is not None:
            # A GPU newer than the toolkit: the toolkit's newest architecture, run through PTX.
            newest = max(supported, key=lambda a: tuple(map(int, a.split("."))))
            arches = [a if a in supported else newest for a in arches]
    else:
        arches = [a for a in _PORTABLE_CUDA_ARCHES if supported is None or a in supported]
        source = "the portable default (no GPU visible)"
        if not arches:
            sys.exit(
                f"The CUDA toolkit at {cuda_home} supports none of {', '.join(_PORTABLE_CUDA_ARCHES)}; "
                "set TORCH_CUDA_ARCH_LIST to the architectures to build for."
            )
    arches = list(dict.fromkeys(arches))
    arches[-1] += "+PTX"
    return ";".join(arches), source


here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))
cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
if with_cuda:
    cuda_arch_list, arch_source = _choose_cuda_arch_list(_cuda_home)
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list  # what torch's BuildExtension compiles for
    print(f"fastdcp: CUDA architectures {cuda_arch_list} (from {arch_source})")
    cu_sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "cuda", "*.cu")))
    ext = CUDAExtension(
        "fastdcp._C",
        cpp_sources + cu_sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=[
            ("FASTDCP_WITH_CUDA", "1"),
            ("FASTDCP_TORCH_VERSION", f'"{torch.__version__}"'),
            ("FASTDCP_CUDA_ARCH_LIST", f'"{cuda_arch_list}"'),
        ],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
    )
else:
    ext = CppExtension(
        "fastdcp._C",
        cpp_sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=[("FASTDCP_TORCH_VERSION", f'"{torch.__version__}"')],
        extra_compile_args={"cxx": cxx_flags},
    )
print(f"fastdcp: building the extension {'with' if with_cuda else 'without'} CUDA (CUDA_HOME={_cuda_home})")

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
