"""Why ``fastdcp._C`` could not be imported, said in one message (no import of ``_C`` here).

The extension includes no torch header (tensors cross as addresses, csrc/bindings.cpp), so a torch
other than the one it was built against is harmless once it loads; what stops it loading is an
extension built for another Python, a shared library it was linked against that is missing here
(the CUDA runtime of another toolkit, say), or none built at all. The message names the file,
the torch it was built against (``build_info()["torch_compiled"]``, read from the file itself)
and the torch running now, and says how to rebuild.
"""

from __future__ import annotations

import importlib.machinery
import re
from pathlib import Path

__all__ = ["REBUILD", "import_failure_message", "recorded_torch_version", "same_minor"]

REBUILD = "`pip install --no-build-isolation -e .` (or `python setup.py build_ext --inplace`) in the source tree"

# build_info() stores the torch version under this key; the compiler emits the key's literal and
# then the version's (csrc/bindings.cpp), each NUL-terminated.
_RECORDED = re.compile(rb"torch_compiled\x00(\d+\.\d+[0-9A-Za-z.+_-]*)\x00")


def recorded_torch_version(extension: Path) -> str | None:
    """The torch version ``extension`` was built against, as its ``build_info()`` would report it,
    read from the file's bytes; None where the file cannot be read or holds no such record."""
    try:
        found = _RECORDED.search(extension.read_bytes())
    except OSError:
        return None
    return found.group(1).decode("ascii") if found else None


def same_minor(a: str, b: str) -> bool:
    """Whether two torch versions share major.minor ("2.5.1+cu124" and "2.5.0" do)."""
    return a.split(".")[:2] == b.split(".")[:2]


def _python() -> str:
    import sys

    return f"{sys.version_info.major}.{sys.version_info.minor}"


def import_failure_message(error: BaseException, package_dir: Path, torch_version: str,
                           torch_cuda: str | None) -> str:
    """The ImportError message for a failed ``import fastdcp._C``: which file (or that none fits
    this Python), the recorded and the running torch, and how to rebuild."""
    running = f"torch {torch_version}" + (f" (CUDA {torch_cuda})" if torch_cuda else " (no CUDA)")
    rebuild = f"Rebuild it with this Python and {running}: {REBUILD}."
    built = sorted(package_dir.glob("_C.*.so")) + sorted(package_dir.glob("_C.*.pyd"))
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    here = [path for path in built if any(path.name == "_C" + suffix for suffix in suffixes)]
    if not built:
        message = f"fastdcp's compiled extension fastdcp._C is not built in {package_dir} ({error}). {rebuild}"
        if (package_dir.parent / "setup.py").is_file():
            # A source tree: after `pip install .` the extension lives in the installed copy, which
            # a process started in the tree's root does not import (its folder comes first).
            message += (f" If fastdcp is installed (`pip install .`), this process imports the source folder "
                        f"{package_dir.parent} instead: run it from another directory.")
        return message
    if not here:
        others = ", ".join(path.name for path in built)
        return (f"fastdcp's compiled extension fastdcp._C is not built for this Python {_python()} in "
                f"{package_dir} (there is only {others}; this Python loads _C{suffixes[0]}) ({error}). {rebuild}")
    extension = here[0]
    recorded = recorded_torch_version(extension)
    if recorded is None:
        against = "it records no torch version that could be read"
    elif same_minor(recorded, torch_version):
        against = f"it was built against torch {recorded}, the same release as the running {running}"
    else:
        against = f"it was built against torch {recorded}, but this process runs {running}"
    return f"fastdcp's compiled extension {extension} cannot be loaded ({error}); {against}. {rebuild}"
