"""``python -m fastdcp verify``: check a checkpoint without loading it, and find one damaged byte.

Two ranks save the tutorial's FSDP2 model (made wider) and its Adam state with
``FastFileSystemWriter(path, checksums=True)``, which records a CRC-32C of every stored item in
``.metadata``. Rank 0 then runs ``python -m fastdcp verify PATH``, as a job would before resuming
or a pipeline before publishing a checkpoint: it checks the structure (every item the metadata
names has its file, byte range and tensor header, of the right dtype and shape) and the recorded
checksums. Exit status 0 OK, 1 damaged, 2 not a checkpoint.

Then it copies the checkpoint, flips one byte in the middle of one tensor's stored data (a bit rot
or a bad copy that leaves every size and header intact), and runs ``verify`` on the copy: it must
exit 1 and name the tensor and the data file. A load with ``FastFileSystemReader(path,
verify_checksums=True)`` must refuse the copy as well. Structure checks alone cannot see such a
flip: the data bytes are checked only against checksums recorded at save time.

    torchrun --nproc_per_node=2 examples/verify_checkpoint.py --dir /tmp/verify_checkpoint

Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter

from common import AppState, differences, process_group, sharded_model, snapshot, train_step

WIDTH = 1024  # net1.weight: 4 MiB, a 2 MiB shard per rank
KEY = "app.model.net1.weight"  # the tensor whose stored data gets one flipped byte


def verify(*paths: str) -> list[tuple[int, str]]:
    """``python -m fastdcp verify PATH`` of each path (run side by side): exit status and output."""
    runs = [subprocess.Popen([sys.executable, "-m", "fastdcp", "verify", path], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for path in paths]
    return [(run.wait(), run.stdout.read()) for run in runs]


def flip_one_byte(path: str) -> str:
    """Flip every bit of the middle byte of KEY's last stored chunk (tensor data, not its header).
    Returns the data file's name."""
    with fastdcp.open(path) as ckpt:
        chunk = ckpt.metadata(KEY).chunks[-1]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(chunk.byte_offset + chunk.byte_length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
    return chunk.file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_verify_checkpoint"))
    args = parser.parse_args()
    good, damaged = os.path.join(args.dir, "good"), os.path.join(args.dir, "damaged")
    with process_group() as device:
        model, optimizer = sharded_model(device, seed=0, width=WIDTH)
        train_step(model, optimizer, device)
        state = {"app": AppState(model, optimizer)}
        dcp.save(state, storage_writer=FastFileSystemWriter(good, checksums=True))
        saved = snapshot(state["app"].state_dict())

        if dist.get_rank() == 0:
            shutil.rmtree(damaged, ignore_errors=True)
            shutil.copytree(good, damaged)
            data_file = flip_one_byte(damaged)
            (good_status, good_output), (damaged_status, damaged_output) = verify(good, damaged)
            for path, status, output in ((good, good_status, good_output), (damaged, damaged_status, damaged_output)):
                print(f"$ python -m fastdcp verify {path}\n{output.rstrip()}\n(exit {status})")
            if good_status != 0 or "OK:" not in good_output:
                raise RuntimeError(f"verify did not pass the checkpoint just saved (exit {good_status})")
            if damaged_status != 1 or f"'{KEY}'" not in damaged_output or data_file not in damaged_output:
                raise RuntimeError(f"verify did not report the flipped byte of {KEY} in {data_file} "
                                   f"(exit {damaged_status}, expected 1)")
        dist.barrier()

        # The load side: the intact checkpoint loads bit-exact; the damaged copy is refused.
        fresh = {"app": AppState(*sharded_model(device, seed=1, width=WIDTH))}
        dcp.load(fresh, storage_reader=FastFileSystemReader(good, verify_checksums=True))
        wrong = differences(saved, snapshot(fresh["app"].state_dict()))
        if wrong:
            raise RuntimeError(f"rank {dist.get_rank()}: loaded different values for {wrong}")
        try:
            dcp.load(fresh, storage_reader=FastFileSystemReader(damaged, verify_checksums=True))
        except CheckpointException as error:
            refusal = str(error)
        else:
            raise RuntimeError(f"rank {dist.get_rank()}: the damaged copy loaded with verify_checksums=True")
        if dist.get_rank() == 0:
            if "checksum mismatch" not in refusal:
                raise RuntimeError(f"the damaged copy was refused for another reason: {refusal[-2000:]}")
            print(f"verify_checkpoint: OK, verify passed {good} (exit 0) and found the one flipped byte of "
                  f"{KEY} in {data_file} of its copy (exit 1); a load with verify_checksums=True refused the "
                  f"copy and loaded the original bit-exact")


if __name__ == "__main__":
    main()
