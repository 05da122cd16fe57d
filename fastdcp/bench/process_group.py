"""A local process group for the parts of the suite that need one: a free TCP port for a rendezvous,
and a 1-rank gloo default group (stock's process-mode ``async_save`` and NVRx's writer read the
rank from it even in a single process)."""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneRankGroup:
    """A 1-rank gloo default process group from :meth:`open` (or ``with``) until :meth:`close`,
    unless one exists already (then both are no-ops)."""

    def __init__(self) -> None:
        self.own = False

    def open(self) -> "OneRankGroup":
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            self.own = True
        return self

    def close(self) -> None:
        import torch.distributed as dist

        if self.own and dist.is_initialized():
            dist.destroy_process_group()
        self.own = False

    def __enter__(self) -> "OneRankGroup":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()
