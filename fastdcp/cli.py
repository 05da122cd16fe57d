"""``python -m fastdcp``: look inside a DCP checkpoint and check it, without loading it.

    python -m fastdcp inspect DIR [--json]   tensors (shape, dtype, chunks), byte items, files
    python -m fastdcp verify DIR [--json]    structure checks, and the CRC-32C checksums a fastdcp
                                             writer recorded (checksums=True; reads those items
                                             whole); exit 0 = OK, 1 = damaged, 2 = usage error or
                                             not a checkpoint

Works on checkpoints written by stock DCP and by fastdcp. Nothing in the checkpoint is trusted:
``.metadata`` goes through the restricted loader (:mod:`fastdcp._metadata`; ``--allow-unsafe-metadata``
opts out for a trusted checkpoint with custom classes), data files are opened only inside the
directory, and tensor blobs are parsed by :func:`fastdcp._blob.parse_tensor_blob` (headers only,
not tensor data).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import stat
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ._blob import BlobFormatError, TensorBlobInfo, parse_tensor_blob
from ._metadata import (
    METADATA_NAME,
    CheckpointFormatError,
    CHECKSUM_ATTRIBUTE,
    CheckpointNotFoundError,
    load_metadata,
    resolve_data_file,
)

__all__ = ["main"]

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2

_HEAD = 8 << 10  # blob bytes read from the front: data.pkl and the data record's local header
_TAIL = 4 << 10  # and from the back: the central directory and end records
_TORCH_LOAD_LIMIT = 64 << 20  # blobs fastdcp cannot parse (quantized, ...) up to this size go to torch.load
_WRITER_SAMPLE = 8  # tensor blobs examined to tell which writer wrote the checkpoint
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")


class _NotACheckpoint(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------


class _DataFile:
    """A data file opened for positional reads; ``error`` is set instead when it cannot be."""

    def __init__(self, directory: str, relative_path: str, entry: Any) -> None:
        self.relative_path = relative_path
        self.path = os.path.join(directory, str(relative_path))
        self.fd: int | None = None
        self.size = 0
        self.error: str | None = None
        try:
            self.path = resolve_data_file(directory, relative_path, entry=entry)
            self.fd = os.open(self.path, os.O_RDONLY)
            self.size = os.fstat(self.fd).st_size
        except (CheckpointFormatError, OSError) as e:
            self.error = str(e)

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` at ``offset`` (EOFError naming the file when it ends first)."""
        assert self.fd is not None
        chunks, done = [], 0
        while done < nbytes:
            data = os.pread(self.fd, nbytes - done, offset + done)
            if not data:
                raise EOFError(f"'{self.path}' ends at {offset + done} bytes, wanted {nbytes} bytes at {offset}")
            chunks.append(data)
            done += len(data)
        return b"".join(chunks)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _parse_blob(file: _DataFile, offset: int, length: int) -> tuple[TensorBlobInfo, bytes]:
    """Parse the tensor blob at [offset, offset+length) of ``file``; also returns the head bytes."""
    head = file.read(offset, min(length, _HEAD))
    tail_len = min(length, _TAIL)
    tail = file.read(offset + length - tail_len, tail_len)

    def read_more(rel: int, nbytes: int) -> bytes:
        if rel < 0 or nbytes < 0 or rel + nbytes > length:
            raise BlobFormatError(f"'{file.path}': blob at offset {offset} refers to bytes outside itself")
        return file.read(offset + rel, nbytes)

    return parse_tensor_blob(head, tail, length, read_more, f"'{file.path}' (blob at offset {offset})"), head


def _pad_marker(head: bytes) -> bytes | None:
    """The id of the padding field in the data record's local header: b"FS" for fastdcp blobs,
    b"FB" for torch.save's; None if not found in ``head``."""
    i = head.find(b"/data/0")
    while i >= 0:
        start = head.rfind(b"PK\x03\x04", max(0, i - 300), i)
        if start >= 0 and start + 30 <= len(head):
            name_len = int.from_bytes(head[start + 26 : start + 28], "little")
            extra_len = int.from_bytes(head[start + 28 : start + 30], "little")
            name_end = start + 30 + name_len
            if name_end == i + 7:
                extra = head[name_end : min(len(head), name_end + extra_len)]
                p = 0
                while p + 4 <= len(extra):
                    hid, hlen = extra[p : p + 2], int.from_bytes(extra[p + 2 : p + 4], "little")
                    if hid in (b"FS", b"FB"):
                        return hid
                    p += 4 + hlen
                return None
        i = head.find(b"/data/0", i + 1)
    return None


