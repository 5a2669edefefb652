"""Restricted pickle reading: one set of limits for every pickle a reader of ours opens.

The formats we read that are pickles, any of them possibly hostile:

* CUDA memory snapshots, read by :mod:`workbench.memory.plainpickle`, a plain-data machine of our own (it
  never calls ``pickle``; it checks the memo limit itself and hashes nothing but strings);
* the ``data.pkl`` of a ``torch.save`` archive (a DCP tensor item), read by
  :mod:`workbench.checkpoint.directread` through the C ``pickle.Unpickler``;
* DCP's ``.metadata``, read by :mod:`workbench.checkpoint.safeload` through the C ``pickle.Unpickler``;
* a ``.pt`` file's ``data.pkl``, read by torch's own ``weights_only`` unpickler (its allow-list), after
  :func:`scan` (:func:`workbench.checkpoint.safeload.read_torch_file`).

Each has an allow-list of what it may name (:class:`PickleFormat`). An allow-list stops code from running;
it does not stop a pickle of plain data that is built to hurt the reader:

* a memo index far past the end (``LONG_BINPUT 2**32-1``): the C unpickler grows its memo to twice the
  index, 64 GiB asked for by a 10-byte file;
* a tuple nested 10**6 deep used as a dict key or set member: hashing it recurses in C with no recursion
  guard, and the process dies of a stack overflow (a thread of the Jupyter server takes the server with it);
* shared tuples ``t[k] = (t[k-1], t[k-1])``: 60 opcodes whose hash (or repr, or comparison) takes 2**60 steps;
* lengths that claim more than the file holds, opcodes that call things (EXT, PERSID), a truncated stream.

So :func:`scan` reads the opcode stream once, in time linear in its length, before ``load()`` sees it.
It models the stack, the marks and the memo with abstract values (0 for a leaf: a number, string, bytes,
``None``, a global; otherwise a node number) and enforces the limits in :data:`LIMITS`:

* **memo**: a slot index may not exceed the slots in use plus the bytes left (each slot needs an opcode
  to fill it), and a GET must name a filled slot;
* **depth**: a node nests at most ``max_depth`` containers or objects deep;
* **expanded size**: a node counts every object it reaches as often as it reaches it (shared parts again
  each time), which is what hashing, comparing, printing or walking it costs; at most
  ``work_per_byte`` times the file's bytes (plus a small floor);
* **lengths** fit in the bytes left; **opcodes** are the format's; the stream ends with STOP and one object.

Depth and expanded size are known exactly when a node is built, because a pickle writer finishes a
container before it puts it into another: a node becomes *sealed* when it becomes a child, and a
file that changes a sealed node (which pickle never writes, and which a cycle needs) is refused. So the
sizes never go stale and no cycle can form.

:class:`RestrictedUnpickler` is the C ``pickle.Unpickler`` with the scan run before ``load()`` and
``find_class`` held to the format's allow-list. Every refusal is an :class:`UnsafePickle`: a ``ValueError``
whose message is one line, names no bytes of the file, and leaves naming the file to the caller.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Limits", "LIMITS", "PickleFormat", "UnsafePickle", "PickleTruncated", "PickleRefused", "scan",
           "RestrictedUnpickler", "check_memo_index", "skip_padding", "dotted_name"]


class UnsafePickle(ValueError):
    """A pickle that a reader refuses: ``problem`` is one line that names no bytes of the file."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(problem)


class PickleTruncated(UnsafePickle):
    """The stream ends before its STOP (or inside an opcode's argument)."""


class PickleRefused(UnsafePickle):
    """The stream asks for something the format's allow-list does not hold (an opcode or a global)."""


@dataclass(frozen=True)
class Limits:
    """What one pickle may ask of a reader (see the module docstring)."""

    max_depth: int = 100
    work_per_byte: int = 64
    work_floor: int = 1 << 16

    def max_expanded(self, nbytes: int) -> int:
        return self.work_per_byte * nbytes + self.work_floor


LIMITS = Limits()


