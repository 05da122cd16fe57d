"""A local process group for the parts of the suite that need one: a free TCP port for a rendezvous,
a 1-rank gloo default group (stock's process-mode ``async_save`` and NVRx's writer read the
rank from it even in a single process), and the end of a spawned gloo rank."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any, NoReturn


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


def stop_checkpoint_daemon() -> None:
    """Ask DCP's process-mode ``async_save`` daemon of this process, if any, to exit and wait for
    it (up to DCP's 5 s). Interpreter finalization would do it; a process that ends with
    ``os._exit`` must, or the daemon outlives it until it notices its pipe closed. Best effort:
    the daemon is a private detail of torch that may move."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor

        daemon = executor._CHECKPOINT_PROCESS
        if daemon is not None:
            executor._CHECKPOINT_PROCESS = None
            daemon.__del__()
    except Exception:  # noqa: BLE001 - best effort, see above
        pass


def exit_spawned_rank(status: int = 0) -> NoReturn:
    """Stop DCP's process-mode daemon (:func:`stop_checkpoint_daemon`), destroy this process's
    default process group, flush stdout/stderr and end the process with ``status`` at once,
    without interpreter finalization.

    Precondition: the rank's outcome is already reported (its files written and closed): nothing
    after this call runs, no ``atexit`` handler, no ``finally`` of a caller. A failure of
    ``destroy_process_group`` is printed and turns status 0 into 1.

    Why not return and let the interpreter exit: gloo's worker threads drop their reference to a
    finished collective's tensors after the caller has moved on, and when that reference is the
    last owner of a Python tensor object (``all_gather_object`` and the other object
    collectives make such tensors) the thread takes the GIL to free it. A DTensor's device mesh
    keeps the group, and so its threads, alive past ``destroy_process_group``. If the drop comes
    while the interpreter finalizes, taking the GIL ends the thread by a forced unwind through a
    ``noexcept`` frame of ``ProcessGroupGloo::runLoop``: ``std::terminate``, SIGABRT
    ("terminate called without an active exception"; pytorch/pytorch#190489). Seen here in about
    1 of 3 runs of a 2-rank DTensor save/load test on 2 busy cores.
    """
    import torch.distributed as dist

    stop_checkpoint_daemon()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported, then the process ends anyway
        traceback.print_exc()
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed stream has nothing to flush
            pass
    os._exit(status)


def spawn_ranks(main: Any, args: tuple, world: int, out_path: str) -> list[dict[str, Any]]:
    """Run ``main(rank, *args)`` in ``world`` spawned processes, then return the records each rank
    wrote (:func:`rank_records`) to ``{out_path}.{rank}``, each with its ``rank``."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(main, args=args, nprocs=world, join=True, start_method="spawn")
    out: list[dict[str, Any]] = []
    for rank in range(world):
        with open(f"{out_path}.{rank}") as f:
            for record in json.load(f):
                record["rank"] = rank
                out.append(record)
    return out


class rank_records:
    """In a spawned rank: ``with rank_records(out_path, rank) as records:`` collects the rank's
    records; at the end (an error becomes a record with its traceback) they are written to
    ``{out_path}.{rank}``, the default process group is destroyed and the process ends
    (:func:`exit_spawned_rank`)."""

    def __init__(self, out_path: str, rank: int) -> None:
        self.path = f"{out_path}.{rank}"
        self.records: list[dict[str, Any]] = []

    def __enter__(self) -> list[dict[str, Any]]:
        return self.records

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        import json

        import torch.distributed as dist

        if error is not None:
            self.records.append({"system": "?", "rep": -1, "seconds": 0.0,
                                 "error": "".join(traceback.format_exception(kind, error, tb))})
        with open(self.path, "w") as f:
            json.dump(self.records, f)
        if dist.is_initialized():
            dist.destroy_process_group()
        exit_spawned_rank()
