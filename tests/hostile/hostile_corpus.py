"""The adversarial corpus: hostile inputs for every reader, built at test time from the valid bases.

Each case is a function that writes one input under the task's root (``ctx.root``) and returns its path.
It may point out of the root, to the task's own ``outside/`` directory (a canary file, a FIFO, a secret)
or to ``/etc/passwd``, ``/dev/zero``, ``/proc/self/environ``. ``refuse=True``: the input is not a valid
file of its kind; a reader that reads it anyway is listed as "accepted" (for a look: ``inspect`` rightly
succeeds on a checkpoint whose data file, which it never opens, is a FIFO). ``refuse=False``: a valid
file built to be costly, or one a tolerant reader may read. Either way what may never happen is a crash, a
hang (``cpu_cap``: the bombs' own, tighter, CPU cap), an undeclared exception, a read outside, a changed
file or code run.

Families and their readers are in ``hostile_readers.FAMILY_READERS``; ``build_server_root`` lays the same
cases out under a JupyterLab server's root for ``test_hostile_server.py``.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import pickle
import shutil
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import hostile_pickles as P
from hostile_harness import Ctx, Task

FAMILY_OF = {"snapshot": "snapshot", "profiler": "profiler", "profiler_gz": "profiler", "timeline": "timeline",
             "dcp": "checkpoint", "dcp_plain": "checkpoint", "hf": "checkpoint", "safetensors": "checkpoint",
             "torch": "checkpoint", "run": "run", "plan": "plan", "config": "config"}
SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Case:
    name: str  # "<base format>/<what>"
    base: str  # the base format it starts from (decides the family)
    build: Callable[[Ctx], Path]
    refuse: bool = True
    cpu_cap: float | None = None  # CPU seconds for all its readers together (default: the harness's 8 s)

    @property
    def family(self) -> str:
        return FAMILY_OF[self.base]


CASES: list[Case] = []


def case(name: str, base: str, build: Callable[[Ctx], Path], refuse: bool = True, cpu_cap: float | None = None) -> None:
    full = f"{base}/{name}"
    assert all(c.name != full for c in CASES), full
    CASES.append(Case(full, base, build, refuse, cpu_cap))


class _Exploit:
    """Unpickled, it creates ``target``: a torch.save or pickle.dumps of it is the classic evil file."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

def base_copy(ctx: Ctx, fmt: str) -> Path:
    src = ctx.bases[fmt]
    dst = ctx.root / src.name
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copyfile(src, dst)
    return dst


def replace_file(p: Path, data: bytes | Callable[[Ctx], bytes] | None = None, *, link: str | None = None,
                 fifo: bool = False, directory: bool = False) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()
    if link is not None:
        p.symlink_to(link)
    elif fifo:
        os.mkfifo(p)
    elif directory:
        p.mkdir()
    else:
        p.write_bytes(data)  # type: ignore[arg-type]


def _target(ctx: Ctx, what: str) -> str:
    return {"canary": str(ctx.canary), "fifo": str(ctx.fifo), "passwd": "/etc/passwd", "zero": "/dev/zero",
            "environ": "/proc/self/environ", "outside": str(ctx.outside)}[what]


def file_case(name: str, base: str, data: Callable[[Ctx], bytes], refuse: bool = True, member: str = "",
              cpu_cap: float | None = None) -> None:
    """The base with one of its files (``member``; "" = the input itself) replaced by ``data(ctx)``."""
    def build(ctx: Ctx) -> Path:
        p = base_copy(ctx, base)
        replace_file(p / member if member else p, data(ctx))
        return p
    case(name, base, build, refuse, cpu_cap)


# A snapshot reader streams 60-75 MB/s (README). The megabyte bombs below (deep nesting, padding) are read
# by three readers (import, identify, one command); 2 CPU seconds for all three is still 4 MB/s or more
# for each full read, a fifteenth of that: a reader that slows to a crawl on them is caught here.
BOMB_CPU_S = 2.0


def special_cases(prefix: str, base: str, member: str = "", refuse: bool = True,
                  kinds: tuple[str, ...] = ("fifo", "zero", "canary", "passwd", "dir")) -> None:
    """The base with one file replaced by a FIFO, a link to /dev/zero, to the canary outside the root, to
    /etc/passwd, or a directory."""
    for kind in kinds:
        def build(ctx: Ctx, kind: str = kind) -> Path:
            p = base_copy(ctx, base)
            f = p / member if member else p
            if kind == "fifo":
                replace_file(f, fifo=True)
            elif kind == "dir":
                replace_file(f, directory=True)
            else:
                replace_file(f, link=_target(ctx, kind))
            return p
        what = {"fifo": "a FIFO", "zero": "a link to /dev/zero", "canary": "a link out of the root",
                "passwd": "a link to /etc/passwd", "dir": "a directory"}[kind]
        case(f"{prefix}{member or 'the file'} is {what}", base, build, refuse)


def gz_members(text: bytes, copies: int) -> bytes:
    one = gzip.compress(text, mtime=0)
    return one * copies


def zip_bomb_member(name: str, header: bytes, n: int) -> bytes:
    """A zip whose one member inflates to ``header`` + ``n`` zero bytes (n a multiple of 1 MiB). The
    deflate stream is one compressed MiB of zeros repeated (each ends on a full flush, so copies chain),
    built in milliseconds instead of deflating a gigabyte."""
    mib = b"\0" * (1 << 20)
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = co.compress(header) + co.flush(zlib.Z_FULL_FLUSH)
    block = co.compress(mib) + co.flush(zlib.Z_FULL_FLUSH)
    comp = head + block * (n >> 20) + co.flush(zlib.Z_FINISH)
    crc = zlib.crc32(header)
    for _ in range(n >> 20):
        crc = zlib.crc32(mib, crc)
    size = len(header) + (n >> 20 << 20)
    fname = name.encode()
    local = struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(comp) & 0xFFFFFFFF,
                        size & 0xFFFFFFFF, len(fname), 0) + fname
    central = struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(comp) & 0xFFFFFFFF,
                          size & 0xFFFFFFFF, len(fname), 0, 0, 0, 0, 0, 0) + fname
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 1, 1, len(central), len(local) + len(comp), 0)
    return local + comp + central + end