def check_memo_index(idx: int, in_use: int, remaining: int, at: int) -> None:
    """Refuse a memo slot that the rest of the file could not have filled honestly (the memo bomb)."""
    if idx > in_use + remaining:
        raise UnsafePickle(f"puts memo slot {idx} at byte {at}, past the {in_use} slots in use and the "
                           f"{remaining} bytes left (a memo that large would take {8 * idx:,} bytes)")


# Opcode byte -> name, for the allow-lists and messages
_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}

# Padding: runs of opcode pairs that do nothing (push a constant or duplicate the top, then POP; MARK
# then POP_MARK) and of PROTO. No writer emits them, and one loop turn per opcode would make padding the
# slowest thing to read (a 40 MB file of DUP POP took minutes), so a reader skips a run at once:
# :func:`skip_padding`. DUP POP is a no-op only while the stack is not empty.
_PAD = rb"[N\x88\x89)\]}\x8f]0|\(1|K[\x00-\xff]0|M[\x00-\xff]{2}0|J[\x00-\xff]{4}0|\x80[\x00-\x05]"
_PADDING = (re.compile(rb"(?:" + _PAD + rb")++"), re.compile(rb"(?:" + _PAD + rb"|20)++"))
_PAIRS = frozenset({b"N0", b"\x880", b"\x890", b")0", b"]0", b"}0", b"\x8f0", b"(1", b"20"})


def skip_padding(buf: Any, p: int, stack_nonempty: bool) -> int:
    """Where a run of padding that starts at ``p`` ends (``p`` if none starts there).

    One pair repeated is compared a doubling block at a time (memory speed, ~1 GB/s); a mix of pairs is
    matched by one possessive regular expression (~60 MB/s)."""
    pair = bytes(buf[p:p + 2])
    if pair in _PAIRS and (stack_nonempty or pair != b"20"):
        size = 1
        while size:
            if buf[p:p + 2 * size] == pair * size:
                p += 2 * size
                size = min(2 * size, 1 << 20)
            else:
                size //= 2
    m = _PADDING[stack_nonempty].match(buf, p)
    return m.end() if m is not None else p


_BINARY = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
    "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "SHORT_BINSTRING",
    "BINSTRING", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "LIST",
    "EMPTY_DICT", "SETITEM", "SETITEMS", "DICT", "EMPTY_SET", "ADDITEMS", "FROZENSET"})
_OBJECTS = frozenset({"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX"})


@dataclass(frozen=True)
class PickleFormat:
    """One pickle format: what it is called in messages, the opcodes it may use, the globals it may name
    (module -> names; the unpickler's ``find_class`` resolves only these), and its limits."""

    what: str
    opcodes: frozenset[str]
    globals: Mapping[str, frozenset[str]] = field(default_factory=dict)
    limits: Limits = LIMITS

    def allows(self, module: str, name: str) -> bool:
        return name in self.globals.get(module, ())


def _format_opcodes(*extra: str) -> frozenset[str]:
    return _BINARY | _OBJECTS | frozenset(extra)


# A tensor's data.pkl as torch.save writes it (protocol 2): torch's rebuild functions, storage types and
# dtypes, OrderedDict for the backward hooks, and BINPERSID for the storage it points at.
DATA_PKL_OPCODES = _format_opcodes("BINPERSID")
# DCP's .metadata (pickle's default protocol): dataclasses built with NEWOBJ/REDUCE and BUILD, no
# persistent ids.
DCP_METADATA_OPCODES = _format_opcodes()


# -- the scan ------------------------------------------------------------------------------------------

_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from

# What the scan does with each opcode: a small number per kind, tested in the order of how often DCP's
# .metadata uses them (the scan is on the checkpoint load path; one if-chain turn is ~20 ns).
(_NO, _MEMOIZE, _BINGET, _LONG_BINGET, _LEAF0, _MARK, _CALL, _BUILD, _TUPLE1, _EMPTY, _SETITEMS, _LEAF1,
 _TUPLE2, _COUNTED1, _LEAF2, _LEAF4, _TUPLE, _APPEND, _APPENDS, _BINPUT, _LONG_BINPUT, _TUPLE3, _SETITEM,
 _STACK_GLOBAL, _LEAF8, _COUNTED4, _COUNTED4S, _COUNTED8, _LIST, _DICT, _FROZENSET, _ADDITEMS, _NEWOBJ_EX,
 _BINPERSID, _POP, _POP_MARK, _DUP, _PROTO, _FRAME, _STOP, _GLOBAL) = range(41)
