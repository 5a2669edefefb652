"""A seeded mutator: byte-level (bit flips, interesting values, insert, delete, truncate, duplicate,
splice with another format's file) and field-aware (a JSON node, a pickle opcode and its argument, a
safetensors header's offsets, dtype, shape and length, a zip's central directory and members, an
``.npy`` header, a gzip stream, a JSON-lines file, a pointer file).

``Mutator(rng, ctx).mutate(kind, data)`` returns ``(new bytes, what was done)``. The hostile values it
plants include paths that lead out of the root (to the task's canary, its FIFO, ``/etc/passwd``,
``/dev/zero``), huge and negative numbers, non-UTF-8 bytes, lone surrogates and deep nesting.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pickletools
import random
import re
import struct
import zipfile
from typing import Any, Callable

import hostile_pickles as P

_INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1,
                     2**63, 2**64 - 1, 2**64 + 7, -(2**31), -(2**63), -(2**63) - 1, 10**30, -(10**30), 10**400]
_INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0xFE, 0x0A, 0x22, 0x5C, 0x2E, 0x2F]


class Mutator:
    def __init__(self, rng: random.Random, ctx: Any, splice_from: list[bytes] | None = None):
        self.rng = rng
        self.ctx = ctx
        self.splice_from = splice_from or []

    # -- hostile values -----------------------------------------------------------------------
    def hostile_path(self) -> str:
        c = self.ctx
        return self.rng.choice([
            "../outside/canary.safetensors", "../../outside/canary.safetensors", "../outside/secret.json",
            "../outside/fifo", str(c.canary), str(c.fifo), str(c.outside), "/etc/passwd", "/dev/zero",
            "/proc/self/environ", "..", "../..", "/", ".", "", "a/../../../outside/canary.safetensors",
            "model.safetensors/../../outside/canary.safetensors", "\x00", "x" * 5000])

    def hostile_string(self) -> str:
        return self.rng.choice([
            self.hostile_path(), "", "\udcff", "\ud800x", "é" * 3, "\u202e", "%s%n", "{}", "nan", "inf", "-1",
            "1e30", "0x10", "step-999999", "x" * 70_000, "float8_e4m3fn", "evil", "object", "<f8", "|O"])

    def hostile_value(self) -> Any:
        r = self.rng.random()
        if r < 0.35:
            return self.rng.choice(_INTERESTING_INTS)
        if r < 0.45:
            return self.rng.choice([1e308, -1e308, 5e-324, float("nan"), float("inf"), -0.0, 1.5, 1e30])
        if r < 0.7:
            return self.hostile_string()
        if r < 0.8:
            return self.rng.choice([None, True, False, [], {}, [None], {"": None}])
        if r < 0.9:
            depth = self.rng.choice([50, 3000, 100_000])
            if depth > 400:  # written as text: json.dumps would recurse
                return _Deep(depth)
            v: Any = []
            for _ in range(depth):
                v = [v]
            return v
        return self.rng.choice([list(range(50_000)), ["x"] * 20_000, {str(k): k for k in range(20_000)}])

    # -- bytes --------------------------------------------------------------------------------
    def bytes_(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        b = bytearray(data)
        n = len(b)
        op = rng.choice(["flip", "flip", "set", "int", "insert", "delete", "truncate", "dup", "splice"])
        if n == 0:
            op = "insert"
        pos = rng.randrange(max(n, 1))
        if op == "flip":
            k = rng.choice([1, 1, 2, 4, 8])
            for _ in range(k):
                p = rng.randrange(n)
                b[p] ^= 1 << rng.randrange(8)
            return bytes(b), f"flip {k} bit(s) near {pos}"
        if op == "set":
            v = rng.choice(_INTERESTING_BYTES)
            b[pos] = v
            return bytes(b), f"byte {pos} = {v:#x}"
        if op == "int":
            width = rng.choice([1, 2, 4, 8])
            v = rng.choice(_INTERESTING_INTS) % (1 << (8 * width))
            b[pos:pos + width] = v.to_bytes(width, "little")
            return bytes(b[:max(n, pos + width)]), f"{width}-byte int {v} at {pos}"
        if op == "insert":
            k = rng.choice([1, 4, 16, 300])
            ins = bytes(rng.randrange(256) for _ in range(k))
            b[pos:pos] = ins
            return bytes(b), f"insert {k} random bytes at {pos}"
        if op == "delete":
            k = rng.choice([1, 4, 64, max(1, n // 3)])
            del b[pos:pos + k]
            return bytes(b), f"delete {k} bytes at {pos}"
        if op == "truncate":
            return bytes(b[:pos]), f"truncate to {pos} of {n} bytes"
        if op == "dup":
            k = rng.choice([8, 64, 1024])
            chunk = b[pos:pos + k]
            at = rng.randrange(n)
            b[at:at] = chunk * rng.choice([1, 2, 50])
            return bytes(b), f"duplicate {len(chunk)} bytes from {pos} at {at}"
        other = rng.choice(self.splice_from) if self.splice_from else data
        at = rng.randrange(len(other) or 1)
        return bytes(b[:pos]) + other[at:at + rng.choice([16, 256, 4096])] + bytes(b[pos:]), \
            f"splice {min(len(other) - at, 4096)} bytes of another format at {pos}"

    # -- JSON ---------------------------------------------------------------------------------
    def json_(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        if rng.random() < 0.15:
            return self.bytes_(data)
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return self.bytes_(data)
        doc, desc = self.json_doc(doc)
        text = dumps(doc)
        if rng.random() < 0.08:  # bytes that are not UTF-8, inside a string
            quotes = [m.start() for m in re.finditer(rb'"', text)]
            if quotes:
                at = rng.choice(quotes) + 1
                text = text[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc"]) + text[at:]
                desc += " + non-UTF-8 bytes in a string"
        return text, desc

    def json_doc(self, doc: Any) -> tuple[Any, str]:
        rng = self.rng
        paths = []
        _walk(doc, (), paths, 4000)
        if not paths or rng.random() < 0.05:
            return self.hostile_value(), "whole document replaced"
        path = rng.choice(paths)
        parent, key = _at(doc, path[:-1]), path[-1] if path else None
        if key is None:
            return self.hostile_value(), "whole document replaced"
        op = rng.choice(["value", "value", "value", "delete", "type", "rename", "repeat", "wrap"])
        where = ".".join(map(str, path))[:120]
        if op == "value":
            v = self.hostile_value()
            parent[key] = v
            return doc, f"set {where} = {_short(v)}"
        if op == "delete":
            del parent[key]
            return doc, f"delete {where}"
        if op == "type":
            v = parent[key]
            nv = str(v) if not isinstance(v, str) else (int(v) if v.isdigit() else len(v))
            if isinstance(v, (list, dict)):
                nv = list(v.values()) if isinstance(v, dict) else {str(i): x for i, x in enumerate(v)}
            parent[key] = nv
            return doc, f"retype {where} to {type(nv).__name__}"
        if op == "rename" and isinstance(parent, dict):
            new = rng.choice([self.hostile_path(), key + "x", "", key.upper(), "__proto__"])
            parent[new] = parent.pop(key)
            return doc, f"rename key {where} to {_short(new)}"
        if op == "repeat" and isinstance(parent, list):
            parent.extend([parent[key]] * rng.choice([2, 100, 5000]))
            return doc, f"repeat {where}"
        parent[key] = [parent[key]]
        return doc, f"wrap {where} in a list"

    # -- JSON lines -----------------------------------------------------------------------------
    def jsonl_(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        lines = data.split(b"\n")
        body = [i for i, ln in enumerate(lines) if ln.strip()]
        op = rng.choice(["line", "line", "line", "insert", "delete", "repeat", "bytes"])
        if op == "bytes" or not body:
            return self.bytes_(data)
        i = rng.choice(body)
        if op == "line":
            try:
                doc, desc = self.json_doc(json.loads(lines[i]))
                lines[i] = dumps(doc)
            except (ValueError, RecursionError):
                return self.bytes_(data)
            return b"\n".join(lines), f"line {i + 1}: {desc}"
        if op == "insert":
            new = rng.choice([b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000, b"[1, 2]", b'"text"', b"42", b"null",
                              b'{"type": "step", "rank": 0, "step": "x", "loss": "nan", "mem_bytes": 1e400}',
                              b'{"type": "checkpoint", "rank": 0, "step": 1, "path": "/etc"}',
                              b'{"type": "checkpoint", "rank": 0, "step": 1, "path": "../outside"}',
                              b'{"type": "schedule", "rank": 0, "step": 1, "actions": [{}]}',
                              b'{"type": "schedule", "rank": "0", "step": null, "actions": 5}',
                              b'{"type": "pipeline", "rank": [], "schedule": {}}',
                              b'{"type": "run_end", "rank": -1, "status": ["x"]}',
                              b'{"type": "error", "rank": 0, "message": 5, "traceback": [1]}',
                              b" " * 200_000 + b"{}"])
            lines.insert(i, new)
            return b"\n".join(lines), f"insert line {i + 1}: {_short(new)}"
        if op == "delete":
            del lines[i]
            return b"\n".join(lines), f"delete line {i + 1}"
        k = rng.choice([10, 1000])
        lines[i:i + 1] = [lines[i]] * k
        return b"\n".join(lines), f"repeat line {i + 1} x{k}"

    # -- a pointer file ("latest") ------------------------------------------------------------------
    def text_(self, data: bytes) -> tuple[bytes, str]:
        if self.rng.random() < 0.3:
            return self.bytes_(data)
        new = self.rng.choice([self.hostile_path(), "step-999999", "step-000001/../../outside", "../checkpoints",
                               "step-000001\x00", "\udcff"])
        return new.encode("utf-8", "surrogateescape") if new != "\udcff" else b"\xff\xfe", f"pointer = {_short(new)}"

    # -- pickle -------------------------------------------------------------------------------------
    def pickle_(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        try:
            ops = genops(data)
        except Exception:  # noqa: BLE001 - pickletools' own errors: mutate the bytes instead
            return self.bytes_(data)
        if rng.random() < 0.7 and any(op.name == "FRAME" for op, _, _ in ops):
            # Frames declare their length: most edits inside one break the framing first and reach nothing
            # deeper. Without them (still a valid pickle) an edit reaches the reader's own logic.
            data = unframe(data)
            ops = genops(data)
        if rng.random() < 0.2 or len(ops) < 3:
            return self.bytes_(data)
        ends = [pos for _, _, pos in ops[1:]] + [len(data)]
        spans = [(op, arg, pos, end) for (op, arg, pos), end in zip(ops, ends)]
        choice = rng.choice(["int", "memo", "string", "delete", "dup", "insert", "insert", "swap", "truncate"])
        marker = str(self.ctx.marker)

        def pick(names: set[str]):
            cands = [sp for sp in spans if sp[0].name in names]
            return rng.choice(cands) if cands else None

        def put(sp, new: bytes, desc: str) -> tuple[bytes, str]:
            return data[:sp[2]] + new + data[sp[3]:], f"{desc} at opcode {sp[0].name}@{sp[2]}"

        if choice == "int":
            sp = pick({"BININT1", "BININT2", "BININT", "LONG1"})
            if sp:
                v = rng.choice(_INTERESTING_INTS)
                return put(sp, P.i(v), f"int {sp[1]} -> {v}")
        if choice == "memo":
            sp = pick({"BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})
            if sp:
                v = rng.choice([0, (sp[1] or 0) + 1, (sp[1] or 0) * 1000 + 7, 2**24, 2**31 - 1, 2**32 - 1])
                enc = P.binget(v) if "GET" in sp[0].name else P.binput(v)
                return put(sp, enc, f"memo index {sp[1]} -> {v}")
        if choice == "string":
            sp = pick({"SHORT_BINUNICODE", "BINUNICODE", "UNICODE"})
            if sp:
                v = rng.choice([self.hostile_string(), b"\xff\xfe", b"\xed\xa0\x80", "os", "system", "posix",
                                "builtins", "eval", "__reduce__"])
                return put(sp, P.s(v), f"string {_short(sp[1])} -> {_short(v)}")
        if choice == "delete":
            sp = rng.choice(spans[1:-1])
            return put(sp, b"", "delete")
        if choice == "dup":
            sp = rng.choice(spans[1:-1])
            k = rng.choice([2, 3, 1000])
            return put(sp, data[sp[2]:sp[3]] * k, f"repeat x{k}")
        if choice == "swap":
            k = rng.randrange(1, len(spans) - 2)
            a, b = spans[k], spans[k + 1]
            swapped = data[:a[2]] + data[b[2]:b[3]] + data[a[2]:a[3]] + data[b[3]:]
            return swapped, f"swap {a[0].name}@{a[2]} and {b[0].name}"
        if choice == "truncate":
            sp = rng.choice(spans[1:])
            return data[:sp[2]], f"truncate before opcode {sp[0].name}@{sp[2]}"
        ins = rng.choice([
            (P.DUP, "DUP"), (P.POP, "POP"), (P.MARK, "MARK"), (P.STOP, "STOP"), (P.NONE, "NONE"),
            (P.EMPTY_DICT, "EMPTY_DICT"), (P.EMPTY_LIST, "EMPTY_LIST"), (P.TUPLE1, "TUPLE1"), (P.SETITEM, "SETITEM"),
            (P.APPEND, "APPEND"), (P.REDUCE, "REDUCE"), (P.BUILD, "BUILD"), (P.MEMOIZE, "MEMOIZE"),
            (P.evil_system(f"touch {marker}"), "GLOBAL posix.system REDUCE"),
            (P.evil_stack_global(f"touch {marker}"), "STACK_GLOBAL builtins.exec REDUCE"),
            (P.evil_open(marker), "GLOBAL builtins.open REDUCE"), (P.global_("os", "system"), "GLOBAL os.system"),
            (P.binget(rng.choice([0, 2**24, 2**31 - 1])), "GET far"), (P.binput(2**24 + 3), "PUT far"),
            (P.deep_tuple(rng.choice([100, 50_000])), "deep tuple"), (P.deep_list(50_000), "deep list"),
            (P.frame_claiming(2**62), "FRAME claiming 2^62"),
            (P.binunicode8_claiming(2**40), "BINUNICODE8 claiming 2^40"),
            (P.binbytes8_claiming(2**62), "BINBYTES8 claiming 2^62"),
            (P.long4_claiming(2**31 - 1), "LONG4 claiming 2^31"),
            (P.memo_bomb(8), "memo bomb"), (P.laughs(8, 8)[1:-1] + P.POP, "shared-tuple fan-out"),
            (P.persid("0"), "PERSID"), (P.ext1(1), "EXT1"), (P.inst("os", "system"), "INST os.system")])
        sp = rng.choice(spans[1:])
        return data[:sp[2]] + ins[0] + data[sp[2]:], f"insert {ins[1]} before {sp[0].name}@{sp[2]}"

    # -- safetensors --------------------------------------------------------------------------------
    def safetensors_(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        if len(data) < 8 or rng.random() < 0.15:
            return self.bytes_(data)
        n = int.from_bytes(data[:8], "little")
        try:
            header = json.loads(data[8:8 + n])
        except (ValueError, RecursionError):
            return self.bytes_(data)
        rest = data[8 + n:]
        op = rng.choice(["length", "offsets", "offsets", "dtype", "shape", "metadata", "json", "entries"])
        if op == "length":
            v = rng.choice([0, 1, n - 1, n + 1, len(data), len(data) + 1, 2**32, 2**63 - 1, 2**64 - 1])
            return struct.pack("<Q", v % 2**64) + data[8:], f"header length {n} -> {v}"
        try:
            return self._safetensors_field(op, header, rest)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):  # a header an earlier edit broke
            return self.bytes_(data)

    def _safetensors_field(self, op: str, header: Any, rest: bytes) -> tuple[bytes, str]:
        rng = self.rng
        names = [k for k in header if k != "__metadata__"]
        name = rng.choice(names) if names else None
        desc = ""
        if op == "offsets" and name:
            a, b = header[name].get("data_offsets", [0, 0])
            other = header[rng.choice(names)].get("data_offsets", [0, 0])
            v = rng.choice([[b, a], [0, 2**62], [-1, b], [a, a], [a, len(rest) + 100], [other[0], b], ["0", "4"],
                            [1.5, b], [a], [a, b, 0], None, [2**64, 2**64 + 4], [a, b + 1]])
            header[name]["data_offsets"] = v
            desc = f"{name}.data_offsets = {v}"
        elif op == "dtype" and name:
            v = rng.choice(["evil", "F64", "BF16", "", 5, "F8_E4M3", "BOOL", "U8", "I64", "F8_E8M0", None])
            header[name]["dtype"] = v
            desc = f"{name}.dtype = {v!r}"
        elif op == "shape" and name:
            v = rng.choice([[-1], [2**40, 2**40], [0], [], [1] * 64, "3", [3.5], [2**63], [2**31, 2**31, 2**31], None])
            header[name]["shape"] = v
            desc = f"{name}.shape = {_short(v)}"
        elif op == "metadata":
            v = rng.choice([{"format": ["x"]}, {"k": 5}, "text", [], {"format": "pt", "x" * 100: "y" * 100_000},
                            {self.hostile_path(): self.hostile_path()}])
            header["__metadata__"] = v
            desc = f"__metadata__ = {_short(v)}"
        elif op == "entries":
            k = rng.choice([1000, 5000])
            for j in range(k):
                header[f"x.{j}"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
            desc = f"{k} extra entries"
        else:
            header, desc = self.json_doc(header)
        body = dumps(header)
        body += b" " * (-len(body) % 8)
        return struct.pack("<Q", len(body)) + body + rest, desc

    # -- zip (torch.save, .npz) -----------------------------------------------------------------------
    def zip_(self, data: bytes, member: Callable[[str, bytes], tuple[bytes, str]] | None = None,
             compression: int = zipfile.ZIP_STORED) -> tuple[bytes, str]:
        rng = self.rng
        r = rng.random()
        if r < 0.15:
            return self.bytes_(data)
        if r < 0.4:
            return self.zip_structure(data)
        try:
            zin = zipfile.ZipFile(io.BytesIO(data))
            infos = zin.infolist()
            contents = [(i.filename, zin.read(i)) for i in infos]
        except Exception:  # noqa: BLE001 - zipfile's own errors on a damaged base: bytes instead
            return self.bytes_(data)
        k = rng.randrange(len(contents))
        name, content = contents[k]
        op = rng.random()
        if op < 0.1:
            contents.append((name, content))
            desc = f"member {name} twice"
        elif op < 0.15:
            contents.append((rng.choice(["../../outside/x", "/etc/passwd", name + "/../x"]), b"x"))
            desc = "a member named outside"
        else:
            new, desc = (member(name, content) if member else self.bytes_(content))
            contents[k] = (name, new)
            desc = f"{name}: {desc}"
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression) as zout:
            for n, c in contents:
                zout.writestr(n, c)
        return buf.getvalue(), desc

    def zip_structure(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        b = bytearray(data)
        central = [m.start() for m in re.finditer(rb"PK\x01\x02", data)]
        local = [m.start() for m in re.finditer(rb"PK\x03\x04", data)]
        end = [m.start() for m in re.finditer(rb"PK\x05\x06", data)]
        fields = []
        for p in central:
            fields += [(p + 20, 4, "central compressed size"), (p + 24, 4, "central size"), (p + 28, 2, "name length"),
                       (p + 30, 2, "extra length"), (p + 42, 4, "local header offset")]
        for p in local:
            fields += [(p + 18, 4, "local compressed size"), (p + 22, 4, "local size"),
                       (p + 26, 2, "local name length")]
        for p in end:
            fields += [(p + 10, 2, "entries"), (p + 12, 4, "directory size"), (p + 16, 4, "directory offset")]
        if not fields:
            return self.bytes_(data)
        at, width, what = rng.choice(fields)
        v = rng.choice([0, 1, 2**(8 * width) - 1, len(data), len(data) * 2, rng.randrange(2**(8 * width))])
        v %= 2 ** (8 * width)  # a 2-byte field holds at most 65535, whatever the file's length
        b[at:at + width] = v.to_bytes(width, "little")
        return bytes(b), f"zip {what} = {v}"

    def npy_(self, name: str, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        m = re.match(rb"\x93NUMPY(.)(.)", data)
        if not m or rng.random() < 0.3:
            return self.bytes_(data)
        hlen = struct.unpack("<H", data[8:10])[0] if data[6] == 1 else struct.unpack("<I", data[8:12])[0]
        start = 10 if data[6] == 1 else 12
        header = data[start:start + hlen].decode("latin1")
        body = data[start + hlen:]
        op = rng.choice(["shape", "descr", "order", "length"])
        if op == "length":
            v = rng.choice([0, 1, hlen + 50, 65535])
            return data[:8] + struct.pack("<H", v) + data[10:], f"{name}: npy header length {hlen} -> {v}"
        if op == "shape":
            v = rng.choice(["(1000000000000,)", "(-1,)", "(4611686018427387904, 4611686018427387904)", "()", "(0,)",
                            "(3, 'x')"])
            header = re.sub(r"'shape': \([^)]*\)", f"'shape': {v}", header)
        elif op == "descr":
            v = rng.choice(["'|O'", "'<U1000000'", "'V99999999'", "'<f8'", "'evil'", "[('a', '<i8')]"])
            header = re.sub(r"'descr': '[^']*'", f"'descr': {v}", header)
        else:
            v = "True"
            header = header.replace("False", "True")
        enc = header.encode("latin1")
        enc = enc.rstrip(b"\n ") + b" " * (-(len(enc) + start) % 64) + b"\n"
        return data[:8] + struct.pack("<H", len(enc)) + enc + body, f"{name}: npy {op} = {v}"

    # -- gzip ---------------------------------------------------------------------------------------
    def gz_(self, data: bytes) -> tuple[bytes, str]:
        rng = self.rng
        r = rng.random()
        if r < 0.2:
            return self.bytes_(data)
        try:
            plain = gzip.decompress(data)
        except Exception:  # noqa: BLE001 - OSError, EOFError, zlib.error: a damaged stream, mutate its bytes
            return self.bytes_(data)
        if r < 0.3:
            return data + data * rng.choice([1, 50]), "gzip members concatenated"
        new, desc = self.json_(plain)
        return gzip.compress(new, mtime=0), f"inside the gzip: {desc}"

    # -- dispatch -----------------------------------------------------------------------------------
    def mutate(self, kind: str, data: bytes) -> tuple[bytes, str]:
        if kind == "json":
            return self.json_(data)
        if kind == "jsonl":
            return self.jsonl_(data)
        if kind == "text":
            return self.text_(data)
        if kind == "pickle":
            return self.pickle_(data)
        if kind == "safetensors":
            return self.safetensors_(data)
        if kind == "pt":
            return self.zip_(data, lambda n, c: self.pickle_(c) if n.endswith(".pkl") else self.bytes_(c))
        if kind == "npz":
            return self.zip_(data, self.npy_, zipfile.ZIP_DEFLATED)
        if kind == "gz":
            return self.gz_(data)
        return self.bytes_(data)


class _Deep:
    """A JSON array nested ``depth`` deep, written without recursion."""

    def __init__(self, depth: int):
        self.depth = depth


def dumps(doc: Any) -> bytes:
    """JSON of ``doc`` (NaN and infinities as Python writes them; lone surrogates escaped)."""
    if isinstance(doc, _Deep):
        return b"[" * doc.depth + b"]" * doc.depth
    deep: list[_Deep] = []

    def default(o: Any) -> Any:
        if isinstance(o, _Deep):
            deep.append(o)
            return f"@@DEEP{len(deep) - 1}@@"
        raise TypeError(type(o).__name__)

    text = json.dumps(doc, default=default).encode("utf-8", "surrogatepass")
    for k, d in enumerate(deep):
        text = text.replace(f'"@@DEEP{k}@@"'.encode(), b"[" * d.depth + b"]" * d.depth)
    return text


_OPS: dict[bytes, list] = {}  # the bases' opcodes, parsed once in the parent (pickletools is slow)
_UNFRAMED: dict[bytes, bytes] = {}


def _key(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def genops(data: bytes) -> list:
    key = _key(data)
    ops = _OPS.get(key)
    if ops is None:
        ops = list(pickletools.genops(data))
    return ops


def unframe(data: bytes) -> bytes:
    key = _key(data)
    if key in _UNFRAMED:
        return _UNFRAMED[key]
    return _unframe(data, genops(data))


def prime(pickles: list[bytes]) -> None:
    """Parse the bases' pickles once (framed and not), before the children fork."""
    for data in pickles:
        _OPS[_key(data)] = list(pickletools.genops(data))
        flat = _unframe(data, _OPS[_key(data)])
        _UNFRAMED[_key(data)] = flat
        _OPS[_key(flat)] = list(pickletools.genops(flat))


def _unframe(data: bytes, ops: list) -> bytes:
    out, last = [], 0
    for op, _, pos in ops:
        if op.name == "FRAME":
            out.append(data[last:pos])
            last = pos + 9
    out.append(data[last:])
    return b"".join(out)


def _walk(doc: Any, path: tuple, out: list, limit: int) -> None:
    stack = [(doc, path)]
    while stack and len(out) < limit:
        node, p = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                out.append(p + (k,))
                stack.append((v, p + (k,)))
        elif isinstance(node, list):
            for k, v in enumerate(node[:200]):
                out.append(p + (k,))
                stack.append((v, p + (k,)))


def _at(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _short(v: Any) -> str:
    if isinstance(v, _Deep):
        return f"<array nested {v.depth} deep>"
    text = repr(v)
    return text if len(text) <= 60 else text[:40] + f"...<{len(text)} chars>"
