"""The PyTorch DCP tutorial's FSDP2 model, saved and loaded with fastdcp swapped in.

The model, the ``AppState`` wrapper (both in ``common.py``, with the other plumbing the examples
share) and the training step are the tutorial's
(https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html); the one change is the
storage: ``storage_writer=FastFileSystemWriter(path)`` / ``storage_reader=FastFileSystemReader(path)``
instead of ``checkpoint_id=path``. The checkpoint stays a standard DCP checkpoint: a fresh model
loads it with fastdcp's reader and again with stock ``FileSystemReader``, and both must equal the
saved state (this rank's shard of every parameter and Adam state) exactly.

    torchrun --nproc_per_node=2 examples/fsdp_save_load.py --dir /tmp/fsdp_save_load

Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from fastdcp import FastFileSystemReader, FastFileSystemWriter

from common import AppState, differences, process_group, sharded_model, snapshot, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_fsdp_save_load"))
    args = parser.parse_args()
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0)
        optimizer.zero_grad()
        train_step(model, optimizer, device)

        state_dict = {"app": AppState(model, optimizer)}
        dcp.save(state_dict, storage_writer=FastFileSystemWriter(args.dir))
        saved = snapshot(state_dict["app"].state_dict())

        for reader_class in (FastFileSystemReader, FileSystemReader):
            # Another seed, so a load that changed nothing cannot pass for a correct one.
            fresh = {"app": AppState(*sharded_model(device, seed=1))}
            if not differences(saved, snapshot(fresh["app"].state_dict())):
                raise RuntimeError("the fresh model already equals the saved one: the check would prove nothing")
            dcp.load(fresh, storage_reader=reader_class(args.dir))
            wrong = differences(saved, snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {reader_class.__name__} loaded different values for {wrong}")
        if dist.get_rank() == 0:
            print(f"fsdp_save_load: OK, {len(saved)} entries per rank saved with FastFileSystemWriter to {args.dir}, "
                  f"loaded bit-exact by FastFileSystemReader and stock FileSystemReader")


if __name__ == "__main__":
    main()