def rezip(src: bytes, replace: dict[str, bytes], add: dict[str, bytes] | None = None,
          compression: int = zipfile.ZIP_STORED) -> bytes:
    zin = zipfile.ZipFile(io.BytesIO(src))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zout:
        for info in zin.infolist():
            name = info.filename
            zout.writestr(name, next((v for k, v in replace.items() if name.endswith(k)), zin.read(info)))
        for k, v in (add or {}).items():
            zout.writestr(k, v)
    return buf.getvalue()


def zip_field(data: bytes, sig: bytes, offset: int, width: int, value: int) -> bytes:
    b = bytearray(data)
    at = data.index(sig) + offset
    b[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(b)


def safetensors(header: Any, payload: bytes = b"", length: int | None = None, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length % 2**64) + body + payload


def st_base(ctx: Ctx) -> tuple[dict, bytes]:
    data = ctx.bases["safetensors"].read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def st_edit(edit: Callable[[dict, bytes], Any]) -> Callable[[Ctx], bytes]:
    """The single-file base with its header edited (``edit`` changes it in place, or returns new bytes)."""
    def data(ctx: Ctx) -> bytes:
        header, payload = st_base(ctx)
        out = edit(header, payload)
        return out if isinstance(out, bytes) else safetensors(header, payload)
    return data


def first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def deep_json(depth: int, inner: bytes = b"") -> bytes:
    return b"[" * depth + inner + b"]" * depth


def metadata_paths(ctx: Ctx, step: Path, path: Callable[[Ctx, str], str]) -> None:
    """Rewrite a DCP step's .metadata (ours, trusted: torch unpickles it here) so every chunk lives at
    ``path(ctx, old)``."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(step)).read_metadata()
    md.storage_data = {k: dataclasses.replace(v, relative_path=path(ctx, v.relative_path))
                       for k, v in md.storage_data.items()}
    (step / ".metadata").write_bytes(pickle.dumps(md))


def json_edit(base: str, member: str, edit: Callable[[Any, Ctx], Any]) -> Callable[[Ctx], bytes]:
    def data(ctx: Ctx) -> bytes:
        src = ctx.bases[base] / member if member else ctx.bases[base]
        doc = json.loads(src.read_bytes())
        out = edit(doc, ctx)
        return out if isinstance(out, bytes) else json.dumps(doc if out is None else out).encode()
    return data


def _set(path: str, value: Any) -> Callable[[Any, Ctx], None]:
    keys = path.split("/")

    def edit(doc: Any, ctx: Ctx) -> None:
        d = doc
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value(ctx) if callable(value) else value
    return edit


NON_UTF8 = b"\xff\xfe\xc3\x28"

# --------------------------------------------------------------------------------------------------
# snapshots (.pickle)
# --------------------------------------------------------------------------------------------------

_EVIL = {
    "GLOBAL posix.system + REDUCE": lambda c: P.evil_system(f"touch {c.marker}"),
    "STACK_GLOBAL builtins.exec + REDUCE": lambda c: P.evil_stack_global(f"touch {c.marker}"),
    "GLOBAL builtins.open + REDUCE": lambda c: P.evil_open(str(c.marker)),
    "INST os.system": lambda c: P.evil_inst(f"touch {c.marker}"),
    "OBJ os.system": lambda c: P.evil_obj(f"touch {c.marker}"),
    "NEWOBJ OrderedDict": lambda c: P.evil_newobj(),
    "BUILD": lambda c: P.evil_build(),
    "PERSID": lambda c: P.evil_persid(),
    "BINPERSID": lambda c: P.evil_binpersid(),
    "EXT1": lambda c: P.evil_ext(),
}
for _name, _value in _EVIL.items():
    file_case(f"evil pickle: {_name}", "snapshot", lambda c, v=_value: P.wrap(v(c)))
file_case("evil pickle: protocol 0 GLOBAL", "snapshot",
          lambda c: b"(dp0\nS'device_traces'\np1\n" + P.evil_system(f"touch {c.marker}") + b"s.")
file_case("evil pickle: pickle.dumps of a __reduce__ object", "snapshot",
          lambda c: pickle.dumps({"segments": [], "device_traces": [[{
              "action": "alloc", "addr": 1, "size": 8, "time_us": 1, "frames": [_Exploit(str(c.marker))]}]]}))
file_case("tuple nested 10^6 deep as a dict key", "snapshot", lambda c: P.wrap(P.deep_tuple_key(1_000_000)),
          cpu_cap=BOMB_CPU_S)
file_case("tuple nested 10^6 deep in a set", "snapshot", lambda c: P.wrap(P.deep_set_member(1_000_000)),
          cpu_cap=BOMB_CPU_S)
file_case("list nested 10^6 deep", "snapshot", lambda c: P.wrap(P.deep_list(1_000_000)), cpu_cap=BOMB_CPU_S)
file_case("dict nested 10^5 deep", "snapshot", lambda c: P.wrap(P.deep_dict(100_000)), cpu_cap=BOMB_CPU_S)
file_case("shared tuples 10^30 wide as a dict key", "snapshot", lambda c: P.wrap(P.laughs(30)), refuse=False)
file_case("list that contains itself as a dict key", "snapshot", lambda c: P.wrap(P.self_reference()))
file_case("memo bomb: 40 PUTs 2^24 apart", "snapshot", lambda c: P.wrap(P.memo_bomb(40)))
file_case("memo bomb: one PUT at 2^31", "snapshot", lambda c: P.wrap(P.NONE + b"r" + struct.pack("<I", 2**31 - 1)))
file_case("GET of a memo slot never PUT", "snapshot", lambda c: P.wrap(P.memo_get_far()))
file_case("10^6 MARKs left open", "snapshot", lambda c: P.wrap(P.many_marks(1_000_000)), cpu_cap=BOMB_CPU_S)


def _padded(ctx: Ctx, pad: bytes) -> bytes:
    data = ctx.bases["snapshot"].read_bytes()
    return data[:2] + P.NONE + pad + P.POP + data[2:]  # after PROTO, before the first FRAME: a valid pickle


file_case("4 MB of DUP/POP before a valid snapshot", "snapshot", lambda c: _padded(c, (P.DUP + P.POP) * 2_000_000),
          refuse=False, cpu_cap=BOMB_CPU_S)
file_case("4 MB of MARK/POP_MARK before a valid snapshot", "snapshot",
          lambda c: _padded(c, (P.MARK + P.POP_MARK) * 2_000_000), refuse=False, cpu_cap=BOMB_CPU_S)
file_case("BINUNICODE8 claiming 2^60 bytes", "snapshot", lambda c: P.wrap(P.binunicode8_claiming(2**60, b"x")))
file_case("BINBYTES8 claiming 2^62 bytes", "snapshot", lambda c: P.wrap(P.binbytes8_claiming(2**62, b"x")))
file_case("BINUNICODE claiming 2^32-1 bytes", "snapshot", lambda c: P.wrap(P.binunicode_claiming(2**32 - 1)))
file_case("FRAME claiming 2^62 bytes", "snapshot", lambda c: P.PROTO4 + P.frame_claiming(2**62) + P.wrap(P.NONE)[2:])
file_case("LONG4 claiming 2^31 bytes", "snapshot", lambda c: P.wrap(P.long4_claiming(2**31 - 1, b"\x01")))
file_case("BINSTRING claiming 2^31 bytes", "snapshot", lambda c: P.wrap(P.binstring_claiming(2**31 - 1, b"x")))
file_case("truncated to half", "snapshot", lambda c: c.bases["snapshot"].read_bytes()[:13_000])
file_case("truncated to 8 bytes", "snapshot", lambda c: c.bases["snapshot"].read_bytes()[:8])
file_case("empty", "snapshot", lambda c: b"")
file_case("JSON named .pickle", "snapshot", lambda c: b'{"device_traces": []}')
file_case("random bytes after a pickle header", "snapshot",
          lambda c: b"\x80\x04" + bytes((i * 7919 + 13) % 256 for i in range(4096)))
file_case("a list, not a dict", "snapshot", lambda c: pickle.dumps([["segments", "device_traces"]]))


def _trace(entry_ops: bytes) -> bytes:
    """``{"segments": [], "device_traces": [[<entry>]]}`` with the entry's opcodes written by hand."""
    return P.wrap(P.EMPTY_LIST + P.EMPTY_LIST + entry_ops + P.APPEND + P.APPEND)


def _entry(**fields: bytes) -> bytes:
    out = P.EMPTY_DICT + P.MARK
    for k, v in fields.items():
        out += P.s(k) + v
    return out + P.SETITEMS


_GOOD = dict(action=P.s("alloc"), addr=P.i(4096), size=P.i(512), stream=P.i(0), time_us=P.i(1),
             frames=P.EMPTY_LIST + P.EMPTY_DICT + P.MARK + P.s("filename") + P.s("f.py") + P.s("line") + P.i(1)
             + P.s("name") + P.s("forward") + P.SETITEMS + P.APPEND)
file_case("a frame's file name that is not UTF-8", "snapshot", lambda c: _trace(_entry(**{
    **_GOOD, "frames": P.EMPTY_LIST + P.EMPTY_DICT + P.MARK + P.s("filename") + P.s(NON_UTF8) + P.s("line") + P.i(1)
    + P.s("name") + P.s("f") + P.SETITEMS + P.APPEND})), refuse=False)
for _field, _bad in {"size": P.s("big"), "addr": P.i(-1), "time_us": P.i(2**70), "action": P.i(7),
                     "size ": P.i(2**64), "frames": P.i(5), "stream": P.s("x")}.items():
    file_case(f"a trace entry whose {_field.strip()} is {_bad!r}", "snapshot",
              lambda c, f=_field, b=_bad: _trace(_entry(**{**_GOOD, f.strip(): b})), refuse=False)
file_case("device_traces is an int", "snapshot", lambda c: P.wrap(P.i(5)))
file_case("device_traces is a string", "snapshot", lambda c: P.wrap(P.s("x")))
file_case("device_traces holds an int", "snapshot", lambda c: P.wrap(P.EMPTY_LIST + P.EMPTY_LIST + P.i(5) + P.APPEND
                                                                     + P.APPEND), refuse=False)
special_cases("", "snapshot", kinds=("fifo", "zero", "dir"))


def _snapshot_dir(kind: str) -> Callable[[Ctx], Path]:
    """A directory of snapshots (import_snapshots reads every *.pickle) whose rank1 is hostile."""
    def build(ctx: Ctx) -> Path:
        d = ctx.root / "snapshots"
        d.mkdir()
        shutil.copyfile(ctx.bases["snapshot"], d / "rank0.pickle")
        if kind == "fifo":
            os.mkfifo(d / "rank1.pickle")
        else:
            (d / "rank1.pickle").symlink_to(_target(ctx, kind))
        return d
    return build


for _kind in ("fifo", "canary", "passwd", "zero"):
    case(f"a directory whose rank1.pickle is {_kind}", "snapshot", _snapshot_dir(_kind), refuse=False)

# --------------------------------------------------------------------------------------------------
# profiler traces (.json, .json.gz)
# --------------------------------------------------------------------------------------------------


def _memory_arg(key: str, value: Any) -> Callable[[Any, Ctx], None]:
    def edit(doc: Any, ctx: Ctx) -> None:
        for e in doc["traceEvents"]:
            if e.get("name") == "[memory]":
                e["args"][key] = value
    return edit


file_case("a string that is not UTF-8", "profiler",
          json_edit("profiler", "", lambda d, c: json.dumps(d).encode().replace(b'"[memory]"', b'"[memory\xff]"', 1)))
file_case("traceEvents nested 10^5 deep", "profiler", lambda c: b'{"traceEvents": ' + deep_json(100_000) + b"}")
file_case("args nested 10^5 deep", "profiler",
          lambda c: b'{"traceEvents": [{"name": "[memory]", "ph": "i", "ts": 1, "args": ' + deep_json(100_000) + b"}]}")
for _key, _value in {"Bytes": 1e400, "Bytes ": 10**30, "Total Allocated": "x", "Addr": "0x10", "Device Type": "x",
                     "Device Id": [1], "Bytes  ": None, "Ev Idx": {"a": 1}}.items():
    file_case(f"memory events whose {_key.strip()} is {_value!r}", "profiler",
              json_edit("profiler", "", _memory_arg(_key.strip(), _value)), refuse=False)
file_case("memory events whose ts is a string", "profiler",
          json_edit("profiler", "", lambda d, c: [e.update(ts="abc") for e in d["traceEvents"]] and None), refuse=False)
file_case("memory events whose ts is NaN", "profiler",
          json_edit("profiler", "", lambda d, c: [e.update(ts=float("nan")) for e in d["traceEvents"]] and None),
          refuse=False)
file_case("spans whose dur is -1e308", "profiler",
          json_edit("profiler", "", lambda d, c: [e.update(dur=-1e308) for e in d["traceEvents"] if "dur" in e]
                    and None),
          refuse=False)
file_case("args is a list", "profiler",
          json_edit("profiler", "", lambda d, c: [e.update(args=[1]) for e in d["traceEvents"]] and None))
file_case("traceEvents is a dict", "profiler", lambda c: b'{"traceEvents": {"0": {"name": "[memory]"}}}')
file_case("traceEvents holds numbers", "profiler", lambda c: b'{"traceEvents": [1, 2, "x", null]}')
file_case("empty", "profiler", lambda c: b"")
file_case("null", "profiler", lambda c: b"null")
file_case("1e999", "profiler", lambda c: b"1e999")
file_case("a 20 MB string", "profiler", lambda c: b'{"traceEvents": [], "x": "' + b"a" * (20 << 20) + b'"}')
special_cases("", "profiler", kinds=("fifo", "zero", "dir"))
file_case("gzip that inflates to 256 MB", "profiler_gz",
          lambda c: gz_members(b'{"traceEvents": []}' + b" " * ((1 << 20) - 19), 256), refuse=False)
file_case("gzip truncated", "profiler_gz", lambda c: c.bases["profiler_gz"].read_bytes()[:200])
file_case("gzip with a bad CRC", "profiler_gz",
          lambda c: (lambda d: d[:-8] + bytes([d[-8] ^ 1]) + d[-7:])(c.bases["profiler_gz"].read_bytes()))
file_case("gzip of bytes that are not UTF-8", "profiler_gz", lambda c: gzip.compress(b'{"traceEvents": ["\xff"]}'))
file_case("gzip of JSON nested 10^5 deep", "profiler_gz",
          lambda c: gzip.compress(b'{"traceEvents": ' + deep_json(100_000) + b"}"))
file_case("a .json.gz that is not gzip", "profiler_gz", lambda c: b"\x1f\x8bnot gzip at all")

# --------------------------------------------------------------------------------------------------
# saved timelines (rank*.json + rank*.npz)
# --------------------------------------------------------------------------------------------------

file_case("rank0.json not UTF-8", "timeline", lambda c: b'{"format": "workbench.memory_timeline", "x": "\xff"}',
          member="rank0.json")
file_case("rank0.json nested 10^5 deep", "timeline",
          lambda c: b'{"format": "workbench.memory_timeline", "meta": ' + deep_json(100_000) + b"}",
          member="rank0.json")
for _key, _value in {"rank": "abc", "rank ": 1e30, "rank  ": -5, "rank   ": "../../outside/secret", "base_bytes": "x",
                     "base_bytes ": 1e400, "meta": [1, 2], "meta ": {"base_by_category": 5},
                     "source": {"a": []}}.items():
    file_case(f"rank0.json whose {_key.strip()} is {_value!r}", "timeline",
              json_edit("timeline", "rank0.json", _set(_key.strip(), _value)), member="rank0.json")
file_case("rank0.json is a list", "timeline", lambda c: b"[1]", member="rank0.json")
file_case("rank0.npz is text", "timeline", lambda c: b"not a zip", member="rank0.npz")


def _npz_edit(replace: Callable[[bytes], dict[str, bytes]],
              add: dict[str, bytes] | None = None) -> Callable[[Ctx], bytes]:
    def data(ctx: Ctx) -> bytes:
        src = (ctx.bases["timeline"] / "rank0.npz").read_bytes()
        return rezip(src, replace(src), add, zipfile.ZIP_DEFLATED)
    return data


def _npy(descr: str, shape: str, body: bytes = b"") -> bytes:
    header = f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}".encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + body


