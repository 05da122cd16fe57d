"""One tensor as a ``torch.save`` zip blob, emitted by hand (parsing: :mod:`fastdcp.format.blob_parse`).

Stock DCP stores every tensor chunk as a complete ``torch.save`` zip archive ("blob") at some
offset of a ``.distcp`` file. This module is the only place that knows that format:

* :func:`tensor_blob_layout` computes the bytes that surround a tensor's raw data so that the
  result is a blob ``torch.load`` reads like one ``torch.save`` wrote (``data.pkl`` is
  byte-identical to torch's), while the tensor bytes start at a ``data_align``-aligned *file*
  offset. The caller writes ``head``, then the tensor bytes straight from memory (O_DIRECT),
  then ``tail``; nothing here touches tensor memory.
* :func:`fastdcp.format.blob_parse.parse_tensor_blob` does the reverse without ``torch.load`` or
  :mod:`zipfile`: it walks EOCD -> central directory -> local headers and unpickles ``data.pkl`` with a restricted
  unpickler, returning where the storage bytes are and how to view them (dtype, size, stride,
  storage offset), so a reader can ``pread`` only the bytes it needs.

Zip facts this relies on (checked against torch 2.13's miniz-based reader):

* ``torch.load`` never verifies CRC-32 fields, so we write 0 and never compute CRCs (computing
  them would mean reading every tensor byte, defeating the zero-copy write).
* The reader takes sizes and offsets from the central directory and reads a local header only
  for its signature and name/extra lengths, so padding the ``data/0`` local header's extra
  field moves the data wherever we want.
* All offsets inside a blob are blob-relative: readers see the blob as a file of its own.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "ZIP_ALIGN",
    "DATA_ALIGN",
    "MAX_DATA_ALIGN",
    "BlobFormatError",
    "TensorBlobLayout",
    "tensor_blob_layout",
    "is_plain_dense",
    "tensor_stand_in",
    "pickle_stand_ins",
]

ZIP_ALIGN = 64  # blobs start at 64-aligned file offsets (torch's storage_alignment convention)
DATA_ALIGN = 4096  # default file alignment of tensor data (O_DIRECT block size)
# The padding lives in one 16-bit-sized zip extra field, so the alignment must leave room for
# the largest pad (data_align - 1 bytes) plus the zip64 block and field headers.
MAX_DATA_ALIGN = 32768

# ---------------------------------------------------------------------------------------------
# Zip constants (PKWARE APPNOTE 6.3; sizes match miniz's MZ_ZIP_* constants)
# ---------------------------------------------------------------------------------------------
_SIG_LOCAL = 0x04034B50
_SIG_CENTRAL = 0x02014B50
_SIG_EOCD = 0x06054B50
_SIG_ZIP64_EOCD = 0x06064B50
_SIG_ZIP64_LOCATOR = 0x07064B50
_EOCD_SIG_BYTES = b"PK\x05\x06"

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_EXTRA_HDR = struct.Struct("<HH")
_U64 = struct.Struct("<Q")

_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF  # also the zip64 "look in the extra field" sentinel
_ZIP64_EXTRA_ID = 0x0001
# Our padding block: the two ASCII bytes "FS" (header id 0x5346 read little-endian), payload of
# b"Z" bytes. torch/miniz pads the same way with "FB"; a distinct id marks fastdcp-written blobs.
_PAD_ID_BYTES = b"FS"
_VERSION_NEEDED = 20
_VERSION_NEEDED_ZIP64 = 45
_EOCD_SEARCH = 0xFFFF + _EOCD.size  # max comment length + EOCD size

# Records of a torch.save archive, as torch 2.x names them (prefix "archive/").
_NAME_PKL = b"archive/data.pkl"
_NAME_DATA0 = b"archive/data/0"
# Small records with the content torch.save writes: .format_version "1" (storages ordered by
# numeric key), .storage_alignment "64" (data records are 64-aligned; true for ours too since
# data_align is a multiple of 64), byteorder (tensor bytes are written in native order),
# version "3" (kProducedFileFormatVersion). tests/format/test_blob.py compares them with torch.save's.
_RECORDS_BEFORE_DATA: tuple[tuple[bytes, bytes], ...] = (
    (b"archive/.format_version", b"1"),
    (b"archive/.storage_alignment", str(ZIP_ALIGN).encode()),
    (b"archive/byteorder", sys.byteorder.encode()),
)
_NAME_VERSION = b"archive/version"
_VERSION_CONTENT = b"3\n"
_NAME_SERIALIZATION_ID = b"archive/.data/serialization_id"


class BlobFormatError(ValueError):
    """A blob is not a readable single-tensor ``torch.save`` archive; the message names the file."""


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorBlobLayout:
    """The bytes around one tensor's raw data that make a complete ``torch.save`` blob.

    The blob is ``head + <data_nbytes tensor bytes, C order, native byte order> + tail`` and
    starts at file offset ``blob_offset``; ``blob_offset + data_offset`` is aligned to the
    requested ``data_align``.
    """

    blob_offset: int  # file offset where the blob starts (== the file_offset passed in)
    head: bytes  # blob bytes [0, data_offset)
    data_offset: int  # blob-relative offset of the first tensor byte
    data_nbytes: int
    tail: bytes  # blob bytes after the data up to the blob end

    @property
    def length(self) -> int:
        """Total blob length in bytes."""
        return len(self.head) + self.data_nbytes + len(self.tail)

    @property
    def data_file_offset(self) -> int:
        """File offset of the first tensor byte."""
        return self.blob_offset + self.data_offset


class _StorageStub:
    """Stands in for the tensor's storage while pickling; never holds or reads data."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class _TensorStub:
    """Pickles exactly like a plain CPU tensor: its reduce value is the one torch computes."""

    __slots__ = ("reduce_value",)

    def __init__(self, reduce_value: tuple) -> None:
        self.reduce_value = reduce_value

    def __reduce_ex__(self, protocol: int) -> tuple:
        return self.reduce_value


