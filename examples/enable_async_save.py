"""``fastdcp.enable()`` under ``dcp.async_save(state, checkpoint_id=path)``, called as torchtitan
calls it in its two asynchronous modes.

torchtitan never names a storage writer: its ``async`` mode calls ``dcp.async_save(state,
checkpoint_id=path, process_group=pg)`` with a gloo group of its own; ``async_with_pinned_mem``
adds ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` and one
``async_stager=DefaultStager(StagingOptions(True, True, True, True))`` kept for the whole run, and
waits for ``staging_completion`` before the next optimizer step. With ``fastdcp.enable()`` both
write through ``FastFileSystemWriter``, built in the calling process (so the checkpoint process of
``PROCESS`` mode gets it too). In the first mode fastdcp's writer also stages the state; in the
second the stager passed is used: stock's ``DefaultStager`` copies the state, fastdcp writes it.

One checkpoint per mode; right after each call the training step changes the live state. Each
checkpoint must hold the state of the moment its ``async_save`` was called (this rank's shards,
bit-exact, loaded back by ``dcp.load(checkpoint_id=...)``, which ``enable()`` also routes to
fastdcp), and its data files must be fastdcp's (``__{rank}_{token}_{i}.distcp``; stock's are
``__{rank}_{i}.distcp``).

    torchrun --nproc_per_node=2 examples/enable_async_save.py --dir /tmp/enable_async_save

Runs on CPU with gloo; on a node with a GPU per rank, on the GPUs with NCCL. On the CPU the stager
gets ``StagingOptions(False, True, True, False)``: pinned memory and non-blocking copies need an
accelerator (without one, stock warns and ignores the first and refuses the second).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import fastdcp

from common import AppState, differences, process_group, sharded_model, snapshot, train_step

WIDTH = 256  # the tutorial's model made wider
FASTDCP_DATA_FILE = re.compile(r"__\d+_[0-9a-f]+_\d+\.distcp")  # docs/GUARANTEES.md, "Save-unique names"


def stop_checkpoint_process() -> None:
    """Stop the checkpoint process that PROCESS mode started on this rank (stock keeps one for the
    job). Stock has no public call for it: the handle stops it when garbage-collected, at the
    latest at interpreter exit, which these examples skip (see common.py); without this the
    process prints an EOFError traceback when its parent ends."""
    from torch.distributed.checkpoint import _async_process_executor  # private: no public equivalent

    _async_process_executor._CHECKPOINT_PROCESS = None  # its last reference: stops and joins it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_enable_async_save"))
    args = parser.parse_args()
    with process_group() as device:
        fastdcp.enable()  # the one line added to the training script (or FASTDCP_ENABLE=1 and `import fastdcp`)

        # What torchtitan's CheckpointManager sets up (torchtitan/components/checkpoint.py).
        model, optimizer = sharded_model(device, seed=0, width=WIDTH, lr=0.01)
        checkpoint_group = dist.new_group(backend="gloo")
        on_gpu = device == "cuda"
        stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=on_gpu))

        expected: dict[str, dict[str, object]] = {}  # checkpoint path -> the state at its async_save call
        for step, mode in enumerate(("async", "async_with_pinned_mem"), start=1):
            train_step(model, optimizer, device)
            optimizer.zero_grad()
            path = os.path.join(args.dir, f"step_{step}")
            state = {"app": AppState(model, optimizer)}
            expected[path] = snapshot(state["app"].state_dict())
            if mode == "async":
                result = dcp.async_save(state, checkpoint_id=path, process_group=checkpoint_group)
            else:
                result = dcp.async_save(state, checkpoint_id=path, process_group=checkpoint_group,
                                        async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
                result.staging_completion.result()  # torchtitan's maybe_wait_for_staging()
            # Training goes on while the checkpoint is written: the live state changes.
            train_step(model, optimizer, device)
            optimizer.zero_grad()
            getattr(result, "upload_completion", result).result()  # a Future, or an AsyncSaveResponse
        stager.close()
        stop_checkpoint_process()

        for (path, state_at_call), mode in zip(expected.items(), ("async", "async_with_pinned_mem")):
            fresh = {"app": AppState(*sharded_model(device, seed=1, width=WIDTH, lr=0.01))}
            dcp.load(fresh, checkpoint_id=path)
            wrong = differences(state_at_call, snapshot(fresh["app"].state_dict()))
            if wrong:
                raise RuntimeError(f"rank {dist.get_rank()}: {path} ({mode}) does not hold the state of its "
                                   f"async_save call: {wrong}")
            data_files = sorted(name for name in os.listdir(path) if name.endswith(".distcp"))
            if not data_files or not all(FASTDCP_DATA_FILE.fullmatch(name) for name in data_files):
                raise RuntimeError(f"{path} ({mode}) was not written by fastdcp: its data files are {data_files}")
        if dist.get_rank() == 0:
            print(f"enable_async_save: OK, dcp.async_save(checkpoint_id=...) in torchtitan's async and "
                  f"async_with_pinned_mem (PROCESS + DefaultStager) modes wrote through fastdcp under {args.dir}; "
                  f"each checkpoint equals the state at its call, bit-exact")


if __name__ == "__main__":
    main()