file_case("an object array in the npz", "timeline",
          _npz_edit(lambda s: {"t.npy": _npy("'|O'", "(2,)", pickle.dumps([1, 2]))}), member="rank0.npz")
file_case("an npy claiming 10^12 elements", "timeline",
          _npz_edit(lambda s: {"t.npy": _npy("'<f8'", "(1000000000000,)", b"\0" * 64)}), member="rank0.npz")
file_case("an npy claiming 2^62 x 2^62", "timeline",
          _npz_edit(lambda s: {"t.npy": _npy("'<f8'", "(4611686018427387904, 4611686018427387904)")}),
          member="rank0.npz")
file_case("an npy of 10^6-char strings", "timeline",
          _npz_edit(lambda s: {"op__vocab.npy": _npy("'<U1000000'", "(100,)")}), member="rank0.npz")
file_case("an npz member that inflates to 1 GiB", "timeline",
          lambda c: zip_bomb_member("t.npy", _npy("'<f8'", "(134217728,)"), 1 << 30), member="rank0.npz")
file_case("an npz whose directory claims 4 GiB", "timeline",
          lambda c: zip_field((c.bases["timeline"] / "rank0.npz").read_bytes(), b"PK\x01\x02", 24, 4, 2**32 - 1),
          member="rank0.npz")
