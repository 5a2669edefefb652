"""Runs workbench's readers on hostile inputs in forked children, and judges every outcome.

A preloaded parent (it has imported torch and workbench, and called every reader once) forks a few
children at a time. Each child takes a run of tasks; for each task it builds the input in a private
directory, then calls the readers named by the task under a sandbox:

* memory: ``RLIMIT_AS`` (what the child had + ``mem_cap``), ``RLIMIT_FSIZE`` (a write past it fails with
  EFBIG instead of filling the disk), no core files;
* time: the parent kills a child whose task has used ``cpu_cap`` seconds of CPU, or has slept without
  using any for ``blocked_cap`` seconds (an ``open()`` of a FIFO, a lock never released), or has run for
  ``wall_cap`` seconds whatever it did (a *hang*). CPU time, not the wall clock, is what a busy machine
  cannot stretch, so the verdict does not depend on what else runs there;
* reads: an audit hook (``sys.addaudithook``) sees every ``open``/``os.listdir``/``os.scandir`` from
  Python, resolves symlinks and flags any path outside the input's directory, the task's output
  directory and the interpreter's own files (an *outside read*; the open is then refused so a FIFO cannot
  block the child). A canary file outside the root is also checked by its access time, which catches
  opens from C/C++/Rust code the hook does not see;
* code: ``os.system``/``subprocess``/``exec*``/``spawn`` audit events, and a marker file that the
  hostile pickles would create, count as *executed*;
* files: every file under the input's directory and the outside directory is hashed before and after;
  any difference is a *lost file*.

An exception is *declared* when it is an instance of the reader's documented classes, was raised by
workbench's own code (the innermost frame lies in the workbench package: a ``ValueError`` thrown up from
inside numpy or json is not a refusal, it is a leak), and carries a one-line message. Anything else is
*undeclared*. A declared error whose message names none of the input's files is counted as *vague*.
A child that dies by a signal is a *crash*. A child whose task failed exits, and a fresh one goes on with
the next task, so one input never changes the state another input is read in.

The parent needs no threads and imports nothing itself beyond what its caller loaded; results come back
as JSON lines on a pipe per child. Everything is deterministic: a task's input depends only on its key.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import resource
import select
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

# --------------------------------------------------------------------------------------------------
# the task's directories
# --------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """One task's directories. Readers may read ``root`` (and write ``out``); nothing else of it."""

    scratch: Path
    bases: dict[str, Path]  # the valid inputs hostile ones are made from (read by builders only)
    root: Path = None  # type: ignore[assignment]
    outside: Path = None  # type: ignore[assignment]
    out: Path = None  # type: ignore[assignment]
    cwd: Path = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.root = self.root or self.scratch / "root"
        self.outside = self.outside or self.scratch / "outside"
        self.out = self.out or self.scratch / "out"
        self.cwd = self.cwd or self.scratch / "cwd"

    @property
    def canary(self) -> Path:
        """A file outside the root that no reader may ever open."""
        return self.outside / "canary.safetensors"

    @property
    def marker(self) -> Path:
        """What an evil pickle would create if anything in it ran."""
        return self.outside / "pwned"

    @property
    def fifo(self) -> Path:
        """A FIFO outside the root: opening it for reading blocks until a writer comes."""
        return self.outside / "fifo"

    def make(self) -> None:
        if self.scratch.exists():
            shutil.rmtree(self.scratch)
        for d in (self.root, self.outside, self.out, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        # The canary is a valid-looking file of every kind a reader might want (a safetensors header that
        # parses), so a reader that reaches it has no reason to stop before reading it.
        header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        self.canary.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\x80\x3f")
        (self.outside / "secret.json").write_text('{"secret": "outside the root"}')
        (self.cwd / "events.jsonl").write_text('{"type": "decoy", "rank": 0, "time": 0}\n')
        os.mkfifo(self.fifo)


def backdate_atime(p: Path) -> int:
    """Set ``p``'s access time before its modification time, so the next read moves it (relatime)."""
    st = os.stat(p)
    os.utime(p, ns=(st.st_mtime_ns - 10**11, st.st_mtime_ns))
    return os.stat(p).st_atime_ns


# --------------------------------------------------------------------------------------------------
# lost files: a tree's state before and after
# --------------------------------------------------------------------------------------------------


def tree_state(*dirs: Path) -> dict[str, str]:
    """``{path: what it is}`` for everything under ``dirs``, symlinks not followed, FIFOs never opened."""
    out: dict[str, str] = {}
    for top in dirs:
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    out[p] = "link:" + os.readlink(p)
                elif stat.S_ISREG(st.st_mode) and st.st_size > (16 << 20):  # a sparse giant: no hashing
                    out[p] = f"file:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
                elif stat.S_ISREG(st.st_mode):
                    h = hashlib.blake2b(digest_size=16)
                    with open(p, "rb") as f:
                        for chunk in iter(lambda: f.read(1 << 20), b""):
                            h.update(chunk)
                    out[p] = f"file:{st.st_size}:{h.hexdigest()}"
                elif stat.S_ISDIR(st.st_mode):
                    out[p] = "dir"
                else:
                    out[p] = f"special:{stat.S_IFMT(st.st_mode)}"
    return out


def tree_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    changes = []
    for p, what in before.items():
        if p not in after:
            changes.append(f"removed {p}")
        elif after[p] != what:
            changes.append(f"changed {p}")
    changes += [f"added {p}" for p in after if p not in before]
    return changes


# --------------------------------------------------------------------------------------------------
# the sandbox inside a child
# --------------------------------------------------------------------------------------------------

_EXEC_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
                "pty.spawn", "ctypes.dlopen")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PROC_SECRETS = ("/environ", "/mem", "/cmdline", "/kcore")