# ---------------------------------------------------------------------------------------------
# The checkpoint as seen by the commands
# ---------------------------------------------------------------------------------------------


@dataclass
class _Checkpoint:
    directory: str
    metadata_files: list[str]
    metadata: list[Any]  # one per metadata file
    files: dict[str, _DataFile] = field(default_factory=dict)

    def storage_items(self) -> list[tuple[Any, Any]]:
        items = []
        for md in self.metadata:
            items.extend(md.storage_data.items())
        return items

    def open_files(self) -> None:
        for index, info in self.storage_items():
            rel = info.relative_path
            if rel not in self.files:
                self.files[rel] = _DataFile(self.directory, rel, index)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _metadata_files(directory: str) -> list[str]:
    if not os.path.lexists(directory):
        raise _NotACheckpoint(f"'{directory}' is not a DCP checkpoint: the directory does not exist")
    if not os.path.isdir(directory):
        raise _NotACheckpoint(f"'{directory}' is not a DCP checkpoint: not a directory")
    if os.path.lexists(os.path.join(directory, METADATA_NAME)):
        return [METADATA_NAME]
    try:
        ranks = sorted(int(m.group(1)) for m in map(_RANK_METADATA.match, os.listdir(directory)) if m)
    except OSError as e:
        raise _NotACheckpoint(f"'{directory}': cannot list the directory: {e}") from None
    if not ranks:
        raise _NotACheckpoint(f"'{directory}' is not a DCP checkpoint: no {METADATA_NAME}")
    return [f"__{r}{METADATA_NAME}" for r in ranks]


def _load(directory: str, allow_unsafe: bool) -> _Checkpoint:
    """Raises _NotACheckpoint, or CheckpointFormatError for damaged metadata."""
    names = _metadata_files(directory)
    metadata = []
    for name in names:
        try:
            metadata.append(load_metadata(os.path.join(directory, name), allow_unsafe=allow_unsafe))
        except CheckpointNotFoundError as e:
            raise _NotACheckpoint(str(e)) from None
    return _Checkpoint(directory, names, metadata)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_rows(ckpt: _Checkpoint) -> tuple[list[dict], list[dict]]:
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
                        "dtype": _dtype_name(dtype),
                        "chunks": len(entry.chunks),
                        "nbytes": numel * itemsize,
                    }
                )
            else:
                byte_items.append({"fqn": fqn, "stored_bytes": sizes.get((fqn, None))})
    return tensors, byte_items


def _detect_writer(ckpt: _Checkpoint) -> str:
    hint = [getattr(md, "fastdcp", None) for md in ckpt.metadata]
    markers = set()
    examined = 0
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds = {}
    for md in ckpt.metadata:
        kinds.update(md.state_dict_metadata)
    for index, info in ckpt.storage_items():
        if examined >= _WRITER_SAMPLE:
            break
        if isinstance(kinds.get(index.fqn), BytesStorageMetadata) or getattr(info, "transform_descriptors", None):
            continue
        file = ckpt.files.get(info.relative_path)
        if file is None or file.error or info.offset + info.length > file.size:
            continue
        try:
            _, head = _parse_blob(file, info.offset, info.length)
        except (BlobFormatError, EOFError, OSError):
            continue
        examined += 1
        markers.add(_pad_marker(head))
    if any(isinstance(h, dict) for h in hint) or markers == {b"FS"}:
        return "fastdcp (4096-aligned tensor data)"
    if markers and b"FS" not in markers:
        return "torch.save blobs (stock DCP or compatible)"
    if markers:
        return "mixed (fastdcp and torch.save blobs)"
    return "unknown"


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------


