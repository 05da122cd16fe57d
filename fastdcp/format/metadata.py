"""A DCP ``.metadata`` pickle, parsed without trusting it: bytes in, validated ``Metadata`` out.

Stock ``FileSystemReader.read_metadata`` is ``pickle.load``: a checkpoint downloaded from anywhere
can run arbitrary code the moment it is opened. This module is the hostile-input boundary for
the metadata (tensor blobs are :mod:`fastdcp.format.blob`'s job; the files themselves are
:mod:`fastdcp.io.checkpoint_files`'):

* :func:`parse_metadata` unpickles with an allow-list of exactly what stock DCP writes (the
  ``torch.distributed.checkpoint`` metadata dataclasses, ``torch.Size``, dtypes, layouts, the
  memory-format enum, ``pathlib`` paths, plain containers), after a scan of the opcode stream
  (scan and unpickler are :mod:`fastdcp.format.pickles`'s, with this module's rules and allow-list)
  that refuses memory bombs (memo indices and declared lengths larger than the file) and opcodes
  a metadata pickle never needs (persistent ids, extension codes, out-of-band buffers). Nothing
  outside the objects the load itself creates can be modified: allow-listed functions and the
  enum resolve to inert per-load stand-ins, and the dataclasses to per-load subclasses (a
  ``BUILD`` opcode aimed at a class object tampers with a throwaway class), whose instances are
  switched to the real classes once the load is done. Then the structure is validated (types,
  byte ranges, chunk boxes inside their tensors).
* Custom planner or storage classes are allowed one by one with :func:`add_safe_metadata_globals`
  (or, on a torch that has it, stock's function of the same name: whatever stock's restricted
  loader accepts, this one does too). ``allow_unsafe=True`` is the explicit opt-out: plain
  ``pickle``; the structural validation still runs.

Errors are :class:`CheckpointFormatError` (a ``ValueError``); a missing directory, ``.metadata``
or data file is :class:`CheckpointNotFoundError`, which is also a ``FileNotFoundError`` (what stock
raises, so ``except FileNotFoundError`` keeps working). Every message names the file.
"""

from __future__ import annotations

import collections
import importlib
import io
import pathlib
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import filesystem as _stock_fs
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ..compat.torch_internals import TENSOR_PROPERTIES_HAVE_STRIDES
from .pickles import ALL_OPCODES, OpcodeRules, RestrictedUnpickler, load_pickle, opcode_codes, scan_opcodes

__all__ = [
    "METADATA_NAME",
    "RANK_METADATA_RE",
    "CHECKSUM_ATTRIBUTE",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "parse_metadata",
    "unpickle_restricted",
    "add_safe_metadata_globals",
    "entry_name",
    "shown",
]

METADATA_NAME = ".metadata"  # stock's filesystem._metadata_fn
# A rank-local save's metadata (``dcp.save(use_collectives=False)``): ``__{rank}.metadata``.
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
# The attribute holding the CRC-32C a fastdcp writer may record on each _StorageInfo (defined
# here, with the rest of the metadata format; the writer and format.checksums import it).
CHECKSUM_ATTRIBUTE = "fastdcp_crc32c"
# Byte offsets and lengths beyond this cannot be real (and would overflow the engine's int64).
_MAX_FILE_OFFSET = 1 << 62
_MAX_NDIM = 1024
SHOW_CHARS = 200  # characters of a hostile value shown in an error message


class CheckpointFormatError(ValueError):
    """A checkpoint (its ``.metadata`` or a data file) is damaged, hostile or not a DCP
    checkpoint; the message names the file and the problem."""


class CheckpointNotFoundError(CheckpointFormatError, FileNotFoundError):
    """The checkpoint directory, its ``.metadata`` or a data file it names does not exist."""


def shown(value: Any) -> str:
    """A bounded ``repr`` for error messages (hostile values can be megabytes long)."""
    t = type(value)
    if t is int:
        text = repr(value) if value.bit_length() < 256 else f"<int of {value.bit_length()} bits>"
    elif t is str or t is bytes:
        text = repr(value[: SHOW_CHARS + 1])
    elif t in (float, bool, type(None)):
        text = repr(value)
    elif (
        t in (tuple, list, torch.Size)
        and len(value) <= 16
        and all(type(v) is int and v.bit_length() < 256 for v in value)
    ):
        text = repr(tuple(value))
    else:
        text = f"<{t.__name__}>"
    return text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS] + "..."


