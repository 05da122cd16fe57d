"""Pickles read as hostile input, by one mechanism for every pickle a checkpoint holds (``.metadata``,
a blob's ``data.pkl``, the chunk index's objects): a scan of the opcode stream under a format's
:class:`OpcodeRules` before the C unpickler sees a byte (:func:`scan_opcodes`: refused opcodes,
memo indices and declared lengths larger than the data, overlong text), one
:class:`RestrictedUnpickler` whose globals and persistent ids only the format's allow-list
resolves, :func:`load_pickle` (restricted, or plain ``pickle`` for a trusted file), and
:func:`first_state_item`, which reads a pickle's opening without unpickling it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Callable

__all__ = ["ALL_OPCODES", "OpcodeRules", "scan_opcodes", "RestrictedUnpickler", "load_pickle", "first_state_item",
           "opcode_codes"]

# An opcode's argument, as pickletools describes it: >= 0 bytes of fixed size, else one of these.
_NL = pickletools.UP_TO_NEWLINE  # up to a newline
_NL2 = -10  # two newline-terminated lines (GLOBAL, INST)
_LEN1 = pickletools.TAKEN_FROM_ARGUMENT1  # length-prefixed: 1-byte length
_LEN4S = pickletools.TAKEN_FROM_ARGUMENT4  # 4-byte signed length
_LEN4U = pickletools.TAKEN_FROM_ARGUMENT4U  # 4-byte unsigned length
_LEN8U = pickletools.TAKEN_FROM_ARGUMENT8U  # 8-byte unsigned length
_REFUSED = -99  # an opcode the rules do not allow
_STOP = ord(".")
_FRAME = 0x95


def _argument_kinds() -> list[int | None]:
    """Per byte value: its opcode's argument kind, None where no opcode has that code."""
    table: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        code = ord(op.code)
        if op.arg is None:
            table[code] = 0
        elif op.name in ("GLOBAL", "INST"):
            table[code] = _NL2
        else:
            table[code] = op.arg.n
    return table


_KINDS = _argument_kinds()


def opcode_codes(names: Iterable[str]) -> frozenset[int]:
    """The codes of the opcodes named (pickletools' names: ``"BINPUT"``, ``"STACK_GLOBAL"``)."""
    by_name = {op.name: ord(op.code) for op in pickletools.opcodes}
    return frozenset(by_name[name] for name in names)


ALL_OPCODES = frozenset(code for code, kind in enumerate(_KINDS) if kind is not None)


class OpcodeRules:
    """What one kind of pickle may hold, and what a refusal says.

    Args:
        allowed: the opcodes it may use (codes; see :func:`opcode_codes`).
        memo_checked: opcodes whose memo index (binary or decimal) must be below the pickle's size.
        max_line: the longest text argument, newline included.
        check_frames: refuse a FRAME longer than the data after it.
        trailing: bytes after STOP are ignored (else refused).
        error: the exception class a refusal raises.
        messages: per refusal (``invalid``: no such opcode, ``refused``, ``memo``, ``memo_text``,
            ``frame``, ``line``, ``length``, ``truncated``: no STOP, ``trailing``) its text, formatted
            with ``op``, ``op_bytes``, ``at`` (a position), ``index``, ``length``, ``follow``, ``n``.
    """

    def __init__(self, *, allowed: frozenset[int], memo_checked: frozenset[int], max_line: int, check_frames: bool,
                 trailing: bool, error: type[Exception], messages: Mapping[str, str]) -> None:
        self.memo_checked = memo_checked
        self.max_line = max_line
        self.check_frames = check_frames
        self.trailing = trailing
        self.error = error
        self.messages = dict(messages)
        self.kinds = [kind if kind is None or code in allowed else _REFUSED for code, kind in enumerate(_KINDS)]
        self.fast_skip = self._fast_skip()

    def refuse(self, reason: str, **fields: Any) -> Exception:
        """The exception for refusal ``reason``."""
        return self.error(self.messages[reason].format(**fields))

    def _fast_skip(self) -> re.Pattern[bytes]:
        """A regex matching a run of opcodes that need no check: allowed, with no argument or a
        fixed-size one that sizes nothing. Alternatives are told apart by their first byte, so
        matching is linear; it moves most of a large pickle's opcodes out of the Python loop."""
        groups: dict[int, list[int]] = {}
        for code, kind in enumerate(self.kinds):
            if kind is None or kind < 0 or code == _STOP or code in self.memo_checked:
                continue
            if code == _FRAME and self.check_frames:
                continue
            groups.setdefault(kind, []).append(code)
        alternatives = []
        for width, codes in sorted(groups.items()):
            cls = b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"
            alternatives.append(cls + (b".{%d}" % width if width else b""))
        body = b"(?:" + b"|".join(alternatives) + b")"
        try:
            return re.compile(body + b"*+", re.DOTALL)  # possessive (Python 3.11+): no backtracking state
        except re.error:  # pragma: no cover - Python 3.10
            return re.compile(body + b"*", re.DOTALL)