def _system_prefixes() -> tuple[str, ...]:
    """What the interpreter, its libraries and the kernel's own files are: reading them is no escape."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            *(p for p in sys.path if p and os.path.isdir(p))}
    real = {os.path.realpath(d) + os.sep for d in dirs}
    return tuple(sorted(real)) + ("/usr/lib/", "/lib/", "/usr/lib64/", "/lib64/", "/usr/share/zoneinfo/", "/sys/")


_SYSTEM_FILES = ("/dev/null", "/dev/urandom", "/dev/random", "/etc/localtime", "/etc/ld.so.cache")


class Sandbox:
    """The audit hook's state (one per child; hooks cannot be removed, so it is switched on and off)."""

    def __init__(self) -> None:
        self.active = False
        self.read_ok: tuple[str, ...] = ()
        self.write_ok: tuple[str, ...] = ()
        self.system = _system_prefixes()
        self.outside: list[str] = []
        self.executed: list[str] = []

    def begin(self, ctx: Ctx) -> None:
        root, out = os.path.realpath(ctx.root) + os.sep, os.path.realpath(ctx.out) + os.sep
        self.read_ok, self.write_ok = (root, out), (out,)
        self.outside, self.executed = [], []
        self.active = True

    def end(self) -> None:
        self.active = False

    def _system(self, real: str) -> bool:
        if real in _SYSTEM_FILES:
            return True
        if real.startswith("/proc/"):
            return not real.endswith(_PROC_SECRETS)
        return real.startswith(self.system)

    def hook(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "open":
            path, flags = args[0], args[2] if len(args) > 2 else 0
            if path is None or isinstance(path, int):
                return
            mode = args[1] if len(args) > 1 else None
            write = bool((flags or 0) & _WRITE_FLAGS) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
            self._check(os.fsdecode(os.fspath(path)), write, refuse=True)
        elif event in ("os.listdir", "os.scandir"):
            path = args[0] if args else "."
            if path is None or isinstance(path, int):
                return
            self._check(os.fsdecode(os.fspath(path)), False, refuse=False)
        elif event.startswith(_EXEC_EVENTS):
            self.executed.append(f"{event} {str(args)[:200]}")
            raise PermissionError(f"hostile harness: {event} refused")

    def _check(self, path: str, write: bool, refuse: bool) -> None:
        self.active = False  # realpath may itself raise audit events
        try:
            real = os.path.realpath(path)
        finally:
            self.active = True
        inside = (real + os.sep).startswith(self.write_ok if write else self.read_ok) or \
            real + os.sep in (self.write_ok if write else self.read_ok)
        if inside or (not write and self._system(real)):
            return
        self.outside.append(("write " if write else "read ") + real)
        if refuse:  # the read is counted; refusing it keeps a FIFO or /dev/zero from stalling the run
            raise PermissionError(errno.EACCES, "hostile harness: outside the root", path)


SANDBOX = Sandbox()


# --------------------------------------------------------------------------------------------------
# readers and their verdicts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reader:
    """One public entry point: ``call(ctx, path)``, and what it documents."""

    name: str
    call: Callable[[Ctx, Path], Any]
    declared: Callable[[], tuple[type, ...]] = lambda: (ValueError,)
    kind: str = "api"  # "api" | "server" (a 4xx Refused is its error) | "cli" (call returns a CliResult)
    never_raises: bool = False  # documented to report, not raise (verify, identify_memory_file, read_events)
    refused: Callable[[Any], bool] | None = None  # does a returned value mean "refused"? (verify: not ok)
    may_accept: bool = False  # a success is never wrong here (identify: None or a kind; a tolerant reader)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str
    as_json: bool


WORKBENCH_DIR = ""  # set by the driver: the workbench package's directory, with a trailing separator


def _origin(exc: BaseException) -> str:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return "?"
    return f"{last.tb_frame.f_code.co_filename}:{last.tb_lineno}"


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def _names(ctx: Ctx, path: Path) -> set[str]:
    """What a message may name the input by: its name, or any file or directory under the root."""
    names = {path.name}
    for dirpath, dirnames, filenames in os.walk(ctx.root):
        names.update(n for n in dirnames + filenames if len(n) > 2)
    return names


def judge_exception(reader: Reader, exc: BaseException, ctx: Ctx, path: Path) -> dict[str, Any]:
    msg = _message(exc)
    where = _origin(exc)
    out = {"exc": type(exc).__qualname__, "msg": msg.strip()[:300], "where": where.replace(WORKBENCH_DIR, "workbench/")}
    if reader.kind == "server":
        status = getattr(exc, "status", None)
        ok = type(exc).__name__ == "Refused" and isinstance(status, int) and 400 <= status < 500
        out["status"] = status if type(exc).__name__ == "Refused" else 500
    else:  # a UnicodeDecodeError or JSONDecodeError is a ValueError that escaped: it names no file
        ok = (not reader.never_raises and isinstance(exc, reader.declared())
              and not isinstance(exc, (UnicodeError, json.JSONDecodeError)))
    if ok and WORKBENCH_DIR and not where.startswith(WORKBENCH_DIR):
        ok, out["why"] = False, "raised from inside a library, not by workbench"
    if ok and (not msg.strip() or "\n" in msg.strip()):
        ok, out["why"] = False, "the message is not one line"
    if not ok:
        out["outcome"] = "undeclared"
        out.setdefault("why", "not a documented error of this reader")
        return out
    out["outcome"] = "refused" if any(n in msg for n in _names(ctx, path)) else "vague"
    return out


def judge_cli(res: CliResult) -> dict[str, Any]:
    out: dict[str, Any] = {"exit": res.code, "msg": (res.stderr.strip() or res.stdout.strip())[:300]}
    if res.code == 0:
        out["outcome"] = "ok"
        return out
    problems = []
    if res.code not in (1, 2):
        problems.append(f"exit {res.code}")
    if "Traceback" in res.stderr or "Traceback" in res.stdout:
        problems.append("a traceback")
    if res.as_json:
        try:
            doc = json.loads(res.stdout)
            if not isinstance(doc, dict) or doc.get("status") != "error":
                problems.append("no {'status': 'error'} document")
        except ValueError:
            problems.append("stdout is not one JSON document")
        else:
            out["msg"] = str(doc.get("error") or doc.get("problems") or "")[:300]
    else:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        if not lines:
            problems.append("no error line")
        elif not all(ln.startswith(("error: ", "warning: ", "note: ")) for ln in lines):
            problems.append("stderr has lines that are not 'error: ...'")
    out["outcome"] = "undeclared" if problems else "refused"
    if problems:
        out["why"] = "; ".join(problems)
    return out


# --------------------------------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------------------------------


@dataclass
class Task:
    key: str  # unique and reproducible: "fuzz:<format>:<seed>:<index>" or "corpus:<case>"
    format: str
    build: Callable[[Ctx], tuple[Path, str]]  # writes the input under ctx.root -> (its path, a description)
    readers: list[str]
    # Not a valid file of its kind: a reader that reads it anyway is counted as "accepted", for a look (a
    # reader that never touches the hostile part, e.g. inspect and a damaged data file, rightly succeeds).
    refuse: bool = False
    cpu_cap: float | None = None  # this input's own CPU cap (bombs whose cost the issue bounds), else Options


@dataclass
class Options:
    lanes: int = 2
    cpu_cap: float = 8.0  # CPU seconds one input may take, all its readers together
    blocked_cap: float = 2.0  # seconds asleep without using CPU (nothing a reader of local files waits for)
    wall_cap: float = 120.0
    mem_cap: int = 2 << 30
    fsize_cap: int = 256 << 20
    chunk: int = 100  # tasks a child takes in turn (a fresh child after any failure)
    keep_failed: int = 0  # keep the directories of this many failed tasks (for a look); others are removed


def task_failed(r: dict[str, Any]) -> bool:
    return any(r.get(k) for k in ("crash", "hang", "lost", "outside", "executed", "harness")) or any(
        c["outcome"] in ("undeclared", "outside", "executed") for c in r["calls"])


def _send(fd: int, msg: dict[str, Any]) -> None:
    data = (json.dumps(msg, default=str) + "\n").encode()
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child_setup(opts: Options) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails (EFBIG) instead of killing
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (opts.fsize_cap, resource.RLIM_INFINITY))  # builders lift it
    limit = _vm_bytes() + opts.mem_cap
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if not getattr(sys, "_hostile_hook", False):
        sys.addaudithook(SANDBOX.hook)
        sys._hostile_hook = True  # type: ignore[attr-defined]


