"""``python -m fastdcp inspect``: tensors (shape, dtype, chunks), byte items and files."""

from __future__ import annotations

import json
import sys
from typing import Any


from .checkpoint import EXIT_OK, Checkpoint, detect_writer, dtype_name, human_size


def _tensor_rows(ckpt: Checkpoint) -> tuple[list[dict], list[dict]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, byte_items = [], []
    sizes: dict[tuple[str, Any], int] = {}
    for index, info in ckpt.storage_items():
        sizes[(index.fqn, tuple(index.offset) if index.offset is not None else None)] = info.length
    for md in ckpt.metadata:
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                numel = 1
                for s in entry.size:
                    numel *= s
                dtype = entry.properties.dtype
                itemsize = getattr(dtype, "itemsize", 0)
                tensors.append(
                    {
                        "fqn": fqn,
                        "shape": list(entry.size),
                        "dtype": dtype_name(dtype),
                        "chunks": len(entry.chunks),
                        "nbytes": numel * itemsize,
                    }
                )
            else:
                byte_items.append({"fqn": fqn, "stored_bytes": sizes.get((fqn, None))})
    return tensors, byte_items


def run_inspect(ckpt: Checkpoint, as_json: bool) -> int:
    ckpt.open_files()
    tensors, byte_items = _tensor_rows(ckpt)
    entries_per_file: dict[str, int] = {}
    for _, info in ckpt.storage_items():
        entries_per_file[info.relative_path] = entries_per_file.get(info.relative_path, 0) + 1
    files = [
        {
            "name": rel,
            "size": None if f.error else f.size,
            "entries": entries_per_file.get(rel, 0),
            **({"error": f.error} if f.error else {}),
        }
        for rel, f in sorted(ckpt.files.items(), key=lambda kv: str(kv[0]))
    ]
    referenced = set(ckpt.files)
    others = sorted(n for n in ckpt.source.data_file_names() if n not in referenced)
    total = sum(f["size"] or 0 for f in files)
    md0 = ckpt.metadata[0]
    report = {
        "path": ckpt.directory,
        "metadata_files": ckpt.metadata_files,
        "version": getattr(md0, "version", None),
        "writer": detect_writer(ckpt),
        "tensors": tensors,
        "byte_items": byte_items,
        "files": files,
        "unreferenced_files": others,
        "total_file_bytes": total,
        "tensor_bytes": sum(t["nbytes"] for t in tensors),
    }
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    out = sys.stdout.write
    out(f"checkpoint: {ckpt.directory}\n")
    out(f"metadata:   {', '.join(ckpt.metadata_files)} (DCP format version {report['version'] or 'unknown'})\n")
    out(f"written by: {report['writer']}\n")
    out(f"tensors:    {len(tensors)} ({human_size(report['tensor_bytes'])} of tensor data)\n")
    if tensors:
        w = min(60, max(len(t["fqn"]) for t in tensors))
        for t in tensors:
            shape = "(" + ", ".join(map(str, t["shape"])) + ")"
            out(f"  {t['fqn']:<{w}}  {shape:<22} {t['dtype']:<14} {t['chunks']} chunk{'s' if t['chunks'] != 1 else ''}\n")
    out(f"byte items: {len(byte_items)}\n")
    for b in byte_items:
        out(f"  {b['fqn']}  ({human_size(b['stored_bytes'])})\n")
    out(f"files:      {len(files)} ({human_size(total)} total)\n")
    for f in files:
        size = "MISSING/REFUSED: " + f["error"] if "error" in f else human_size(f["size"])
        out(f"  {f['name']}  {size}  ({f['entries']} entries)\n")
    if others:
        out(f"unreferenced .distcp files (leftovers of another save?): {', '.join(others)}\n")
    return EXIT_OK