def _inspect(ckpt: _Checkpoint, as_json: bool) -> int:
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
    try:
        others = sorted(
            n
            for n in os.listdir(ckpt.directory)
            if n.endswith(".distcp") and n not in referenced and stat.S_ISREG(os.lstat(os.path.join(ckpt.directory, n)).st_mode)
        )
    except OSError:
        others = []
    total = sum(f["size"] or 0 for f in files)
    md0 = ckpt.metadata[0]
    report = {
        "path": ckpt.directory,
        "metadata_files": ckpt.metadata_files,
        "version": getattr(md0, "version", None),
        "writer": _detect_writer(ckpt),
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
    out(f"tensors:    {len(tensors)} ({_human(report['tensor_bytes'])} of tensor data)\n")
    if tensors:
        w = min(60, max(len(t["fqn"]) for t in tensors))
        for t in tensors:
            shape = "(" + ", ".join(map(str, t["shape"])) + ")"
            out(f"  {t['fqn']:<{w}}  {shape:<22} {t['dtype']:<14} {t['chunks']} chunk{'s' if t['chunks'] != 1 else ''}\n")
    out(f"byte items: {len(byte_items)}\n")
    for b in byte_items:
        out(f"  {b['fqn']}  ({_human(b['stored_bytes'])})\n")
    out(f"files:      {len(files)} ({_human(total)} total)\n")
    for f in files:
        size = "MISSING/REFUSED: " + f["error"] if "error" in f else _human(f["size"])
        out(f"  {f['name']}  {size}  ({f['entries']} entries)\n")
    if others:
        out(f"unreferenced .distcp files (leftovers of another save?): {', '.join(others)}\n")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------


def _check_checksums(ckpt: _Checkpoint, storage: dict, damaged: set[tuple[str, int]]) -> tuple[str, list[str]]:
    """Verify the CRC-32C checksums a fastdcp writer recorded (``FastFileSystemWriter(checksums=True)``)
    for every item not already found damaged. Returns a summary line and one message per mismatch."""
    try:
        from . import _C, _integrity
        from ._engine import IoOptions, get_engine
    except ImportError as e:  # pragma: no cover - a partial installation
        return f"checksums not checked ({e})", []
    items = [
        it
        for it in _integrity.checksummed_items(storage)
        if (it.relative_path, it.offset) not in damaged and not ckpt.files[it.relative_path].error
    ]
    recorded = sum(getattr(info, CHECKSUM_ATTRIBUTE, None) is not None for info in storage.values())
    if not recorded:
        return "no checksums recorded (tensor data bytes are not verified)", []
    options = IoOptions.resolve(direct_io=False, default_direct_io=False, io_threads=None, task_bytes=None)
    files = {rel: _C.File(ckpt.files[rel].path, "r", False) for rel in {it.relative_path for it in items}}
    try:
        mismatches = _integrity.verify_checksums(get_engine(options), files, items, options.memory_budget_bytes)
    finally:
        for f in files.values():
            f.close()
    return f"checksums: {len(items) - len(mismatches)} of {recorded} recorded checksums match", mismatches


def _torch_load_matches(file: _DataFile, offset: int, length: int) -> torch.Tensor | None:
    """For blobs fastdcp's parser does not take (quantized, sparse, ...): what stock's
    ``torch.load(weights_only=True)`` makes of them, or None."""
    if length > _TORCH_LOAD_LIMIT:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(io.BytesIO(file.read(offset, length)), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any failure means "not loadable"
        return None
    return obj if isinstance(obj, torch.Tensor) else None


def _check_item(ckpt: _Checkpoint, file: _DataFile, index: Any, info: Any, kinds: dict, problem: Any) -> None:
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
        blob, _ = _parse_blob(file, start, info.length)
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
            f"blob holds a {_dtype_name(got_dtype)} tensor of shape {got_shape}, the metadata says "
            f"{_dtype_name(want_dtype)} {want_shape}",
            fqn,
        )


def _verify(ckpt: _Checkpoint, as_json: bool) -> int:
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
    for index, info in storage.items():
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
        ckpt = _load(directory, args.allow_unsafe_metadata)
    except _NotACheckpoint as e:
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
            return _inspect(ckpt, args.json)
        return _verify(ckpt, args.json)
    except BrokenPipeError:  # `... | head`: stop quietly (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_DAMAGED
    finally:
        ckpt.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