def _run_call(reader: Reader, ctx: Ctx, path: Path, refuse: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    SANDBOX.begin(ctx)
    try:
        value = reader.call(ctx, path)
        exc = None
    except BaseException as e:  # noqa: BLE001 - judging every way out is the point
        value, exc = None, e
    finally:
        SANDBOX.end()
    seconds = time.perf_counter() - t0
    if reader.kind == "cli" and exc is None:
        out = judge_cli(value)
    elif exc is not None:
        out = judge_exception(reader, exc, ctx, path)
        if reader.kind == "cli":
            out["why"] = "an exception escaped the command (WORKBENCH_DEBUG=1 re-raises unforeseen ones)"
            out["outcome"] = "undeclared"
        if isinstance(exc, MemoryError):
            out["why"] = "ran out of the memory cap"
    elif reader.refused is not None and reader.refused(value):
        out = {"outcome": "refused", "msg": str(getattr(value, "problems", ""))[:300]}
    else:
        out = {"outcome": "ok"}
    if out["outcome"] == "ok" and refuse and not reader.may_accept:
        out["outcome"], out["why"] = "accepted", "a hostile input was read as if it were valid"
    if SANDBOX.outside:
        out["outside"] = SANDBOX.outside[:5]
        out["outcome"] = "outside"
    if SANDBOX.executed:
        out["executed"] = SANDBOX.executed[:3]
        out["outcome"] = "executed"
    out["api"], out["s"] = reader.name, round(seconds, 4)
    return out


def _prepare(ctx: Ctx) -> None:
    os.chdir(ctx.cwd)
    tmp = ctx.out / "tmp"
    tmp.mkdir(exist_ok=True)
    tempfile.tempdir = str(tmp)
    os.environ["TMPDIR"] = str(tmp)
    os.environ["XDG_CACHE_HOME"] = str(ctx.out / "cache")


def _state_file(ctx: Ctx) -> Path:
    return ctx.scratch / "before.json"


def _after_checks(ctx: Ctx, atime: int | None) -> dict[str, Any]:
    """Lost files, a read canary and a created marker, from the files alone (the parent can run it too)."""
    out: dict[str, Any] = {}
    try:
        before = json.loads(_state_file(ctx).read_text())
    except (OSError, ValueError):
        return out
    atime = before.get("atime") if atime is None else atime
    try:  # before hashing the files below reads the canary
        if atime is not None and os.stat(ctx.canary).st_atime_ns != atime:
            out["outside"] = [f"read {ctx.canary} (its access time moved)"]
    except OSError:
        pass
    changes = tree_changes(before["state"], tree_state(ctx.root, ctx.outside))
    if ctx.marker.exists():
        out["executed"] = [f"{ctx.marker} was created"]
        changes = [c for c in changes if not c.endswith(str(ctx.marker))]
    if changes:
        out["lost"] = changes[:5]
    return out


def _child(tasks: list[Task], lo: int, hi: int, wfd: int, scratch: Path, bases: dict[str, Path],
           readers: dict[str, Reader], opts: Options) -> None:
    code = 0
    try:
        _child_setup(opts)
        for i in range(lo, hi):
            task = tasks[i]
            t0 = time.process_time()
            ctx = Ctx(scratch / f"t{i:06d}", bases)
            ctx.make()
            _prepare(ctx)
            t1 = time.process_time()
            try:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                path, desc = task.build(ctx)  # may write a sparse giant
                resource.setrlimit(resource.RLIMIT_FSIZE, (opts.fsize_cap, resource.RLIM_INFINITY))
            except Exception as e:  # noqa: BLE001 - a builder bug: counted (tests require none), not hidden
                resource.setrlimit(resource.RLIMIT_FSIZE, (opts.fsize_cap, resource.RLIM_INFINITY))
                _send(wfd, {"ev": "start", "i": i, "desc": "?"})
                _send(wfd, {"ev": "end", "i": i, "harness": f"building the input failed: {type(e).__name__}: {e}"
                                                            f" at {_origin(e)}"})
                return
            t2 = time.process_time()
            state = tree_state(ctx.root, ctx.outside)  # reads the canary: before its access time is set back
            atime = backdate_atime(ctx.canary)
            _state_file(ctx).write_text(json.dumps({"state": state, "atime": atime}))
            _send(wfd, {"ev": "start", "i": i, "desc": desc, "path": str(path.relative_to(ctx.root))})
            t3 = time.process_time()
            calls = []
            for name in task.readers:
                _send(wfd, {"ev": "call", "i": i, "api": name})
                res = _run_call(readers[name], ctx, path, task.refuse)
                calls.append(res)
                _send(wfd, {"ev": "res", "i": i, **res})
            t4 = time.process_time()
            end = _after_checks(ctx, atime)
            t5 = time.process_time()
            _send(wfd, {"ev": "end", "i": i, **end, "t": [round(x, 5) for x in (t1 - t0, t2 - t1, t3 - t2, t4 - t3,
                                                                                 t5 - t4)]})
            failed = bool(end) or any(c["outcome"] in ("undeclared", "outside", "executed") for c in calls)
            if failed:
                return  # a fresh child takes the next task: this one's state may be damaged
            shutil.rmtree(ctx.scratch, ignore_errors=True)
    except BaseException as e:  # noqa: BLE001
        try:
            _send(wfd, {"ev": "harness", "error": f"{type(e).__name__}: {e}",
                        "tb": traceback.format_exc()[-2000:]})
        except BaseException:  # noqa: BLE001
            pass
        code = 3
    finally:
        os._exit(code)


@dataclass
class _Lane:
    pid: int
    fd: int
    lo: int
    hi: int
    buf: bytes = b""
    cur: int | None = None
    api: str | None = None
    started: float = 0.0
    last_end: int = -1
    cpu0: float = 0.0  # the child's CPU seconds when the task started
    cpu_seen: float = 0.0
    cpu_moved: float = 0.0  # when its CPU time last moved (monotonic)


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> tuple[float, str]:
    """A process's CPU seconds (user + system) and its state letter (R running, S/D asleep...)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode()
    except OSError:
        return 0.0, "?"
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK, fields[0]


def _new_result(task: Task) -> dict[str, Any]:
    return {"key": task.key, "format": task.format, "desc": None, "path": None, "calls": []}


def run_tasks(tasks: list[Task], scratch: Path, bases: dict[str, Path], readers: dict[str, Reader],
              opts: Options, progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Run every task in forked children; one result dict per task, in order."""
    scratch.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = [_new_result(t) for t in tasks]
    # What the parent holds (torch, workbench, the bases) goes to the collector's permanent generation:
    # a child's collections then leave those pages alone, and fork's copy-on-write copies far fewer.
    gc.collect()
    gc.freeze()
    queue = [(lo, min(lo + opts.chunk, len(tasks))) for lo in range(0, len(tasks), opts.chunk)]
    lanes: dict[int, _Lane] = {}
    done = 0
    kept = 0

    def spawn(lo: int, hi: int) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(r)
            _child(tasks, lo, hi, w, scratch, bases, readers, opts)
        os.close(w)
        lanes[r] = _Lane(pid, r, lo, hi)

    def finish_task(i: int, extra: dict[str, Any]) -> None:
        nonlocal done, kept
        res = results[i]
        res.update(extra)
        ctx = Ctx(scratch / f"t{i:06d}", bases)
        if task_failed(res) and kept < opts.keep_failed:
            kept += 1
            res["kept"] = str(ctx.scratch)
        elif task_failed(res):  # a passing task's child removed its directory itself
            shutil.rmtree(ctx.scratch, ignore_errors=True)
        done += 1
        if progress is not None:
            progress(done, len(tasks))

    def handle(lane: _Lane, msg: dict[str, Any]) -> None:
        ev = msg.pop("ev")
        if ev == "harness":
            raise RuntimeError(f"the hostile harness failed in a child: {msg['error']}\n{msg.get('tb', '')}")
        i = msg.pop("i")
        res = results[i]
        if ev == "start":
            lane.cur, lane.api, lane.started = i, None, time.monotonic()
            lane.cpu0 = lane.cpu_seen = _proc_cpu(lane.pid)[0]
            lane.cpu_moved = lane.started
            res["desc"], res["path"] = msg.get("desc"), msg.get("path")
        elif ev == "call":
            lane.api = msg["api"]
        elif ev == "res":
            res["calls"].append(msg)
        elif ev == "end":
            lane.cur, lane.last_end = None, i
            finish_task(i, msg)

    def close(lane: _Lane, killed_for_hang: str | None) -> None:
        del lanes[lane.fd]
        os.close(lane.fd)
        _, status = os.waitpid(lane.pid, 0)
        nxt = lane.last_end + 1 if lane.last_end >= lane.lo else lane.lo
        if lane.cur is not None:  # died or was killed inside a task
            i = lane.cur
            ctx = Ctx(scratch / f"t{i:06d}", bases)
            extra = _after_checks(ctx, None)
            if killed_for_hang:
                extra["hang"] = {"api": lane.api, "why": killed_for_hang}
            elif os.WIFSIGNALED(status):
                extra["crash"] = {"api": lane.api, "signal": signal.Signals(os.WTERMSIG(status)).name}
            else:
                extra["crash"] = {"api": lane.api, "exit": os.WEXITSTATUS(status)}
            finish_task(i, extra)
            nxt = i + 1
        elif os.WIFSIGNALED(status) or os.WEXITSTATUS(status) not in (0,):
            raise RuntimeError(f"a hostile-harness child ended with status {status} between tasks")
        if nxt < lane.hi:
            queue.insert(0, (nxt, lane.hi))

    while queue or lanes:
        while queue and len(lanes) < opts.lanes:
            spawn(*queue.pop(0))
        ready, _, _ = select.select(list(lanes), [], [], 0.25)
        for fd in ready:
            lane = lanes[fd]
            data = os.read(fd, 1 << 16)
            if not data:
                close(lane, None)
                continue
            lane.buf += data
            *lines, lane.buf = lane.buf.split(b"\n")
            for line in lines:
                handle(lane, json.loads(line))
        now = time.monotonic()
        for lane in list(lanes.values()):
            if lane.cur is None:
                continue
            cpu, state = _proc_cpu(lane.pid)
            if cpu != lane.cpu_seen or state == "R":
                lane.cpu_seen, lane.cpu_moved = cpu, now
            why = None
            cap = tasks[lane.cur].cpu_cap or opts.cpu_cap
            if cpu - lane.cpu0 > cap:
                why = f"used {cpu - lane.cpu0:.1f} s of CPU (cap {cap:g} s)"
            elif now - lane.cpu_moved > opts.blocked_cap:
                why = f"blocked for {now - lane.cpu_moved:.1f} s without using CPU (state {state})"
            elif now - lane.started > opts.wall_cap:
                why = f"ran {now - lane.started:.0f} s (cap {opts.wall_cap:g} s)"
            if why is not None:
                try:
                    os.kill(lane.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                # drain what it wrote before it died, so its finished calls are kept
                while True:
                    data = os.read(lane.fd, 1 << 16)
                    if not data:
                        break
                    lane.buf += data
                *lines, lane.buf = lane.buf.split(b"\n")
                for line in lines:
                    handle(lane, json.loads(line))
                close(lane, why if lane.cur is not None else None)
    return results


# --------------------------------------------------------------------------------------------------
# counting
# --------------------------------------------------------------------------------------------------

COUNTS = ("inputs", "calls", "ok", "refused", "vague", "undeclared", "accepted", "outside_calls", "executed_calls",
          "crash", "hang", "outside", "lost", "executed", "harness")


def count(results: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per format: inputs and (finished) calls; calls that read fine (ok), were refused as documented
    (refused; vague: refused without naming the file), raised an undeclared exception, accepted an input
    they must refuse, or read outside / ran code (outside_calls, executed_calls); inputs that crashed, hung,
    read outside, lost files or ran code."""
    per: dict[str, dict[str, int]] = {}
    for r in results:
        c = per.setdefault(r["format"], dict.fromkeys(COUNTS, 0))
        c["inputs"] += 1
        c["calls"] += len(r["calls"])
        for call in r["calls"]:
            o = call["outcome"]
            c[o + "_calls" if o in ("outside", "executed") else o] += 1
        c["crash"] += bool(r.get("crash"))
        c["hang"] += bool(r.get("hang"))
        c["lost"] += bool(r.get("lost"))
        c["harness"] += bool(r.get("harness"))  # the input could not even be built: a bug of the harness
        c["outside"] += bool(r.get("outside")) or any(call["outcome"] == "outside" for call in r["calls"])
        c["executed"] += bool(r.get("executed")) or any(call["outcome"] == "executed" for call in r["calls"])
    return per


def failure_classes(results: Iterable[dict[str, Any]], per_class: int = 3) -> list[dict[str, Any]]:
    """Distinct failures: (format, api, what, exception, where) with the first reproducers of each."""
    classes: dict[tuple, dict[str, Any]] = {}

    def add(r: dict[str, Any], api: str | None, what: str, exc: str, where: str, detail: str) -> None:
        k = (r["format"], api, what, exc, where)
        c = classes.setdefault(k, {"format": r["format"], "api": api, "what": what, "exc": exc, "where": where,
                                   "count": 0, "examples": []})
        c["count"] += 1
        if len(c["examples"]) < per_class:
            c["examples"].append({"key": r["key"], "input": r.get("path"), "desc": r.get("desc"),
                                  "detail": detail[:300], **({"kept": r["kept"]} if "kept" in r else {})})

    for r in results:
        for what in ("crash", "hang"):
            if r.get(what):
                info = r[what]
                add(r, info.get("api"), what, str(info.get("signal") or info.get("exit") or ""), "", json.dumps(info))
        for what in ("lost", "outside", "executed"):
            if r.get(what):
                add(r, None, what, "", "", "; ".join(r[what]))
        if r.get("harness"):
            add(r, None, "harness", "", "", r["harness"])
        for call in r["calls"]:
            o = call["outcome"]
            if o in ("undeclared", "accepted", "outside", "executed", "vague"):  # accepted, vague: for a look
                detail = call.get("msg") or ""
                if o in ("outside", "executed"):
                    detail = "; ".join(call.get(o, []))
                elif call.get("why"):
                    detail = f"{call['why']}: {detail}"
                add(r, call["api"], o, call.get("exc", ""), call.get("where", ""), detail)
    return sorted(classes.values(), key=lambda c: (c["what"] in _SOFT, c["format"], -c["count"]))


_SOFT = ("vague", "accepted")  # reported for a look, not failures: see count()


def describe_failures(classes: list[dict[str, Any]], per_format: int = 6, examples: int = 2,
                      with_soft: bool = False) -> str:
    """The first ``per_format`` classes of each format (most frequent first), ``examples`` reproducers each."""
    lines = []
    shown = [c for c in classes if with_soft or c["what"] not in _SOFT]
    by_format: dict[str, list[dict[str, Any]]] = {}
    for c in shown:
        by_format.setdefault(c["format"], []).append(c)
    for fmt, group in by_format.items():
        for c in group[:per_format]:
            head = f"[{fmt}] {c['what']} x{c['count']} in {c['api'] or '-'}: {c['exc']} {c['where']}"
            lines.append(head.rstrip())
            for ex in c["examples"][:examples]:
                lines.append(f"    {ex['key']} {ex['input']} ({ex['desc']}): {ex['detail']}")
        if len(group) > per_format:
            total = sum(c["count"] for c in group)
            lines.append(f"[{fmt}] ... {len(group) - per_format} more classes ({total} failures in all)")
    return "\n".join(lines)
