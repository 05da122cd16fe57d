"""Job functions for tests/save/test_concurrent_saves.py that the benchmark runner
(fastdcp/bench/concurrency.py) does not have: a "previous job" whose process-mode ``dcp.async_save``
is still in flight when a "new job" saves into the same directory.

They run in children forked from :class:`fastdcp.bench.concurrency.Zygote` (torch imported once),
started with ``zygote.fork(function, log, **args)``, and record what happened as JSON lines in
``records``: ``{"job", "event", "t", ...}`` with ``t`` from ``time.monotonic()`` (one clock for
every process of the host).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict

from fastdcp.bench.concurrency import _append, describe_error, make_state
from fastdcp.bench.process_group import stop_checkpoint_daemon

PAUSE_NOTES = "phases"           # in the control directory: the paused save notes its phase here
TRIGGER_TIMEOUT_S = 120.0        # the daemon of a process-mode save starts a Python with torch


def _is_tensor(value: object) -> bool:
    return hasattr(value, "fill_")


def previous_job_async_save(directory: str, control: str, records: str, state: int, tensors: int,
                            tensor_bytes: int, pause_before_commit_s: float | None = None) -> None:
    """A training job's last checkpoint: ``dcp.async_save`` in process mode (DCP's daemon
    process does the save; it needs a process group, here gloo with world size 1), after which
    the job changes its live tensors (the checkpoint must hold the state of the call), waits for
    the upload and records how it ended.

    ``pause_before_commit_s``: the daemon stops that long with its data files written and
    fsynced, before its commit (the writer's test hook ``FASTDCP_TEST_PAUSE_AT=sync``, inherited
    by the daemon through the environment), noting ``sync`` in ``control/phases`` first, so that
    the new job's save can be started exactly while this one is in flight."""
    warnings.filterwarnings("ignore")
    if pause_before_commit_s is not None:
        os.environ.update(FASTDCP_TEST_PAUSE_AT="sync", FASTDCP_TEST_PAUSE_S=str(pause_before_commit_s),
                          FASTDCP_TEST_PAUSE_NOTIFY=os.path.join(control, PAUSE_NOTES))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the daemon's TCPStore
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from fastdcp import FastFileSystemWriter

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(control, 'store_previous')}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=180))
    live = make_state(state, tensors, tensor_bytes)
    _append(records, {"job": "previous", "event": "start", "t": time.monotonic(), "state": state})
    response = dcp.async_save(live, storage_writer=FastFileSystemWriter(directory),
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    _append(records, {"job": "previous", "event": "called", "t": time.monotonic()})
    for value in live.values():  # training goes on: the checkpoint must not see this
        if _is_tensor(value):
            value.fill_(-7)
    error = None
    try:
        getattr(response, "upload_completion", response).result(timeout=TRIGGER_TIMEOUT_S + 60)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        error = describe_error(exc)
    _append(records, {"job": "previous", "event": "end", "t": time.monotonic(), "ok": error is None,
                      "error": None if error is None else asdict(error)})
    stop_checkpoint_daemon()
    dist.destroy_process_group()


def new_job_blocking_save(directory: str, control: str, records: str, state: int, tensors: int,
                          tensor_bytes: int, start_when: str, names_before: list[str]) -> None:
    """A new job given the same directory: one blocking ``dcp.save`` with a
    ``FastFileSystemWriter``, started when the previous job's save is in flight:

    * ``start_when="paused"``: once that save noted ``sync`` (paused before its commit);
    * ``start_when="writing"``: once a data file that was not in the directory before
      (``names_before``) appears, i.e. while that save writes its data.
    """
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    from fastdcp import FastFileSystemWriter

    state_dict = make_state(state, tensors, tensor_bytes)
    before = set(names_before)
    notes = os.path.join(control, PAUSE_NOTES)
    deadline = time.monotonic() + TRIGGER_TIMEOUT_S
    triggered = False
    while time.monotonic() < deadline:
        if start_when == "paused":
            try:
                with open(notes) as f:
                    triggered = any(line.split()[:1] == ["sync"] for line in f)
            except FileNotFoundError:
                pass
        else:
            triggered = any(n.endswith(".distcp") and n not in before for n in os.listdir(directory))
        if triggered:
            break
        time.sleep(0.001)
    _append(records, {"job": "new", "event": "start", "t": time.monotonic(), "state": state, "triggered": triggered})
    error = None
    try:
        dcp.save(state_dict, storage_writer=FastFileSystemWriter(directory), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        error = describe_error(exc)
    _append(records, {"job": "new", "event": "end", "t": time.monotonic(), "ok": error is None,
                      "error": None if error is None else asdict(error)})
