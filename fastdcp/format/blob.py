"""One tensor as a ``torch.save`` zip blob: emit one by hand, or find a tensor inside one.

Stock DCP stores every tensor chunk as a complete ``torch.save`` zip archive ("blob") at some
offset of a ``.distcp`` file. This module is the only place that knows that format:

* :func:`tensor_blob_layout` computes the bytes that surround a tensor's raw data so that the
  result is a blob ``torch.load`` reads like one ``torch.save`` wrote (``data.pkl`` is
  byte-identical to torch's), while the tensor bytes start at a ``data_align``-aligned *file*
  offset. The caller writes ``head``, then the tensor bytes straight from memory (O_DIRECT),
  then ``tail``; nothing here touches tensor memory.
* :func:`parse_tensor_blob` does the reverse without ``torch.load`` or :mod:`zipfile`: it walks
  EOCD -> central directory -> local headers and unpickles ``data.pkl`` with a restricted
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
from typing import Any, Callable, NamedTuple

import torch

__all__ = [
    "ZIP_ALIGN",
    "DATA_ALIGN",
    "MAX_DATA_ALIGN",
    "BlobFormatError",
    "TensorBlobLayout",
    "TensorBlobInfo",
    "tensor_blob_layout",
    "parse_tensor_blob",
    "is_plain_dense",
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

# Parser limits: a single-tensor blob has ~7 records and a data.pkl of a few hundred bytes.
# The caps bound memory and time on hostile input without rejecting anything torch writes.
_MAX_CENTRAL_DIR = 1 << 20
_MAX_PKL = 1 << 20
_MAX_NDIM = 1024


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


@functools.lru_cache(maxsize=16384)
def _data_pkl(dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """``archive/data.pkl`` as ``torch.save`` writes it for a CPU tensor owning its storage."""
    recipe = _pickle_recipe(dtype)
    numel = 1
    for s in size:
        numel *= s
    storage_numel = numel * dtype.itemsize if recipe.numel_is_bytes else numel
    # Persistent id exactly as torch.serialization._save builds it: key "0" (first and only
    # storage), location "cpu" whatever the source device (torch.save of tensor.cpu()).
    storage = _StorageStub(("storage", recipe.storage_type, "0", "cpu", storage_numel))
    # Fresh tuples for size and stride: the pickler memoizes by identity, and torch's two
    # tuples are distinct objects, so ours must be too.
    args = (
        storage,
        0,
        tuple(size),
        tuple(stride),
        False,
        collections.OrderedDict(),
        *recipe.trailing_args,
    )
    buf = io.BytesIO()
    _StubPickler(buf, protocol=_PICKLE_PROTOCOL).dump(_TensorStub((recipe.rebuild_func, args)))
    return buf.getvalue()


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


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorBlobInfo:
    """Where one tensor's bytes are inside a blob and how to view them.

    The tensor is ``storage[storage_offset:]`` viewed with ``size``/``stride`` (in elements of
    ``dtype``), where ``storage`` is the blob's bytes ``[data_offset, data_offset +
    storage_nbytes)``. The parser has checked that every addressed element lies in the storage.
    """

    data_offset: int  # blob-relative offset of the storage's first byte (record archive/data/<key>)
    storage_nbytes: int  # size of that record
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (numel * itemsize), not of the storage."""
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """True if the tensor is C-contiguous in the storage (size-1 dims' strides ignored)."""
        expected = 1
        for s, st in zip(reversed(self.size), reversed(self.stride)):
            if s == 0:
                return True
            if s != 1 and st != expected:
                return False
            expected *= s
        return True

    @property
    def first_byte_offset(self) -> int:
        """Blob-relative offset of element [0, ..., 0]."""
        return self.data_offset + self.storage_offset * self.dtype.itemsize


# The legacy typed-storage names of _rebuild_tensor_v2 pickles. torch froze this map for
# BC/FC ("we should no longer add dtypes to this map"), so it is an on-disk constant.
# Quantized storages are left out: their tensors pickle through _rebuild_qtensor.
_TYPED_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


