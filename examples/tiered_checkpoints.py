"""Tiered checkpoints: each save commits to node-local memory (``/dev/shm``) and returns; background
threads then drain it to shared storage, where ``.metadata`` is written last.

``FastTieredWriter(shared_path, local_root=..., async_staging=True)`` takes the place of
``FastFileSystemWriter``: ``upload_completion`` of ``dcp.async_save`` means committed in the local
tier, ``writer.wait_durable()`` committed in the shared one. After training, a "restarted" job
asks ``fastdcp.tiered.newest_checkpoint`` what to resume from and loads it with
``FastTieredReader``, which reads the local copy when this node holds it whole (else the shared
one). Then, as a job on a node that lost its local tier would, stock ``FileSystemReader`` loads the
shared copy. Both must equal the state at the checkpoint's ``async_save`` call (this rank's shards,
bit-exact).

    torchrun --nproc_per_node=2 examples/tiered_checkpoints.py --dir /tmp/tiered_checkpoints

``--dir`` stands in for the shared filesystem (or use an ``s3://`` URL in your own code);
``--local-root`` is the node-local tier (default ``$FASTDCP_LOCAL_TIER``, else
``/dev/shm/fastdcp-tiered``). Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs
with NCCL.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import fastdcp
from fastdcp import FastTieredReader, FastTieredWriter
from fastdcp.tiered import newest_checkpoint

from common import AppState, differences, process_group, sharded_model, snapshot

WIDTH = 256  # the tutorial's model made wider


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_tiered_checkpoints"))
    parser.add_argument("--local-root", default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    if not 2 <= args.every <= args.steps:
        # A checkpoint at step 1 would precede Adam's first step, which creates its state.
        parser.error("--every must be at least 2 and at most --steps")
    shared_root = os.path.abspath(args.dir)
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0, width=WIDTH, lr=0.01)
        # The save runs collectives on a background thread while FSDP runs its own in forward and
        # backward: on one group they would interleave differently on each rank.
        checkpoint_group = dist.new_group(backend="gloo")
        staging_guard = fastdcp.guard(optimizer, model)
        # One writer for the run; each async_save points it at its checkpoint by checkpoint_id.
        writer = FastTieredWriter(os.path.join(shared_root, "step_0"), local_root=args.local_root, async_staging=True)
        expected: dict[str, dict[str, object]] = {}  # shared location -> the state at its async_save call
        pending = None
        for step in range(1, args.steps + 1):
            model(torch.rand(8, WIDTH, device=device)).sum().backward()
            if step % args.every == 0:
                if pending is not None:
                    pending.upload_completion.result()  # committed in the local tier (the drain goes on)
                path = os.path.join(shared_root, f"step_{step}")
                state = {"app": AppState(model, optimizer)}
                expected[path] = snapshot(state["app"].state_dict())
                pending = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=checkpoint_group)
            optimizer.step()
            optimizer.zero_grad()
        pending.upload_completion.result()
        staging_guard.remove()
        writer.wait_durable()
        # On rank 0 (the coordinator) durable means committed in the shared tier; on the others, only
        # that their own files are there. After the barrier the last checkpoint is committed there.
        dist.barrier()

        # A restarted job: what to resume from, then load it from the nearest tier that holds it whole.
        resume_from = newest_checkpoint(shared_root, local_root=args.local_root)
        last = list(expected)[-1]
        if resume_from != last:
            raise RuntimeError(f"newest_checkpoint chose {resume_from}, expected {last}")
        tiered_reader = FastTieredReader(resume_from, local_root=args.local_root)
        for name, reader in (("FastTieredReader", tiered_reader),
                             ("stock FileSystemReader on the shared copy", FileSystemReader(resume_from))):
            fresh = {"app": AppState(*sharded_model(device, seed=1, width=WIDTH, lr=0.01))}
            dcp.load(fresh, storage_reader=reader)
            wrong = differences(expected[resume_from], snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {name} loaded different values for {wrong}")
        if tiered_reader.tier != "local":
            raise RuntimeError(f"rank {dist.get_rank()}: FastTieredReader read the {tiered_reader.tier} tier, "
                               f"though this node holds {resume_from} whole in {writer.local_root}")
        if dist.get_rank() == 0:
            print(f"tiered_checkpoints: OK, {len(expected)} checkpoints committed in {writer.local_root} and "
                  f"drained to {shared_root}; resumed from {resume_from}: the local copy and the shared one "
                  f"(stock reader) equal the state at its async_save call")


if __name__ == "__main__":
    main()
