"""The warning of an extension built without CUDA where torch has a GPU (fastdcp.io.cuda_build):
when it applies, that it comes once per process, what it says, and that CPU and stand-in loads
never raise it. On a GPU machine a real load into CUDA tensors warns exactly when the extension
lacks CUDA."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter
from fastdcp.io import cuda_build
from fastdcp.io.copy_engine import to_standin_device

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("built, available, cuda_dest", list(itertools.product([False, True], repeat=3)))
def test_only_a_cuda_tensor_with_torch_cuda_and_no_cuda_build_is_slow(built, available, cuda_dest):
    assert cuda_build.slow_gpu_path(built, available, cuda_dest) == (cuda_dest and available and not built)


_CHILD = """
import json, warnings
from fastdcp.io import cuda_build
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    returned = [cuda_build.warn_if_slow_gpu_path(True, built_with_cuda=False, torch_cuda_available=True)
                for _ in range(3)]
    returned.append(cuda_build.warn_if_slow_gpu_path(True, built_with_cuda=True, torch_cuda_available=True))
print(json.dumps({"returned": returned, "warnings": [str(w.message) for w in caught],
                  "categories": [w.category.__name__ for w in caught]}))
"""


def test_the_warning_comes_once_per_process_and_says_how_to_rebuild():
    """A fresh process (the once-per-process flag starts clear): three slow copies warn once."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["returned"] == [True, True, True, False]
    assert result["categories"] == ["UserWarning"], result
    (message,) = result["warnings"]
    assert "fastdcp.build_info()['cuda'] is False" in message, message
    assert "FASTDCP_BUILD_CUDA=1 pip install --no-build-isolation ." in message, message
    assert "fastdcp._C" in message and "slower" in message, message


def test_cpu_and_standin_loads_and_saves_do_not_warn(tmp_path, monkeypatch):
    """No CUDA tensor, no warning, even where torch has CUDA (as this test makes the module
    believe): the load's call site passes what it saw, not a guess."""
    monkeypatch.setattr(cuda_build, "_torch_cuda_available", lambda: True)
    monkeypatch.setattr(cuda_build, "_warned", False)
    state = {"a": C.random_float((64, 32), 1), "b": C.random_float((1000,), 2)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
        dest = {"a": torch.zeros(64, 32), "b": to_standin_device(torch.zeros(1000))}
        dcp.load(dest, storage_reader=FastFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(dest["a"], state["a"]) and torch.equal(dest["b"], state["b"])
    assert not [w for w in caught if "fastdcp._C was built without" in str(w.message)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_into_cuda_tensors_warns_exactly_without_the_cuda_build(tmp_path):
    state = {"a": C.random_float((256, 16), 3)}
    dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
    code = f"""
import json, warnings, torch, torch.distributed.checkpoint as dcp, fastdcp
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dest = {{"a": torch.zeros(256, 16, device="cuda")}}
    dcp.load(dest, storage_reader=fastdcp.FastFileSystemReader({str(tmp_path)!r}), no_dist=True)
print(json.dumps([str(w.message) for w in caught if "fastdcp._C was built without" in str(w.message)]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    warned = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(warned) == (0 if fastdcp.build_info()["cuda"] else 1), warned