class _StorageTypeRef(NamedTuple):
    """Inert stand-in for a torch storage class named in a pickle."""

    dtype: torch.dtype | None  # None: UntypedStorage (the dtype comes from _rebuild_tensor_v3)


class _StorageRef(NamedTuple):
    """Inert result of a storage persistent id."""

    storage_type: _StorageTypeRef
    key: str
    numel: int


class _TensorRef(NamedTuple):
    """Inert result of a tensor rebuild call."""

    storage: _StorageRef
    storage_offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype


class _PickleReject(Exception):
    """Internal: data.pkl contains something a single-tensor blob does not."""


def _is_int(x: Any) -> bool:
    return type(x) is int


def _rebuild_common(args: tuple, dtype: torch.dtype | None, name: str) -> _TensorRef:
    # (storage, storage_offset, size, stride, requires_grad, backward_hooks[, dtype][, metadata])
    storage, storage_offset, size, stride, requires_grad, hooks = args[:6]
    rest = args[6:]
    if dtype is None:
        if not rest or not isinstance(rest[0], torch.dtype):
            raise _PickleReject(f"{name} without a dtype argument")
        dtype = rest[0]
        rest = rest[1:]
    if rest:
        if len(rest) != 1 or not isinstance(rest[0], dict):
            raise _PickleReject(f"{name} with unexpected extra arguments")
        if rest[0]:
            # conj/neg bits: the stored bytes are not the tensor's values.
            raise _PickleReject(f"tensor metadata {sorted(map(str, rest[0]))} (conj/neg bit) is not supported")
    if type(storage) is not _StorageRef:
        raise _PickleReject(f"{name}: first argument is not a storage")
    if not _is_int(storage_offset):
        raise _PickleReject(f"{name}: storage_offset is not an int")
    if type(size) is not tuple or type(stride) is not tuple:
        raise _PickleReject(f"{name}: size/stride are not tuples")
    if not all(map(_is_int, size)) or not all(map(_is_int, stride)):
        raise _PickleReject(f"{name}: size/stride contain non-integers")
    if type(requires_grad) is not bool:
        raise _PickleReject(f"{name}: requires_grad is not a bool")
    if not isinstance(hooks, dict) or hooks:
        raise _PickleReject(f"{name}: backward hooks are not an empty dict")
    return _TensorRef(storage, storage_offset, size, stride, dtype)


# The rebuild stand-ins are instances of attribute-less classes rather than functions: a
# pickle's BUILD opcode can setattr on any object it holds, and a module-level function
# would let one blob tamper with state (its __dict__, __defaults__) seen by later blobs.


class _RebuildV2:
    __slots__ = ()

    def __call__(self, *args: Any) -> _TensorRef:
        if len(args) not in (6, 7):
            raise _PickleReject("_rebuild_tensor_v2 with wrong argument count")
        st = args[0].storage_type if type(args[0]) is _StorageRef else None
        if st is None or st.dtype is None:
            raise _PickleReject("_rebuild_tensor_v2 needs a typed storage")
        return _rebuild_common(args, st.dtype, "_rebuild_tensor_v2")


class _RebuildV3:
    __slots__ = ()

    def __call__(self, *args: Any) -> _TensorRef:
        if len(args) not in (7, 8):
            raise _PickleReject("_rebuild_tensor_v3 with wrong argument count")
        if type(args[0]) is not _StorageRef or args[0].storage_type.dtype is not None:
            raise _PickleReject("_rebuild_tensor_v3 needs an UntypedStorage")
        return _rebuild_common(args, None, "_rebuild_tensor_v3")


class _RebuildParameter:
    __slots__ = ()

    def __call__(self, *args: Any) -> _TensorRef:
        # torch.save(nn.Parameter): (data, requires_grad, backward_hooks).
        if len(args) != 3 or type(args[0]) is not _TensorRef:
            raise _PickleReject("_rebuild_parameter with unexpected arguments")
        return args[0]


