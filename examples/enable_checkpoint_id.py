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

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fastdcp

from common import AppState, differences, process_group, sharded_model, snapshot, train_step


def save_and_resume(path: str, device: str) -> tuple[dict[str, object], dict[str, object]]:
    """Framework code, unaware of fastdcp: train a step, save by checkpoint_id, load it into a fresh
    model. Returns the saved state and the loaded one."""
    model, optimizer = sharded_model(device, seed=0)
    train_step(model, optimizer, device)
    state = {"app": AppState(model, optimizer)}
    dcp.save(state, checkpoint_id=path)

    fresh = {"app": AppState(*sharded_model(device, seed=1))}
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
    with process_group() as device:
        fastdcp.enable()  # process-wide; `with fastdcp.enable():` limits it to a block
        fastdcp_log = logging.getLogger("fastdcp")
        records = Records()
        fastdcp_log.addHandler(records)
        fastdcp_log.setLevel(logging.DEBUG)

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


if __name__ == "__main__":
    main()
