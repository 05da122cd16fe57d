"""``python -m fastdcp convert SRC DST``: a DCP checkpoint as ``.safetensors`` or a ``.pt`` file,
streamed through :func:`fastdcp.load.lazy.open_checkpoint` one tensor at a time.

``.safetensors``: the header (8-byte little-endian length, then JSON with each tensor's dtype,
shape and ``data_offsets``) is computed from ``.metadata`` alone and written first; then every
tensor's bytes in storage order, each read in row blocks of at most half ``--memory-budget``
(one block is written by a background thread while the next is read). Memory stays within the
budget whatever the tensor sizes (a single row larger than half the budget is read whole). Past
``--max-shard-size`` the output is split as Hugging Face does: ``model-00001-of-00003.safetensors``
next to DST's name, plus ``DST.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``).
Keys are DCP's flattened names; non-tensor entries are skipped with a note (safetensors holds
tensors only), as are dtypes safetensors has no name for.

``.pt``: the nested state dict ``torch.load`` returns (the structure
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes, rebuilt from DCP's
``planner_data``), written in ``torch.save``'s zip format: ``data.pkl`` is pickled first from
stand-ins that never hold data (the ones :mod:`fastdcp.format.blob` uses), then each tensor is
read whole and written as its ``data/N`` record. torch's zip writer takes a record in one piece,
so memory is the largest tensor plus the read budget (not the whole state, as with
``torch.save``). Non-tensor entries are skipped unless ``--include-objects`` (they are unpickled
as DCP does, which runs code the checkpoint names: trusted checkpoints only).

``--dtype`` casts floating-point tensors (others keep theirs); ``--keys REGEX`` keeps the keys it
matches (``re.search``). Output goes to a temporary name and is renamed into place when complete.
A progress line is drawn only when stderr is a terminal.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..format.blob import pickle_stand_ins, tensor_stand_in
from ..load.lazy import LazyCheckpoint, StoredRun, TensorInfo
from ..objstore.lazy import open_any as open_checkpoint
from .progress import Progress

__all__ = ["ConvertOptions", "run_convert", "parse_size", "DTYPE_NAMES", "SAFETENSORS_DTYPES"]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}

# safetensors' names (its format specification); dtypes without one cannot be stored.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"5GB"`` (10^9, as Hugging Face counts), ``"1GiB"`` (2^30), ``"512M"`` (2^20), ``"123"``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 1GiB, 512MiB, 1000000)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value


@dataclass(frozen=True)
class ConvertOptions:
    source: str
    destination: str
    dtype: torch.dtype | None = None
    keys: str | None = None  # a regular expression
    max_shard_size: int | None = None
    memory_budget: int = 1 << 30
    include_objects: bool = False
    allow_unsafe_metadata: bool = False


@dataclass(frozen=True)
class _Tensor:
    key: str
    info: TensorInfo
    out_dtype: torch.dtype

    @property
    def out_nbytes(self) -> int:
        return self.info.numel * self.out_dtype.itemsize


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def _select(ckpt: LazyCheckpoint, options: ConvertOptions, for_safetensors: bool) -> tuple[list[_Tensor], list[str]]:
    """Tensors to write (storage order) and object keys (for .pt); notes what is skipped."""
    pattern = re.compile(options.keys) if options.keys else None
    tensors: list[_Tensor] = []
    objects: list[str] = []
    skipped_objects: list[str] = []
    for key in ckpt:  # storage order: each data file is read front to back
        if pattern is not None and not pattern.search(key):
            continue
        info = ckpt.metadata(key)
        if not isinstance(info, TensorInfo):
            (objects if options.include_objects and not for_safetensors else skipped_objects).append(key)
            continue
        out_dtype = options.dtype if options.dtype is not None and info.dtype.is_floating_point else info.dtype
        if for_safetensors and out_dtype not in SAFETENSORS_DTYPES:
            _note(f"skipped '{key}': safetensors has no dtype for {out_dtype}")
            continue
        tensors.append(_Tensor(key, info, out_dtype))
    if skipped_objects:
        why = "safetensors holds tensors only" if for_safetensors else "pass --include-objects to keep them"
        shown = ", ".join(skipped_objects[:5]) + (", ..." if len(skipped_objects) > 5 else "")
        _note(f"skipped {len(skipped_objects)} non-tensor entr{'y' if len(skipped_objects) == 1 else 'ies'} "
              f"({why}): {shown}")
    return tensors, objects


def _blocks(ckpt: LazyCheckpoint, tensor: _Tensor, block_bytes: int):
    """The tensor in row blocks of at most ``block_bytes`` (source and cast copy together), each
    contiguous in the output dtype."""
    shape = tensor.info.shape
    rows = shape[0] if shape else 1
    row_bytes = (tensor.info.nbytes // rows if rows else 0) + (tensor.out_nbytes // rows if rows else 0)
    if not shape or rows == 0 or row_bytes * rows <= block_bytes:
        yield ckpt[tensor.key].to(tensor.out_dtype)
        return
    step = max(1, block_bytes // max(row_bytes, 1))
    handle = ckpt.get_slice(tensor.key)
    for start in range(0, rows, step):
        yield handle[start : start + step].to(tensor.out_dtype)


def _copy_run(run: StoredRun, out: Any) -> None:
    """Append ``run``'s bytes to ``out`` (flushed) inside the kernel: ``copy_file_range`` (same
    filesystem, may share extents), else ``sendfile`` (any two files), else positional reads and
    writes."""
    fd = os.open(run.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        dst = out.fileno()
        position, left = run.offset, run.nbytes
        # Each copies up to ``n`` bytes at ``pos`` to dst's file position and returns the count.
        methods = []
        if hasattr(os, "copy_file_range"):
            methods.append(lambda pos, n: os.copy_file_range(fd, dst, n, pos))
        if hasattr(os, "sendfile"):
            methods.append(lambda pos, n: os.sendfile(dst, fd, pos, n))
        methods.append(lambda pos, n: os.write(dst, os.pread(fd, min(n, 64 << 20), pos)))
        for method in methods:
            try:
                while left:
                    done = method(position, min(left, 1 << 30))
                    if done == 0:
                        raise EOFError(f"'{run.path}' ends before byte {position + left}")
                    position += done
                    left -= done
            except OSError:  # EXDEV across filesystems, EINVAL/ENOSYS where unsupported: next one
                if method is methods[-1]:
                    raise
                continue
            break
        out.seek(0, os.SEEK_END)  # the buffered writer continues after the copied bytes
    finally:
        os.close(fd)


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _shards(tensors: list[_Tensor], limit: int | None) -> list[list[_Tensor]]:
    """Consecutive tensors, a new shard when the next would pass ``limit`` (Hugging Face's rule: a
    tensor larger than the limit gets a shard of its own)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if limit is not None and shards[-1] and size + t.out_nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.out_nbytes
    return shards


