"""Pickle opcodes, written by hand: the hostile pickles no ``pickle.dumps`` would make.

Each helper returns the bytes of one opcode with its argument. ``wrap`` puts a hostile value where a
torch memory snapshot or a DCP ``.metadata`` keeps its data, so a reader that sniffs the first bytes
(``device_traces``, ``segments``) takes the file for what it claims to be before it meets the attack.
"""

from __future__ import annotations

import struct

PROTO4 = b"\x80\x04"
PROTO2 = b"\x80\x02"
STOP = b"."
MARK = b"("
TUPLE = b"t"
TUPLE1 = b"\x85"
EMPTY_TUPLE = b")"
EMPTY_DICT = b"}"
EMPTY_LIST = b"]"
EMPTY_SET = b"\x8f"
ADDITEMS = b"\x90"
FROZENSET = b"\x91"
SETITEM = b"s"
SETITEMS = b"u"
APPEND = b"a"
APPENDS = b"e"
LIST = b"l"
DICT = b"d"
NONE = b"N"
NEWTRUE = b"\x88"
DUP = b"2"
POP = b"0"
POP_MARK = b"1"
MEMOIZE = b"\x94"
REDUCE = b"R"
BUILD = b"b"
STACK_GLOBAL = b"\x93"
NEWOBJ = b"\x81"
NEWOBJ_EX = b"\x92"
OBJ = b"o"
BINPERSID = b"Q"