file_case("an npz whose directory offset lies", "timeline",
          lambda c: zip_field((c.bases["timeline"] / "rank0.npz").read_bytes(), b"PK\x05\x06", 16, 4, 2**31),
          member="rank0.npz")
special_cases("", "timeline", member="rank0.json")
special_cases("", "timeline", member="rank0.npz")

# --------------------------------------------------------------------------------------------------
# checkpoints: DCP (.metadata, *.distcp, workbench.json), HF, safetensors, torch.save
# --------------------------------------------------------------------------------------------------

for _name, _value in list(_EVIL.items())[:5]:
    file_case(f".metadata evil pickle: {_name}", "dcp", lambda c, v=_value: P.PROTO4 + v(c) + P.STOP,
              member=".metadata")
file_case(".metadata evil pickle: pickle.dumps of a __reduce__ object", "dcp",
          lambda c: pickle.dumps(_Exploit(str(c.marker))), member=".metadata")
file_case(".metadata evil pickle: DCP's Metadata class with an evil argument", "dcp",
          lambda c: P.PROTO4 + P.s("torch.distributed.checkpoint.metadata") + P.s("Metadata") + P.STACK_GLOBAL
          + P.evil_system(f"touch {c.marker}") + P.TUPLE1 + P.REDUCE + P.STOP, member=".metadata")
