"""pytest configuration for the fastdcp test-suite.

* puts the repository root (for ``import fastdcp`` without installing) and this
  directory (for ``import dcp_cases``) on ``sys.path`` -- also inherited by
  worker processes started with the ``spawn`` method;
* a per-test wall-clock limit (SIGALRM) so that a hang fails instead of blocking
  forever.  Default 300 s, override with ``FASTDCP_TEST_TIMEOUT`` (seconds, 0 =
  off) or ``@pytest.mark.fastdcp_timeout(seconds)``.  Disabled when the
  ``pytest-timeout`` plugin is active.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
for _p in (_TESTS_DIR, _REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "fastdcp_timeout(seconds): per-test wall-clock limit enforced with SIGALRM",
    )
    config.addinivalue_line(
        "markers",
        "cuda: runs a GPU code path (skips without a CUDA device); `pytest -m cuda` is the GPU "
        "acceptance command's test step",
    )
    # Stock DCP warns on every no_dist save/load; keep the output readable.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning",
    )


def pytest_runtest_logreport(report):
    """With FASTDCP_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens (under pytest-xdist, by the controlling process): a run cut off by a time limit, as a
    lent GPU machine's is, still says why what failed failed (xdist prints tracebacks only at the
    end)."""
    path = os.environ.get("FASTDCP_FAILURE_LOG")
    if not path or not report.failed:
        return
    with open(path, "a") as log:
        log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def _fastdcp_per_test_timeout(request):
    if (
        request.config.pluginmanager.hasplugin("timeout")
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGALRM")
    ):
        yield
        return
    marker = request.node.get_closest_marker("fastdcp_timeout")
    seconds = int(marker.args[0]) if marker else int(os.environ.get("FASTDCP_TEST_TIMEOUT", "300"))
    if seconds <= 0:
        yield
        return

    def _on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded its {seconds}s wall-clock limit (hang?)")

    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
