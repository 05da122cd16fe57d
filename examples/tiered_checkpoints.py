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
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fastdcp
from fastdcp import FastTieredReader, FastTieredWriter
from fastdcp.tiered import newest_checkpoint


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(256, 256)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(256, 8)

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
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_tiered_checkpoints"))
    parser.add_argument("--local-root", default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    if not 2 <= args.every <= args.steps:
        # A checkpoint at step 1 would precede Adam's first step, which creates its state.
        parser.error("--every must be at least 2 and at most --steps")
    shared_root = os.path.abspath(args.dir)
    device = init_distributed()
    try:
        model, optimizer = sharded_model(device, seed=0)
        # The save runs collectives on a background thread while FSDP runs its own in forward and
        # backward: on one group they would interleave differently on each rank.
        checkpoint_group = dist.new_group(backend="gloo")
        staging_guard = fastdcp.guard(optimizer, model)
        # One writer for the run; each async_save points it at its checkpoint by checkpoint_id.
        writer = FastTieredWriter(os.path.join(shared_root, "step_0"), local_root=args.local_root, async_staging=True)
        expected: dict[str, dict[str, object]] = {}  # shared location -> the state at its async_save call
        pending = None
        for step in range(1, args.steps + 1):
            model(torch.rand(8, 256, device=device)).sum().backward()
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
            fresh_model, fresh_optimizer = sharded_model(device, seed=1)
            fresh = {"app": AppState(fresh_model, fresh_optimizer)}
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
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