file_case(".metadata evil pickle: an allowed class, os.system as its state", "dcp",
          lambda c: P.PROTO4 + P.s("torch.distributed.checkpoint.metadata") + P.s("Metadata") + P.STACK_GLOBAL
          + P.EMPTY_TUPLE + P.NEWOBJ + P.evil_system(f"touch {c.marker}") + P.BUILD + P.STOP, member=".metadata")
file_case("evil pickle in a plain DCP's .metadata", "dcp_plain",
          lambda c: P.PROTO4 + P.evil_system(f"touch {c.marker}") + P.STOP, member=".metadata")
file_case(".metadata tuple nested 10^6 deep as a dict key", "dcp",
          lambda c: P.PROTO4 + P.deep_tuple_key(1_000_000) + P.STOP, member=".metadata")
file_case(".metadata list nested 10^5 deep", "dcp", lambda c: P.PROTO4 + P.deep_list(100_000) + P.STOP,
          member=".metadata")
file_case(".metadata memo bomb", "dcp", lambda c: P.PROTO4 + P.memo_bomb(40) + P.STOP, member=".metadata")
file_case(".metadata BINUNICODE8 claiming 2^60", "dcp", lambda c: P.PROTO4 + P.binunicode8_claiming(2**60) + P.STOP,
          member=".metadata")
file_case(".metadata shared tuples 10^30 wide", "dcp", lambda c: P.PROTO4 + P.laughs(30) + P.STOP,
          member=".metadata")
file_case(".metadata with 4 MB of DUP/POP", "dcp", lambda c: (lambda d: d[:2] + P.NONE + (P.DUP + P.POP) * 2_000_000
                                                               + P.POP + d[2:])(
    (c.bases["dcp"] / ".metadata").read_bytes()), member=".metadata", refuse=False)
file_case(".metadata truncated", "dcp", lambda c: (c.bases["dcp"] / ".metadata").read_bytes()[:7000],
          member=".metadata")
file_case(".metadata empty", "dcp", lambda c: b"", member=".metadata")
special_cases("", "dcp", member=".metadata")
special_cases("", "dcp", member="__0_0.distcp", kinds=("fifo", "zero", "canary"))
file_case("__0_0.distcp truncated to 10 bytes", "dcp", lambda c: (c.bases["dcp"] / "__0_0.distcp").read_bytes()[:10],
          member="__0_0.distcp")


def _sparse(member: str, size: int) -> Callable[[Ctx], Path]:
    def build(ctx: Ctx) -> Path:
        p = base_copy(ctx, "dcp")
        with open(p / member, "r+b") as f:
            f.truncate(size)
        return p
    return build


case("__0_0.distcp grown to 64 GiB (sparse)", "dcp", _sparse("__0_0.distcp", 64 << 30))


def _escape(where: str, base: str = "dcp") -> Callable[[Ctx], Path]:
    def build(ctx: Ctx) -> Path:
        p = base_copy(ctx, base)
        shutil.copyfile(p / "__0_0.distcp", ctx.outside / "__0_0.distcp")

        def path(c: Ctx, old: str) -> str:
            return {"dotdot": os.path.relpath(c.outside / "__0_0.distcp", p),
                    "absolute": str(c.outside / "__0_0.distcp"), "passwd": "/etc/passwd", "zero": "/dev/zero",
                    "fifo": str(c.fifo),
                    "canary": os.path.relpath(c.canary, p)}[where]
        metadata_paths(ctx, p, path)
        return p
    return build


for _where in ("dotdot", "absolute", "passwd", "zero", "fifo", "canary"):
    case(f".metadata naming data files outside ({_where})", "dcp", _escape(_where))
case(".metadata of a plain DCP naming data files outside", "dcp_plain", _escape("dotdot", "dcp_plain"))

file_case("workbench.json not UTF-8", "dcp", lambda c: b'{"format": "workbench-checkpoint", "x": "\xff\xfe"}',
          member="workbench.json")
file_case("workbench.json nested 10^5 deep", "dcp", lambda c: deep_json(100_000), member="workbench.json")
file_case("workbench.json is a list", "dcp", lambda c: b"[]", member="workbench.json")


def _files_outside(kind: str) -> Callable[[Ctx], Path]:
    def build(ctx: Ctx) -> Path:
        p = base_copy(ctx, "dcp")
        doc = json.loads((p / "workbench.json").read_text())
        name = {"dotdot": os.path.relpath(ctx.canary, p), "passwd": "/etc/passwd", "zero": "/dev/zero",
                "fifo": str(ctx.fifo), "environ": "/proc/self/environ"}[kind]
        first = next(iter(doc["files"].values()))
        doc["files"][name] = dict(first)
        (p / "workbench.json").write_text(json.dumps(doc))
        return p
    return build


for _kind in ("dotdot", "passwd", "zero", "fifo", "environ"):
    case(f"workbench.json lists a file outside ({_kind})", "dcp", _files_outside(_kind))
