"""The PyTorch DCP tutorial's FSDP2 model, saved and loaded with fastdcp swapped in.

The model, the ``AppState`` wrapper and the training step are the tutorial's
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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
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
    """The tutorial's wrapper: DCP calls state_dict() on save and load_state_dict() on load, and
    get_state_dict / set_state_dict handle FSDP's sharded parameters and the optimizer's keys."""

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


def snapshot(state: object, path: str = "") -> dict[str, object]:
    """Every leaf of a nested state dict by its dotted path; tensors copied (a DTensor: this rank's shard)."""
    if isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return {k: v for key, value in items for k, v in snapshot(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(state, DTensor):
        state = state.to_local()
    return {path: state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state}


def differences(expected: dict[str, object], actual: dict[str, object]) -> list[str]:
    if expected.keys() != actual.keys():
        return [f"keys differ: {sorted(expected.keys() ^ actual.keys())}"]
    return [key for key, value in expected.items()
            if not (torch.equal(value, actual[key]) if isinstance(value, torch.Tensor) else value == actual[key])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_fsdp_save_load"))
    args = parser.parse_args()
    device = init_distributed()
    try:
        model, optimizer = sharded_model(device, seed=0)
        optimizer.zero_grad()
        model(torch.rand(8, 16, device=device)).sum().backward()
        optimizer.step()

        state_dict = {"app": AppState(model, optimizer)}
        dcp.save(state_dict, storage_writer=FastFileSystemWriter(args.dir))
        saved = snapshot(state_dict["app"].state_dict())

        for reader_class in (FastFileSystemReader, FileSystemReader):
            # Another seed, so a load that changed nothing cannot pass for a correct one.
            fresh_model, fresh_optimizer = sharded_model(device, seed=1)
            fresh = {"app": AppState(fresh_model, fresh_optimizer)}
            if not differences(saved, snapshot(fresh["app"].state_dict())):
                raise RuntimeError("the fresh model already equals the saved one: the check would prove nothing")
            dcp.load(fresh, storage_reader=reader_class(args.dir))
            wrong = differences(saved, snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {reader_class.__name__} loaded different values for {wrong}")
        if dist.get_rank() == 0:
            print(f"fsdp_save_load: OK, {len(saved)} entries per rank saved with FastFileSystemWriter to {args.dir}, "
                  f"loaded bit-exact by FastFileSystemReader and stock FileSystemReader")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
