"""The plain-data pickle machine: a snapshot's opcodes read without unpickling, streamed into rows.

**Read without unpickling.** A pickle may name any callable (``os.system``) and call it, so this module
never calls ``pickle.load``. It runs its own small stack machine that knows only the plain-data
opcodes (dicts, lists, tuples, strings, bytes, numbers, ``None``, the memo). An opcode that would
import or call something (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, EXT, PERSID) stops the
read with one line that names what the file refers to; nothing in the file is executed.

**Streamed.** A recording of a long run is gigabytes; its tree of Python dicts would be ten times that.
The machine keeps only what a timeline needs: each trace entry becomes one row of five integers
(action, addr, size, time_us, stack id) as it joins its device's list, and each traceback becomes a
stack id into a table of unique stacks (torch shares frame dicts between tracebacks, so the pickle
memoizes them and later entries refer back with GET: the memo is kept, but an entry's slot holds a
marker and a traceback's slot its stack id). Most entries are matched in one step by a regular
expression for the exact bytes pickle writes for ``{action: GET, addr: int, ..., frames: [GET, ...]}``;
anything else (a first-seen frame, a FRAME header) goes through the general opcode loop, which gives
the same result. The file is memory-mapped and the pages already read are handed back to the OS.

**Bounded by the file.** A hostile file must not cost more than its size (:mod:`workbench.safepickle` holds
the limits every pickle reader shares):

- the memo grows only as far as the bytes left could fill it (``LONG_BINPUT 2**24`` from a 100-byte file
  asked for gigabytes);
- only string keys are kept (all torch writes), and set members are dropped: nothing is hashed but
  strings, so a tuple nested 10**6 deep as a key cannot recurse in C (it killed the process), and
  colliding numeric keys cannot make a dict quadratic; nothing a timeline reads is lost;
- nothing built is walked recursively, printed or compared; the walks that are done (a traceback list
  to its stack) count against a budget in proportion to the file;
- padding (a run of DUP POP, NONE POP, MARK POP_MARK, PROTO) is skipped with one regular expression, and
  the opcode loop is split so that no opcode waits behind more than ~15 tests; the fast path backs off
  where it keeps failing and compiles at most a few dozen entry layouts.
"""

from __future__ import annotations

import codecs
import mmap
import re
import struct
from typing import Any, Callable

from workbench.memory.traces import _ACTIONS, _KEPT, _OOM, _FrameRef, _Stacks, _StackRef, _Trace
from workbench.safepickle import LIMITS, UnsafePickle, check_memo_index, dotted_name, skip_padding

__all__: list[str] = []


class _Refused(Exception):
    """The file asks for something that is not plain data (the message says what)."""


class _Damaged(Exception):
    """The opcode stream is not a well-formed pickle here (the message says what)."""


class _Malformed(_Damaged):
    """A well-formed pickle whose values are not a snapshot's (a string where a size belongs)."""


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_ENTRY = _Marker("trace entry")  # what the stack and the memo hold for a trace entry once it became a row


# regular expressions for the bytes pickle (protocol 4/5) writes for a typical trace entry:
#   EMPTY_DICT MEMOIZE MARK (key:GET value)*k SETITEMS
# with values that are ints, GETs, None/bools, an empty string, or a traceback list of GETs
_GET = rb"h.|j...."
_INT = (rb"K.|M..|J....|\x8a(?:\x00|\x01.|\x02..|\x03...|\x04....|\x05.....|\x06......|\x07.......|"
        rb"\x08........)")
_FRAMES = rb"\]\x94(?:\((?:" + _GET + rb")*+e|(?:" + _GET + rb")a)?"
_VALUE = rb"(" + _INT + rb"|" + _GET + rb"|N|\x88|\x89|\x8c\x00\x94|" + _FRAMES + rb")"
_KEY = rb"(" + _GET + rb")"
_ENTRY_PATTERNS = [re.compile(rb"\}\x94\(" + (_KEY + _VALUE) * k + rb"u", re.S) for k in (6, 5, 7, 8, 4, 9)]

_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_F64 = struct.Struct(">d").unpack_from