for _path, _value in {"files/__0_0.distcp/bytes": 10**30, "files/__0_1.distcp": "x", "step": "x", "world_size": -1,
                      "layout": {"tp": 0}, "job": {"model": {"dim": 1e30}}, "job ": {"model": [1]}, "quant": {"x": 5},
                      "spans": {"x": [[1e300]]}, "checksum": "md5", "files": [], "kinds": 5}.items():
    file_case(f"workbench.json {_path.strip()} = {_value!r}", "dcp",
              json_edit("dcp", "workbench.json", _set(_path.strip(), _value)), member="workbench.json")
file_case("workbench.json lists 10k files", "dcp", json_edit("dcp", "workbench.json", _set(
    "files", {f"__9_{i}.distcp": {"bytes": 1, "xxh3_128": "0" * 32} for i in range(10_000)})), member="workbench.json")

# HF: the index and the shard it names
for _kind in ("passwd", "dotdot", "fifo", "zero", "canary", "environ", "empty", "dir", "infifo"):
    def _hf_build(ctx: Ctx, kind: str = _kind) -> Path:
        p = base_copy(ctx, "hf")
        doc = json.loads((p / INDEX).read_text())
        target = {"passwd": "/etc/passwd", "dotdot": os.path.relpath(ctx.canary, p), "fifo": str(ctx.fifo),
                  "zero": "/dev/zero", "canary": str(ctx.canary), "environ": "/proc/self/environ", "empty": "",
                  "dir": ".", "infifo": "fifo.safetensors"}[kind]
        if kind == "infifo":
            os.mkfifo(p / "fifo.safetensors")
        first = next(iter(doc["weight_map"]))
        doc["weight_map"][first] = target
        (p / INDEX).write_text(json.dumps(doc))
        return p
    case(f"index names a shard {_kind}", "hf", _hf_build)
file_case("index not UTF-8", "hf", lambda c: b'{"weight_map": {"a": "\xff.safetensors"}}', member=INDEX)
file_case("index nested 10^5 deep", "hf", lambda c: b'{"weight_map": ' + deep_json(100_000) + b"}", member=INDEX)
file_case("index weight_map is a list", "hf", lambda c: b'{"weight_map": ["model-00001-of-00001.safetensors"]}',
          member=INDEX)
file_case("index total_size = 1e30", "hf", json_edit("hf", INDEX, _set("metadata/total_size", 1e30)), member=INDEX,
          refuse=False)
file_case("index with 10k keys on one shard", "hf", json_edit("hf", INDEX, lambda d, c: d["weight_map"].update(
    {f"x.{i}": SHARD for i in range(10_000)})), member=INDEX)
special_cases("", "hf", member=SHARD, kinds=("fifo", "zero", "canary"))
file_case("config.json nested 10^5 deep", "hf", lambda c: deep_json(100_000), member="config.json", refuse=False)
file_case("config.json not UTF-8", "hf", lambda c: b'{"x": "\xff"}', member="config.json", refuse=False)

# safetensors headers: in the HF shard, and as one file
_ST_EDITS: dict[str, Callable[[dict, bytes], Any]] = {
    "header length 2^63-1": lambda h, p: safetensors(h, p, length=2**63 - 1),
    "header length 2^64-1": lambda h, p: safetensors(h, p, length=2**64 - 1),
    "header length past the end": lambda h, p: safetensors(h, p, length=len(json.dumps(h)) + len(p) + 100),
    "header length 0": lambda h, p: safetensors(h, p, length=0),
    "header not UTF-8": lambda h, p: safetensors(None, p, raw=json.dumps(h).encode().replace(b'"F32"', b'"F\xff2"')),
    "header nested 10^5 deep": lambda h, p: safetensors(None, p, raw=deep_json(100_000)),
    "header is a list": lambda h, p: safetensors([1, 2], p),
    "dtype 'evil'": lambda h, p: first_tensor(h).update(dtype="evil"),
    "dtype F64 over F32 bytes": lambda h, p: first_tensor(h).update(dtype="F64"),
    "shape [-1]": lambda h, p: first_tensor(h).update(shape=[-1]),
    "shape [2^40, 2^40]": lambda h, p: first_tensor(h).update(shape=[2**40, 2**40]),
    "shape ['x']": lambda h, p: first_tensor(h).update(shape=["x"]),
    "data_offsets past the end": lambda h, p: first_tensor(h).update(data_offsets=[0, len(p) + 1000]),
    "data_offsets reversed": lambda h, p: first_tensor(h).update(data_offsets=first_tensor(h)["data_offsets"][::-1]),
    "data_offsets [0, 2^62]": lambda h, p: first_tensor(h).update(data_offsets=[0, 2**62]),
    "data_offsets negative": lambda h, p: first_tensor(h).update(data_offsets=[-8, 4]),
    "data_offsets strings": lambda h, p: first_tensor(h).update(data_offsets=["0", "4"]),
    "__metadata__ not strings": lambda h, p: h.update(__metadata__={"format": ["pt"], "k": {"a": 1}}),
    "10k entries": lambda h, p: h.update({f"x.{i}": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
                                          for i in range(10_000)}),
}
for _name, _edit in _ST_EDITS.items():
    file_case(f"{_name}", "safetensors", st_edit(_edit), refuse=_name != "10k entries")
for _name in ("header length 2^63-1", "header not UTF-8", "header nested 10^5 deep", "dtype 'evil'",
              "data_offsets past the end", "shape [2^40, 2^40]"):
    file_case(f"shard {_name}", "hf", lambda c, e=_ST_EDITS[_name]: (lambda h, p: (
        lambda out: out if isinstance(out, bytes) else safetensors(h, p))(e(h, p)))(*_hf_shard(c)), member=SHARD)


def _hf_shard(ctx: Ctx) -> tuple[dict, bytes]:
    data = (ctx.bases["hf"] / SHARD).read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


file_case("empty", "safetensors", lambda c: b"")
file_case("7 bytes", "safetensors", lambda c: b"\x10\0\0\0\0\0\0")
special_cases("", "safetensors", kinds=("fifo", "zero", "dir"))

# torch.save zips
file_case("torch.save of a __reduce__ object", "torch", lambda c: _torch_save_exploit(c))