_LEAF_WIDTH = {_LEAF0: 1, _LEAF1: 2, _LEAF2: 3, _LEAF4: 5, _LEAF8: 9}
_KINDS = {
    "MEMOIZE": _MEMOIZE, "BINGET": _BINGET, "LONG_BINGET": _LONG_BINGET, "EMPTY_TUPLE": _LEAF0, "NONE": _LEAF0,
    "NEWTRUE": _LEAF0, "NEWFALSE": _LEAF0, "MARK": _MARK, "NEWOBJ": _CALL, "REDUCE": _CALL, "BUILD": _BUILD,
    "TUPLE1": _TUPLE1, "EMPTY_DICT": _EMPTY, "EMPTY_LIST": _EMPTY, "EMPTY_SET": _EMPTY, "SETITEMS": _SETITEMS,
    "BININT1": _LEAF1, "TUPLE2": _TUPLE2, "SHORT_BINUNICODE": _COUNTED1, "SHORT_BINBYTES": _COUNTED1,
    "SHORT_BINSTRING": _COUNTED1, "LONG1": _COUNTED1, "BININT2": _LEAF2, "BININT": _LEAF4, "TUPLE": _TUPLE,
    "APPEND": _APPEND, "APPENDS": _APPENDS, "BINPUT": _BINPUT, "LONG_BINPUT": _LONG_BINPUT, "TUPLE3": _TUPLE3,
    "SETITEM": _SETITEM, "STACK_GLOBAL": _STACK_GLOBAL, "BINFLOAT": _LEAF8, "BINUNICODE": _COUNTED4,
    "BINBYTES": _COUNTED4, "BINSTRING": _COUNTED4S, "LONG4": _COUNTED4S, "BINUNICODE8": _COUNTED8,
    "BINBYTES8": _COUNTED8, "BYTEARRAY8": _COUNTED8, "LIST": _LIST, "DICT": _DICT, "FROZENSET": _FROZENSET,
    "ADDITEMS": _ADDITEMS, "NEWOBJ_EX": _NEWOBJ_EX, "BINPERSID": _BINPERSID, "POP": _POP, "POP_MARK": _POP_MARK,
    "DUP": _DUP, "PROTO": _PROTO, "FRAME": _FRAME, "STOP": _STOP, "GLOBAL": _GLOBAL}
# (protocol 0's text opcodes other than GLOBAL are in no format: torch and DCP write protocol 2 or more)


class _Graph:
    """Nodes of the scan: depth and expanded size of each, and whether it is sealed (inside another)."""

    def __init__(self, fmt: PickleFormat, n: int):
        self.what = fmt.what
        self.max_depth = fmt.limits.max_depth
        self.max_size = fmt.limits.max_expanded(n)
        self.n = n
        self.depth = [0]  # node 0 stands for every leaf: depth 0, expanded size 1, never sealed
        self.size = [1]
        self.sealed = bytearray(1)

    def _seal(self, children: list[int], d: int, s: int, at: int) -> tuple[int, int]:
        """Seal ``children`` into a node of depth ``d`` + 1 and size ``s`` so far: its new depth and size."""
        depth, size, sealed = self.depth, self.size, self.sealed
        for c in children:
            if c:
                sealed[c] = 1
                if depth[c] > d:
                    d = depth[c]
                s += size[c]
            else:
                s += 1
        if d >= self.max_depth or s > self.max_size:
            self.limit(d + 1, s, at)
        return d + 1, s

    def node(self, children: list[int], at: int) -> int:
        """A new node holding ``children``, each of which is sealed."""
        d, s = self._seal(children, 0, 1, at)
        self.depth.append(d)
        self.size.append(s)
        self.sealed.append(0)
        return len(self.depth) - 1

    def add(self, target: int, children: list[int], at: int, what: str) -> None:
        """``children`` go into ``target`` (APPEND, SETITEM, BUILD ...)."""
        depth, size, sealed = self.depth, self.size, self.sealed
        if not target:
            raise UnsafePickle(f"uses {what} at byte {at} on a value that is not a container or an object")
        if sealed[target]:
            raise UnsafePickle(f"changes an object with {what} at byte {at} after putting it into another "
                               "(no pickle writer does that; it is how a cycle is built)")
        if target in children:
            raise UnsafePickle(f"puts an object into itself with {what} at byte {at}")
        depth[target], size[target] = self._seal(children, depth[target] - 1, size[target], at)

    def limit(self, d: int, s: int, at: int) -> None:
        """Raise for whichever limit ``d`` (depth) or ``s`` (expanded size) passes."""
        if d > self.max_depth:
            raise UnsafePickle(f"nests objects more than {self.max_depth} deep (at byte {at}); {self.what} "
                               "is never that deep")
        if s > self.max_size:
            raise UnsafePickle(f"builds an object at byte {at} that reaches {s:,} others (shared ones counted "
                               f"each time they are reached), more than the {self.max_size:,} allowed for a "
                               f"file of {self.n:,} bytes")


