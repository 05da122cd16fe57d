"""``python -m fastdcp``: look inside a DCP checkpoint and check it, without loading it.

    python -m fastdcp inspect DIR [--json]   tensors (shape, dtype, chunks), byte items, files
    python -m fastdcp verify DIR [--json]    structure checks, and the CRC-32C checksums a fastdcp
                                             writer recorded (checksums=True; reads those items
                                             whole); exit 0 = OK, 1 = damaged, 2 = usage error or
                                             not a checkpoint
    python -m fastdcp gc URL [--delete] [--min-age-s 3600]
                                             the objects interrupted saves left under an s3://
                                             or az:// checkpoint; a dry run unless --delete
    python -m fastdcp convert SRC DST [--dtype bf16] [--keys REGEX] [--max-shard-size 5GB]
                                      [--memory-budget 1GiB]
                                             to .safetensors (sharded past --max-shard-size, with
                                             an index JSON) or .pt, streamed within the budget

DIR and SRC are local directories or ``s3://bucket/prefix`` / ``az://container/prefix`` URLs (the
``AWS_*`` / ``AZURE_STORAGE_*`` environment, as for :class:`fastdcp.FastS3Reader` and
:class:`fastdcp.FastAzureReader`). Works on checkpoints written by stock DCP and by fastdcp.
Nothing in the checkpoint is trusted: ``.metadata`` goes through the restricted loader (:mod:`fastdcp.format.metadata`; ``--allow-unsafe-metadata``
opts out for a trusted checkpoint with custom classes), data files are opened only inside the
directory, and tensor blobs are parsed by :func:`fastdcp.format.blob_parse.parse_tensor_blob` (headers only,
not tensor data).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from ..format.metadata import CheckpointFormatError
from ..objstore.location import is_object_url
from .checkpoint import EXIT_DAMAGED, EXIT_OK, EXIT_USAGE, NotACheckpoint, open_checkpoint
from .object_checkpoint import open_object_checkpoint
from .convert_command import DTYPE_NAMES, ConvertOptions, parse_size, run_convert
from .gc_command import run_gc
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{inspect,verify,convert,gc}")
    for name, help_text in (
        ("inspect", "list tensors (shape, dtype, chunks), byte items and files"),
        ("verify", "check structure (metadata, files, byte ranges, blob headers); exit 0 OK, 1 damaged, 2 not a checkpoint"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("directory", metavar="DIR", help="checkpoint directory, or s3://bucket/prefix or az://container/prefix")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--allow-unsafe-metadata",
            action="store_true",
            help="unpickle .metadata with plain pickle (runs any code it names: trusted checkpoints only)",
        )
    convert = sub.add_parser(
        "convert", help="write the checkpoint as .safetensors (optionally sharded) or .pt",
        description="Write a DCP checkpoint as .safetensors (tensors only, streamed; sharded past "
        "--max-shard-size with a model.safetensors.index.json) or .pt (a torch.save state dict).",
    )
    convert.add_argument("directory", metavar="SRC", help="checkpoint directory, or s3://bucket/prefix or az://container/prefix")
    convert.add_argument("destination", metavar="DST", help="output file: *.safetensors, *.pt or *.pth")
    convert.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="cast floating-point tensors to this dtype")
    convert.add_argument("--keys", metavar="REGEX", help="keep only the (flattened) keys this matches (re.search)")
    convert.add_argument("--max-shard-size", metavar="SIZE", type=parse_size,
                         help="split .safetensors output into files of at most SIZE (e.g. 5GB, 2GiB)")
    convert.add_argument("--memory-budget", metavar="SIZE", type=parse_size, default=parse_size("1GiB"),
                         help="memory for tensor data in flight (default 1GiB; .pt output also holds the "
                         "largest tensor whole)")
    convert.add_argument("--include-objects", action="store_true",
                         help=".pt only: keep non-tensor entries (unpickled as DCP does: trusted checkpoints only)")
    convert.add_argument("--allow-unsafe-metadata", action="store_true",
                         help="unpickle .metadata with plain pickle (runs any code it names: trusted checkpoints only)")
    gc = sub.add_parser(
        "gc", help="list (--delete: remove) the objects interrupted saves left under an s3:// or az:// checkpoint",
        description="List the data objects under an object storage checkpoint that its .metadata does not name "
        "(left by saves cut off before they could clean up), older than --min-age-s; --delete removes them. "
        "A dry run by default; the checkpoint and every object DCP would not have written are kept.",
    )
    gc.add_argument("directory", metavar="URL", help="s3://bucket/prefix or az://container/prefix")
    gc.add_argument("--delete", action="store_true", help="delete the objects left over (default: only list them)")
    gc.add_argument("--min-age-s", type=float, default=3600.0,
                    help="an unnamed object younger than this may belong to a save still running: kept (default 3600)")
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _convert(args: argparse.Namespace) -> int:
    options = ConvertOptions(
        source=args.directory, destination=args.destination,
        dtype=DTYPE_NAMES[args.dtype] if args.dtype else None, keys=args.keys,
        max_shard_size=args.max_shard_size, memory_budget=args.memory_budget,
        include_objects=args.include_objects, allow_unsafe_metadata=args.allow_unsafe_metadata,
    )
    try:
        written = run_convert(options)
    except FileNotFoundError as e:  # CheckpointNotFoundError included
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, re.error) as e:  # CheckpointFormatError and BlobFormatError are ValueErrors
        damaged = isinstance(e, CheckpointFormatError) or type(e).__name__ == "BlobFormatError"
        print(f"{'DAMAGED' if damaged else 'error'}: {e}", file=sys.stderr)
        return EXIT_DAMAGED if damaged else EXIT_USAGE
    for name in written:
        print(name)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "convert":
        return _convert(args)
    if args.command == "gc":
        return run_gc(args.directory, delete=args.delete, min_age_s=args.min_age_s, as_json=args.json)
    directory = args.directory
    try:
        opener = open_object_checkpoint if is_object_url(directory) else open_checkpoint
        ckpt = opener(directory, args.allow_unsafe_metadata)
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
