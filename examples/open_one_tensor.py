"""``fastdcp.open``: one tensor, or some rows of one, read from a checkpoint without loading it.

Two ranks save the tutorial's FSDP2 model (made wider) and its Adam state with
``FastFileSystemWriter``; each rank's file holds its half of every tensor. Then rank 0, as an
evaluation script or a notebook would, opens the checkpoint with ``fastdcp.open(path)``: a
read-only mapping over the checkpoint's flattened keys that reads ``.metadata`` only, lists the
keys with their shapes and shards (``ckpt.metadata(key)``), reads one whole tensor (``ckpt[key]``,
assembled from both ranks' files) and a few rows of one (``ckpt.get_slice(key)[a:b]``), which
reads only those rows' bytes. No process group, model or optimizer is needed to do it.

Both must equal the saved tensor (gathered from the two ranks' shards), bit-exact, and the rows'
read must stay far below the tensor's size (``ckpt.bytes_read``).

    torchrun --nproc_per_node=2 examples/open_one_tensor.py --dir /tmp/open_one_tensor

Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs with NCCL (``fastdcp.open``
reads to the CPU unless given ``device="cuda"``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fastdcp
from fastdcp import FastFileSystemWriter

from common import AppState, process_group, sharded_model, snapshot, train_step

WIDTH = 1024  # net1.weight: 1024 x 1024 float32, 4 MiB
KEY = "app.model.net1.weight"  # DCP's flattened name: the state dict's nested keys joined by dots
ROWS = slice(600, 616)  # 16 rows that lie in rank 1's shard (FSDP2 splits dim 0 across the ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_open_one_tensor"))
    args = parser.parse_args()
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0, width=WIDTH)
        train_step(model, optimizer, device)
        state = {"app": AppState(model, optimizer)}
        dcp.save(state, storage_writer=FastFileSystemWriter(args.dir))
        saved = snapshot({"app": state["app"].state_dict()}, whole=True)  # whole tensors, by DCP's names (a collective)
        dist.barrier()

        if dist.get_rank() == 0:
            with fastdcp.open(args.dir) as ckpt:
                # What is in it, from .metadata alone (no data file read yet).
                tensors = [key for key in ckpt if isinstance(ckpt.metadata(key), fastdcp.TensorInfo)]
                info = ckpt.metadata(KEY)
                print(f"{len(ckpt)} entries, {len(tensors)} tensors; {KEY}: shape {info.shape}, {info.dtype}, "
                      f"{len(info.chunks)} chunks in " + ", ".join(sorted({c.file for c in info.chunks})))
                if ckpt.bytes_read != 0:
                    raise RuntimeError(f"listing the keys read {ckpt.bytes_read} bytes of data files")

                rows = ckpt.get_slice(KEY)[ROWS]
                rows_bytes = ckpt.bytes_read
                whole = ckpt[KEY]

            expected = saved[KEY]
            if not torch.equal(rows, expected[ROWS]):
                raise RuntimeError(f"get_slice({KEY!r})[{ROWS.start}:{ROWS.stop}] differs from the saved rows")
            if not torch.equal(whole, expected):
                raise RuntimeError(f"ckpt[{KEY!r}] differs from the saved tensor")
            if rows_bytes > expected.nbytes // 8:
                raise RuntimeError(f"reading {ROWS.stop - ROWS.start} rows read {rows_bytes} bytes, "
                                   f"not far below the tensor's {expected.nbytes}")
            print(f"open_one_tensor: OK, fastdcp.open({args.dir!r}): {KEY} {tuple(whole.shape)} read whole "
                  f"and rows {ROWS.start}:{ROWS.stop} read alone ({rows_bytes / 1024:.0f} KiB of "
                  f"{expected.nbytes / 2**20:.0f} MiB), both bit-exact")
        dist.barrier()


if __name__ == "__main__":
    main()
