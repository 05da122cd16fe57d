"""Asynchronous checkpoints every k steps: ``dcp.async_save`` with ``async_staging=True`` and
``fastdcp.guard`` around the optimizer step.

With ``FastFileSystemWriter(path, async_staging=True)`` the ``async_save`` call returns while the
state is still being copied to host memory, so training goes on at once. ``fastdcp.guard(optimizer,
model)`` makes ``optimizer.step()`` wait for a copy still in flight of the tensors it changes
(usually the copy finished during forward and backward, and the step does not wait). Before each
checkpoint the previous one must be committed (``upload_completion``); after the loop, the last.

Each checkpoint must hold the state of the moment ``async_save`` was called, though the optimizer
changed it right after: the script keeps a copy of that state and, at the end, loads every
checkpoint into a fresh FSDP2 model and compares (this rank's shards, bit-exact).

    torchrun --nproc_per_node=2 examples/async_every_k_steps.py --dir /tmp/async_every_k_steps

Options: --steps (default 10), --every (k, default 3). Runs on CPU with gloo; on a node with a
GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter

from common import AppState, differences, process_group, sharded_model, snapshot

WIDTH = 1024  # the tutorial's model made wider: 12 MiB of parameters and Adam state, so staging takes a moment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_async_every_k_steps"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    if not 2 <= args.every <= args.steps:
        # A checkpoint at step 1 would precede Adam's first step, which creates its state.
        parser.error("--every must be at least 2 and at most --steps")
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0, width=WIDTH, lr=0.01)
        # The save runs collectives on a background thread while FSDP runs its own in forward and
        # backward: on one group they would interleave differently on each rank.
        checkpoint_group = dist.new_group(backend="gloo")
        staging_guard = fastdcp.guard(optimizer, model)  # keep the reference: a dropped guard guards nothing
        expected: dict[str, dict[str, object]] = {}  # checkpoint path -> the state at its async_save call
        writers: list[FastFileSystemWriter] = []
        pending = None
        for step in range(1, args.steps + 1):
            model(torch.rand(8, WIDTH, device=device)).sum().backward()
            if step % args.every == 0:
                if pending is not None:
                    pending.upload_completion.result()  # the previous checkpoint is committed
                path = os.path.join(args.dir, f"step_{step}")
                state = {"app": AppState(model, optimizer)}
                expected[path] = snapshot(state["app"].state_dict())
                writers.append(FastFileSystemWriter(path, async_staging=True))
                pending = dcp.async_save(state, checkpoint_id=path, storage_writer=writers[-1],
                                         process_group=checkpoint_group)
            optimizer.step()  # waits only while staging of these tensors is still running
            optimizer.zero_grad()
        if pending is not None:
            pending.upload_completion.result()
        staging_guard.remove()

        for path, state_at_call in expected.items():
            fresh = {"app": AppState(*sharded_model(device, seed=1, width=WIDTH, lr=0.01))}
            dcp.load(fresh, storage_reader=FastFileSystemReader(path))
            wrong = differences(state_at_call, snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {path} does not hold the state of its async_save call: {wrong}")
        blocked_ms = [1000 * w.last_staging_report.blocked_s for w in writers]
        if dist.get_rank() == 0:
            print(f"async_every_k_steps: OK, {len(expected)} checkpoints in {args.steps} steps under {args.dir}, "
                  f"each equal to the state at its async_save call; the calls blocked training "
                  f"{min(blocked_ms):.1f}-{max(blocked_ms):.1f} ms")


if __name__ == "__main__":
    main()