_UNTYPED = _StorageTypeRef(None)
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _RebuildV2(),
    ("torch._utils", "_rebuild_tensor_v3"): _RebuildV3(),
    ("torch._utils", "_rebuild_parameter"): _RebuildParameter(),
    # OrderedDict only ever builds the (empty) backward-hooks dict; constructing a dict runs
    # no user code.
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch", "UntypedStorage"): _UNTYPED,
}
_ALLOWED_GLOBALS.update({("torch", n): _StorageTypeRef(d) for n, d in _TYPED_STORAGE_DTYPES.items()})
# dtype globals appear as _rebuild_tensor_v3's dtype argument. Quantized dtypes never do
# (their tensors pickle through _rebuild_qtensor), and raw bytes could not rebuild them.
_QUANTIZED_DTYPE_NAMES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
_ALLOWED_GLOBALS.update(
    {
        ("torch", n): v
        for n, v in vars(torch).items()
        if isinstance(v, torch.dtype) and not n.startswith("_") and n not in _QUANTIZED_DTYPE_NAMES
    }
)


# Opcodes a tensor's data.pkl can contain (protocol 2 as torch.save writes it, plus the
# protocol-4 framing/memo forms, for pickle_protocol=4 writers), with the size of their
# fixed-length argument. Everything else -- INST/OBJ/NEWOBJ, EXT*, BUILD, text-number forms,
# BINBYTES -- is refused before the C unpickler sees it: not needed for a tensor, and some
# can make the C unpickler allocate gigabytes from a few bytes (a LONG_BINPUT index sizes the
# memo table; BINBYTES preallocates its declared length).
_OPCODE_ARG_BYTES: dict[int, int] = {
    0x80: 1,  # PROTO
    0x95: 8,  # FRAME
    ord("q"): 1,  # BINPUT
    ord("r"): 4,  # LONG_BINPUT
    ord("h"): 1,  # BINGET
    ord("j"): 4,  # LONG_BINGET
    0x94: 0,  # MEMOIZE
    ord("("): 0,  # MARK
    ord("t"): 0,  # TUPLE
    0x85: 0,  # TUPLE1
    0x86: 0,  # TUPLE2
    0x87: 0,  # TUPLE3
    ord(")"): 0,  # EMPTY_TUPLE
    ord("}"): 0,  # EMPTY_DICT
    ord("s"): 0,  # SETITEM
    ord("u"): 0,  # SETITEMS
    ord("]"): 0,  # EMPTY_LIST
    ord("a"): 0,  # APPEND
    ord("e"): 0,  # APPENDS
    ord("K"): 1,  # BININT1
    ord("M"): 2,  # BININT2
    ord("J"): 4,  # BININT
    ord("G"): 8,  # BINFLOAT
    ord("N"): 0,  # NONE
    0x88: 0,  # NEWTRUE
    0x89: 0,  # NEWFALSE
    ord("Q"): 0,  # BINPERSID
    ord("R"): 0,  # REDUCE
    0x93: 0,  # STACK_GLOBAL (resolved through find_class)
    ord("."): 0,  # STOP
}
_OP_GLOBAL = ord("c")
_OP_BINUNICODE = ord("X")
_OP_SHORT_BINUNICODE = 0x8C
_OP_LONG1 = 0x8A
_OP_STOP = ord(".")
_MEMO_OPS = {ord("q"): "<B", ord("r"): "<I", ord("h"): "<B", ord("j"): "<I"}
_MAX_GLOBAL_LINE = 256


