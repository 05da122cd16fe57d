"""``python -m fastdcp verify``: structure checks and recorded CRC-32C checksums; exit 0 OK, 1 damaged."""

from __future__ import annotations

import io
import json
import sys
import warnings
from typing import Any

import torch

from ..format.blob import BlobFormatError
from ..format.metadata import CHECKSUM_ATTRIBUTE
from .checkpoint import EXIT_DAMAGED, EXIT_OK, Checkpoint, DataFile, dtype_name, parse_blob_headers, TORCH_LOAD_LIMIT
from .progress import Progress


def _check_checksums(ckpt: Checkpoint, storage: dict, damaged: set[tuple[str, int]]) -> tuple[str, list[str]]:
    """Verify the CRC-32C checksums a fastdcp writer recorded (``FastFileSystemWriter(checksums=True)``)
    for every item not already found damaged. Returns a summary line and one message per mismatch."""
    try:
        from ..format.checksums import checksummed_items
        from ..io.engine import IoOptions
        from ..load.verify import verify_checksums
    except ImportError as e:  # pragma: no cover - a partial installation
        return f"checksums not checked ({e})", []
    items = [
        it
        for it in checksummed_items(storage)
        if (it.relative_path, it.offset) not in damaged and not ckpt.files[it.relative_path].error
    ]
    recorded = sum(getattr(info, CHECKSUM_ATTRIBUTE, None) is not None for info in storage.values())
    if not recorded:
        return "no checksums recorded (tensor data bytes are not verified)", []
    options = IoOptions.resolve(direct_io=False, default_direct_io=False, io_threads=None, task_bytes=None)
    engine, files = ckpt.source.checksum_reader({it.relative_path: ckpt.files[it.relative_path] for it in items},
                                                options)
    try:
        mismatches = verify_checksums(engine, files, items, options.read_buffer_limit_bytes)
    finally:
        for f in files.values():
            f.close()
    return f"checksums: {len(items) - len(mismatches)} of {recorded} recorded checksums match", mismatches


def _torch_load_matches(file: DataFile, offset: int, length: int) -> torch.Tensor | None:
    """For blobs fastdcp's parser does not take (quantized, sparse, ...): what stock's
    ``torch.load(weights_only=True)`` makes of them, or None."""
    if length > TORCH_LOAD_LIMIT:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(io.BytesIO(file.read(offset, length)), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any failure means "not loadable"
        return None
    return obj if isinstance(obj, torch.Tensor) else None


def _check_item(ckpt: Checkpoint, file: DataFile, index: Any, info: Any, kinds: dict, problem: Any) -> None:
    """Structure checks of one storage entry; each problem found goes to ``problem``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    fqn = index.fqn
    if file.error:
        problem(file.path, None, file.error, fqn)
        return
    start, end = info.offset, info.offset + info.length
    if end > file.size:
        problem(
            file.path,
            start,
            f"bytes [{start}, {end}) lie past the end of the file ({file.size} bytes): truncated or damaged",
            fqn,
        )
        return
    entry = kinds.get(fqn)
    if entry is None:
        problem(file.path, start, "storage entry for an item the metadata does not describe", fqn)
        return
    if isinstance(entry, BytesStorageMetadata) or getattr(info, "transform_descriptors", None):
        return
    chunk = next((c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
    if chunk is None:
        problem(file.path, start, f"storage entry for chunk offsets {_fmt(index.offset)} the tensor does not have", fqn)
        return
    want_dtype, want_shape = entry.properties.dtype, tuple(chunk.sizes)
    try:
        blob, _ = parse_blob_headers(file, start, info.length)
        got_dtype, got_shape = blob.dtype, tuple(blob.size)
    except (BlobFormatError, EOFError, OSError) as e:
        loaded = _torch_load_matches(file, start, info.length)
        if loaded is None:
            problem(file.path, start, f"tensor blob does not parse: {e}", fqn)
            return
        got_dtype, got_shape = loaded.dtype, tuple(loaded.shape)
    if got_dtype != want_dtype or got_shape != want_shape:
        problem(
            file.path,
            start,
            f"blob holds a {dtype_name(got_dtype)} tensor of shape {got_shape}, the metadata says "
            f"{dtype_name(want_dtype)} {want_shape}",
            fqn,
        )


def run_verify(ckpt: Checkpoint, as_json: bool) -> int:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    ckpt.open_files()
    problems: list[dict] = []
    notes: list[str] = []

    def problem(file: str | None, offset: int | None, what: str, fqn: str | None = None) -> None:
        problems.append({"file": file, "offset": offset, "fqn": fqn, "problem": what})

    kinds: dict[str, Any] = {}
    for md in ckpt.metadata:
        kinds.update(md.state_dict_metadata)
    storage = {}
    for md in ckpt.metadata:
        storage.update(md.storage_data)

    # Every item the metadata describes has a storage entry.
    for fqn, entry in kinds.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                if MetadataIndex(fqn, chunk.offsets) not in storage:
                    problem(None, None, f"chunk at offsets {tuple(chunk.offsets)} has no storage entry", fqn)
        elif MetadataIndex(fqn) not in storage:
            problem(None, None, "byte item has no storage entry", fqn)

    tensors_checked = bytes_checked = skipped = 0
    damaged: set[tuple[str, int]] = set()  # (relative_path, offset) of items reported as damaged
    progress = Progress("verify", sum(int(getattr(i, "length", 0) or 0) for i in storage.values()), len(storage))
    for index, info in storage.items():
        progress.advance(int(getattr(info, "length", 0) or 0), 1)
        fqn = index.fqn
        file = ckpt.files[info.relative_path]
        before = len(problems)
        _check_item(ckpt, file, index, info, kinds, problem)
        if len(problems) > before:
            damaged.add((info.relative_path, info.offset))
        elif not file.error and isinstance(kinds.get(fqn), BytesStorageMetadata):
            bytes_checked += 1
        elif getattr(info, "transform_descriptors", None):
            skipped += 1
            notes.append(f"{fqn}: stored through stream transforms {list(info.transform_descriptors)}; blob not parsed")
        elif not file.error:
            tensors_checked += 1

    progress.finish()
    checksum_note, mismatches = _check_checksums(ckpt, storage, damaged)
    for message in mismatches:
        problem(None, None, message)
    ok = not problems
    if as_json:
        json.dump(
            {
                "path": ckpt.directory,
                "ok": ok,
                "problems": problems,
                "tensor_blobs_checked": tensors_checked,
                "byte_items_checked": bytes_checked,
                "skipped": skipped,
                "notes": notes,
                "checksums": checksum_note,
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
    else:
        out = sys.stdout.write
        for p in problems:
            where = p["file"] or ("metadata" if p["fqn"] else "")
            if p["offset"] is not None:
                where += f" at offset {p['offset']}"
            prefix = (f"{where}: " if where else "") + (f"{p['fqn']}: " if p["fqn"] else "")
            out(f"DAMAGED: {prefix}{p['problem']}\n")
        for n in notes:
            out(f"note: {n}\n")
        out(f"{checksum_note}\n")
        summary = (
            f"{tensors_checked} tensor blobs, {bytes_checked} byte items in {len(ckpt.files)} files"
            + (f", {skipped} skipped" if skipped else "")
        )
        if ok:
            out(f"OK: {ckpt.directory}: structure verified ({summary})\n")
        else:
            out(f"DAMAGED: {ckpt.directory}: {len(problems)} problem{'s' if len(problems) != 1 else ''} ({summary})\n")
    return EXIT_OK if ok else EXIT_DAMAGED


def _fmt(offset: Any) -> str:
    return str(tuple(offset)) if offset is not None else "None"
