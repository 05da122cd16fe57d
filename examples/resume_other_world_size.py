"""Resume at another world size: a checkpoint saved by 2 ranks of an FSDP2 model, loaded by 1.

DCP stores each shard with its place in the full tensor, so a job may resume with a different
number of ranks: every rank of the new job reads the parts of the saved shards that make up its
own shard. Nothing in the code depends on the world size; fastdcp's reader reads only the byte
runs each new shard needs.

Two runs, the second after the first (any world size works for either):

    torchrun --nproc_per_node=2 examples/resume_other_world_size.py --phase save --dir /tmp/resume_ws
    torchrun --nproc_per_node=1 examples/resume_other_world_size.py --phase load --dir /tmp/resume_ws

The save run also writes the full (unsharded) state to ``reference.pt`` beside the checkpoint;
the load run compares the whole resumed state with it, bit-exact. Runs on CPU with gloo; on a
node with a GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fastdcp import FastFileSystemReader, FastFileSystemWriter

from common import AppState, differences, process_group, sharded_model, snapshot, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("save", "load"), required=True)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_resume_other_world_size"))
    args = parser.parse_args()
    checkpoint, reference = os.path.join(args.dir, "checkpoint"), os.path.join(args.dir, "reference.pt")
    with process_group() as device:
        world_size = dist.get_world_size()
        if args.phase == "save":
            model, optimizer = sharded_model(device, seed=0)
            train_step(model, optimizer, device)
            state = {"app": AppState(model, optimizer)}
            dcp.save(state, storage_writer=FastFileSystemWriter(checkpoint))
            # The full tensors (a collective, on every rank), comparable with a state at any world size.
            full_state = snapshot(state["app"].state_dict(), whole=True)
            if dist.get_rank() == 0:
                torch.save({"world_size": world_size, "state": full_state}, reference)
                print(f"resume_other_world_size: saved at world size {world_size} to {checkpoint}; "
                      f"now load it with another --nproc_per_node and --phase load")
        else:
            saved = torch.load(reference)
            # Another seed, so a load that changed nothing cannot pass for a correct one.
            model, optimizer = sharded_model(device, seed=1)
            state = {"app": AppState(model, optimizer)}
            if not differences(saved["state"], snapshot(state["app"].state_dict(), whole=True)):
                raise RuntimeError("the fresh model already equals the saved one: the check would prove nothing")
            dcp.load(state, storage_reader=FastFileSystemReader(checkpoint))
            wrong = differences(saved["state"], snapshot(state["app"].state_dict(), whole=True))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: resumed with different values for {wrong}")
            if dist.get_rank() == 0:
                print(f"resume_other_world_size: OK, saved at world size {saved['world_size']}, resumed at "
                      f"world size {world_size}: all {len(saved['state'])} entries equal the saved state")


if __name__ == "__main__":
    main()