def scan(data: bytes | bytearray | memoryview, fmt: PickleFormat) -> None:
    """Check one pickle against ``fmt`` and its limits, in one linear pass; raise :class:`UnsafePickle`.

    Nothing is built: a value is a leaf (0) or a node number, with each node's depth and expanded size."""
    buf = bytes(data)
    n = len(buf)
    kind = [0] * 256
    leaf = [0] * 256  # the bytes taken by an opcode that pushes a number, None, a bool or ()
    for c, name in _NAMES.items():
        if name in fmt.opcodes:
            kind[c] = _KINDS[name]
            leaf[c] = _LEAF_WIDTH.get(kind[c], 0)
    # the kinds tested most often, as locals (a global lookup per test costs more than the test)
    MEMOIZE, BINGET, LONG_BINGET, MARK, CALL, BUILD, TUPLE1, EMPTY, SETITEMS, APPENDS, ADDITEMS, TUPLE2, \
        COUNTED1, TUPLE = (_MEMOIZE, _BINGET, _LONG_BINGET, _MARK, _CALL, _BUILD, _TUPLE1, _EMPTY, _SETITEMS,
                           _APPENDS, _ADDITEMS, _TUPLE2, _COUNTED1, _TUPLE)
    g = _Graph(fmt, n)
    node, add = g.node, g.add
    depth, size, sealed = g.depth, g.size, g.sealed
    max_depth, max_size = g.max_depth, g.max_size
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    p = at = 0
    # Short stacks, empty marks, missing memo slots and the end of the data show up as IndexError or
    # KeyError from the plain operations below; the handler at the end says which.
    try:
        while True:
            at = p
            c = buf[p]
            w = leaf[c]
            if w:
                stack.append(0)
                p += w
                continue
            k = kind[c]
            if k == MEMOIZE:
                memo[len(memo)] = stack[-1]
                p += 1
            elif k == BINGET:
                stack.append(memo[buf[p + 1]])
                p += 2
            elif k == LONG_BINGET:
                stack.append(memo[_U32(buf, p + 1)[0]])
                p += 5
            elif k == MARK:
                marks.append(len(stack))
                p += 1
            elif k == CALL:  # REDUCE, NEWOBJ: the result holds what it was made from (inline: hot)
                c = stack.pop()
                f = stack[-1]
                if c:
                    sealed[c] = 1
                    d, s = depth[c], size[c] + 2
                else:
                    d, s = 0, 3
                if f:  # a callable that is itself a node (a REDUCE result called again)
                    sealed[f] = 1
                    d, s = max(d, depth[f]), s + size[f] - 1
                if d >= max_depth or s > max_size:
                    g.limit(d + 1, s, at)
                depth.append(d + 1)
                size.append(s)
                sealed.append(0)
                stack[-1] = len(depth) - 1
                p += 1
            elif k == BUILD:  # the state goes into the object (inline: hot)
                c = stack.pop()
                t = stack[-1]
                if not t or sealed[t] or c == t:
                    add(t, [c], at, "BUILD")  # says what is wrong
                if c:
                    sealed[c] = 1
                    d, s = depth[c] + 1, size[t] + size[c]
                    if d > depth[t]:
                        depth[t] = d
                else:
                    d, s = depth[t], size[t] + 1
                if d > max_depth or s > max_size:
                    g.limit(d, s, at)
                size[t] = s
                p += 1
            elif k == TUPLE1:
                c = stack[-1]
                if c:
                    sealed[c] = 1
                    d, s = depth[c] + 1, size[c] + 1
                    if d > max_depth or s > max_size:
                        g.limit(d, s, at)
                    else:
                        depth.append(d)
                        size.append(s)
                        sealed.append(0)
                        stack[-1] = len(depth) - 1
                else:
                    depth.append(1)
                    size.append(2)
                    sealed.append(0)
                    stack[-1] = len(depth) - 1
                p += 1
            elif k == EMPTY:
                depth.append(1)
                size.append(1)
                sealed.append(0)
                stack.append(len(depth) - 1)
                p += 1
            elif k == SETITEMS or k == APPENDS or k == ADDITEMS:
                m = marks.pop()
                items = stack[m:]
                del stack[m:]
                t = stack[-1]
                if not t or sealed[t] or t in items:
                    add(t, items, at, _NAMES[c])  # says what is wrong
                d, s = depth[t] - 1, size[t] + len(items)
                for c in items:  # (inline: hot)
                    if c:
                        sealed[c] = 1
                        if depth[c] > d:
                            d = depth[c]
                        s += size[c] - 1
                if d >= max_depth or s > max_size:
                    g.limit(d + 1, s, at)
                depth[t] = d + 1
                size[t] = s
                p += 1
            elif k == TUPLE2:
                items = stack[-2:]
                if len(items) < 2:
                    raise IndexError
                del stack[-2:]
                if items[0] or items[1]:
                    stack.append(node(items, at))
                else:  # two leaves (inline: hot)
                    depth.append(1)
                    size.append(3)
                    sealed.append(0)
                    stack.append(len(depth) - 1)
                p += 1
            elif k == COUNTED1:
                p += 2 + buf[p + 1]
                stack.append(0)
            elif k == TUPLE or k == _LIST or k == _DICT or k == _FROZENSET:
                m = marks.pop()
                items = stack[m:]
                del stack[m:]
                stack.append(node(items, at) if items or k != _TUPLE else 0)
                p += 1
            elif k == _APPEND:
                item = stack.pop()
                add(stack[-1], [item], at, "APPEND")
                p += 1
            elif k == _BINPUT or k == _LONG_BINPUT:
                if k == _BINPUT:
                    idx, p = buf[p + 1], p + 2
                else:
                    idx, p = _U32(buf, p + 1)[0], p + 5
                if p > n:
                    raise IndexError
                if idx not in memo:
                    check_memo_index(idx, len(memo), n - p, at)
                memo[idx] = stack[-1]
            elif k == _TUPLE3:
                items = stack[-3:]
                if len(items) < 3:
                    raise IndexError
                del stack[-3:]
                stack.append(node(items, at))
                p += 1
            elif k == _SETITEM:
                if len(stack) < 3:
                    raise IndexError
                items = stack[-2:]
                del stack[-2:]
                add(stack[-1], items, at, "SETITEM")
                p += 1
            elif k == _STACK_GLOBAL:
                if len(stack) < 2:
                    raise IndexError
                del stack[-2:]
                stack.append(0)
                p += 1
            elif k == _COUNTED4 or k == _COUNTED4S or k == _COUNTED8:
                width = 8 if k == _COUNTED8 else 4
                if p + 1 + width > n:
                    raise IndexError
                length = (_U64(buf, p + 1)[0] if k == _COUNTED8 else _I32(buf, p + 1)[0] if k == _COUNTED4S
                          else _U32(buf, p + 1)[0])
                p += 1 + width
                if length < 0 or length > n - p:
                    raise PickleTruncated(f"claims {length:,} bytes at byte {at}, more than the {n - p:,} "
                                          "left in the file")
                p += length
                stack.append(0)
            elif k == _NEWOBJ_EX:
                if len(stack) < 3:
                    raise IndexError
                items = stack[-3:]
                del stack[-3:]
                stack.append(node(items, at))
                p += 1
            elif k == _BINPERSID:
                stack[-1] = node([stack[-1]], at)
                p += 1
            elif k == _POP:
                if stack:
                    stack.pop()
                    p = skip_padding(buf, p + 1, bool(stack))
                else:
                    marks.pop()
                    p += 1
            elif k == _POP_MARK:
                del stack[marks.pop():]
                p += 1
            elif k == _DUP:
                stack.append(stack[-1])
                p += 1
            elif k == _PROTO:
                p += 2
            elif k == _FRAME:
                p += 9
            elif k == _STOP:
                if len(stack) != 1 or marks:
                    raise UnsafePickle(f"stops at byte {at} with {len(stack)} objects on the stack instead of one")
                return
            elif k == _GLOBAL:  # its name is judged by find_class: the whole stream is scanned first
                _, p = _line(buf, p + 1, at, "GLOBAL")
                _, p = _line(buf, p, at, "GLOBAL")
                stack.append(0)
            else:
                c = buf[at]
                if c in _NAMES:
                    raise PickleRefused(f"has the opcode {_NAMES[c]} at byte {at}, which {fmt.what} never holds")
                raise UnsafePickle(f"has byte 0x{c:02x} at offset {at}, which is no pickle opcode")
    except (IndexError, KeyError, struct.error):
        if p >= n or at >= n or _cut_short(buf, at):
            raise PickleTruncated("ends early (no STOP opcode)") from None
        name = _NAMES.get(buf[at], "?")
        if name in ("BINGET", "LONG_BINGET", "GET"):
            raise UnsafePickle(f"reads a memo slot at byte {at} that was never filled") from None
        raise UnsafePickle(f"has {name} at byte {at} without the values or MARK it needs") from None