def _check_opcodes(pkl: bytes) -> None:
    """Refuse a pickle with opcodes outside the allow-list or with out-of-range arguments."""
    n = len(pkl)
    p = 0
    while p < n:
        op = pkl[p]
        p += 1
        if op == _OP_GLOBAL:  # two newline-terminated lines: module, name
            for _ in range(2):
                q = pkl.find(b"\n", p, p + _MAX_GLOBAL_LINE)
                if q < 0:
                    raise _PickleReject("malformed GLOBAL opcode in data.pkl")
                p = q + 1
            continue
        if op == _OP_BINUNICODE:
            if p + 4 > n:
                break
            p += 4 + struct.unpack_from("<I", pkl, p)[0]
        elif op == _OP_SHORT_BINUNICODE or op == _OP_LONG1:
            if p + 1 > n:
                break
            p += 1 + pkl[p]
        else:
            arg = _OPCODE_ARG_BYTES.get(op)
            if arg is None:
                raise _PickleReject(f"data.pkl uses pickle opcode {bytes([op])!r}, not allowed in a tensor pickle")
            if op in _MEMO_OPS and p + arg <= n:
                # Memo indices index a table the unpickler sizes by the largest index seen; a
                # real pickle never needs more entries than it has bytes.
                if struct.unpack_from(_MEMO_OPS[op], pkl, p)[0] >= n:
                    raise _PickleReject("data.pkl memo index out of range")
            p += arg
            if op == _OP_STOP:
                if p != n:
                    raise _PickleReject("data.pkl has trailing bytes after STOP")
                return
    raise _PickleReject("data.pkl is truncated (no STOP opcode)")


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed globals, each to an inert stand-in; counts storages.

    Precondition: the pickle passed _check_opcodes. Every opcode that can reach a callable
    (GLOBAL, STACK_GLOBAL; INST and EXT* are filtered out before) goes through find_class, so
    nothing outside the allow-list can be called.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: list[_StorageRef] = []

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            what = f"{str(module)[:100]}.{str(name)[:100]}"
            raise _PickleReject(f"data.pkl references disallowed global {what}") from None

    def persistent_load(self, pid: Any) -> Any:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise _PickleReject("data.pkl has a persistent id that is not a storage")
        _, storage_type, key, location, numel = pid
        if type(storage_type) is not _StorageTypeRef:
            raise _PickleReject("storage persistent id names an unknown storage type")
        if type(key) is not str or type(location) is not str:
            raise _PickleReject("storage persistent id has a non-string key or location")
        if not _is_int(numel) or numel < 0:
            raise _PickleReject("storage persistent id has an invalid size")
        if not key.isascii() or not key.isdigit():
            raise _PickleReject(f"storage key {key[:40]!r} is not a decimal number")
        ref = _StorageRef(storage_type, key, numel)
        self.storages.append(ref)
        return ref


@functools.lru_cache(maxsize=4096)
def _decode_pkl(pkl: bytes) -> _TensorRef:
    """The tensor a data.pkl describes; raises _PickleReject or the unpickler's own errors.

    Cached by content: every blob of the same dtype/shape/stride has the same data.pkl, and
    only successful results are cached (lru_cache does not cache exceptions).
    """
    _check_opcodes(pkl)
    up = _RestrictedUnpickler(pkl)
    obj = up.load()
    if type(obj) is not _TensorRef:
        raise _PickleReject(f"data.pkl does not hold a single tensor (got {type(obj).__name__})")
    if len(up.storages) != 1:
        raise _PickleReject(f"data.pkl references {len(up.storages)} storages, expected exactly one")
    return obj


def _unpickle_tensor(pkl: bytes, where: str) -> _TensorRef:
    try:
        return _decode_pkl(pkl)
    except _PickleReject as e:
        raise BlobFormatError(f"{where}: {e}") from None
    except RecursionError:
        raise BlobFormatError(f"{where}: data.pkl nests too deeply") from None
    except Exception as e:  # any malformed pickle: UnpicklingError, EOFError, TypeError, ...
        raise BlobFormatError(
            f"{where}: data.pkl is not a valid tensor pickle ({type(e).__name__}: {str(e)[:200]})"
        ) from None


class _BlobBytes:
    """Random access to blob bytes from the head/tail windows, else through read_more."""

    __slots__ = ("head", "tail", "tail_start", "length", "read_more", "where")

    def __init__(self, head: bytes, tail: bytes, length: int, read_more: Callable[[int, int], bytes], where: str):
        self.head = head
        self.tail = tail
        self.tail_start = length - len(tail)
        self.length = length
        self.read_more = read_more
        self.where = where

    def get(self, off: int, n: int, what: str) -> bytes:
        if off < 0 or n < 0 or off + n > self.length:
            raise BlobFormatError(
                f"{self.where}: {what} at blob offset {off} (+{n} bytes) lies outside the blob "
                f"of {self.length} bytes (truncated or corrupt)"
            )
        end = off + n
        if end <= len(self.head):
            return self.head[off:end]
        ts = self.tail_start
        if off >= ts:
            return self.tail[off - ts : end - ts]
        if len(self.head) >= ts:  # head and tail overlap: together they cover the blob
            return self.head[off:] + self.tail[len(self.head) - ts : end - ts]
        data = self.read_more(off, n)
        if len(data) != n:
            raise BlobFormatError(f"{self.where}: short read of {what}: wanted {n} bytes at {off}, got {len(data)}")
        return bytes(data)


