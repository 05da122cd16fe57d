"""Export a sharded training checkpoint to one ``.safetensors`` file.

Two ranks save an FSDP2 model and its optimizer with fastdcp; then
``python -m fastdcp convert CHECKPOINT model.safetensors`` turns the checkpoint into a single
file, streaming one tensor at a time (no process group, no model code, memory bounded by
``--memory-budget``). ``--keys`` keeps the model's weights (drops the optimizer state) and
``--dtype bf16`` casts them, as for publishing a model. ``safetensors.torch.load_file`` then
reads the file, and each tensor must equal the full (unsharded) parameter cast to bfloat16.

    torchrun --nproc_per_node=2 examples/export_safetensors.py --dir /tmp/export_safetensors

Needs ``pip install safetensors`` for the check (the conversion itself does not). Runs on CPU with
gloo; on a node with a GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict

from fastdcp import FastFileSystemWriter

from common import process_group, sharded_model, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_export_safetensors"))
    args = parser.parse_args()
    checkpoint, exported = os.path.join(args.dir, "checkpoint"), os.path.join(args.dir, "model.safetensors")
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0)
        train_step(model, optimizer, device)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, storage_writer=FastFileSystemWriter(checkpoint))
        # The whole parameters (a collective, on every rank), in the checkpoint's key names.
        expected = {f"model.{name}": value.full_tensor().to(torch.bfloat16).cpu() for name, value in model_state.items()}

        if dist.get_rank() == 0:
            # The export is a separate command: it needs neither the model's code nor the ranks.
            subprocess.run([sys.executable, "-m", "fastdcp", "convert", checkpoint, exported,
                            "--keys", r"^model\.", "--dtype", "bf16"], check=True)
            tensors = load_file(exported)
            if tensors.keys() != expected.keys():
                raise RuntimeError(f"{exported} holds {sorted(tensors)}, expected {sorted(expected)}")
            wrong = [key for key, value in expected.items() if not torch.equal(tensors[key], value)]
            if wrong:
                raise RuntimeError(f"{exported}: different values for {wrong}")
            print(f"export_safetensors: OK, {len(tensors)} bfloat16 weights of a {dist.get_world_size()}-rank "
                  f"checkpoint exported to {exported}, equal to the full parameters")


if __name__ == "__main__":
    main()