def _safetensors_header(tensors: list[_Tensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.key] = {"dtype": SAFETENSORS_DTYPES[t.out_dtype], "shape": list(t.info.shape),
                         "data_offsets": [offset, offset + t.out_nbytes]}
        offset += t.out_nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensor data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def _write_safetensors_file(ckpt: LazyCheckpoint, tensors: list[_Tensor], path: str, budget: int,
                            progress: Progress) -> None:
    block_bytes = max(1, budget // 2)  # one block written while the next is read
    with open(path, "wb") as out, ThreadPoolExecutor(1, thread_name_prefix="fastdcp-convert") as writer:
        out.write(_safetensors_header(tensors))
        pending: Future | None = None
        for t in tensors:
            run = ckpt.stored_run(t.key) if t.out_dtype == t.info.dtype else None
            if run is not None:
                # Stored as exactly the bytes safetensors wants: copied file to file by the
                # kernel, never through this process's memory.
                if pending is not None:
                    pending.result()
                    pending = None
                out.flush()
                _copy_run(run, out)
                progress.advance(run.nbytes, 1)
                continue
            for block in _blocks(ckpt, t, block_bytes):
                if pending is not None:
                    pending.result()
                view = _raw(block)
                pending = writer.submit(out.write, view)
                progress.advance(len(view))
            progress.advance(0, 1)
        if pending is not None:
            pending.result()


def _convert_safetensors(ckpt: LazyCheckpoint, options: ConvertOptions) -> list[str]:
    tensors, _ = _select(ckpt, options, for_safetensors=True)
    shards = _shards(tensors, options.max_shard_size)
    progress = Progress("convert", sum(t.out_nbytes for t in tensors), len(tensors), "tensors")
    dst = options.destination
    if len(shards) == 1:
        names = [dst]
    else:
        stem = os.path.basename(dst)[: -len(".safetensors")]
        names = [os.path.join(os.path.dirname(dst), f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors")
                 for i in range(len(shards))]
    for name, shard in zip(names, shards):
        partial = name + ".partial"
        _write_safetensors_file(ckpt, shard, partial, options.memory_budget, progress)
        os.replace(partial, name)
    progress.finish()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.out_nbytes for t in tensors)},
                 "weight_map": {t.key: os.path.basename(n) for n, shard in zip(names, shards) for t in shard}}
        with open(dst + ".index.json.partial", "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        os.replace(dst + ".index.json.partial", dst + ".index.json")
        names.append(dst + ".index.json")
    return names


def _tensor_stand_in(t: _Tensor, storage_key: str) -> Any:
    """What ``torch.save`` pickles for a contiguous CPU tensor owning storage ``storage_key``."""
    size = tuple(t.info.shape)
    stride = tuple(torch.empty(size, dtype=t.out_dtype, device="meta").stride())
    return tensor_stand_in(t.out_dtype, size, stride, storage_key)


def _nested(ckpt: LazyCheckpoint, entries: list[tuple[str, Any]]) -> dict:
    """The state dict DCP's ``planner_data`` paths describe (as ``dcp_to_torch_save`` rebuilds it)."""
    from torch.distributed.checkpoint._traverse import set_element

    state: dict = {}
    for key, value in entries:
        path = ckpt.metadata(key).path
        if path:
            set_element(state, path, value)
        else:
            state[key] = value
    return state


def _convert_torch_save(ckpt: LazyCheckpoint, options: ConvertOptions) -> list[str]:
    tensors, object_keys = _select(ckpt, options, for_safetensors=False)
    keys = {t.key: str(i) for i, t in enumerate(tensors)}  # storage keys in write order
    entries: list[tuple[str, Any]] = [(t.key, _tensor_stand_in(t, keys[t.key])) for t in tensors]
    entries += [(key, ckpt[key]) for key in object_keys]
    data_pkl = pickle_stand_ins(_nested(ckpt, entries))
    progress = Progress("convert", sum(t.out_nbytes for t in tensors), len(tensors), "tensors")
    partial = options.destination + ".partial"
    serialization = torch.serialization
    writer = torch._C.PyTorchFileWriter(partial, serialization.get_crc32_options(),
                                        serialization._get_storage_alignment())
    completed = False
    try:
        # The records torch.save writes, in its order (torch.serialization._save).
        writer.write_record("data.pkl", data_pkl, len(data_pkl))
        writer.write_record(".format_version", "1", 1)
        alignment = str(serialization._get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for t in tensors:
            tensor = ckpt[t.key].to(t.out_dtype)
            storage = tensor.untyped_storage()
            if tensor.storage_offset() or storage.nbytes() != t.out_nbytes:  # never for a fresh read
                storage = tensor.clone().untyped_storage()
            writer.write_record(f"data/{keys[t.key]}", storage, t.out_nbytes)
            del tensor, storage  # before the next one is read
            progress.advance(t.out_nbytes, 1)
        writer.write_end_of_file()
        completed = True
    finally:
        del writer  # closes the file
        if not completed and os.path.exists(partial):
            os.remove(partial)
    os.replace(partial, options.destination)
    progress.finish()
    return [options.destination]


def run_convert(options: ConvertOptions) -> list[str]:
    """Convert; returns the files written. Raises ValueError for bad options."""
    dst = options.destination
    to_safetensors = dst.endswith(".safetensors")
    if not to_safetensors and not dst.endswith(".pt") and not dst.endswith(".pth"):
        raise ValueError(f"DST must end in .safetensors, .pt or .pth, not {os.path.basename(dst)!r}")
    if options.max_shard_size is not None and not to_safetensors:
        raise ValueError("--max-shard-size applies to .safetensors output only")
    if to_safetensors and sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        raise ValueError("safetensors stores little-endian data; this host is big-endian")
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    with open_checkpoint(options.source, read_buffer_limit_bytes=options.memory_budget,
                         allow_unsafe_metadata=options.allow_unsafe_metadata) as ckpt:
        if to_safetensors:
            return _convert_safetensors(ckpt, options)
        return _convert_torch_save(ckpt, options)
