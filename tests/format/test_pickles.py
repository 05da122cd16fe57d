"""The one mechanism every checkpoint pickle is read through (fastdcp/format/pickles.py): the opcode
scan under a format's rules (each refusal, with the message the rules give it, and the fast path
agreeing with the checked loop), the restricted unpickler resolving only through the functions it
is given, the trusted/untrusted choice, and a pickle's opening read without unpickling it."""

from __future__ import annotations

import collections
import pickle
import pickletools

import pytest

from fastdcp.format.pickles import (
    ALL_OPCODES,
    OpcodeRules,
    RestrictedUnpickler,
    first_state_item,
    load_pickle,
    opcode_codes,
    scan_opcodes,
)


class Refused(Exception):
    pass


MESSAGES = {reason: reason + " {at}" for reason in ("invalid", "refused", "frame", "line", "memo_text")}
MESSAGES.update(memo="memo {index} at {at} of {n}", length="length {length} at {at}, {follow} follow",
                truncated="truncated at {n}", trailing="trailing after STOP")


def rules(**overrides) -> OpcodeRules:
    options = dict(allowed=ALL_OPCODES - opcode_codes(["EXT1"]), memo_checked=opcode_codes(["LONG_BINPUT", "PUT"]),
                   max_line=16, check_frames=True, trailing=True, error=Refused, messages=MESSAGES)
    options.update(overrides)
    return OpcodeRules(**options)


def refusal(data: bytes, **overrides) -> str:
    with pytest.raises(Refused) as info:
        scan_opcodes(data, rules(**overrides))
    return str(info.value)


def test_real_pickles_pass_every_protocol():
    value = {"a": [1, 2.5, "é" * 300, b"x" * 1000, (None, True)], "b": list(range(300))}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        scan_opcodes(pickle.dumps(value, protocol=protocol), rules(max_line=1 << 16))


@pytest.mark.parametrize("data, message", [
    (b"\x80\x02\xff.", "invalid 2"),  # no such opcode
    (b"\x80\x02\x82\x01.", "refused 2"),  # EXT1, not allowed by these rules
    (b"\x80\x02Nr\xff\xff\x00\x00.", "memo 65535 at 3 of 9"),  # LONG_BINPUT past the pickle's size
    (b"\x80\x02p99\n.", "memo 99 at 2 of 7"),  # PUT (decimal) past it
    (b"\x80\x02pxx\n.", "memo_text 2"),
    (b"\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00N.", "frame 2"),
    (b"\x80\x02I" + b"9" * 20 + b"\n.", "line 2"),  # longer than max_line
    (b"\x80\x02X\xff\x00\x00\x00abc.", "length 255 at 2, 4 follow"),
    (b"\x80\x02N", "truncated at 3"),
])
def test_each_refusal_says_what_the_rules_say(data, message):
    assert refusal(data) == message


def test_the_rules_choose_what_is_checked():
    scan_opcodes(b"\x80\x02N.junk", rules())  # trailing bytes ignored
    assert refusal(b"\x80\x02N.junk", trailing=False) == "trailing after STOP"
    scan_opcodes(b"\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00N.", rules(check_frames=False))
    scan_opcodes(b"\x80\x02\x82\x01N.", rules(allowed=ALL_OPCODES))
    assert refusal(b"\x80\x02q\x09N.", memo_checked=opcode_codes(["BINPUT"])) == "memo 9 at 2 of 6"
    scan_opcodes(b"\x80\x02q\x09N.", rules())  # BINPUT unchecked here


def test_the_fast_path_stops_where_an_argument_is_cut():
    """Opcodes the fast path skips (fixed-size arguments) cut off at the end: truncated, never
    read past the data."""
    for data in (b"\x80\x02K", b"\x80\x02M\x01", b"\x80\x02J\x01\x02\x03", b"\x80\x02G" + b"\0" * 7):
        assert refusal(data) == f"truncated at {len(data)}"


def test_every_opcode_of_pickletools_has_a_kind():
    """The table is pickletools' own: each opcode there is allowed by ALL_OPCODES, nothing else."""
    assert ALL_OPCODES == frozenset(ord(op.code) for op in pickletools.opcodes)


def test_the_unpickler_resolves_only_through_the_functions_given():
    asked = []

    def find_global(module, name):
        asked.append((module, name))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise Refused(f"{module}.{name}")

    def no_pid(pid):
        raise Refused(f"persistent id {pid!r}")

    ordered = collections.OrderedDict(a=1)
    assert RestrictedUnpickler(pickle.dumps(ordered, protocol=4), find_global, no_pid).load() == ordered
    with pytest.raises(Refused, match="os.system"):
        RestrictedUnpickler(b"\x80\x02cos\nsystem\n.", find_global, no_pid).load()
    with pytest.raises(Refused, match="persistent id '7'"):
        RestrictedUnpickler(b"P7\n.", find_global, no_pid).load()
    assert asked == [("collections", "OrderedDict"), ("os", "system")]


def test_load_pickle_is_restricted_unless_unsafe_is_allowed():
    data = pickle.dumps([1, 2])
    assert load_pickle(data, allow_unsafe=False, restricted=lambda d: "restricted", fail=Refused,
                       unreadable="bad") == "restricted"
    assert load_pickle(data, allow_unsafe=True, restricted=lambda d: "restricted", fail=Refused,
                       unreadable="bad") == [1, 2]
    with pytest.raises(Refused, match=r"^not a pickle \(UnpicklingError: ") as info:
        load_pickle(b"\xff", allow_unsafe=True, restricted=lambda d: None, fail=Refused, unreadable="not a pickle")
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)


class Opening:
    pass


Opening.__module__ = "my.module"


def test_first_state_item_reads_an_opening_without_unpickling():
    def opening(key, value, memoised=True, frame=False):
        strings = b"\x8c\x09my.module" + (b"\x94" if memoised else b"") + b"\x8c\x07Opening" + (
            b"\x94" if memoised else b"")
        body = strings + b"\x93)\x81}" + b"\x8c" + bytes([len(key)]) + key + b"\x8c" + bytes([len(value)]) + value + b"s"
        framed = b"\x95" + len(body).to_bytes(8, "little") + body if frame else body
        return b"\x80\x04" + framed

    assert first_state_item(opening(b"k", b"v"), "my.module", "Opening") == ("k", "v")
    assert first_state_item(opening(b"k", b"v", memoised=False, frame=True), "my.module", "Opening") == ("k", "v")
    assert first_state_item(opening(b"k", b"v"), "my.module", "Other") is None
    for data in (b"", b"\x80", b"\x80\x04\xff", opening(b"k", b"v")[:20], b"\x80\x04h\x05", pickle.dumps([1])):
        assert first_state_item(data, "my.module", "Opening") is None  # never raises