class _Entry(NamedTuple):
    """One central directory record (zip64 values resolved)."""

    size: int  # uncompressed
    compressed_size: int
    local_header_offset: int
    method: int
    flags: int


def _find_eocd(b: _BlobBytes) -> int:
    """Blob offset of the end-of-central-directory record."""
    where = b.where
    last = b.length - _EOCD.size
    # Fast path: no archive comment (torch never writes one).
    end = b.get(last, _EOCD.size, "end of central directory")
    if end[:4] == _EOCD_SIG_BYTES and end[20:] == b"\0\0":
        return last
    win_start = max(0, b.length - _EOCD_SEARCH)
    win = b.get(win_start, b.length - win_start, "end of central directory search window")
    i = len(win) - _EOCD.size
    while True:
        i = win.rfind(_EOCD_SIG_BYTES, 0, i + 4)
        if i < 0:
            raise BlobFormatError(f"{where}: no zip end-of-central-directory record (not a torch.save blob?)")
        (comment_len,) = struct.unpack_from("<H", win, i + 20)
        if win_start + i + _EOCD.size + comment_len == b.length:
            return win_start + i
        i -= 1


def _read_central_directory(b: _BlobBytes) -> tuple[dict[bytes, _Entry], bytes, int]:
    """Records by name, the first record's name, and the directory's blob offset."""
    where = b.where
    eocd_off = _find_eocd(b)
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_off, _ = _EOCD.unpack(b.get(eocd_off, _EOCD.size, "EOCD"))
    cd_end_limit = eocd_off
    # A zip64 locator sits right before the EOCD when the archive has zip64 records.
    if eocd_off >= _ZIP64_LOCATOR.size:
        loc = b.get(eocd_off - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size, "zip64 EOCD locator")
        lsig, _, z64_off, n_disks = _ZIP64_LOCATOR.unpack(loc)
        if lsig == _SIG_ZIP64_LOCATOR:
            if n_disks > 1:
                raise BlobFormatError(f"{where}: multi-disk zip archives are not supported")
            if z64_off + _ZIP64_EOCD.size > eocd_off - _ZIP64_LOCATOR.size:
                raise BlobFormatError(f"{where}: zip64 EOCD offset {z64_off} out of range")
            (zsig, _, _, _, disk, cd_disk, n_disk, n_total, cd_size, cd_off) = _ZIP64_EOCD.unpack(
                b.get(z64_off, _ZIP64_EOCD.size, "zip64 EOCD")
            )
            if zsig != _SIG_ZIP64_EOCD:
                raise BlobFormatError(f"{where}: bad zip64 EOCD signature at blob offset {z64_off}")
            cd_end_limit = z64_off
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise BlobFormatError(f"{where}: multi-disk zip archives are not supported")
    if n_total == 0:
        raise BlobFormatError(f"{where}: zip archive has no records")
    if cd_size > _MAX_CENTRAL_DIR or n_total * _CENTRAL.size > cd_size:
        raise BlobFormatError(f"{where}: implausible central directory ({n_total} records in {cd_size} bytes)")
    if cd_off + cd_size > cd_end_limit:
        raise BlobFormatError(
            f"{where}: central directory [{cd_off}, {cd_off + cd_size}) overruns the end records at {cd_end_limit}"
        )
    cd = b.get(cd_off, cd_size, "central directory")

    # Names stay bytes: only two records are ever looked up, so nothing else gets decoded.
    entries: dict[bytes, _Entry] = {}
    first_name = b""
    unpack = _CENTRAL.unpack_from
    p = 0
    for _ in range(n_total):
        if p + _CENTRAL.size > cd_size:
            raise BlobFormatError(f"{where}: central directory truncated")
        (sig, _, _, flags, method, _, _, _, comp, uncomp, nlen, xlen, clen, _, _, _, lho) = unpack(cd, p)
        if sig != _SIG_CENTRAL:
            raise BlobFormatError(f"{where}: bad central directory signature at blob offset {cd_off + p}")
        q = p + _CENTRAL.size
        p = q + nlen + xlen + clen
        if p > cd_size:
            raise BlobFormatError(f"{where}: central directory entry overruns the directory")
        name = cd[q : q + nlen]
        if uncomp == _U32_MAX or comp == _U32_MAX or lho == _U32_MAX:
            uncomp, comp, lho = _zip64_extra(cd[q + nlen : q + nlen + xlen], uncomp, comp, lho, where, name)
        if lho >= cd_off:
            raise BlobFormatError(
                f"{where}: record {_show(name)} local header offset {lho} is not before the directory at {cd_off}"
            )
        if name in entries:
            raise BlobFormatError(f"{where}: duplicate record {_show(name)}")
        if not entries:
            first_name = name
        entries[name] = _Entry(uncomp, comp, lho, method, flags)
    return entries, first_name, cd_off


