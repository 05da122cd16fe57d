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
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fastdcp import FastFileSystemReader, FastFileSystemWriter


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class AppState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optimizer_state}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def init_distributed() -> str:
    """The process group torchrun describes; returns the device the model runs on (a GPU per rank
    when the node has enough, else the CPU)."""
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl")
        return "cuda"
    dist.init_process_group("gloo")
    return "cpu"


def sharded_model(device: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = ToyModel().to(device)
    fully_shard(model, mesh=init_device_mesh(device, (dist.get_world_size(),)))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def full_snapshot(state: object, path: str = "") -> dict[str, object]:
    """Every leaf of a nested state dict by its dotted path; a DTensor gathered whole (a collective:
    every rank calls this), so states at different world sizes compare."""
    if isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return {k: v for key, value in items for k, v in full_snapshot(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(state, DTensor):
        state = state.full_tensor()
    return {path: state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state}


def differences(expected: dict[str, object], actual: dict[str, object]) -> list[str]:
    if expected.keys() != actual.keys():
        return [f"keys differ: {sorted(expected.keys() ^ actual.keys())}"]
    return [key for key, value in expected.items()
            if not (torch.equal(value, actual[key]) if isinstance(value, torch.Tensor) else value == actual[key])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("save", "load"), required=True)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_resume_other_world_size"))
    args = parser.parse_args()
    checkpoint, reference = os.path.join(args.dir, "checkpoint"), os.path.join(args.dir, "reference.pt")
    device = init_distributed()
    world_size = dist.get_world_size()
    try:
        if args.phase == "save":
            model, optimizer = sharded_model(device, seed=0)
            model(torch.rand(8, 16, device=device)).sum().backward()
            optimizer.step()
            state = {"app": AppState(model, optimizer)}
            dcp.save(state, storage_writer=FastFileSystemWriter(checkpoint))
            full_state = full_snapshot(state["app"].state_dict())
            if dist.get_rank() == 0:
                torch.save({"world_size": world_size, "state": full_state}, reference)
                print(f"resume_other_world_size: saved at world size {world_size} to {checkpoint}; "
                      f"now load it with another --nproc_per_node and --phase load")
        else:
            saved = torch.load(reference)
            # Another seed, so a load that changed nothing cannot pass for a correct one.
            model, optimizer = sharded_model(device, seed=1)
            state = {"app": AppState(model, optimizer)}
            if not differences(saved["state"], full_snapshot(state["app"].state_dict())):
                raise RuntimeError("the fresh model already equals the saved one: the check would prove nothing")
            dcp.load(state, storage_reader=FastFileSystemReader(checkpoint))
            wrong = differences(saved["state"], full_snapshot(state["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: resumed with different values for {wrong}")
            if dist.get_rank() == 0:
                print(f"resume_other_world_size: OK, saved at world size {saved['world_size']}, resumed at "
                      f"world size {world_size}: all {len(saved['state'])} entries equal the saved state")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
