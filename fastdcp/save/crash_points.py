"""Named moments of a save at which crash tests stop the process (a no-op unless asked)."""

from __future__ import annotations

import os
import time

__all__ = ["crash_point"]


def crash_point(phase: str) -> None:
    """Crash-test hook: with ``FASTDCP_TEST_PAUSE_AT`` naming ``phase`` (comma-separated list), note the
    phase in the file ``FASTDCP_TEST_PAUSE_NOTIFY`` (if set) and sleep ``FASTDCP_TEST_PAUSE_S``
    seconds (default 60), so a crash test can SIGKILL the process exactly there. Phases: ``plan``,
    ``open``, ``write``, ``sync``, ``commit``, ``cleanup``, ``cleanup_mid``, and ``drain`` (a tiered
    save's copy of a data file to the shared tier, :mod:`fastdcp.tiered.drain`)."""
    wanted = os.environ.get("FASTDCP_TEST_PAUSE_AT")
    if not wanted or phase not in wanted.split(","):
        return
    notify = os.environ.get("FASTDCP_TEST_PAUSE_NOTIFY")
    if notify:
        with open(notify, "a") as f:
            f.write(f"{phase} {os.getpid()}\n")
    time.sleep(float(os.environ.get("FASTDCP_TEST_PAUSE_S", "60")))
