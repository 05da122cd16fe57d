"""A checkpoint directory opened for inspection: its metadata, data files and blob headers,
nothing trusted and no tensor data read."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any


from ..format.blob import BlobFormatError
from ..format.blob_parse import TensorBlobInfo, parse_tensor_blob
from ..format.metadata import METADATA_NAME, RANK_METADATA_RE, CheckpointFormatError, CheckpointNotFoundError
from ..io.checkpoint_files import load_metadata, resolve_data_file


EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2

HEAD_BYTES = 8 << 10  # blob bytes read from the front: data.pkl and the data record's local header

TAIL_BYTES = 4 << 10  # and from the back: the central directory and end records

TORCH_LOAD_LIMIT = 64 << 20  # blobs fastdcp cannot parse (quantized, ...) up to this size go to torch.load

WRITER_SAMPLE = 8  # tensor blobs examined to tell which writer wrote the checkpoint



class NotACheckpoint(Exception):
    pass


class DataFile:
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


def parse_blob_headers(file: DataFile, offset: int, length: int) -> tuple[TensorBlobInfo, bytes]:
    """Parse the tensor blob at [offset, offset+length) of ``file``; also returns the head bytes."""
    head = file.read(offset, min(length, HEAD_BYTES))
    tail_len = min(length, TAIL_BYTES)
    tail = file.read(offset + length - tail_len, tail_len)

    def read_more(rel: int, nbytes: int) -> bytes:
        if rel < 0 or nbytes < 0 or rel + nbytes > length:
            raise BlobFormatError(f"'{file.path}': blob at offset {offset} refers to bytes outside itself")
        return file.read(offset + rel, nbytes)

    return parse_tensor_blob(head, tail, length, read_more, f"'{file.path}' (blob at offset {offset})"), head


def pad_marker(head: bytes) -> bytes | None:
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


class LocalFiles:
    """Where a checkpoint directory's bytes come from: files, read with ``pread`` and, for the
    checksum pass, the native engine. :class:`fastdcp.cli.object_checkpoint.ObjectFiles` is the same
    surface over an ``s3://`` prefix."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open_data_file(self, relative_path: str, entry: Any) -> DataFile:
        return DataFile(self.directory, relative_path, entry)

    def checksum_reader(self, data_files: dict[str, DataFile], options: Any) -> tuple[Any, dict[str, Any]]:
        """(an engine, ``{relative path: file}``) reading ``data_files`` (opened, without errors) for
        :func:`fastdcp.load.verify.verify_checksums`; the caller closes the files."""
        from .._native import _C
        from ..io.engine import get_engine

        return get_engine(options), {rel: _C.File(f.path, "r", False) for rel, f in data_files.items()}

    def data_file_names(self) -> list[str]:
        """Every ``.distcp`` file in the directory (regular files only); [] when it cannot be listed."""
        try:
            return [n for n in os.listdir(self.directory)
                    if n.endswith(".distcp") and stat.S_ISREG(os.lstat(os.path.join(self.directory, n)).st_mode)]
        except OSError:
            return []


@dataclass
class Checkpoint:
    directory: str  # a local directory or an s3:// URL
    metadata_files: list[str]
    metadata: list[Any]  # one per metadata file
    source: Any = None  # LocalFiles or ObjectFiles (LocalFiles of ``directory`` when not given)
    files: dict[str, Any] = field(default_factory=dict)  # DataFile or ObjectDataFile

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = LocalFiles(self.directory)

    def storage_items(self) -> list[tuple[Any, Any]]:
        items = []
        for md in self.metadata:
            items.extend(md.storage_data.items())
        return items

    def open_files(self) -> None:
        for index, info in self.storage_items():
            rel = info.relative_path
            if rel not in self.files:
                self.files[rel] = self.source.open_data_file(rel, index)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def metadata_files(directory: str) -> list[str]:
    if not os.path.lexists(directory):
        raise NotACheckpoint(f"'{directory}' is not a DCP checkpoint: the directory does not exist")
    if not os.path.isdir(directory):
        raise NotACheckpoint(f"'{directory}' is not a DCP checkpoint: not a directory")
    if os.path.lexists(os.path.join(directory, METADATA_NAME)):
        return [METADATA_NAME]
    try:
        ranks = sorted(int(m.group(1)) for m in map(RANK_METADATA_RE.match, os.listdir(directory)) if m)
    except OSError as e:
        raise NotACheckpoint(f"'{directory}': cannot list the directory: {e}") from None
    if not ranks:
        raise NotACheckpoint(f"'{directory}' is not a DCP checkpoint: no {METADATA_NAME}")
    return [f"__{r}{METADATA_NAME}" for r in ranks]


def open_checkpoint(directory: str, allow_unsafe: bool) -> Checkpoint:
    """A local checkpoint directory (``s3://`` URLs: :mod:`fastdcp.cli.object_checkpoint`). Raises
    NotACheckpoint, or CheckpointFormatError for damaged metadata."""
    names = metadata_files(directory)
    metadata = []
    for name in names:
        try:
            metadata.append(load_metadata(os.path.join(directory, name), allow_unsafe=allow_unsafe))
        except CheckpointNotFoundError as e:
            raise NotACheckpoint(str(e)) from None
    return Checkpoint(directory, names, metadata)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def detect_writer(ckpt: Checkpoint) -> str:
    hint = [getattr(md, "fastdcp", None) for md in ckpt.metadata]
    markers = set()
    examined = 0
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds = {}
    for md in ckpt.metadata:
        kinds.update(md.state_dict_metadata)
    for index, info in ckpt.storage_items():
        if examined >= WRITER_SAMPLE:
            break
        if isinstance(kinds.get(index.fqn), BytesStorageMetadata) or getattr(info, "transform_descriptors", None):
            continue
        file = ckpt.files.get(info.relative_path)
        if file is None or file.error or info.offset + info.length > file.size:
            continue
        try:
            _, head = parse_blob_headers(file, info.offset, info.length)
        except (BlobFormatError, EOFError, OSError):
            continue
        examined += 1
        markers.add(pad_marker(head))
    if any(isinstance(h, dict) for h in hint) or markers == {b"FS"}:
        return "fastdcp (4096-aligned tensor data)"
    if markers and b"FS" not in markers:
        return "torch.save blobs (stock DCP or compatible)"
    if markers:
        return "mixed (fastdcp and torch.save blobs)"
    return "unknown"


def human_size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