def _show(name: bytes) -> str:
    """A record name for an error message."""
    return repr(name[:200].decode("utf-8", "replace"))


def _zip64_extra(extra: bytes, uncomp: int, comp: int, lho: int, where: str, name: bytes) -> tuple[int, int, int]:
    """Resolve the 0xFFFFFFFF sentinels of a central directory entry from its zip64 extra field."""
    p = 0
    while p + 4 <= len(extra):
        hid, hlen = _EXTRA_HDR.unpack_from(extra, p)
        p += 4
        if p + hlen > len(extra):
            break
        if hid == _ZIP64_EXTRA_ID:
            field = extra[p : p + hlen]
            need = 8 * ((uncomp == _U32_MAX) + (comp == _U32_MAX) + (lho == _U32_MAX))
            if hlen < need:
                raise BlobFormatError(f"{where}: zip64 extra field of {_show(name)} too short")
            k = 0
            if uncomp == _U32_MAX:
                (uncomp,) = _U64.unpack_from(field, k)
                k += 8
            if comp == _U32_MAX:
                (comp,) = _U64.unpack_from(field, k)
                k += 8
            if lho == _U32_MAX:
                (lho,) = _U64.unpack_from(field, k)
            return uncomp, comp, lho
        p += hlen
    raise BlobFormatError(f"{where}: record {_show(name)} needs a zip64 extra field but has none")


def _record_data_offset(b: _BlobBytes, name: bytes, e: _Entry, cd_off: int) -> int:
    """Blob offset of a stored record's first data byte, from its local header."""
    where = b.where
    if e.method != 0 or e.compressed_size != e.size:
        raise BlobFormatError(
            f"{where}: record {_show(name)} is compressed (method {e.method}); only stored records are supported"
        )
    if e.flags & 0x41:  # bit 0: encrypted, bit 6: strong encryption
        raise BlobFormatError(f"{where}: record {_show(name)} is encrypted")
    lho = e.local_header_offset
    hdr = b.get(lho, _LOCAL.size + len(name), f"local header of {_show(name)}")
    sig, _, _, _, _, _, _, _, _, nlen, xlen = _LOCAL.unpack_from(hdr)
    if sig != _SIG_LOCAL:
        raise BlobFormatError(f"{where}: bad local header signature for {_show(name)} at blob offset {lho}")
    if nlen != len(name) or hdr[_LOCAL.size :] != name:
        raise BlobFormatError(f"{where}: local header name of {_show(name)} does not match the central directory")
    data_off = lho + _LOCAL.size + nlen + xlen
    if data_off + e.size > cd_off:
        raise BlobFormatError(
            f"{where}: record {_show(name)} data [{data_off}, {data_off + e.size}) overruns the central "
            f"directory at {cd_off}"
        )
    return data_off