# ---------------------------------------------------------------------------------------------
# Opcode scan: refuse memory bombs and opcodes a metadata pickle never contains, before the C
# unpickler sees the bytes.
# ---------------------------------------------------------------------------------------------


class _Reject(Exception):
    """Internal: the pickle contains something a DCP metadata pickle does not."""


# Persistent ids (no metadata has storages), the copyreg extension registry (process-global
# state) and out-of-band buffers (never passed) have no place in a metadata pickle. Memo indices
# checked: LONG_BINPUT's and the decimal PUT's and GET's (the other fixed-size memo opcodes index
# at most 256 entries); trailing bytes after STOP are ignored, as pickle.load does.
_OPCODE_RULES = OpcodeRules(
    allowed=ALL_OPCODES - opcode_codes(("PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER",
                                        "READONLY_BUFFER")),
    memo_checked=opcode_codes(("LONG_BINPUT", "PUT", "GET")),
    max_line=1 << 16,
    check_frames=True,
    trailing=True,
    error=_Reject,
    messages={
        "invalid": "invalid pickle opcode 0x{op:02x} at byte {at}",
        "refused": "pickle opcode 0x{op:02x} at byte {at} is not allowed in DCP metadata",
        "memo": "memo index {index} at byte {at} exceeds the pickle's size ({n} bytes)",
        "memo_text": "malformed memo index at byte {at}",
        "frame": "pickle frame at byte {at} is longer than the data that follows (truncated or damaged)",
        "line": "unterminated or overlong text argument at byte {at}",
        "length": "pickle argument at byte {at} declares {length} bytes but only {follow} follow (truncated or "
                  "damaged)",
        "truncated": "the pickle is truncated (it ends at byte {n} without a STOP opcode)",
    },
)


# ---------------------------------------------------------------------------------------------
# The restricted unpickler.
# ---------------------------------------------------------------------------------------------


class _Inert:
    """Base of the per-load stand-ins: no ``__dict__``, no settable attributes, so a ``BUILD``
    opcode aimed at one fails instead of changing it."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Reject("the pickle tries to set an attribute on an allow-listed function")

    def __delattr__(self, name: str) -> None:
        raise _Reject("the pickle tries to delete an attribute of an allow-listed function")


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


class _LayoutCall(_Inert):
    __slots__ = ()

    def __call__(self, *args: Any) -> torch.layout:
        if len(args) != 1 or type(args[0]) is not str or args[0] not in _LAYOUTS:
            raise _Reject("torch.serialization._get_layout(...) with an argument that is not a layout name")
        return _LAYOUTS[args[0]]


class _MemFormatToken(int):
    """Stands in for a ``metadata._MEM_FORMAT_ENCODING`` member (the real members are shared,
    mutable singletons a ``BUILD`` could tamper with). Only the per-load ``TensorProperties``
    subclass's ``__setstate__`` consumes it."""

    __slots__ = ()


_MEM_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


class _MemFormatCall(_Inert):
    __slots__ = ()

    def __call__(self, *args: Any) -> _MemFormatToken:
        if len(args) != 1 or type(args[0]) is not int or args[0] not in _MEM_FORMATS:
            raise _Reject("_MEM_FORMAT_ENCODING(...) with an unknown value")
        return _MemFormatToken(args[0])


_PATH_CLASSES = {
    name: getattr(pathlib, name) for name in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath")
}


class _PathCall(_Inert):
    """``pathlib`` paths (``StorageMeta.checkpoint_id`` when the writer got a ``Path``); building
    one from strings touches no filesystem. A Windows path becomes a PureWindowsPath."""

    __slots__ = ("_cls_name",)

    def __init__(self, cls_name: str) -> None:
        object.__setattr__(self, "_cls_name", cls_name)

    def __call__(self, *args: Any) -> pathlib.PurePath:
        if not all(type(a) is str for a in args) or sum(map(len, args)) > 1 << 16:
            raise _Reject(f"pathlib.{self._cls_name}(...) with arguments other than strings")
        cls = _PATH_CLASSES.get(self._cls_name, pathlib.PureWindowsPath)
        return cls(*args)