def global_(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def inst(module: str, name: str) -> bytes:
    return b"i" + module.encode() + b"\n" + name.encode() + b"\n"


def persid(pid: str) -> bytes:
    return b"P" + pid.encode() + b"\n"


def ext1(code: int) -> bytes:
    return b"\x82" + bytes([code & 0xFF])


def s(text: str | bytes) -> bytes:
    """A string: SHORT_BINUNICODE or BINUNICODE (bytes are taken as they are: possibly not UTF-8)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text  # a lone surrogate: not UTF-8
    if len(data) < 256:
        return b"\x8c" + bytes([len(data)]) + data
    return b"X" + struct.pack("<I", len(data)) + data


def binunicode_claiming(n: int, data: bytes = b"") -> bytes:
    return b"X" + struct.pack("<I", n) + data


def binunicode8_claiming(n: int, data: bytes = b"") -> bytes:
    return b"\x8d" + struct.pack("<Q", n) + data


def binbytes8_claiming(n: int, data: bytes = b"") -> bytes:
    return b"\x8e" + struct.pack("<Q", n) + data


def frame_claiming(n: int) -> bytes:
    return b"\x95" + struct.pack("<Q", n)


def long4_claiming(n: int, data: bytes = b"") -> bytes:
    return b"\x8b" + struct.pack("<i", n) + data


def binstring_claiming(n: int, data: bytes = b"") -> bytes:
    return b"T" + struct.pack("<i", n) + data


def i(n: int) -> bytes:
    """An int: BININT1/BININT2/BININT or LONG1."""
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def binput(n: int) -> bytes:
    return b"q" + bytes([n]) if n < 256 else b"r" + struct.pack("<I", n)


def binget(n: int) -> bytes:
    return b"h" + bytes([n]) if n < 256 else b"j" + struct.pack("<I", n)


def wrap(value: bytes, key: str = "device_traces", proto: bytes = PROTO4) -> bytes:
    """``{"segments": [], key: <value>}``: the header a snapshot reader sniffs, then the attack."""
    return proto + EMPTY_DICT + s("segments") + EMPTY_LIST + SETITEM + s(key) + value + SETITEM + STOP


# --------------------------------------------------------------------------------------------------
# attacks (each returns the value's opcodes; ``wrap`` makes a whole file of it)
# --------------------------------------------------------------------------------------------------

def evil_system(command: str) -> bytes:
    """GLOBAL posix.system + REDUCE: run a shell command."""
    return global_("posix", "system") + s(command) + TUPLE1 + REDUCE


def evil_stack_global(command: str) -> bytes:
    """STACK_GLOBAL builtins.exec (protocol 4) + REDUCE."""
    return s("builtins") + s("exec") + STACK_GLOBAL + s(f"import os; os.system({command!r})") + TUPLE1 + REDUCE


def evil_open(path: str) -> bytes:
    """builtins.open(path, 'w') through REDUCE: proof by a created file."""
    return global_("builtins", "open") + s(path) + s("w") + b"\x86" + REDUCE


def evil_inst(command: str) -> bytes:
    """INST (protocol 0): os.system through the instantiation opcode."""
    return MARK + s(command) + inst("os", "system")


def evil_obj(command: str) -> bytes:
    return MARK + global_("os", "system") + s(command) + OBJ


def evil_newobj() -> bytes:
    return global_("collections", "OrderedDict") + EMPTY_TUPLE + NEWOBJ


def evil_build() -> bytes:
    """BUILD on a plain dict with a __setstate__-like state: no class, but a state to apply."""
    return EMPTY_DICT + EMPTY_DICT + s("__class__") + NONE + SETITEM + BUILD


def evil_persid() -> bytes:
    return persid("0")


def evil_binpersid() -> bytes:
    return s("storage") + BINPERSID


def evil_ext() -> bytes:
    return ext1(1)


def deep_tuple(depth: int) -> bytes:
    """A tuple nested ``depth`` deep: hashing or comparing it recurses in C."""
    return EMPTY_TUPLE + TUPLE1 * depth


def deep_list(depth: int) -> bytes:
    return EMPTY_LIST * depth + APPEND * (depth - 1)


def deep_dict(depth: int) -> bytes:
    return (EMPTY_DICT + i(0)) * (depth - 1) + EMPTY_DICT + SETITEM * (depth - 1)


def deep_tuple_key(depth: int) -> bytes:
    """``{<tuple nested depth deep>: None}``: the dict hashes its key (row 1 of issue 27)."""
    return EMPTY_DICT + deep_tuple(depth) + NONE + SETITEM


def deep_set_member(depth: int) -> bytes:
    return EMPTY_SET + MARK + deep_tuple(depth) + ADDITEMS


def laughs(levels: int, fan: int = 10) -> bytes:
    """A tuple of ``fan`` references to the level below, ``levels`` deep, used as a dict key: a few
    hundred bytes whose hash (tuples do not cache it) visits fan**levels elements."""
    out = EMPTY_TUPLE + binput(0)
    for level in range(1, levels + 1):
        out += MARK + binget(level - 1) * fan + TUPLE + binput(level)
    return EMPTY_DICT + out + NONE + SETITEM


def memo_bomb(puts: int = 40, gap: int = 2**24 - 1) -> bytes:
    """LONG_BINPUT to memo slots far past the memo's size: a reader that grows a list to the index asks
    for ``puts * gap`` slots from ``5 * puts`` bytes (row 2)."""
    out = NONE
    idx = 0
    for _ in range(puts):
        idx += gap
        out += b"r" + struct.pack("<I", idx & 0xFFFFFFFF)
    return out


def memo_get_far() -> bytes:
    return NONE + binput(0) + b"j" + struct.pack("<I", 2**31 - 1)


def dup_pop(n_bytes: int) -> bytes:
    """DUP/POP padding: ``n_bytes`` of opcodes that do nothing (row 12: a 40 MB one did not finish)."""
    return NONE + (DUP + POP) * (n_bytes // 2)


def mark_pop(n_bytes: int) -> bytes:
    return NONE + (MARK + POP_MARK) * (n_bytes // 2)


def many_marks(n: int) -> bytes:
    """``n`` MARKs left open: a mark stack that grows with the file, never closed."""
    return MARK * n + NONE


def self_reference() -> bytes:
    """A list that contains itself, used as a dict key (unhashable) and walked (cycles)."""
    return EMPTY_DICT + EMPTY_LIST + binput(0) + binget(0) + APPEND + NONE + SETITEM