_UNPACK4U = struct.Struct("<I").unpack_from
_UNPACK4S = struct.Struct("<i").unpack_from
_UNPACK8 = struct.Struct("<Q").unpack_from


def scan_opcodes(data: bytes, rules: OpcodeRules) -> None:
    """Walk the opcode stream of ``data`` and raise ``rules``' error for an opcode the rules refuse
    or that does not exist, a memo index or declared length larger than the data (a few bytes could
    otherwise make the C unpickler allocate gigabytes: a LONG_BINPUT index sizes the memo table,
    BINBYTES8 preallocates its length), an overlong text argument, or a stream without STOP."""
    n = len(data)
    table = rules.kinds
    skip = rules.fast_skip.match
    memo_checked, check_frames, max_line = rules.memo_checked, rules.check_frames, rules.max_line
    p = 0
    while True:
        p = skip(data, p).end()
        if p >= n:
            break
        op = data[p]
        kind = table[op]
        p += 1
        if kind == 0:
            if op == _STOP:
                if not rules.trailing and p != n:
                    raise rules.refuse("trailing", n=n)
                return  # like pickle.load, trailing bytes are ignored
            continue
        if kind is None:
            raise rules.refuse("invalid", op=op, op_bytes=bytes([op]), at=p - 1)
        if kind > 0:
            if p + kind > n:
                break
            if op in memo_checked:
                index = data[p] if kind == 1 else _UNPACK4U(data, p)[0]
                if index >= n:
                    raise rules.refuse("memo", index=index, at=p - 1, n=n)
            elif op == _FRAME and check_frames and _UNPACK8(data, p)[0] > n - p - kind:
                raise rules.refuse("frame", at=p - 1)
            p += kind
        elif kind == _NL or kind == _NL2:
            for _ in range(2 if kind == _NL2 else 1):
                q = data.find(b"\n", p, p + max_line)
                if q < 0:
                    raise rules.refuse("line", at=p - 1)
                if op in memo_checked:
                    try:
                        index = int(data[p:q])
                    except ValueError:
                        raise rules.refuse("memo_text", at=p - 1) from None
                    if not 0 <= index < n:
                        raise rules.refuse("memo", index=index, at=p - 1, n=n)
                p = q + 1
        elif kind == _REFUSED:
            raise rules.refuse("refused", op=op, op_bytes=bytes([op]), at=p - 1)
        else:
            width = 1 if kind == _LEN1 else 8 if kind == _LEN8U else 4
            if p + width > n:
                break
            if kind == _LEN1:
                length = data[p]
            elif kind == _LEN4S:
                length = _UNPACK4S(data, p)[0]
            elif kind == _LEN4U:
                length = _UNPACK4U(data, p)[0]
            else:
                length = _UNPACK8(data, p)[0]
            p += width
            if length < 0 or length > n - p:
                raise rules.refuse("length", at=p - width - 1, length=length, follow=n - p)
            p += length
    raise rules.refuse("truncated", n=n)


class RestrictedUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` over bytes whose globals and persistent ids are resolved only by
    the functions it is given (each raises for what its format does not allow).

    Args:
        data: the pickle (checked with :func:`scan_opcodes` first).
        find_global: ``(module, name) -> object`` for every ``GLOBAL``/``STACK_GLOBAL``.
        persistent_load: ``pid -> object`` for every persistent id.
    """

    def __init__(self, data: bytes, find_global: Callable[[str, str], Any],
                 persistent_load: Callable[[Any], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._find_global = find_global
        self._persistent_load = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        return self._find_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent_load(pid)


def load_pickle(data: bytes, *, allow_unsafe: bool, restricted: Callable[[bytes], Any],
                fail: Callable[[str], Exception], unreadable: str) -> Any:
    """``restricted(data)``; or, with ``allow_unsafe`` (a trusted file only), plain
    :func:`pickle.loads`, whose failure raises ``fail(f"{unreadable} (ErrorType: message)")``."""
    if not allow_unsafe:
        return restricted(data)
    try:
        return pickle.loads(data)
    except Exception as e:
        raise fail(f"{unreadable} ({type(e).__name__}: {str(e)[:200]})") from e


def first_state_item(data: bytes, module: str, name: str) -> tuple[Any, Any] | None:
    """The first key and value a pickle sets in the state of the object it opens with, when it
    opens as ``fastdcp.format.metadata_emit`` writes: PROTO, an optional FRAME, class
    ``module.name`` (``STACK_GLOBAL`` of strings, memoised or not), ``EMPTY_TUPLE NEWOBJ
    EMPTY_DICT``, then two strings and ``SETITEM``. None for anything else; never raises."""
    try:
        return _first_state_item(data, module, name)
    except Exception:  # noqa: BLE001 - garbage in, None out
        return None


def _first_state_item(data: bytes, module: str, name: str) -> tuple[Any, Any] | None:
    if len(data) < 2 or data[0] != pickle.PROTO[0] or not 2 <= data[1] <= 5:
        return None
    p = 2
    stack: list[Any] = []
    memo: list[Any] = []
    n = len(data)
    for _ in range(64):  # the opening is a dozen opcodes
        if p >= n:
            return None
        op = data[p : p + 1]
        p += 1
        if op == pickle.FRAME:
            p += 8
        elif op in (pickle.SHORT_BINUNICODE, pickle.BINUNICODE):
            if op == pickle.SHORT_BINUNICODE:
                if p >= n:
                    return None
                length, p = data[p], p + 1
            else:
                (length,), p = struct.unpack_from("<I", data, p), p + 4
            if p + length > n:
                return None
            stack.append(data[p : p + length].decode("utf-8", "surrogatepass"))
            p += length
        elif op == pickle.MEMOIZE:
            memo.append(stack[-1])
        elif op == pickle.BINGET:
            stack.append(memo[data[p]])
            p += 1
        elif op == pickle.LONG_BINGET:
            stack.append(memo[struct.unpack_from("<I", data, p)[0]])
            p += 4
        elif op == pickle.STACK_GLOBAL:
            global_name, global_module = stack.pop(), stack.pop()
            stack.append(("global", global_module, global_name))
        elif op == pickle.EMPTY_TUPLE:
            stack.append(())
        elif op == pickle.NEWOBJ:
            args, cls = stack.pop(), stack.pop()
            if cls != ("global", module, name) or args != ():
                return None
            stack.append("metadata")  # (a marker: a pushed string equal to it passes too)
        elif op == pickle.EMPTY_DICT:
            stack.append({})
        elif op == pickle.SETITEM:
            if len(stack) != 4 or stack[:2] != ["metadata", {}]:
                return None
            return stack[2], stack[3]
        else:
            return None
    return None
