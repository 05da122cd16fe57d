"""The library logs through one named logger, ``logging.getLogger("fastdcp")``, and prints nothing
on its own (the command line and the benchmark suite are programs: they print)."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fastdcp import FastFileSystemReader, FastFileSystemWriter

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fastdcp"
PROGRAMS = ("cli", "bench")  # folders that are programs, not library code


def _library_modules() -> list[Path]:
    return [
        p for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] not in PROGRAMS and p.name != "__main__.py"
    ]


def test_library_code_never_prints():
    offenders = []
    for path in _library_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} print()")
            if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr"):
                if isinstance(node.value, ast.Name) and node.value.id == "sys":
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} sys.{node.attr}")
    assert offenders == []


def test_every_logger_is_the_fastdcp_logger():
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger":
                arg = node.args[0] if node.args else None
                names.append((str(path.relative_to(REPO)), arg.value if isinstance(arg, ast.Constant) else None))
    assert names, "no module logs"
    assert [n for n in names if n[1] != "fastdcp"] == []


def test_a_save_and_a_load_log_to_that_logger(tmp_path, caplog):
    state = {"w": torch.arange(1000.0)}
    with caplog.at_level(logging.DEBUG, logger="fastdcp"):
        dcp.save(state, storage_writer=FastFileSystemWriter(tmp_path), no_dist=True)
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=FastFileSystemReader(tmp_path), no_dist=True)
    ours = [r for r in caplog.records if r.name.startswith("fastdcp")]
    assert {r.name for r in ours} == {"fastdcp"}
    messages = [r.getMessage() for r in ours]
    assert any(m.startswith("committed .metadata") for m in messages), messages
    assert any(m.startswith("read 1 files") for m in messages), messages
    assert torch.equal(out["w"], state["w"])


def test_saves_and_loads_print_nothing(tmp_path):
    """A process that saves (blocking and async) and loads, with logging left unconfigured, writes
    nothing to stdout or stderr (torch's own warnings are silenced with -W ignore)."""
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from fastdcp import FastFileSystemWriter, FastFileSystemReader\n"
        "d = sys.argv[1]\n"
        "state = {'w': torch.randn(1 << 16), 'step': 3}\n"
        "dcp.save(state, storage_writer=FastFileSystemWriter(d), no_dist=True)\n"
        "dcp.save(state, storage_writer=FastFileSystemWriter(d), no_dist=True)\n"
        "out = {'w': torch.zeros(1 << 16), 'step': 0}\n"
        "dcp.load(out, storage_reader=FastFileSystemReader(d), no_dist=True)\n"
        "assert torch.equal(out['w'], state['w']) and out['step'] == 3\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