def _torch_save_exploit(ctx: Ctx) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"model.output.weight": torch.ones(2), "x": _Exploit(str(ctx.marker))}, buf)
    return buf.getvalue()


def _pt(replace: dict[str, Callable[[Ctx], bytes]]) -> Callable[[Ctx], bytes]:
    return lambda c: rezip(c.bases["torch"].read_bytes(), {k: v(c) for k, v in replace.items()})


file_case("data.pkl: GLOBAL posix.system", "torch", _pt({"data.pkl": lambda c: P.PROTO2 + P.evil_system(
    f"touch {c.marker}") + P.STOP}))
file_case("data.pkl: tuple nested 10^6 deep as a key", "torch",
          _pt({"data.pkl": lambda c: P.PROTO2 + P.deep_tuple_key(1_000_000) + P.STOP}))
file_case("data.pkl: memo bomb", "torch", _pt({"data.pkl": lambda c: P.PROTO2 + P.memo_bomb(40) + P.STOP}))
file_case("data.pkl: shared tuples 10^30 wide", "torch", _pt({"data.pkl": lambda c: P.PROTO2 + P.laughs(30) + P.STOP}))
file_case("data.pkl: 4 MB of DUP/POP", "torch", _pt({"data.pkl": lambda c: P.PROTO2 + P.NONE + (P.DUP + P.POP)
                                                     * 2_000_000 + P.STOP}), refuse=False)
file_case("zip directory: a member claims 4 GiB", "torch",
          lambda c: zip_field(c.bases["torch"].read_bytes(), b"PK\x01\x02", 24, 4, 2**32 - 1))
file_case("zip directory: a local header past the end", "torch",
          lambda c: zip_field(c.bases["torch"].read_bytes(), b"PK\x01\x02", 42, 4, 2**31))
file_case("zip directory: 65535 entries", "torch",
          lambda c: zip_field(c.bases["torch"].read_bytes(), b"PK\x05\x06", 10, 2, 65535))
file_case("zip directory: offset past the end", "torch",
          lambda c: zip_field(c.bases["torch"].read_bytes(), b"PK\x05\x06", 16, 4, 2**31))
file_case("zip member that inflates to 1 GiB", "torch", lambda c: zip_bomb_member("model/data.pkl", b"", 1 << 30))
file_case("zip member named ../../outside", "torch",
          lambda c: rezip(c.bases["torch"].read_bytes(), {}, {"../../outside/canary.safetensors": b"x"}))
file_case("legacy (not zip) torch file: GLOBAL posix.system", "torch",
          lambda c: P.PROTO2 + P.evil_system(f"touch {c.marker}") + P.STOP)
file_case("truncated", "torch", lambda c: c.bases["torch"].read_bytes()[:3000])
file_case("empty", "torch", lambda c: b"")
special_cases("", "torch", kinds=("fifo", "zero", "dir"))

# --------------------------------------------------------------------------------------------------
# run directories (events.jsonl, config.json, checkpoints/latest)
# --------------------------------------------------------------------------------------------------


def _events_plus(*lines: bytes) -> Callable[[Ctx], bytes]:
    return lambda c: (c.bases["run"] / "events.jsonl").read_bytes() + b"\n".join(lines) + b"\n"


_BAD_LINES = {
    "a line that is not UTF-8": b'{"type": "step", "rank": 0, "x": "\xff\xfe"}',
    "a line nested 10^5 deep": deep_json(100_000),
    "lines that are not objects": b'[1, 2]\n42\n"text"\nnull\ntrue',
    "steps with wrong types": b'{"type": "step", "rank": "x", "step": [1], "loss": "nan", "mem_bytes": 1e400}',
    "a step whose rank is 1e400": b'{"type": "step", "rank": 1e400, "step": 1}',
    "schedule events with garbage": b'{"type": "schedule", "rank": 0, "step": 1, "actions": [{}]}\n'
                                    b'{"type": "schedule", "rank": "0", "step": null, "actions": 5}',
    "a pipeline event with wrong types": b'{"type": "pipeline", "rank": [], "schedule": {}, "microbatches": "x"}',
    "checkpoint events pointing out": b'{"type": "checkpoint", "rank": 0, "step": 1, "path": "/etc"}\n'
                                      b'{"type": "checkpoint", "rank": 0, "step": 2, "path": "../outside"}\n'
                                      b'{"type": "checkpoint", "rank": 0, "step": 3, "path": ["x"]}',
    "an error event with wrong types": b'{"type": "error", "rank": 0, "message": 5, "traceback": [1], "time": "x"}',
    "a run_end with a list status": b'{"type": "run_end", "rank": -1, "status": ["x"]}',
    "a 4 MB line": b'{"type": "step", "rank": 0, "x": "' + b"a" * (4 << 20) + b'"}',
    "50k empty events": b'{"type": "step", "rank": 0, "step": 0}\n' * 50_000,
}
for _name, _line in _BAD_LINES.items():
    file_case(f"events.jsonl: {_name}", "run", _events_plus(_line), member="events.jsonl", refuse=False)
special_cases("", "run", member="events.jsonl", refuse=False, kinds=("fifo", "zero", "canary", "passwd", "dir"))
for _name, _data in {"a list": b"[1]", "nested 10^5 deep": deep_json(100_000), "not UTF-8": b'{"model": "\xff"}',
                     "model is 5": b'{"model": 5, "parallel": {}, "train": {}}',
                     "tp is 'x'": b'{"model": {}, "parallel": {"tp": "x"}, "train": {}}',
                     "1e400": b"1e400"}.items():
    file_case(f"config.json {_name}", "run", lambda c, d=_data: d, member="config.json", refuse=False)
special_cases("", "run", member="config.json", refuse=False, kinds=("fifo", "zero", "canary"))
for _name, _data in {"../../outside": b"../../outside", "/etc": b"/etc", "not UTF-8": b"\xff\xfe",
                     "step-999999": b"step-999999", "50 KB": b"step-" + b"9" * 50_000}.items():
    file_case(f"checkpoints/latest = {_name}", "run", lambda c, d=_data: d, member="checkpoints/latest", refuse=False)
