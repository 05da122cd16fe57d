"""Long commands show a progress line on a terminal and nothing elsewhere: ``convert`` and
``verify`` run with stderr on a pseudo-terminal, then on a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fastdcp import FastFileSystemWriter

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _run(args: list[str], on_terminal: bool) -> str:
    """stderr of ``python -m fastdcp ARGS`` (stdout discarded)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-W", "ignore", "-m", "fastdcp", *args]
    if not on_terminal:
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = os.openpty()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=follower)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
    return b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "ckpt"
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}
    dcp.save(state, storage_writer=FastFileSystemWriter(path), no_dist=True)
    return path


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_progress_only_on_a_terminal(checkpoint, tmp_path, command):
    def args(n: int) -> list[str]:
        return ["convert", str(checkpoint), str(tmp_path / f"m{n}.safetensors")] if command == "convert" \
            else ["verify", str(checkpoint)]

    shown = _run(args(1), on_terminal=True)
    assert f"{command}: 8/8" in shown, shown
    assert f"{command}: " not in _run(args(2), on_terminal=False)
