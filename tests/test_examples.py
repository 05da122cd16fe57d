"""Every script in examples/ runs as its header says, on CPU with gloo.

The commands come from each example's docstring (its ``torchrun ...`` lines, run in order), so
the header and what is tested cannot drift apart, and an example added to the folder is tested
without an entry here. Each example checks its own claim and exits non-zero when it does not
hold; the last command must print ``<name>: OK``. ``common.py``, the plumbing the examples import,
is the one ``*.py`` there that is not an example.
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fastdcp.bench.process_group import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SHARED = "common.py"  # imported by the examples (the tutorial's model, AppState, ...); it runs nothing itself
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != SHARED)


def header_commands(script: str) -> list[list[str]]:
    """The ``torchrun`` command lines of the example's docstring, split into arguments."""
    docstring = ast.get_docstring(ast.parse((EXAMPLES / script).read_text())) or ""
    return [shlex.split(line) for line in map(str.strip, docstring.splitlines()) if line.startswith("torchrun ")]


def test_the_folder_holds_the_examples():
    # A glob that found nothing would leave the parametrized test below with nothing to run.
    assert {"fsdp_save_load.py", "async_every_k_steps.py", "resume_other_world_size.py", "enable_checkpoint_id.py",
            "export_safetensors.py", "tiered_checkpoints.py", "enable_async_save.py", "s3_checkpoints.py",
            "open_one_tensor.py", "verify_checkpoint.py", "planners_at_scale.py"} <= set(SCRIPTS), SCRIPTS
    # What SCRIPTS leaves out by name must be there, or the exclusion hides nothing but a stale name.
    assert (EXAMPLES / SHARED).is_file()


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_examples_readme_lists_it_with_its_commands(script):
    readme = (EXAMPLES / "README.md").read_text()
    for command in header_commands(script):
        assert shlex.join(command) in readme, f"examples/README.md lacks `{shlex.join(command)}`"


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, tmp_path):
    commands = header_commands(script)
    assert commands, f"{script}'s docstring has no `torchrun ...` line to run it by"
    # The local tier of tiered checkpoints goes to a directory of this test's own (on /dev/shm, as
    # in production, where there is one) rather than the machine-wide default.
    local_tier = tempfile.mkdtemp(prefix="fastdcp-examples-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    env = dict(os.environ, FASTDCP_LOCAL_TIER=local_tier,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        for command in commands:
            assert command[0] == "torchrun" and f"examples/{script}" in command and "--dir" in command, command
            args = command[1:]
            args[args.index("--dir") + 1] = str(tmp_path / "out")  # every command of one example shares it
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}", *args],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
            assert run.returncode == 0, (f"{shlex.join(command)} exited {run.returncode}:\n"
                                         f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}")
    finally:
        shutil.rmtree(local_tier, ignore_errors=True)
    name = script.removesuffix(".py")
    assert any(line.startswith(f"{name}: OK") for line in run.stdout.splitlines()), run.stdout