class _StubPickler(pickle.Pickler):
    # Mirrors torch.serialization._save's persistent_id for our storage stand-in; everything
    # else pickles normally, as in torch.
    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageStub:
            return obj.pid
        return None


@dataclass(frozen=True, slots=True)
class _PickleRecipe:
    """How the running torch pickles a plain tensor of one dtype (see Tensor._reduce_ex_internal)."""

    rebuild_func: Callable[..., Any]
    storage_type: Any  # the class torch's persistent_id reports (torch.FloatStorage, torch.UntypedStorage, ...)
    numel_is_bytes: bool  # UntypedStorage counts bytes, TypedStorage counts elements
    trailing_args: tuple  # (dtype,) for _rebuild_tensor_v3, () for v2


_PICKLE_PROTOCOL = getattr(torch.serialization, "DEFAULT_PROTOCOL", 2)


@functools.lru_cache(maxsize=None)
def _pickle_recipe(dtype: torch.dtype) -> _PickleRecipe:
    # Ask the running torch how it reduces an (empty, CPU) tensor of this dtype instead of
    # hard-coding v2/v3: the split between them moves between torch versions.
    try:
        probe = torch.empty(0, dtype=dtype)
    except Exception as e:
        raise ValueError(f"cannot create a {dtype} tensor to learn its pickle form: {e}") from e
    if probe.is_quantized:
        raise ValueError(f"quantized dtype {dtype} is not supported")
    func, args = probe.__reduce_ex__(_PICKLE_PROTOCOL)
    known = (getattr(torch._utils, "_rebuild_tensor_v2", None), getattr(torch._utils, "_rebuild_tensor_v3", None))
    if func not in known or len(args) < 6:
        raise ValueError(f"torch reduces {dtype} tensors in an unsupported way ({func!r})")
    storage = args[0]
    if isinstance(storage, torch.storage.TypedStorage):
        try:
            # Same lookup torch's persistent_id does; raises KeyError for dtypes torch.save
            # cannot write (int1..int7, uint1..uint7).
            storage_type = getattr(torch, storage._pickle_storage_type())
        except KeyError as e:
            raise ValueError(f"torch.save cannot serialize dtype {dtype}") from e
        numel_is_bytes = False
    elif isinstance(storage, torch.UntypedStorage):
        # torch.serialization.normalize_storage_type(type(storage))
        storage_type = getattr(torch, type(storage).__name__)
        numel_is_bytes = True
    else:
        raise ValueError(f"torch reduces {dtype} tensors with an unexpected storage {type(storage)!r}")
    # args = (storage, storage_offset, size, stride, requires_grad, hooks, *trailing); a fresh
    # tensor has no conj/neg metadata, so trailing is (dtype,) for v3 and () for v2.
    return _PickleRecipe(func, storage_type, numel_is_bytes, tuple(args[6:]))


