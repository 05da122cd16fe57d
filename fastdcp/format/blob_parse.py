"""Finding the tensor inside a ``torch.save`` zip blob without ``torch.load`` or :mod:`zipfile`.

:func:`parse_tensor_blob` walks EOCD -> central directory -> local headers and unpickles
``data.pkl`` with a restricted unpickler (:mod:`fastdcp.format.pickles`) that builds nothing
(stand-ins for torch's rebuild functions and storages), returning where the storage bytes are and
how to view them (dtype, size, stride, storage offset), so a reader can ``pread`` only the bytes
it needs. Every length, offset and count comes from untrusted bytes and is checked before it is
used; every failure is a :class:`~fastdcp.format.blob.BlobFormatError` naming the file. The zip
records are the ones :mod:`fastdcp.format.blob` emits (and ``torch.save`` writes).
"""

from __future__ import annotations

import collections
import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .blob import (
    _CENTRAL,
    _EOCD,
    _EOCD_SEARCH,
    _EOCD_SIG_BYTES,
    _EXTRA_HDR,
    _LOCAL,
    _SIG_CENTRAL,
    _SIG_LOCAL,
    _SIG_ZIP64_EOCD,
    _SIG_ZIP64_LOCATOR,
    _U32_MAX,
    _U64,
    _ZIP64_EOCD,
    _ZIP64_EXTRA_ID,
    _ZIP64_LOCATOR,
    BlobFormatError,
)
from .pickles import OpcodeRules, RestrictedUnpickler, opcode_codes, scan_opcodes

__all__ = ["TensorBlobInfo", "parse_tensor_blob"]

# Parser limits: a single-tensor blob has ~7 records and a data.pkl of a few hundred bytes.
# The caps bound memory and time on hostile input without rejecting anything torch writes.
_MAX_CENTRAL_DIR = 1 << 20
_MAX_PKL = 1 << 20
_MAX_NDIM = 1024


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


# Opcodes a tensor's data.pkl can contain: protocol 2 as torch.save writes it, plus the
# protocol-4 framing/memo forms, for pickle_protocol=4 writers. Everything else -- INST/OBJ/NEWOBJ,
# EXT*, BUILD, text-number forms, BINBYTES -- is refused before the C unpickler sees it: not needed
# for a tensor, and some can make the C unpickler allocate gigabytes from a few bytes (a
# LONG_BINPUT index sizes the memo table; BINBYTES preallocates its declared length). Memo indices
# are checked against the pickle's size (a real pickle never needs more entries than it has bytes).
_TRUNCATED = "data.pkl is truncated (no STOP opcode)"
_NOT_ALLOWED = "data.pkl uses pickle opcode {op_bytes!r}, not allowed in a tensor pickle"
_OPCODE_RULES = OpcodeRules(
    allowed=opcode_codes((
        "PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "MEMOIZE", "MARK", "TUPLE", "TUPLE1",
        "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "APPEND", "APPENDS",
        "BININT1", "BININT2", "BININT", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "BINPERSID", "REDUCE",
        "STACK_GLOBAL", "STOP", "GLOBAL", "BINUNICODE", "SHORT_BINUNICODE", "LONG1",
    )),
    memo_checked=opcode_codes(("BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET")),
    max_line=256,
    check_frames=False,
    trailing=False,
    error=_PickleReject,
    messages={
        "invalid": _NOT_ALLOWED,
        "refused": _NOT_ALLOWED,
        "memo": "data.pkl memo index out of range",
        "line": "malformed GLOBAL opcode in data.pkl",
        "length": _TRUNCATED,
        "truncated": _TRUNCATED,
        "trailing": "data.pkl has trailing bytes after STOP",
    },
)


def _find_global(module: str, name: str) -> Any:
    """The inert stand-in of an allow-listed global (``GLOBAL`` and ``STACK_GLOBAL`` reach every
    callable through here; INST and EXT* are refused by the opcode scan)."""
    try:
        return _ALLOWED_GLOBALS[(module, name)]
    except (KeyError, TypeError):
        what = f"{str(module)[:100]}.{str(name)[:100]}"
        raise _PickleReject(f"data.pkl references disallowed global {what}") from None


def _storage_ref(storages: list[_StorageRef], pid: Any) -> _StorageRef:
    """The inert reference a storage persistent id stands for, recorded in ``storages``."""
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
    storages.append(ref)
    return ref


def _unpickler(pkl: bytes) -> tuple[RestrictedUnpickler, list[_StorageRef]]:
    """An unpickler of ``pkl`` (scanned by ``_OPCODE_RULES`` first) that resolves only the
    allow-listed globals, each to an inert stand-in, and the storages its persistent ids name
    (listed in the second element)."""
    storages: list[_StorageRef] = []
    return RestrictedUnpickler(pkl, _find_global, functools.partial(_storage_ref, storages)), storages


@functools.lru_cache(maxsize=4096)
def _decode_pkl(pkl: bytes) -> _TensorRef:
    """The tensor a data.pkl describes; raises _PickleReject or the unpickler's own errors.

    Cached by content: every blob of the same dtype/shape/stride has the same data.pkl, and
    only successful results are cached (lru_cache does not cache exceptions).
    """
    scan_opcodes(pkl, _OPCODE_RULES)
    up, storages = _unpickler(pkl)
    obj = up.load()
    if type(obj) is not _TensorRef:
        raise _PickleReject(f"data.pkl does not hold a single tensor (got {type(obj).__name__})")
    if len(storages) != 1:
        raise _PickleReject(f"data.pkl references {len(storages)} storages, expected exactly one")
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
