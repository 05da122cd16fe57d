"""Build fastdcp and its native extension fastdcp._C.

CUDA sources are compiled when torch was built with CUDA and a CUDA toolkit is found;
FASTDCP_BUILD_CUDA=1 forces them (and fails clearly when impossible), FASTDCP_BUILD_CUDA=0 skips them.
Install with `pip install --no-build-isolation -e .`: an isolated build would fetch another torch.
"""
import glob
import os
import shutil
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

here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))
cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
if with_cuda:
    cu_sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "cuda", "*.cu")))
    ext = CUDAExtension(
        "fastdcp._C",
        cpp_sources + cu_sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=[("FASTDCP_WITH_CUDA", "1"), ("FASTDCP_TORCH_VERSION", f'"{torch.__version__}"')],
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
