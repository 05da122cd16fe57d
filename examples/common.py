"""The plumbing the examples share, none of it fastdcp's: the PyTorch DCP tutorial's model and
``AppState`` wrapper (https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html),
process-group setup and teardown, and the comparison of a saved state with a loaded one.

Not an example itself: each script in this folder imports it (``from common import ...`` works
because ``torchrun script.py`` puts the script's folder first on ``sys.path``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class ToyModel(nn.Module):
    """The tutorial's model; ``width`` (the tutorial's 16) makes it larger where an example needs that."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net1 = nn.Linear(width, width)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(width, 8)

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


@contextmanager
def process_group() -> Iterator[str]:
    """The process group torchrun describes, destroyed on leaving the block; yields the device the
    model runs on (a GPU per rank when the node has enough, with NCCL beside gloo; else the CPU).
    When the block succeeds the process ends with it (see below): it must be a script's last step."""
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl")
        device = "cuda"
    else:
        dist.init_process_group("gloo")
        device = "cpu"
    try:
        yield device
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    # Everything is done and checked: end the process here rather than through interpreter
    # finalization, where gloo's worker threads, kept alive by a DTensor's device mesh, can drop
    # their last reference to a Python tensor and abort the exit ("terminate called without an
    # active exception", pytorch/pytorch#190489; seen once in several runs of these examples).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sharded_model(device: str, seed: int, width: int = 16, lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A ``ToyModel`` sharded with FSDP2 over all ranks, and its Adam optimizer; the seed decides
    the initial weights (a different one for the model a checkpoint is loaded into)."""
    torch.manual_seed(seed)
    model = ToyModel(width).to(device)
    fully_shard(model, mesh=init_device_mesh(device, (dist.get_world_size(),)))
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: str) -> None:
    """One step of training on a random batch: the parameters change and Adam has state to save."""
    model(torch.rand(8, model.net1.in_features, device=device)).sum().backward()
    optimizer.step()


def snapshot(state: object, *, whole: bool = False, path: str = "") -> dict[str, object]:
    """Every leaf of a nested state dict by its dotted path, tensors copied to the CPU. A DTensor
    gives this rank's shard, or with ``whole=True`` the full tensor (a collective: every rank calls
    it), so that states saved and loaded at different world sizes compare."""
    if isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return {k: v for key, value in items
                for k, v in snapshot(value, whole=whole, path=f"{path}.{key}" if path else str(key)).items()}
    if isinstance(state, DTensor):
        state = state.full_tensor() if whole else state.to_local()
    return {path: state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state}


def differences(expected: dict[str, object], actual: dict[str, object]) -> list[str]:
    """The paths where two snapshots differ (tensors compared bit-exact); empty when they are equal."""
    if expected.keys() != actual.keys():
        return [f"keys differ: {sorted(expected.keys() ^ actual.keys())}"]
    return [key for key, value in expected.items()
            if not (torch.equal(value, actual[key]) if isinstance(value, torch.Tensor) else value == actual[key])]
