"""``fastdcp.enable()``: fastdcp under code that only passes ``checkpoint_id``.

Frameworks such as torchtitan call ``dcp.save(state, checkpoint_id=path)`` and let DCP choose the
storage. ``fastdcp.enable()`` (or ``FASTDCP_ENABLE=1`` in the environment of a script that
imports fastdcp) makes that choice ``FastFileSystemWriter`` / ``FastFileSystemReader``, with no
change to the framework's code. ``save_and_resume`` below stands for that code: it never names
fastdcp. Each rank must enable it (the switch is per process).

To show that fastdcp did the work, the script listens to fastdcp's logger (silent unless the
application configures it): on rank 0 it reports the save's commit and the load's reads. The
loaded state must equal the saved one (this rank's shards, bit-exact).

    torchrun --nproc_per_node=2 examples/enable_checkpoint_id.py --dir /tmp/enable_checkpoint_id

Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import logging
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

import fastdcp


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


def save_and_resume(path: str, device: str) -> tuple[dict[str, object], dict[str, object]]:
    """Framework code, unaware of fastdcp: train a step, save by checkpoint_id, load it into a fresh
    model. Returns the saved state and the loaded one."""
    model, optimizer = sharded_model(device, seed=0)
    model(torch.rand(8, 16, device=device)).sum().backward()
    optimizer.step()
    state = {"app": AppState(model, optimizer)}
    dcp.save(state, checkpoint_id=path)

    fresh_model, fresh_optimizer = sharded_model(device, seed=1)
    fresh = {"app": AppState(fresh_model, fresh_optimizer)}
    dcp.load(fresh, checkpoint_id=path)
    return snapshot(state["app"].state_dict()), snapshot(fresh["app"].state_dict())


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_enable_checkpoint_id"))
    args = parser.parse_args()
    device = init_distributed()
    fastdcp.enable()  # process-wide; `with fastdcp.enable():` limits it to a block
    fastdcp_log = logging.getLogger("fastdcp")
    records = Records()
    fastdcp_log.addHandler(records)
    fastdcp_log.setLevel(logging.DEBUG)
    try:
        saved, loaded = save_and_resume(args.dir, device)
        wrong = differences(saved, loaded)
        if wrong:
            raise RuntimeError(f"rank {dist.get_rank()}: loaded different values for {wrong}")
        if dist.get_rank() == 0:
            commits = [m for m in records.messages if m.startswith("committed")]
            reads = [m for m in records.messages if m.startswith("read")]
            if not commits or not reads:
                raise RuntimeError(f"fastdcp did not save and load {args.dir}: its log holds {records.messages}")
            print(f"enable_checkpoint_id: OK, dcp.save/dcp.load with checkpoint_id={args.dir} went through "
                  f"fastdcp ({commits[0]!r}); {len(saved)} entries per rank loaded bit-exact")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