def parse_tensor_blob(
    head: bytes,
    tail: bytes,
    blob_length: int,
    read_more: Callable[[int, int], bytes],
    where: str,
) -> TensorBlobInfo:
    """Locate the single tensor of a ``torch.save`` blob without ``torch.load``.

    ``head`` is blob bytes ``[0, len(head))`` and ``tail`` blob bytes
    ``[blob_length - len(tail), blob_length)`` (they may overlap, or each be the whole blob);
    ``read_more(off, n)`` must return exactly the ``n`` blob bytes at blob offset ``off`` and is
    called only for bytes neither window covers. ``where`` names the file in error messages.

    Accepts blobs written by ``torch.save`` (``_rebuild_tensor_v2``/``_v3``, zip64,
    non-contiguous strides, non-zero storage offsets) and by :func:`tensor_blob_layout`.
    ``data.pkl`` is unpickled by an allow-list unpickler that cannot call anything but inert
    stand-ins. Raises :class:`BlobFormatError` for anything else: unknown globals, several
    storages, not a single tensor, compressed or encrypted records, bad signatures,
    truncation, numbers out of range, or a storage too small for size/stride/storage_offset.
    Exceptions raised by ``read_more`` itself propagate unchanged.
    """
    if type(blob_length) is not int or blob_length < _EOCD.size:
        raise BlobFormatError(f"{where}: blob of {blob_length!r} bytes is too short to be a zip archive")
    if len(head) > blob_length or len(tail) > blob_length:
        raise BlobFormatError(
            f"{where}: head/tail windows ({len(head)}/{len(tail)} bytes) exceed the blob length {blob_length}"
        )
    b = _BlobBytes(head, tail, blob_length, read_more, where)
    entries, first_name, cd_off = _read_central_directory(b)
    # torch names the archive after the first record's top-level folder ("archive/" for
    # torch.save to a buffer, the file's stem for torch.save to a path).
    slash = first_name.find(b"/")
    if slash <= 0:
        raise BlobFormatError(f"{where}: first record {_show(first_name)} is not inside an archive folder")
    prefix = first_name[: slash + 1]

    pkl_name = prefix + b"data.pkl"
    pkl_entry = entries.get(pkl_name)
    if pkl_entry is None:
        raise BlobFormatError(f"{where}: no {_show(pkl_name)} record (not a torch.save blob)")
    if pkl_entry.size > _MAX_PKL:
        raise BlobFormatError(f"{where}: data.pkl of {pkl_entry.size} bytes is too large for a single tensor")
    pkl_off = _record_data_offset(b, pkl_name, pkl_entry, cd_off)
    t = _unpickle_tensor(b.get(pkl_off, pkl_entry.size, "data.pkl"), where)

    storage_name = prefix + b"data/" + t.storage.key.encode("ascii")
    se = entries.get(storage_name)
    if se is None:
        raise BlobFormatError(f"{where}: data.pkl names storage record {_show(storage_name)}, which is missing")
    data_off = _record_data_offset(b, storage_name, se, cd_off)

    itemsize = t.dtype.itemsize
    if itemsize <= 0:
        raise BlobFormatError(f"{where}: dtype {t.dtype} has no byte size")
    untyped = t.storage.storage_type.dtype is None
    expected_nbytes = t.storage.numel if untyped else t.storage.numel * itemsize
    if se.size != expected_nbytes:
        raise BlobFormatError(
            f"{where}: storage record {_show(storage_name)} has {se.size} bytes, data.pkl says {expected_nbytes}"
        )

    size, stride, storage_offset = t.size, t.stride, t.storage_offset
    if len(size) != len(stride) or len(size) > _MAX_NDIM:
        raise BlobFormatError(f"{where}: tensor size {size[:8]} and stride {stride[:8]} do not match")
    if storage_offset < 0 or any(s < 0 for s in size) or any(st < 0 for st in stride):
        raise BlobFormatError(
            f"{where}: negative size/stride/storage_offset (size {size}, stride {stride}, offset {storage_offset})"
        )
    if 0 not in size:
        extent = storage_offset + 1
        for s, st in zip(size, stride):
            extent += (s - 1) * st
        if extent * itemsize > se.size:
            raise BlobFormatError(
                f"{where}: tensor (size {size}, stride {stride}, storage_offset {storage_offset}, {t.dtype}) "
                f"needs {extent * itemsize} storage bytes but the storage has {se.size}"
            )
    return TensorBlobInfo(data_off, se.size, t.dtype, size, stride, storage_offset)