def _tensor_properties_setstate(self: Any, state: Any) -> None:
    # metadata.TensorProperties.__setstate__, taking the memory-format token instead of the enum.
    # Five fields up to torch 2.14; 2.15 appends the tensor's strides (a tuple of ints, or None),
    # and reads a five-field state with strides None. A torch whose TensorProperties has no strides
    # field drops them (nothing of DCP reads them there), where its own unpickler would fail.
    if type(state) is tuple and len(state) in (5, 6):
        dtype, layout, requires_grad, encoding, pin_memory = state[:5]
        strides = state[5] if len(state) == 6 else None
        if type(encoding) is not _MemFormatToken:
            raise _Reject("TensorProperties state with an invalid memory format encoding")
        if strides is not None and (type(strides) is not tuple or not all(type(x) is int for x in strides)):
            raise _Reject("TensorProperties state with strides that are not a tuple of ints")
        d = object.__getattribute__(self, "__dict__")
        d.update(
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            memory_format=_MEM_FORMATS[int(encoding)],
            pin_memory=pin_memory,
        )
        if TENSOR_PROPERTIES_HAVE_STRIDES:
            d["strides"] = strides
    elif type(state) is dict and all(type(k) is str for k in state):  # a plain dataclass pickle
        object.__getattribute__(self, "__dict__").update(state)
    else:
        raise _Reject("TensorProperties state of an unexpected form")


class _FrozenMeta(type):
    """Metaclass of the per-load subclasses: a ``BUILD`` aimed at the class object fails."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _Reject(f"the pickle tries to set attribute {name[:SHOW_CHARS]!r} on class {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise _Reject(f"the pickle tries to delete attribute {name[:SHOW_CHARS]!r} of class {cls.__name__}")


_MD_MODULE = "torch.distributed.checkpoint.metadata"
_FS_MODULE = "torch.distributed.checkpoint.filesystem"
# The dataclasses a stock .metadata instantiates (each becomes a per-load subclass).
_REAL_CLASSES: dict[tuple[str, str], type] = {
    (_MD_MODULE, name): getattr(_md, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
    if hasattr(_md, name)
}
_REAL_CLASSES[(_FS_MODULE, "_StorageInfo")] = _StorageInfo

# Shared values handed out as they are: immutable (no __dict__, no settable attributes).
_VALUES: dict[tuple[str, str], Any] = {
    ("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype) and not n.startswith("_")
}
_VALUES.update(
    {
        # torch.Size is an immutable C type; it refuses non-integer and out-of-range elements.
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
)
_PATH_NAMES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
_ALLOWED_TEXT = (
    "the torch.distributed.checkpoint metadata classes, torch.Size, dtypes, layouts and pathlib paths"
)

# ---------------------------------------------------------------------------------------------
# Globals the user allowed (custom planner or storage classes in .metadata)
# ---------------------------------------------------------------------------------------------
_user_globals: dict[str, frozenset[str]] = {}  # module -> qualified names
_user_globals_lock = threading.Lock()


def add_safe_metadata_globals(safe_globals: Mapping[str, Iterable[str]] | Iterable[Any]) -> None:
    """Allow more globals in a ``.metadata`` the restricted loader reads: a mapping of module name
    to qualified names (``{"my.pkg": {"MyPlannerData"}}``), or the classes and functions
    themselves. Stock's ``add_safe_metadata_globals`` has the same form; on a torch that has it,
    the same globals are registered there too, so stock readers accept the same checkpoints.

    Each allowed global is handed to the pickle as it is (not as a per-load stand-in): allow only
    what is safe to construct from untrusted arguments.
    """
    if isinstance(safe_globals, Mapping):
        pairs = []
        for module, names in safe_globals.items():
            if isinstance(names, str):
                names = (names,)
            elif not isinstance(names, Iterable):
                raise TypeError(
                    f"add_safe_metadata_globals: the names for module {module!r} must be a string or a "
                    f"collection of strings, got {names!r}"
                )
            pairs += [(module, name) for name in names]
    elif isinstance(safe_globals, (str, bytes)):
        raise TypeError(
            f"add_safe_metadata_globals: expected a mapping {{module: names}} or a list of classes and "
            f"functions, got the string {safe_globals!r}"
        )
    else:
        pairs = []
        for obj in safe_globals:
            module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not isinstance(module, str) or not isinstance(name, str):
                raise TypeError(f"add_safe_metadata_globals: {obj!r} has no __module__/__qualname__")
            pairs.append((module, name))
    for module, name in pairs:
        if not isinstance(module, str) or not isinstance(name, str) or not module or not name:
            raise TypeError(f"add_safe_metadata_globals: expected module and name strings, got {module!r}, {name!r}")
    with _user_globals_lock:
        for module, name in pairs:
            _user_globals[module] = _user_globals.get(module, frozenset()) | {name}
    stock_add = getattr(_stock_fs, "add_safe_metadata_globals", None)
    if stock_add is not None:
        stock_add(safe_globals)


def _resolve_qualified(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _user_allowed_global(module: str, name: str) -> Any | None:
    """The object for an allowed global outside fastdcp's own list, or None: registered with
    :func:`add_safe_metadata_globals`, or accepted by stock's restricted metadata loader (which
    holds what users registered with stock's function of the same name, on a torch that has it)."""
    if name in _user_globals.get(module, ()):
        try:
            return _resolve_qualified(module, name)
        except (ImportError, AttributeError) as e:
            raise _Reject(f"the allowed global {module}.{name} cannot be imported ({type(e).__name__}: {e})") from None
    stock_unpickler = getattr(_stock_fs, "_RestrictedMetadataUnpickler", None)
    if stock_unpickler is None or not hasattr(_stock_fs, "add_safe_metadata_globals"):
        return None
    try:
        return stock_unpickler(io.BytesIO(b"")).find_class(module, name)
    except Exception:  # stock refuses it (UnpicklingError), or cannot import it
        return None