special_cases("", "run", member="checkpoints/latest", refuse=False, kinds=("fifo", "canary", "zero"))


def _step_outside(ctx: Ctx) -> Path:
    p = base_copy(ctx, "run")
    step = p / "checkpoints" / "step-000001"
    shutil.move(str(step), str(ctx.outside / "step-000001"))
    step.symlink_to(ctx.outside / "step-000001")
    return p


case("checkpoints/step-000001 links out of the root", "run", _step_outside, refuse=False)

# --------------------------------------------------------------------------------------------------
# plan JSON and model config.json
# --------------------------------------------------------------------------------------------------

for _name, _data in {"nested 10^5 deep": lambda c: deep_json(100_000),
                     "not UTF-8": lambda c: b'{"summary": "\xff", "parallel": {}, "tensors": []}',
                     "a list": lambda c: b"[1]",
                     "summary is 5": lambda c: b'{"summary": 5, "parallel": {}, "tensors": []}',
                     "tensors hold numbers": json_edit("plan", "", _set("tensors", [5, "x", None])),
                     "dp_shard = 10^6": json_edit("plan", "", _set("parallel/dp_shard", 10**6)),
                     "dp_shard = 10^12": json_edit("plan", "", _set("parallel/dp_shard", 10**12)),
                     "tp = 0": json_edit("plan", "", _set("parallel/tp", 0)),
                     "tp = -1": json_edit("plan", "", _set("parallel/tp", -1)),
                     "10k tensors": json_edit("plan", "", lambda d, c: d["tensors"].extend(d["tensors"][:1] * 10_000)),
                     "numbers 1e308": json_edit("plan", "", _set("train/global_batch", 1e308)),
                     "model dim 1e30": json_edit("plan", "", _set("model/dim", 1e30))}.items():
    file_case(_name, "plan", _data, refuse=_name not in ("10k tensors",))
special_cases("", "plan", kinds=("fifo", "zero", "dir"))

for _name, _data in {"a list": lambda c: b"[1]", "nested 10^5 deep": lambda c: deep_json(100_000),
                     "not UTF-8": lambda c: b'{"hidden_size": 16, "x": "\xff"}',
                     "hidden_size = 1e30": json_edit("config", "", _set("hidden_size", 1e30)),
                     "hidden_size = 10^30": json_edit("config", "", _set("hidden_size", 10**30)),
                     "num_hidden_layers = 10^5": json_edit("config", "", _set("num_hidden_layers", 100_000)),
                     "num_hidden_layers = '2'": json_edit("config", "", _set("num_hidden_layers", "2")),
                     "hidden_size = -16": json_edit("config", "", _set("hidden_size", -16)),
                     "num_attention_heads = 0": json_edit("config", "", _set("num_attention_heads", 0)),
                     "vocab_size = 0": json_edit("config", "", _set("vocab_size", 0)),
                     "rms_norm_eps = 'x'": json_edit("config", "", _set("rms_norm_eps", "x")),
                     "model_type = 'evil'": json_edit("config", "", _set("model_type", "evil")),
                     "missing keys": lambda c: b'{"model_type": "llama"}'}.items():
    file_case(_name, "config", _data)
special_cases("", "config", kinds=("fifo", "zero", "dir"))


# --------------------------------------------------------------------------------------------------
# tasks, and the server's root
# --------------------------------------------------------------------------------------------------

def corpus_tasks(families: list[str] | None = None) -> list[Task]:
    """One task per case (of ``families``, default all), read by every API and server reader of its
    family, and by its command-line readers in turn (one per case; two for checkpoints, which have eleven),
    so each command meets many cases of its family."""
    from hostile_readers import FAMILY_READERS

    tasks = []
    turn: dict[str, int] = {}
    for c in CASES:
        if families and c.family not in families:
            continue
        readers = FAMILY_READERS[c.family]
        api = [r for r in readers if not r.startswith("cli.")]
        cli = [r for r in readers if r.startswith("cli.")]
        take = 2 if len(cli) > 4 else 1
        k = turn.get(c.family, 0)
        turn[c.family] = k + take
        cli = [cli[(k + j) % len(cli)] for j in range(take)] if cli else []

        def build(ctx: Ctx, c: Case = c) -> tuple[Path, str]:
            return c.build(ctx), c.name

        tasks.append(Task(f"corpus:{c.name}", c.family, build, api + cli, refuse=c.refuse, cpu_cap=c.cpu_cap))
    return tasks


def build_server_root(root: Path, outside: Path, bases: dict[str, Path]) -> dict[str, Any]:
    """Every case under ``root/<n>/`` (each case's own ``outside`` lies in ``outside/<n>/``), for the server
    test, beside a valid checkpoint (``valid``: what plan-load and diff compare hostile inputs with) and
    links out of the root: ``{"cases": [{"name", "family", "path" (relative to root), "refuse"}],
    "canaries": [...], "valid": "valid/step-000001"}``."""
    cases = []
    canaries = []
    (root / "valid").mkdir(parents=True)
    shutil.copytree(bases["dcp"], root / "valid" / "step-000001")
    far = outside / "far"
    far.mkdir(parents=True)
    shutil.copytree(bases["run"], far / "run")
    (far / "secret.json").write_text('{"parallel": {"dp_shard": 1}, "summary": {}, "tensors": []}')
    (root / "link_out").symlink_to(far)  # a directory link out of the root
    (root / "run_out").symlink_to(far / "run")  # a run directory that lives outside
    (root / "like_out.json").symlink_to(far / "secret.json")
    canaries.append(str(far / "secret.json"))
    for n, c in enumerate(CASES):
        ctx = Ctx(outside / f"c{n:03d}", bases, root=root / f"c{n:03d}", outside=outside / f"c{n:03d}" / "outside")
        ctx.make()
        path = c.build(ctx)
        cases.append({"name": c.name, "family": c.family, "path": str(path.relative_to(root)), "refuse": c.refuse,
                      "workbench": (path / "workbench.json").exists() or (path / "checkpoints").exists()})
        canaries.append(str(ctx.canary))
    return {"cases": cases, "canaries": canaries, "valid": "valid/step-000001"}
