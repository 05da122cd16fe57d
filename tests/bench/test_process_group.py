"""fastdcp.bench.process_group: the end of a spawned gloo rank (``exit_spawned_rank``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _run_rank(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import atexit, datetime, sys
        import torch.distributed as dist
        from fastdcp.bench.process_group import exit_spawned_rank

        marker = {str(tmp_path / "atexit-ran")!r}
        atexit.register(lambda: open(marker, "w").close())
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        out = [None]
        dist.all_gather_object(out, {{"rank": 0}})
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_exit_status_output_and_no_finalization(tmp_path):
    # stdout is a pipe here, so the print stays in Python's buffer until something flushes it
    done = _run_rank(tmp_path, """
        print("reported", out)
        sys.stderr.write("to stderr")
        exit_spawned_rank(7)
        print("after the exit")
    """)
    assert done.returncode == 7, done.stderr
    assert "reported [{'rank': 0}]" in done.stdout
    assert "to stderr" in done.stderr
    assert "after the exit" not in done.stdout
    assert not (tmp_path / "atexit-ran").exists(), "interpreter finalization ran (atexit handlers did)"


def test_the_group_is_destroyed_first(tmp_path):
    done = _run_rank(tmp_path, """
        import fastdcp.bench.process_group as PG
        real_exit = PG.os._exit

        def check_then_exit(status):
            print("initialized at exit:", dist.is_initialized(), flush=True)
            real_exit(status)

        PG.os._exit = check_then_exit
        exit_spawned_rank()
    """)
    assert done.returncode == 0, done.stderr
    assert "initialized at exit: False" in done.stdout