class _MetadataGlobals:
    """The globals of one load, resolved from the allow-list; every mutable thing handed out is
    private to this load (a :class:`~fastdcp.format.pickles.RestrictedUnpickler`'s ``find_global``).

    The metadata dataclasses resolve to frozen per-load subclasses whose ``__new__`` records each
    instance; :meth:`adopt` switches those instances to the real classes after the load.
    """

    def __init__(self) -> None:
        self.shadows: dict[type, type] = {}  # per-load subclass -> real class
        self.instances: list[Any] = []
        self._resolved: dict[tuple[str, str], Any] = {}

    def _shadow(self, real: type) -> type:
        instances = self.instances

        def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
            obj = object.__new__(cls)
            instances.append(obj)
            return obj

        namespace: dict[str, Any] = {
            "__slots__": (),
            "__module__": real.__module__,
            "__qualname__": real.__qualname__,
            "__new__": __new__,
        }
        if real is getattr(_md, "TensorProperties", None):
            namespace["__setstate__"] = _tensor_properties_setstate
        sub = _FrozenMeta(real.__name__, (real,), namespace)
        self.shadows[sub] = real
        return sub

    def __call__(self, module: str, name: str) -> Any:
        if type(module) is not str or type(name) is not str:
            raise _Reject("malformed global reference")
        key = (module, name)
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        if key in _REAL_CLASSES:
            hit = self._shadow(_REAL_CLASSES[key])
        elif key in _VALUES:
            hit = _VALUES[key]
        elif key == ("torch.serialization", "_get_layout"):
            hit = _LayoutCall()
        elif key == (_MD_MODULE, "_MEM_FORMAT_ENCODING"):
            hit = _MemFormatCall()
        elif module in ("pathlib", "pathlib._local") and name in _PATH_NAMES:
            hit = _PathCall(name)
        elif (allowed := _user_allowed_global(module, name)) is not None:
            hit = allowed
        else:
            raise _Reject(
                f"refusing to load disallowed global {module[:SHOW_CHARS]}.{name[:SHOW_CHARS]} "
                f"(a DCP .metadata holds only "
                f"{_ALLOWED_TEXT}; allow a custom class with fastdcp.add_safe_metadata_globals, or pass "
                f"allow_unsafe_metadata=True only for a checkpoint you trust)"
            )
        self._resolved[key] = hit
        return hit

    def adopt(self) -> None:
        """Give every instance the load created its real class (same layout: the subclasses
        add no slots)."""
        shadows = self.shadows
        for obj in self.instances:
            real = shadows.get(type(obj))
            if real is None:  # pragma: no cover - __class__ can only be set to another shadow
                raise _Reject(f"an object of the pickle changed its class to {type(obj).__name__}")
            object.__setattr__(obj, "__class__", real)
        self.instances.clear()