def _cut_short(buf: bytes, at: int) -> bool:
    """Whether the opcode at ``at`` is cut off by the end of the data (a truncated file, not a malformed one),
    as the stdlib's opcode decoder reads it. Asked on the error path only."""
    import pickletools

    try:
        next(pickletools.genops(buf[at:]))
    except StopIteration:
        return True
    except ValueError as e:
        return any(w in str(e) for w in ("remain", "not enough data", "no newline"))
    return False


def _line(buf: bytes, p: int, at: int, name: str) -> tuple[bytes, int]:
    end = buf.find(b"\n", p)
    if end < 0:
        raise PickleTruncated(f"ends early (inside {name} at byte {at})")
    return buf[p:end], end + 1


class RestrictedUnpickler(pickle.Unpickler):
    """The C unpickler, held to one :class:`PickleFormat`: :func:`scan` runs before ``load()``, and
    ``find_class`` admits only the format's globals, then asks :meth:`resolve` for what stands for them.

    Subclasses set ``format`` and may override :meth:`resolve` (default: the real module attribute) and
    :meth:`refuse` (the exception raised for a name outside the allow-list)."""

    format: PickleFormat

    def __init__(self, file: Any, *args: Any, **kwargs: Any):
        if isinstance(file, io.BytesIO):
            self._data = file.getvalue()[file.tell():]
        else:
            self._data = file.read()
            file = io.BytesIO(self._data)
        super().__init__(file, *args, **kwargs)

    def load(self) -> Any:
        scan(self._data, self.format)
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        if not self.format.allows(module, name):
            raise self.refuse(module, name)
        return self.resolve(module, name)

    def resolve(self, module: str, name: str) -> Any:
        return super().find_class(module, name)

    def refuse(self, module: str, name: str) -> Exception:
        return PickleRefused(f"refers to {dotted_name(module, name)}, which {self.format.what} never does")


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}(?:\.[A-Za-z_][A-Za-z0-9_]{0,99}){1,9}")


def dotted_name(module: str, name: str) -> str:
    """``module.name`` for a message when it is one (identifiers and dots only), else words: a refused
    name is the file's own bytes, which may hold terminal escapes or anything else."""
    text = f"{module}.{name}"
    return text if _DOTTED.fullmatch(text) else "a name that is no Python identifier"
