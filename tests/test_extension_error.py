"""``import fastdcp`` where the compiled extension cannot be loaded: the ImportError names the
file, the torch it was built against (read from the file) and the running torch, and how to
rebuild. Checked in real child processes importing a copy of the package whose extension is
doctored (another recorded torch, an export the loader cannot find) or built for another Python."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastdcp
from fastdcp._extension_error import recorded_torch_version, same_minor

PACKAGE = Path(fastdcp.__file__).parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _extension() -> Path:
    """This Python's built extension in the package under test."""
    return PACKAGE / f"_C{SUFFIX}"


def _copy_package(root: Path, extension_name: str, doctor=None) -> Path:
    """A copy of the package's Python files under ``root``, with this Python's extension as
    ``extension_name``, its bytes passed through ``doctor`` first."""
    target = root / "fastdcp"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    data = _extension().read_bytes()
    (target / extension_name).write_bytes(doctor(data) if doctor else data)
    return target


def _import_error(root: Path) -> str:
    """The stderr of a child process importing fastdcp from ``root`` (which must fail)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    # Only the copy under ``root`` may be importable: an editable install of fastdcp adds a finder
    # that would otherwise serve ``fastdcp._C`` from the installed tree when the copy lacks one.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if not getattr(f, '__module__', '').startswith('__editable__')]; import fastdcp")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0, "the doctored package imported"
    return done.stderr


def _running() -> str:
    return f"torch {torch.__version__}"


def test_the_recorded_torch_is_what_build_info_reports():
    assert recorded_torch_version(_extension()) == fastdcp._C.build_info()["torch_compiled"]


@pytest.mark.parametrize("a, b, same", [("2.5.1+cu124", "2.5.0", True), ("2.5.1", "2.6.0", False),
                                        ("2.10.0", "2.1.0", False), ("3.0.0a0+git", "3.0.1", True)])
def test_same_minor(a, b, same):
    assert same_minor(a, b) is same


def test_an_extension_that_cannot_load_names_both_torch_versions(tmp_path):
    recorded = fastdcp._C.build_info()["torch_compiled"]
    other = ("0.1." + "0" * len(recorded))[: len(recorded)]  # same length: the file stays valid
    assert not same_minor(other, torch.__version__)

    def doctor(data: bytes) -> bytes:
        data = data.replace(b"torch_compiled\x00" + recorded.encode() + b"\x00",
                            b"torch_compiled\x00" + other.encode() + b"\x00")
        return data.replace(b"PyInit__C", b"PyInit__X")  # the loader finds no init function

    package = _copy_package(tmp_path, f"_C{SUFFIX}", doctor)
    message = _import_error(tmp_path)
    assert f"{package / ('_C' + SUFFIX)} cannot be loaded" in message, message
    assert f"built against torch {other}, but this process runs {_running()}" in message, message
    assert "pip install --no-build-isolation -e ." in message, message
    assert "python setup.py build_ext --inplace" in message, message


def test_an_extension_of_the_same_torch_says_so(tmp_path):
    recorded = fastdcp._C.build_info()["torch_compiled"]
    _copy_package(tmp_path, f"_C{SUFFIX}", lambda data: data.replace(b"PyInit__C", b"PyInit__X"))
    message = _import_error(tmp_path)
    if same_minor(recorded, torch.__version__):
        assert f"built against torch {recorded}, the same release as the running {_running()}" in message, message
    else:
        assert f"built against torch {recorded}, but this process runs {_running()}" in message, message


def test_an_extension_for_another_python_is_named(tmp_path):
    _copy_package(tmp_path, "_C.cpython-39-x86_64-linux-gnu.so")
    message = _import_error(tmp_path)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"not built for this Python {version}" in message, message
    assert "_C.cpython-39-x86_64-linux-gnu.so" in message and f"loads _C{SUFFIX}" in message, message
    assert "pip install --no-build-isolation -e ." in message, message


def test_a_source_tree_without_the_extension_says_where_the_installed_one_is(tmp_path):
    # `pip install .` puts the extension in the installed copy; a process started in the clone's root
    # imports the clone's folder first, which has none. The message says so where the folder is a
    # source tree (a setup.py beside it), and only there.
    for with_setup in (False, True):
        root = tmp_path / f"setup_{with_setup}"
        shutil.copytree(PACKAGE, root / "fastdcp", ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
        if with_setup:
            (root / "setup.py").write_text("")
        message = _import_error(root)
        assert f"fastdcp._C is not built in {root / 'fastdcp'}" in message, message
        hint = f"this process imports the source folder {root} instead: run it from another directory"
        assert (hint in message) is with_setup, message