def _no_persistent_id(pid: Any) -> Any:
    raise _Reject("the pickle has a persistent id (DCP metadata has none)")


def _unpickle_restricted(data: bytes) -> Any:
    scan_opcodes(data, _OPCODE_RULES)
    resolved = _MetadataGlobals()
    try:
        return RestrictedUnpickler(data, resolved, _no_persistent_id).load()
    finally:
        resolved.adopt()  # also on failure: nothing the caller might still see keeps a per-load class


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _int_seq(value: Any) -> tuple[int, ...] | None:
    """The value (a torch.Size, tuple or list) as a tuple of non-negative ints, or None."""
    t = type(value)
    if t is torch.Size:  # elements are ints by construction
        if len(value) <= _MAX_NDIM and (not value or min(value) >= 0):
            return value
        return None
    if not isinstance(value, (torch.Size, tuple, list)) or len(value) > _MAX_NDIM:
        return None
    if not all(type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


def _validate(md: Any, where: str) -> None:
    """Raise CheckpointFormatError unless ``md`` is Metadata whose entries a reader can trust.

    Classes are checked with isinstance: in the restricted mode only the stock classes exist
    (the per-load subclasses are gone by now); with allow_unsafe, subclasses are accepted.
    """
    M = _md

    def fail(msg: str) -> None:
        raise CheckpointFormatError(f"{where}: {msg}")

    if not isinstance(md, M.Metadata):
        fail(f"does not hold DCP Metadata (found a {type(md).__name__})")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        fail(f"state_dict_metadata is a {type(sdm).__name__}, not a dict")
    TSM, BSM, CSM, TP = M.TensorStorageMetadata, M.BytesStorageMetadata, M.ChunkStorageMetadata, M.TensorProperties
    dtype_type = torch.dtype
    int_seq = _int_seq
    for fqn, entry in sdm.items():
        if type(fqn) is not str:
            fail(f"state_dict_metadata has a key of type {type(fqn).__name__}")
        if isinstance(entry, TSM):
            props = entry.properties
            if not isinstance(props, TP) or not isinstance(getattr(props, "dtype", None), dtype_type):
                fail(f"tensor {shown(fqn)} has invalid properties (no dtype)")
            size = int_seq(entry.size)
            if size is None:
                fail(f"tensor {shown(fqn)} has an invalid size {shown(entry.size)}")
            chunks = entry.chunks
            if type(chunks) is not list:
                fail(f"tensor {shown(fqn)} has chunks of type {type(chunks).__name__}, not a list")
            ndim = len(size)
            for chunk in chunks:
                if not isinstance(chunk, CSM):
                    fail(f"tensor {shown(fqn)} has a chunk of type {type(chunk).__name__}")
                offsets, sizes = int_seq(chunk.offsets), int_seq(chunk.sizes)
                if offsets is None or sizes is None or len(offsets) != ndim or len(sizes) != ndim:
                    fail(
                        f"tensor {shown(fqn)} has a chunk with invalid offsets/sizes "
                        f"{shown(chunk.offsets)}/{shown(chunk.sizes)} for a tensor of size {shown(size)}"
                    )
                for o, c, n in zip(offsets, sizes, size):
                    if o + c > n:
                        fail(
                            f"tensor {shown(fqn)} has a chunk (offsets {shown(offsets)}, sizes {shown(sizes)}) "
                            f"outside the tensor of size {shown(size)}"
                        )
        elif not isinstance(entry, BSM):
            fail(f"entry {shown(fqn)} is a {type(entry).__name__}, not tensor or bytes storage metadata")

    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        fail(f"storage_data is a {type(storage).__name__}, not a dict")
    MI = M.MetadataIndex
    limit = _MAX_FILE_OFFSET
    for index, info in storage.items():
        if not isinstance(index, MI):
            fail(f"storage_data has a key of type {type(index).__name__}")
        if not isinstance(info, _StorageInfo):
            fail(f"the storage entry for {entry_name(index)} is a {type(info).__name__}, not _StorageInfo")
        rel, off, length = info.relative_path, info.offset, info.length
        if (
            type(rel) is not str
            or type(off) is not int
            or type(length) is not int
            or off < 0
            or length < 0
            or off + length > limit
        ):
            if type(rel) is not str:
                fail(f"the storage entry for {entry_name(index)} has a relative_path of type {type(rel).__name__}")
            fail(
                f"the storage entry for {entry_name(index)} in {shown(rel)} has an invalid byte range "
                f"(offset {shown(off)}, length {shown(length)})"
            )
        if type(index.fqn) is not str:
            fail(f"storage_data key with a {type(index.fqn).__name__} fqn")
        chunk_offset = index.offset
        if chunk_offset is not None and int_seq(chunk_offset) is None:
            fail(f"the storage entry for {shown(index.fqn)} has an invalid chunk offset {shown(chunk_offset)}")
        td = getattr(info, "transform_descriptors", None)  # absent on older torch
        if td is not None and (type(td) not in (list, tuple) or not all(type(x) is str for x in td)):
            fail(f"the storage entry for {entry_name(index)} has invalid transform_descriptors")
        crc = getattr(info, CHECKSUM_ATTRIBUTE, None)
        if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
            fail(f"the storage entry for {entry_name(index)} has an invalid checksum {shown(crc)}")

    sm = getattr(md, "storage_meta", None)
    storage_meta_cls = getattr(M, "StorageMeta", None)
    if sm is not None and (storage_meta_cls is None or not isinstance(sm, storage_meta_cls)):
        fail(f"storage_meta is a {type(sm).__name__}, not StorageMeta")
    version = getattr(md, "version", None)
    if version is not None and type(version) is not str:
        fail(f"version is a {type(version).__name__}, not a string")


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def parse_metadata(data: bytes, where: str, *, allow_unsafe: bool = False) -> _md.Metadata:
    """Unpickle and validate the bytes of a ``.metadata`` file; ``where`` names it in errors.

    Raises :class:`CheckpointFormatError` for anything but valid DCP metadata (never another
    exception type for any input, in the restricted mode). ``allow_unsafe=True`` unpickles with
    plain :mod:`pickle`, which runs whatever code the file names: only for trusted checkpoints.
    """
    if not data:
        raise CheckpointFormatError(f"{where}: the file is empty (a save that never finished?)")
    md = load_pickle(data, allow_unsafe=allow_unsafe, restricted=lambda d: unpickle_restricted(d, where),
                     fail=lambda problem: CheckpointFormatError(f"{where}: {problem}"),
                     unreadable="not a readable metadata pickle")
    try:
        _validate(md, where)
    except CheckpointFormatError:
        raise
    except RecursionError:
        raise CheckpointFormatError(f"{where}: the metadata nests too deeply") from None
    except Exception as e:  # e.g. a hostile __eq__/__hash__ in the unsafe mode
        raise CheckpointFormatError(f"{where}: invalid metadata ({type(e).__name__}: {str(e)[:SHOW_CHARS]})") from None
    return md


def unpickle_restricted(data: bytes, where: str) -> Any:
    """Unpickle untrusted bytes with the allow-list of :func:`parse_metadata` (stock's metadata
    classes, ``torch.Size``, dtypes, layouts, paths, plain containers, and the globals allowed with
    :func:`add_safe_metadata_globals`), after the same opcode scan; no structural validation.
    Raises :class:`CheckpointFormatError` naming ``where`` for anything else (never another
    exception type, whatever the bytes)."""
    try:
        return _unpickle_restricted(bytes(data))
    except _Reject as e:
        raise CheckpointFormatError(f"{where}: {e}") from None
    except RecursionError:
        raise CheckpointFormatError(f"{where}: the pickle nests too deeply") from None
    except MemoryError:
        raise CheckpointFormatError(f"{where}: the pickle needs more memory than its size justifies") from None
    except Exception as e:  # UnpicklingError, EOFError, TypeError, ValueError, ... from hostile bytes
        raise CheckpointFormatError(
            f"{where}: not a readable DCP metadata pickle (truncated or damaged: "
            f"{type(e).__name__}: {str(e)[:SHOW_CHARS]})"
        ) from None


def entry_name(key: Any) -> str:
    fqn = getattr(key, "fqn", None)
    if type(fqn) is not str:
        return shown(key)
    off = getattr(key, "offset", None)
    return shown(fqn) + (f" at {shown(off)}" if off is not None else "")
