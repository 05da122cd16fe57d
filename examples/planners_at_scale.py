"""``FastSavePlanner`` / ``FastLoadPlanner``: DCP's planning, cached, for jobs with many ranks.

Before any byte is written, every ``dcp.save`` plans: each rank lists what it holds, the
coordinator (rank 0) gathers every rank's list, deduplicates and builds ``.metadata``, and sends
each rank its plan back. Stock's ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` redo all of it on
every call, in Python per tensor and per rank; at thousands of ranks that takes minutes of the
coordinator's time per save (docs/performance.md, "Planning at thousands of ranks"). fastdcp's
planners build the same plans in bulk and cache them per state-dict structure: a later save of
the same model (same shapes, shardings and keys) reuses every rank's plan and the coordinator's.
``FastLoadPlanner`` plans a load from the chunk index that a ``FastSavePlanner`` save writes beside
``.metadata``, each rank reading its own part of it rather than all of ``.metadata``.

They are passed by hand, as ``planner=``: neither the writer/reader swap nor ``fastdcp.enable()``
installs them (DCP then uses stock's planners). Use them when planning shows up in checkpoint
time: many ranks, or state dicts of many thousands of tensors. The checkpoint they write is
standard: stock's ``DefaultLoadPlanner`` and ``FileSystemReader`` load it.

The script saves the tutorial's FSDP2 model every training step with one ``FastSavePlanner``,
checks that only the first save planned (every later one reused the cached plans, on every rank
and on the coordinator), then loads every checkpoint with ``FastLoadPlanner`` and the last one
also with stock's planner and reader. Each load must equal the state saved at that step (this
rank's shards, bit-exact): a reused plan must not carry an earlier save's data into a later one.

    torchrun --nproc_per_node=2 examples/planners_at_scale.py --dir /tmp/planners_at_scale

Options: --steps (default 4). Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs
with NCCL.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastLoadPlanner, FastSavePlanner

from common import AppState, differences, process_group, sharded_model, snapshot, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_planners_at_scale"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the plans are reused from the second save on")
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0)
        save_planner = FastSavePlanner()  # one for the run; its cache is per process
        expected: dict[str, dict[str, object]] = {}  # checkpoint path -> the state saved there
        for step in range(1, args.steps + 1):
            train_step(model, optimizer, device)
            optimizer.zero_grad()
            path = os.path.join(args.dir, f"step_{step}")
            state = {"app": AppState(model, optimizer)}
            dcp.save(state, storage_writer=FastFileSystemWriter(path), planner=save_planner)
            expected[path] = snapshot(state["app"].state_dict())

        # Planned once, reused by every later save: on every rank, and on the coordinator globally.
        planned = (save_planner.local_plan_misses, save_planner.local_plan_hits)
        if planned != (1, args.steps - 1):
            raise RuntimeError(f"rank {dist.get_rank()}: {planned[0]} local plans built and {planned[1]} "
                               f"reused in {args.steps} saves; expected 1 and {args.steps - 1}")
        if dist.get_rank() == 0 and (save_planner.global_plan_misses, save_planner.global_plan_hits) != (1, args.steps - 1):
            raise RuntimeError(f"the coordinator planned {save_planner.global_plan_misses} times in "
                               f"{args.steps} saves, reusing its plan {save_planner.global_plan_hits} times")

        last = list(expected)[-1]
        loads = [(path, FastFileSystemReader(path), FastLoadPlanner()) for path in expected]
        loads.append((last, FileSystemReader(last), DefaultLoadPlanner()))  # stock reads it too
        for path, reader, planner in loads:
            fresh = {"app": AppState(*sharded_model(device, seed=1))}
            dcp.load(fresh, storage_reader=reader, planner=planner)
            wrong = differences(expected[path], snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {path} loaded with {type(planner).__name__} and "
                                   f"{type(reader).__name__} holds different values for {wrong}")
        if dist.get_rank() == 0:
            print(f"planners_at_scale: OK, {args.steps} saves under {args.dir} with one FastSavePlanner: planned "
                  f"once, the plans reused {args.steps - 1} times; each checkpoint loaded bit-exact with "
                  f"FastLoadPlanner, the last also with stock's DefaultLoadPlanner + FileSystemReader")


if __name__ == "__main__":
    main()
