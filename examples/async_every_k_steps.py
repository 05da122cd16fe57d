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
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter

WIDTH = 1024  # 12 MiB of parameters and Adam state: large enough that staging takes a moment


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(WIDTH, WIDTH)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(WIDTH, 8)

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
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


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
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_async_every_k_steps"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    if not 2 <= args.every <= args.steps:
        # A checkpoint at step 1 would precede Adam's first step, which creates its state.
        parser.error("--every must be at least 2 and at most --steps")
    device = init_distributed()
    try:
        model, optimizer = sharded_model(device, seed=0)
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
            fresh_model, fresh_optimizer = sharded_model(device, seed=1)
            fresh = {"app": AppState(fresh_model, fresh_optimizer)}
            dcp.load(fresh, storage_reader=FastFileSystemReader(path))
            wrong = differences(state_at_call, snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {path} does not hold the state of its async_save call: {wrong}")
        blocked_ms = [1000 * w.last_staging_report.blocked_s for w in writers]
        if dist.get_rank() == 0:
            print(f"async_every_k_steps: OK, {len(expected)} checkpoints in {args.steps} steps under {args.dir}, "
                  f"each equal to the state at its async_save call; the calls blocked training "
                  f"{min(blocked_ms):.1f}-{max(blocked_ms):.1f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
