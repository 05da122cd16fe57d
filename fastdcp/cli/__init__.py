"""``python -m fastdcp``: look inside a DCP checkpoint and check it, without loading it.

    python -m fastdcp inspect DIR [--json]   tensors (shape, dtype, chunks), byte items, files
    python -m fastdcp verify DIR [--json]    structure checks, and the CRC-32C checksums a fastdcp
                                             writer recorded (checksums=True; reads those items
                                             whole); exit 0 = OK, 1 = damaged, 2 = usage error or
                                             not a checkpoint

Works on checkpoints written by stock DCP and by fastdcp. Nothing in the checkpoint is trusted:
``.metadata`` goes through the restricted loader (:mod:`fastdcp.format.metadata`; ``--allow-unsafe-metadata``
opts out for a trusted checkpoint with custom classes), data files are opened only inside the
directory, and tensor blobs are parsed by :func:`fastdcp.format.blob_parse.parse_tensor_blob` (headers only,
not tensor data).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..format.metadata import CheckpointFormatError
from .checkpoint import EXIT_DAMAGED, EXIT_USAGE, NotACheckpoint, open_checkpoint
from .inspect_command import run_inspect
from .verify_command import run_verify

__all__ = ["main"]


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The checkpoint as seen by the commands
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastdcp", description="Inspect and verify PyTorch Distributed Checkpoint directories."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{inspect,verify}")
    for name, help_text in (
        ("inspect", "list tensors (shape, dtype, chunks), byte items and files"),
        ("verify", "check structure (metadata, files, byte ranges, blob headers); exit 0 OK, 1 damaged, 2 not a checkpoint"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("directory", metavar="DIR", help="checkpoint directory")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--allow-unsafe-metadata",
            action="store_true",
            help="unpickle .metadata with plain pickle (runs any code it names: trusted checkpoints only)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    directory = args.directory
    try:
        ckpt = open_checkpoint(directory, args.allow_unsafe_metadata)
    except NotACheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointFormatError as e:
        if args.json:
            json.dump({"path": directory, "ok": False, "problems": [{"file": None, "offset": None, "fqn": None, "problem": str(e)}]}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        print(f"DAMAGED: {e}", file=sys.stdout if not args.json else sys.stderr)
        return EXIT_DAMAGED
    try:
        if args.command == "inspect":
            return run_inspect(ckpt, args.json)
        return run_verify(ckpt, args.json)
    except BrokenPipeError:  # `... | head`: stop quietly (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_DAMAGED
    finally:
        ckpt.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