_OPNAMES = {0x63: "GLOBAL", 0x93: "STACK_GLOBAL", 0x52: "REDUCE", 0x62: "BUILD", 0x69: "INST", 0x6f: "OBJ",
            0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x50: "PERSID",
            0x51: "BINPERSID", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}


# opcode -> its group in the opcode loop (3: the rest, and every byte that is no opcode)
_GROUPS = (b"hj\x94}\x8cKMJ\x8a(ue]a", b"s\x95\x80.N\x88\x89)\x85\x86\x87tld0", b"qrpgX\x8dCB\x8e\x96UT12")
_GROUP = bytes(next((g for g, ops in enumerate(_GROUPS) if op in ops), 3) for op in range(256))

# opcode -> a match of the run of it that starts at a position: a run of one opcode (how a deep list or
# tuple, or a pile of MARKs or of NONEs, is written) is done in one turn of the loop, not one per byte
_RUNS = {op: re.compile(re.escape(bytes([op])) + b"*").match for op in b"]a(1\x85N2"}

# Entry layouts (key orders) kept for the fast path, and compiled at most: torch writes one or two.
_MAX_LAYOUTS = 4
_MAX_COMPILED = 64


class _NotSimple(Exception):
    """A value the fast path does not decode; the general loop takes the entry."""


def _as_int(value: Any) -> int:
    """An address, size or time as the int64 the rows hold (the messages follow "it")."""
    if value is None or isinstance(value, bool):
        return int(bool(value))
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise _Malformed("holds a number beyond 64 bits where an address, a size or a time belongs")
        return value
    raise _Malformed(f"holds a {type(value).__name__} where an address, a size or a time belongs")