def tensor_stand_in(dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], storage_key: str) -> Any:
    """An object that :func:`pickle_stand_ins` pickles exactly as ``torch.save`` pickles a CPU
    tensor of ``dtype``/``size``/``stride`` owning storage ``storage_key`` (no data is touched)."""
    recipe = _pickle_recipe(dtype)
    numel = 1
    for s in size:
        numel *= s
    storage_numel = numel * dtype.itemsize if recipe.numel_is_bytes else numel
    # Persistent id exactly as torch.serialization._save builds it (location "cpu" whatever the
    # source device: torch.save of tensor.cpu()).
    storage = _StorageStub(("storage", recipe.storage_type, storage_key, "cpu", storage_numel))
    # Fresh tuples for size and stride: the pickler memoizes by identity, and torch's two
    # tuples are distinct objects, so ours must be too.
    args = (storage, 0, tuple(size), tuple(stride), False, collections.OrderedDict(), *recipe.trailing_args)
    return _TensorStub((recipe.rebuild_func, args))


def pickle_stand_ins(obj: Any) -> bytes:
    """``obj`` pickled as ``torch.save`` pickles ``data.pkl``, with :func:`tensor_stand_in` objects
    standing for tensors."""
    buf = io.BytesIO()
    _StubPickler(buf, protocol=_PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue()


@functools.lru_cache(maxsize=16384)
def _data_pkl(dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """``archive/data.pkl`` as ``torch.save`` writes it for a CPU tensor owning its storage (key
    "0": the first and only storage)."""
    return pickle_stand_ins(tensor_stand_in(dtype, size, stride, "0"))


def _random_serialization_id() -> str:
    # os.urandom, not the random module: forked ranks share random's state and would all
    # draw the same ids.
    return "%040d" % (int.from_bytes(os.urandom(17), "little") % 10**40)


def _local_header(name: bytes, size: int, extra_len: int, zip64: bool) -> bytes:
    # Stored (method 0), no data descriptor (sizes are known up front), time/date 0 and
    # CRC 0 like torch writes them (torch.load never checks CRCs).
    sz = _U32_MAX if zip64 else size
    return _LOCAL.pack(
        _SIG_LOCAL,
        _VERSION_NEEDED_ZIP64 if zip64 else _VERSION_NEEDED,
        0,
        0,
        0,
        0,
        0,
        sz,
        sz,
        len(name),
        extra_len,
    )


def _central_header(name: bytes, size: int, offset: int, zip64_size: bool) -> bytes:
    if not zip64_size and offset < _U32_MAX:  # the common case, kept short
        return (
            _CENTRAL.pack(
                _SIG_CENTRAL, _VERSION_NEEDED, _VERSION_NEEDED, 0, 0, 0, 0, 0,
                size, size, len(name), 0, 0, 0, 0, 0, offset,
            )  # fmt: skip
            + name
        )
    # zip64 extended information: only the fields whose 32-bit slot holds the sentinel, in
    # the order uncompressed size, compressed size, local header offset (APPNOTE 4.5.3).
    extra = b""
    if zip64_size:
        extra += _U64.pack(size) * 2
    zip64_offset = offset >= _U32_MAX
    if zip64_offset:
        extra += _U64.pack(offset)
    if extra:
        extra = _EXTRA_HDR.pack(_ZIP64_EXTRA_ID, len(extra)) + extra
    version = _VERSION_NEEDED_ZIP64 if extra else _VERSION_NEEDED
    sz = _U32_MAX if zip64_size else size
    return (
        _CENTRAL.pack(
            _SIG_CENTRAL,
            version,  # version made by (MS-DOS host, spec version)
            version,  # version needed to extract
            0,
            0,
            0,
            0,
            0,
            sz,
            sz,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            _U32_MAX if zip64_offset else offset,
        )
        + name
        + extra
    )


def _record(name: bytes, content: bytes) -> bytes:
    return _local_header(name, len(content), 0, False) + name + content


# Records whose bytes never change (local headers hold no offsets), built once.
_SMALL_RECORDS = b"".join(_record(n, c) for n, c in _RECORDS_BEFORE_DATA)
_SMALL_RECORDS_INDEX: tuple[tuple[bytes, int, int], ...] = tuple(
    (n, sum(_LOCAL.size + len(n2) + len(c2) for n2, c2 in _RECORDS_BEFORE_DATA[:i]), len(c))
    for i, (n, c) in enumerate(_RECORDS_BEFORE_DATA)
)
_VERSION_RECORD = _record(_NAME_VERSION, _VERSION_CONTENT)
_SERIALIZATION_ID_HEADER = _local_header(_NAME_SERIALIZATION_ID, 40, 0, False) + _NAME_SERIALIZATION_ID


def is_plain_dense(tensor: torch.Tensor) -> bool:
    """Tensors whose bytes one dtype/shape blob describes (everything torch.save stores as a
    single strided storage). Anything else (sparse, quantized, nested, tensor subclasses) keeps
    stock's ``torch.save`` serialization in the writer and its own CPU copy when staged."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and type(tensor) in (torch.Tensor, torch.nn.Parameter)
    )


def tensor_blob_layout(
    tensor: torch.Tensor,
    file_offset: int,
    *,
    data_align: int = DATA_ALIGN,
    force_zip64: bool = False,
    serialization_id: str | None = None,
) -> TensorBlobLayout:
    """Compute the head/tail bytes of a ``torch.save`` blob holding ``tensor`` at ``file_offset``.

    Only ``tensor``'s dtype, shape and strides are read (any device, including meta). The
    blob's ``data.pkl`` is byte-identical to what ``torch.save`` writes for ``tensor.cpu()``
    when that tensor owns its whole storage (storage offset 0, ``requires_grad`` False, no
    hooks), so stock ``torch.load``/DCP readers load it. Record order matches torch:
    data.pkl, .format_version, .storage_alignment, byteorder, data/0, version,
    .data/serialization_id, central directory, [zip64 EOCD + locator], EOCD.

    Preconditions (ValueError otherwise): ``tensor`` is a strided, contiguous, non-quantized
    tensor without conj/neg bits whose dtype ``torch.save`` supports; ``file_offset`` is a
    non-negative multiple of ``ZIP_ALIGN``; ``data_align`` is a multiple of ``ZIP_ALIGN`` no
    larger than ``MAX_DATA_ALIGN``; ``serialization_id``, when given, is 40 decimal digits.

    zip64 records are emitted when a size or offset does not fit 32 bits; ``force_zip64``
    emits them regardless (the data record's sizes go into a zip64 extra field, plus zip64
    EOCD and locator), for testing readers.
    """
    if not isinstance(file_offset, int) or file_offset < 0 or file_offset % ZIP_ALIGN:
        raise ValueError(
            f"tensor_blob_layout: file_offset {file_offset!r} must be a non-negative multiple of {ZIP_ALIGN}"
        )
    if not isinstance(data_align, int) or not (
        ZIP_ALIGN <= data_align <= MAX_DATA_ALIGN and data_align % ZIP_ALIGN == 0
    ):
        raise ValueError(
            f"tensor_blob_layout: data_align {data_align!r} must be a multiple of {ZIP_ALIGN} "
            f"in [{ZIP_ALIGN}, {MAX_DATA_ALIGN}]"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ValueError(f"tensor_blob_layout: only plain strided tensors are supported, got {tensor.layout}")
    if not tensor.is_contiguous():
        raise ValueError("tensor_blob_layout: tensor must be contiguous")
    if tensor.is_conj() or tensor.is_neg():
        # torch.save would record the bit as metadata over the unresolved bytes; we write
        # memory as-is, so the bit has to be resolved first.
        raise ValueError("tensor_blob_layout: resolve conj/neg bits first (resolve_conj/resolve_neg)")
    if serialization_id is None:
        serialization_id = _random_serialization_id()
    elif not (
        type(serialization_id) is str
        and len(serialization_id) == 40
        and serialization_id.isascii()
        and serialization_id.isdigit()
    ):
        raise ValueError("tensor_blob_layout: serialization_id must be 40 decimal digits")
    # Stride as the tensor has it: for size-1 (or empty) dims a contiguous tensor may carry
    # non-canonical strides, and torch.save records them as they are; they address the same
    # C-order bytes.
    t = blob_template(
        tensor.dtype, tuple(tensor.shape), tensor.stride(), file_offset % data_align, data_align, force_zip64
    )
    return TensorBlobLayout(
        file_offset,
        t.head_before_pad + b"Z" * t.pad,
        t.data_offset,
        t.data_nbytes,
        t.tail_before_id + serialization_id.encode() + t.tail_after_id,
    )


@dataclass(frozen=True, slots=True)
class _BlobTemplate:
    """A blob but for its serialization id (between the two tail parts) and its padding run
    (``pad`` bytes ending the head; left out so cached templates stay small)."""

    head_before_pad: bytes
    pad: int
    data_offset: int
    data_nbytes: int
    tail_before_id: bytes
    tail_after_id: bytes


@functools.lru_cache(maxsize=4096)
def blob_template(
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    phase: int,
    data_align: int,
    force_zip64: bool,
) -> _BlobTemplate:
    """Blob bytes for a tensor whose blob starts at a file offset ``phase`` modulo ``data_align``.

    Cached: a checkpoint has many tensors of few shapes, and the blob depends on the file
    offset only through this phase.
    """
    pkl = _data_pkl(dtype, size, stride)
    numel = 1
    for s in size:
        numel *= s
    nbytes = numel * dtype.itemsize

    # ---- head: data.pkl, the small records, data/0's local header ---------------------------
    entries: list[tuple[bytes, int, int, bool]] = [(_NAME_PKL, len(pkl), 0, False)]
    pos = _LOCAL.size + len(_NAME_PKL) + len(pkl)
    for name, rel, rsize in _SMALL_RECORDS_INDEX:
        entries.append((name, rsize, pos + rel, False))
    pos += len(_SMALL_RECORDS)

    zip64_data = force_zip64 or nbytes >= _U32_MAX
    # Local header zip64 extra: both sizes (APPNOTE 4.5.3: the local header's must have both).
    zip64_extra = _EXTRA_HDR.pack(_ZIP64_EXTRA_ID, 16) + _U64.pack(nbytes) * 2 if zip64_data else b""
    unpadded = pos + _LOCAL.size + len(_NAME_DATA0) + len(zip64_extra) + _EXTRA_HDR.size
    pad = -(phase + unpadded) % data_align
    extra_len = len(zip64_extra) + _EXTRA_HDR.size + pad
    entries.append((_NAME_DATA0, nbytes, pos, zip64_data))
    data_offset = unpadded + pad
    head_before_pad = b"".join(
        (
            _local_header(_NAME_PKL, len(pkl), 0, False),
            _NAME_PKL,
            pkl,
            _SMALL_RECORDS,
            _local_header(_NAME_DATA0, nbytes, extra_len, zip64_data),
            _NAME_DATA0,
            zip64_extra,
            _PAD_ID_BYTES,
            struct.pack("<H", pad),  # the padding block's payload: `pad` bytes of b"Z", like torch
        )
    )
    assert len(head_before_pad) + pad == data_offset

    # ---- tail: version, serialization id, central directory, EOCD ---------------------------
    pos = data_offset + nbytes
    entries.append((_NAME_VERSION, len(_VERSION_CONTENT), pos, False))
    pos += len(_VERSION_RECORD)
    entries.append((_NAME_SERIALIZATION_ID, 40, pos, False))
    tail_before_id = _VERSION_RECORD + _SERIALIZATION_ID_HEADER
    cd_offset = pos + len(_SERIALIZATION_ID_HEADER) + 40

    parts = [_central_header(name, sz, off, z64) for name, sz, off, z64 in entries]
    cd_size = sum(map(len, parts))
    n = len(entries)
    if zip64_data or cd_offset >= _U32_MAX or pos >= _U32_MAX:  # pos: the last local header
        zip64_eocd_offset = cd_offset + cd_size
        parts.append(
            _ZIP64_EOCD.pack(
                _SIG_ZIP64_EOCD,
                _ZIP64_EOCD.size - 12,  # size of the record after this field
                _VERSION_NEEDED_ZIP64,
                _VERSION_NEEDED_ZIP64,
                0,
                0,
                n,
                n,
                cd_size,
                cd_offset,
            )
        )
        # Total number of disks must be 1 (miniz rejects anything else).
        parts.append(_ZIP64_LOCATOR.pack(_SIG_ZIP64_LOCATOR, 0, zip64_eocd_offset, 1))
    if force_zip64:
        # What a >4 GiB archive holds: the sentinels, sending readers to the zip64 record.
        eocd_n, eocd_size, eocd_off = _U16_MAX, _U32_MAX, _U32_MAX
    else:
        eocd_n, eocd_size, eocd_off = min(n, _U16_MAX), min(cd_size, _U32_MAX), min(cd_offset, _U32_MAX)
    parts.append(_EOCD.pack(_SIG_EOCD, 0, 0, eocd_n, eocd_n, eocd_size, eocd_off, 0))
    return _BlobTemplate(head_before_pad, pad, data_offset, nbytes, tail_before_id, b"".join(parts))