class _PlainPickle:
    """One pass over a pickle's opcodes, building plain data and turning trace entries into rows.

    ``load()`` returns the top object with every device trace list left empty; the rows are in
    ``traces`` (keyed by ``id`` of the list they belong to)."""

    def __init__(self, buf: Any, stacks: _Stacks, progress: Callable[[int], None] | None = None):
        self.buf = buf
        self.stacks = stacks
        self.progress = progress
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []
        self.slots: dict[int, int] = {}        # id(dict|list) -> memo index, for containers we may compact
        self.pending: list = []                 # rows of entries completed since their list's last APPENDS
        self.traces: dict[int, _Trace] = {}
        self.plans: dict[tuple, Any] = {}       # key GET bytes of an entry -> its layout (or False)
        self.layouts: list = []                 # layouts seen, the last one used first
        self.actcache: dict[bytes, int] = {}    # GET bytes -> action code
        self.framecache: dict[bytes, _StackRef] = {}  # bytes of a traceback list of GETs -> its stack
        self.ints: dict[bytes, int] = {}        # bytes of an int opcode -> its value (addresses, sizes recur)
        self.pos = 0
        self.compiled = 0                        # entry layouts compiled (never reset: bounded by _MAX_COMPILED)
        # traceback list elements that may still be walked into stacks: each took two bytes or more to write,
        # so walking every list once stays within the file's length
        self.budget = len(buf) + LIMITS.work_floor

    # -- memo compaction ------------------------------------------------------------------------
    def _forget_caches(self) -> None:
        """A PUT overwrote a memo slot: what the caches derived from GET indices may be stale."""
        self.plans.clear()
        self.layouts.clear()
        self.actcache.clear()
        self.framecache.clear()

    def _replace(self, obj: Any, compact: Any) -> None:
        idx = self.slots.pop(id(obj), None)
        if idx is not None and idx < len(self.memo) and self.memo[idx] is obj:
            self.memo[idx] = compact

    def _entry_row(self, d: dict) -> tuple | None:
        """A trace entry dict, complete, becomes a row (None for actions a timeline does not use)."""
        action = d["action"]
        code = _ACTIONS.get(action, -1) if isinstance(action, str) else -1
        frames = d.get("frames")
        if type(frames) is list:
            # a list is walked once and its memo slot then holds the stack; one memoized twice can be
            # handed to any number of entries, so the walks count against the file's budget
            self.budget -= len(frames)
            if self.budget < 0:
                raise UnsafePickle("hands its trace entries the same traceback lists far more often than its "
                                   "size allows")
        sref = self.stacks.stack_of(frames)
        if isinstance(frames, list):
            self._replace(frames, sref)
        self._replace(d, _ENTRY)
        if code not in _KEPT:
            return None
        addr = d.get("addr", 0) if code != _OOM else 0
        return (code, _as_int(addr), _as_int(d.get("size", 0)), _as_int(d.get("time_us", 0)), sref.sid)

    def _trace_of(self, target: Any) -> _Trace:
        if not isinstance(target, list):
            raise _Damaged("appends trace entries to something that is not a list")
        trace = self.traces.get(id(target))
        if trace is None:
            trace = self.traces[id(target)] = _Trace(target)
        return trace

    def _appending(self, target: Any, items: list) -> list:
        """Items about to join a list, which is when a dict is complete (protocols 0 and 1 set a dict's
        items one SETITEM at a time): a trace entry goes to its list's rows instead, a frame dict
        becomes a frame ref. Entries the fast path read are markers whose rows wait in ``pending``."""
        k = items.count(_ENTRY)
        if k > len(self.pending):
            raise _Damaged("appends trace entries twice")
        if k and k == len(items):  # a batch of entries from the fast path: the common case
            self._trace_of(target).add(self.pending[-k:])
            del self.pending[-k:]
            return []
        waiting = iter(self.pending[len(self.pending) - k:]) if k else iter(())
        if k:
            del self.pending[-k:]
        out, rows, entries = [], [], False
        for x in items:
            if x is _ENTRY:
                rows.append(next(waiting))
                entries = True
            elif type(x) is dict and "action" in x:
                rows.append(self._entry_row(x))
                entries = True
            elif type(x) is dict and "filename" in x and "line" in x and "name" in x:
                ref = self.stacks.frame(x["filename"], x["line"], x["name"])
                self._replace(x, ref)
                out.append(ref)
            else:
                out.append(x)
        if entries:
            self._trace_of(target).add(rows)
        return out

    # -- the fast path --------------------------------------------------------------------------
    def _layout(self, keys: tuple[bytes, ...]) -> Any:
        """The fields of entries whose keys are these GETs, and a regex for exactly such entries.

        The keys become literal bytes and only the values that matter are captured, so one ``match``
        does the parsing; False if the keys are not a trace entry's."""
        names = []
        memo = self.memo
        if self.compiled >= _MAX_COMPILED:  # beyond what any torch file has: the general loop reads the rest
            return False
        for kb in keys:
            idx = kb[1] if kb[0] == 0x68 else _U32(kb, 1)[0]
            if idx >= len(memo) or type(memo[idx]) is not str:
                self.plans[keys] = False
                return False
            names.append(memo[idx])
        if "action" not in names or len(set(names)) != len(names):
            self.plans[keys] = False
            return False
        parts, fields = [rb"\}\x94\("], {}
        memo_groups = []
        group = 0
        for kb, name in zip(keys, names):
            parts.append(re.escape(kb))
            if name == "action":
                parts.append(rb"(" + _GET + rb")")
            elif name in ("addr", "size", "time_us"):
                parts.append(rb"(" + _INT + rb")")
            elif name in ("stream", "device_free"):
                parts.append(rb"(?:" + _INT + rb"|N)")
                continue
            elif name == "frames":
                parts.append(rb"(" + _FRAMES + rb"|" + _GET + rb")")
                memo_groups.append(group)
            else:
                parts.append(_VALUE)
                memo_groups.append(group)
            fields[name] = group
            group += 1
        parts.append(rb"u")
        layout = (re.compile(b"".join(parts), re.S), fields["action"], fields.get("addr", -1),
                  fields.get("size", -1), fields.get("time_us", -1), fields.get("frames", -1), tuple(memo_groups))
        self.compiled += 1
        self.plans[keys] = layout
        self.layouts.insert(0, layout)
        del self.layouts[_MAX_LAYOUTS:]  # each one is tried in turn on every entry: keep the recent few
        return layout

    def _frames_value(self, v: bytes) -> tuple[_StackRef, int]:
        """A traceback value's stack, and the memo slot to compact (-1: it makes a new slot)."""
        if v[0] == 0x5d:  # a new list of GETs
            sref = self.framecache.get(v)
            if sref is None:
                body = v[3:-1] if len(v) > 2 and v[2] == 0x28 else v[2:-1]
                fids = []
                memo = self.memo
                i, n = 0, len(body)
                while i < n:
                    if body[i] == 0x68:
                        idx, i = body[i + 1], i + 2
                    else:
                        idx, i = _U32(body, i + 1)[0], i + 5
                    f = memo[idx] if idx < len(memo) else None
                    if type(f) is not _FrameRef:
                        raise _NotSimple
                    fids.append(f.fid)
                sref = self.framecache[v] = self.stacks.stack(tuple(fids))
            return sref, -1
        if v[0] in (0x68, 0x6a):  # the same traceback as an earlier entry (or block)
            idx = v[1] if v[0] == 0x68 else _U32(v, 1)[0]
            obj = self.memo[idx] if idx < len(self.memo) else None
            if type(obj) is _StackRef:
                return obj, -2
            if isinstance(obj, list):
                self.budget -= len(obj)  # each memo slot is walked once, but a list may sit in many
                if self.budget < 0:
                    raise UnsafePickle("hands its trace entries the same traceback lists far more often than "
                                       "its size allows")
                return self.stacks.stack_of(obj), idx
        raise _NotSimple

    def _discover(self, p: int) -> Any:
        """The layout of the entry at ``p`` through the general patterns, or None."""
        for rx in _ENTRY_PATTERNS:
            m = rx.match(self.buf, p)
            if m is not None:
                keys = m.groups()[0::2]
                layout = self.plans.get(keys)
                return self._layout(keys) if layout is None else layout
        return None

    def _fast(self, p: int) -> int:
        """Consume consecutive trace entries starting at ``p`` (an EMPTY_DICT); return where it stopped."""
        buf, memo, stack, pending = self.buf, self.memo, self.stack, self.pending
        if buf[p + 1:p + 3] != b"\x94(":  # every entry pattern starts EMPTY_DICT MEMOIZE MARK
            return p
        actcache, layouts, framecache = self.actcache, self.layouts, self.framecache
        from_bytes = int.from_bytes
        empty = self.stacks._srefs[0]
        ints = self.ints
        hot = None  # the match of the last entry's layout when it is torch's (see below)
        ia = iaddr = isize = itime = iframes = -1  # that layout's groups
        while True:
            if hot is not None:
                # The common case in one step: an entry in torch's layout (the traceback, a new list of
                # GETs, is the one value that makes a memo slot) whose action and traceback were seen
                # before. It does what the general path below does for such an entry.
                m = hot(buf, p)
                if m is not None:
                    g = m.groups()
                    code = actcache.get(g[ia])
                    sref = framecache.get(g[iframes])  # only new lists of GETs are in it
                    if code is not None and sref is not None:
                        v = g[iaddr]
                        addr = ints.get(v)
                        if addr is None:
                            addr = ints[v] = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                                              else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
                        v = g[isize]
                        size = ints.get(v)
                        if size is None:
                            size = ints[v] = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                                              else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
                        v = g[itime]
                        when = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                                else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
                        memo.append(_ENTRY)
                        memo.append(sref)
                        stack.append(_ENTRY)
                        pending.append((code, addr if code != _OOM else 0, size, when, sref.sid)
                                       if code in _KEPT else None)
                        p = m.end()
                        continue
                if len(ints) > (1 << 18):
                    ints.clear()
            m = None
            for layout in layouts:
                m = layout[0].match(buf, p)
                if m is not None:
                    break
            if m is None:
                layout = self._discover(p)
                if not layout:
                    return p
                m = layout[0].match(buf, p)
                if m is None:
                    return p
            if layout is not layouts[0]:
                if layout in layouts:
                    layouts.remove(layout)
                layouts.insert(0, layout)
                del layouts[_MAX_LAYOUTS:]
            _, ia, iaddr, isize, itime, iframes, imemo = layout
            g = m.groups()
            code = actcache.get(g[ia])
            if code is None:
                av = g[ia]
                idx = av[1] if av[0] == 0x68 else _U32(av, 1)[0]
                name = memo[idx] if idx < len(memo) else None
                if type(name) is not str:
                    return p
                code = actcache[av] = _ACTIONS.get(name, -1)
            # ints: BININT1/BININT2 unsigned, BININT and LONG1 signed, little-endian
            v = g[iaddr] if iaddr >= 0 else b"N"
            addr = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                    else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
            v = g[isize] if isize >= 0 else b"N"
            size = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                    else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
            v = g[itime] if itime >= 0 else b"N"
            when = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                    else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
            slot = -2
            if iframes >= 0:
                fv = g[iframes]
                sref = framecache.get(fv)
                if sref is None:
                    try:
                        sref, slot = self._frames_value(fv)
                    except _NotSimple:
                        return p
            else:
                sref = empty
            if len(imemo) == 1 and imemo[0] == iframes:  # torch's layout: the traceback is the one new slot
                memo.append(_ENTRY)
                if fv[0] == 0x5d:
                    memo.append(sref)
            else:
                for i in imemo:  # other values must be ones we can memoize as the general loop would
                    c = g[i][0]
                    if (c == 0x5d and i != iframes) or (c == 0x8c and g[i] != b"\x8c\x00\x94"):
                        return p
                memo.append(_ENTRY)
                for i in imemo:
                    c = g[i][0]
                    if c == 0x5d:
                        memo.append(sref)
                    elif c == 0x8c:
                        memo.append("")
            if slot >= 0:
                memo[slot] = sref
            stack.append(_ENTRY)
            pending.append((code, addr if code != _OOM else 0, size, when, sref.sid) if code in _KEPT else None)
            p = m.end()
            torch_layout = len(imemo) == 1 and imemo[0] == iframes and min(iaddr, isize, itime) >= 0
            hot = layout[0].match if torch_layout else None

    # -- the general loop -----------------------------------------------------------------------
    def load(self) -> Any:
        try:
            return self._run()
        except UnsafePickle:
            raise
        except (IndexError, struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError,
                TypeError) as e:
            if self.pos >= len(self.buf) - 9:  # an opcode's argument runs past the end: 8 bytes at most
                raise _Damaged("ends early") from None
            raise _Damaged(f"is damaged at byte {self.pos} ({type(e).__name__})") from None

    def _run(self) -> Any:
        buf = self.buf
        n = len(buf)
        stack, marks, memo, slots = self.stack, self.marks, self.memo, self.slots
        appending = self._appending
        fast, group, runs = self._fast, _GROUP, _RUNS
        report_every = 1 << 26
        report_at = 1 << 24  # the first report early: a view draws the part read from it
        misses, fast_after = 0, -1  # the fast path's failures in a row, and where it is tried next
        p = at = 0
        try:
            while True:
                at = p  # (a local: an attribute store per opcode cost a tenth of the loop)
                if p >= n:
                    raise _Damaged("ends early")
                op = buf[p]
                p += 1
                # Four groups of at most 15 opcodes, the usual ones first: a turn of an if-chain costs ~25 ns,
                # and the last opcode of one chain of 60 made a file of it read at 0.6 MB/s.
                g = group[op]
                if g == 0:
                    if op == 0x68:  # BINGET
                        stack.append(memo[buf[p]])
                        p += 1
                    elif op == 0x6a:  # LONG_BINGET
                        stack.append(memo[_U32(buf, p)[0]])
                        p += 4
                    elif op == 0x94:  # MEMOIZE
                        obj = stack[-1]
                        if type(obj) is dict or type(obj) is list:
                            slots[id(obj)] = len(memo)
                        memo.append(obj)
                    elif op == 0x7d:  # EMPTY_DICT: most often the start of a run of trace entries
                        if p > fast_after:
                            q = fast(p - 1)
                            if q != p - 1:
                                misses, p = 0, q
                                if p >= report_at:
                                    report_at = p + report_every
                                    self._progress(p)
                                continue
                            # not entries: after many such dicts in a row (a segment's blocks, or a file made
                            # to fail the regular expressions) try again only further on
                            misses += 1
                            if misses > 64:
                                fast_after = p + min(misses << 4, 1 << 20)
                        stack.append({})
                    elif op == 0x8c:  # SHORT_BINUNICODE
                        k = buf[p]
                        if p + 1 + k > n:
                            self._length(k, p + 1)
                        stack.append(str(buf[p + 1:p + 1 + k], "utf-8", "surrogatepass"))
                        p += 1 + k
                    elif op == 0x4b:  # BININT1
                        stack.append(buf[p])
                        p += 1
                    elif op == 0x4d:  # BININT2
                        stack.append(buf[p] | (buf[p + 1] << 8))
                        p += 2
                    elif op == 0x4a:  # BININT
                        stack.append(_I32(buf, p)[0])
                        p += 4
                    elif op == 0x8a:  # LONG1
                        k = buf[p]
                        stack.append(int.from_bytes(buf[p + 1:p + 1 + k], "little", signed=True))
                        p += 1 + k
                    elif op == 0x28:  # MARK
                        if buf[p] == 0x28:  # a run of them at once
                            q = runs[0x28](buf, p).end()
                            marks.extend([len(stack)] * (q - p + 1))
                            p = q
                        else:
                            marks.append(len(stack))
                    elif op == 0x75:  # SETITEMS
                        k = marks.pop()
                        d = stack[k - 1]
                        items = stack[k:]
                        del stack[k:]
                        if type(d) is not dict:
                            raise _Damaged("uses SETITEMS on something that is not a dict")
                        for i in range(0, len(items) - 1, 2):
                            key = items[i]
                            if type(key) is str:  # nothing else is hashed (see the module docstring)
                                d[key] = items[i + 1]
                    elif op == 0x65:  # APPENDS
                        k = marks.pop()
                        target = stack[k - 1]
                        items = stack[k:]
                        del stack[k:]
                        items = appending(target, items)
                        if items:
                            if type(target) is list:
                                target.extend(items)
                            elif type(target) is not set:  # a set's members are dropped, never hashed
                                raise _Damaged("uses APPENDS on something that is not a list")
                        if p >= report_at:
                            report_at = p + report_every
                            self._progress(p)
                    elif op == 0x5d:  # EMPTY_LIST
                        if buf[p] == 0x5d:  # a run of them at once (a list nested deep starts so)
                            q = runs[0x5d](buf, p).end()
                            stack.extend([[] for _ in range(q - p + 1)])
                            p = q
                        else:
                            stack.append([])
                    else:  # APPEND
                        target = stack[-2]
                        item = stack.pop()
                        if type(target) is list and type(item) is not dict and item is not _ENTRY:
                            target.append(item)  # plain data (no entry, no frame): one turn, not a call
                            if buf[p] == 0x61:  # a run: each puts the top into the one below (a deep list)
                                for _ in range(runs[0x61](buf, p).end() - p):
                                    item = stack.pop()
                                    target = stack[-1]
                                    if type(target) is not list or type(item) is dict or item is _ENTRY:
                                        stack.append(item)  # not plain: the general turn takes this one
                                        break
                                    target.append(item)
                                    p += 1
                            continue
                        for item in appending(target, [item]):
                            if type(target) is not list:
                                raise _Damaged("uses APPEND on something that is not a list")
                            target.append(item)
                elif g == 1:
                    if op == 0x73:  # SETITEM
                        v = stack.pop()
                        key = stack.pop()
                        d = stack[-1]
                        if type(d) is not dict:
                            raise _Damaged("uses SETITEM on something that is not a dict")
                        if type(key) is str:
                            d[key] = v
                    elif op == 0x95:  # FRAME: a length hint only
                        p += 8
                    elif op == 0x80:  # PROTO
                        p += 1
                    elif op == 0x2e:  # STOP
                        self.pos = p
                        self._progress(p)
                        if len(stack) != 1:
                            raise _Damaged(f"stops with {len(stack)} objects on the stack")
                        return stack[0]
                    elif op == 0x4e:  # NONE
                        if buf[p] == 0x4e:  # a run at once
                            q = runs[0x4e](buf, p).end()
                            stack.extend([None] * (q - p + 1))
                            p = q
                        else:
                            stack.append(None)
                    elif op == 0x88:  # NEWTRUE
                        stack.append(True)
                    elif op == 0x89:  # NEWFALSE
                        stack.append(False)
                    elif op == 0x29:  # EMPTY_TUPLE
                        stack.append(())
                    elif op == 0x85:  # TUPLE1
                        v = (stack[-1],)
                        if buf[p] == 0x85:  # a run at once (a tuple nested deep)
                            q = runs[0x85](buf, p).end()
                            for _ in range(q - p):
                                v = (v,)
                            p = q
                        stack[-1] = v
                    elif op == 0x86:  # TUPLE2
                        stack[-2:] = [(stack[-2], stack[-1])]
                    elif op == 0x87:  # TUPLE3
                        stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
                    elif op == 0x74:  # TUPLE
                        k = marks.pop()
                        t = tuple(stack[k:])
                        del stack[k:]
                        stack.append(t)
                    elif op == 0x6c:  # LIST
                        k = marks.pop()
                        lst: list = []
                        lst.extend(appending(lst, stack[k:]))
                        del stack[k:]
                        stack.append(lst)
                    elif op == 0x64:  # DICT
                        k = marks.pop()
                        items = stack[k:]
                        del stack[k:]
                        stack.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)
                                      if type(items[i]) is str})
                    else:  # POP
                        if stack:
                            stack.pop()
                            p = skip_padding(buf, p, bool(stack))  # a run of padding after it
                        else:
                            marks.pop()
                elif g == 2:
                    if op == 0x71:  # BINPUT
                        p = self._put(buf[p], p + 1, at)
                    elif op == 0x72:  # LONG_BINPUT
                        p = self._put(_U32(buf, p)[0], p + 4, at)
                    elif op == 0x70:  # PUT (text)
                        line, p = self._line(p)
                        self._put(int(line), p, at)
                    elif op == 0x67:  # GET (text)
                        line, p = self._line(p)
                        stack.append(memo[int(line)])
                    elif op == 0x58:  # BINUNICODE
                        k = self._length(_U32(buf, p)[0], p + 4)
                        stack.append(str(buf[p + 4:p + 4 + k], "utf-8", "surrogatepass"))
                        p += 4 + k
                    elif op == 0x8d:  # BINUNICODE8
                        k = self._length(_U64(buf, p)[0], p + 8)
                        stack.append(str(buf[p + 8:p + 8 + k], "utf-8", "surrogatepass"))
                        p += 8 + k
                    elif op == 0x43:  # SHORT_BINBYTES
                        k = buf[p]
                        stack.append(bytes(buf[p + 1:p + 1 + k]))
                        p += 1 + k
                    elif op == 0x42:  # BINBYTES
                        k = self._length(_U32(buf, p)[0], p + 4)
                        stack.append(bytes(buf[p + 4:p + 4 + k]))
                        p += 4 + k
                    elif op == 0x8e:  # BINBYTES8
                        k = self._length(_U64(buf, p)[0], p + 8)
                        stack.append(bytes(buf[p + 8:p + 8 + k]))
                        p += 8 + k
                    elif op == 0x96:  # BYTEARRAY8
                        k = self._length(_U64(buf, p)[0], p + 8)
                        stack.append(bytearray(buf[p + 8:p + 8 + k]))
                        p += 8 + k
                    elif op == 0x55:  # SHORT_BINSTRING (python 2 str)
                        k = buf[p]
                        stack.append(bytes(buf[p + 1:p + 1 + k]).decode("latin-1"))
                        p += 1 + k
                    elif op == 0x54:  # BINSTRING
                        k = self._length(_I32(buf, p)[0], p + 4)
                        stack.append(bytes(buf[p + 4:p + 4 + k]).decode("latin-1"))
                        p += 4 + k
                    elif op == 0x31:  # POP_MARK
                        del stack[marks.pop():]
                        if buf[p] == 0x31:  # a run of them (after a run of MARKs)
                            for _ in range(runs[0x31](buf, p).end() - p):
                                del stack[marks.pop():]
                                p += 1
                        p = skip_padding(buf, p, bool(stack))  # a run of padding after it
                    else:  # DUP
                        if buf[p] == 0x32:  # a run at once
                            q = runs[0x32](buf, p).end()
                            stack.extend([stack[-1]] * (q - p + 1))
                            p = q
                        else:
                            stack.append(stack[-1])
                else:
                    if op == 0x53:  # STRING (text, quoted)
                        line, p = self._line(p)
                        if len(line) < 2 or line[:1] != line[-1:] or line[:1] not in (b"'", b'"'):
                            raise _Damaged("has a STRING opcode without quotes")
                        stack.append(codecs.escape_decode(line[1:-1])[0].decode("latin-1"))
                    elif op == 0x56:  # UNICODE (text)
                        line, p = self._line(p)
                        stack.append(line.decode("raw-unicode-escape"))
                    elif op == 0x49:  # INT (text)
                        line, p = self._line(p)
                        stack.append(True if line == b"01" else False if line == b"00" else int(line))
                    elif op == 0x4c:  # LONG (text)
                        line, p = self._line(p)
                        stack.append(int(line.rstrip(b"L")))
                    elif op == 0x8b:  # LONG4
                        k = self._length(_I32(buf, p)[0], p + 4)
                        stack.append(int.from_bytes(buf[p + 4:p + 4 + k], "little", signed=True))
                        p += 4 + k
                    elif op == 0x46:  # FLOAT (text)
                        line, p = self._line(p)
                        stack.append(float(line))
                    elif op == 0x47:  # BINFLOAT
                        stack.append(_F64(buf, p)[0])
                        p += 8
                    elif op == 0x8f:  # EMPTY_SET
                        stack.append(set())
                    elif op == 0x90:  # ADDITEMS: the members are dropped, never hashed
                        k = marks.pop()
                        del stack[k:]
                        if type(stack[-1]) is not set:
                            raise _Damaged("uses ADDITEMS on something that is not a set")
                    elif op == 0x91:  # FROZENSET: empty, its members dropped unhashed
                        k = marks.pop()
                        del stack[k:]
                        stack.append(frozenset())
                    elif op in _OPNAMES:
                        raise _Refused(self._refusal(op, p))
                    else:
                        raise _Damaged(f"has byte 0x{op:02x} at offset {p - 1}, which is no pickle opcode")
        except (IndexError, struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError, TypeError):
            self.pos = at  # where the opcode that failed starts (load() words the error)
            raise

    def _put(self, idx: int, p: int, at: int) -> int:
        memo = self.memo
        obj = self.stack[-1]
        if idx == len(memo):
            memo.append(obj)
        elif idx < len(memo):
            memo[idx] = obj
            self._forget_caches()
        else:
            check_memo_index(idx, len(memo), len(self.buf) - p, at)
            memo.extend([None] * (idx - len(memo)))
            memo.append(obj)
        if type(obj) is dict or type(obj) is list:
            self.slots[id(obj)] = idx
        return p

    def _line(self, p: int) -> tuple[bytes, int]:
        end = self.buf.find(b"\n", p)
        if end < 0:
            self.pos = len(self.buf)
            raise _Damaged("ends early")
        return bytes(self.buf[p:end]), end + 1

    def _length(self, k: int, p: int) -> int:
        if k < 0 or p + k > len(self.buf):
            self.pos = len(self.buf)
            raise _Damaged("ends early")
        return k

    def _refusal(self, op: int, p: int) -> str:
        """What the refused opcode names: ``module.name`` when both are dotted identifiers (anything else
        of the file's bytes, such as terminal escapes, is not echoed)."""
        what = f"the pickle opcode {_OPNAMES[op]} (it would construct or call an object)"
        if op in (0x63, 0x69):  # GLOBAL / INST: "module\nname\n"
            try:
                module, p = self._line(p)
                name, _ = self._line(p)
                dotted = f"{module.decode('ascii', 'replace')}.{name.decode('ascii', 'replace')}"
            except _Damaged:
                return what
        elif op == 0x93 and len(self.stack) >= 2 and all(type(x) is str for x in self.stack[-2:]):
            dotted = f"{self.stack[-2]}.{self.stack[-1]}"
        else:
            return what
        return dotted if dotted_name(*dotted.split(".", 1)) == dotted else what

    def _progress(self, p: int) -> None:
        if self.progress is not None:
            self.progress(p)
        buf = self.buf
        if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            # hand back the pages already read: a 1 GB file would otherwise count fully in our RSS
            end = (p - (1 << 20)) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > 0:
                try:
                    buf.madvise(mmap.MADV_DONTNEED, 0, end)
                except OSError:
                    pass
