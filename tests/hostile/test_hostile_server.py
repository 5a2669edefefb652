"""The adversarial corpus against a real ``jupyter server`` with the workbench extension.

Every hostile case of ``hostile_corpus`` lies under the server's root (``c000/`` ...), each with its own
``outside`` directory beyond the root (a canary, a FIFO, secrets), next to a valid checkpoint and links
that lead out of the root. Each case is opened (``open``) and read through one endpoint of its family, in
turn, so every endpoint meets its share of every family; then come hostile query arguments. Every answer
must be 200 or a 4xx with one line (never a 500, never a traceback), within the time cap; nothing outside
the root may be opened (an audit hook inside the server logs it; the canaries' access times are checked
too) or changed; and at the end the server must still answer, having stayed under 2 GiB of memory (a
hostile snapshot once killed it, another took it to 3.2 GB).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from helpers import wait_for_server  # tests/helpers.py

KEY = "model.output.weight"
REQUEST_S = 12  # one answer; the corpus files are small: anything slower is stuck
PEAK_RSS = 2 << 30

# The audit hook the server runs under: every open/listing that resolves into the outside directories,
# /etc/passwd or /etc/shadow, /dev/zero or a process's environ is written to a log.
_AUDITED_SERVER = r"""
import os, sys
log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
watch = os.path.realpath(sys.argv[2]) + os.sep
exact = {"/etc/passwd", "/etc/shadow", "/dev/zero"}

def hook(event, args):
    if event not in ("open", "os.listdir", "os.scandir") or not args:
        return
    path = args[0]
    if path is None or isinstance(path, int):
        return
    try:
        real = os.path.realpath(os.fsdecode(os.fspath(path)))
    except Exception:
        return
    if real.startswith(watch) or real in exact or (real.startswith("/proc/") and real.endswith("/environ")):
        os.write(log, f"{event} {real}\n".encode())

sys.addaudithook(hook)
sys.argv = ["jupyter-server"] + sys.argv[3:]
from jupyter_server.serverapp import main
sys.exit(main())
"""

pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, base: Path, root: Path, outside: Path):
        self.base, self.root, self.outside = base, root, outside
        for d in ("config", "data", "runtime", "cache"):
            (base / d).mkdir()
        (base / "config" / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"jpserver_extensions": {
            "workbench.jupyter": True, "jupyterlab": False, "jupyter_lsp": False, "notebook_shim": False,
            "jupyter_server_terminals": False}}}))
        self.port, self.token = _free_port(), uuid.uuid4().hex
        self.audit = base / "audit.log"
        self.log = base / "server.log"
        repo = Path(__file__).resolve().parents[2]
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_DATA_DIR=str(base / "data"),
                   JUPYTER_RUNTIME_DIR=str(base / "runtime"), JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1",
                   XDG_CACHE_HOME=str(base / "cache"), OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = str(repo) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-c", _AUDITED_SERVER, str(self.audit), str(outside), "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True",
               "--ServerApp.terminals_enabled=False"]
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         cwd=base, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        def status() -> bool:
            return self.raw("/api/status", timeout=2)[0] == 200

        wait_for_server(self.proc, status, "jupyter server", self.log_tail, 120)

    def raw(self, path_and_query: str, timeout: float = REQUEST_S) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path_and_query, headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, endpoint: str, params: dict) -> tuple[int, bytes]:
        return self.raw(f"/workbench/api/{endpoint}?{urllib.parse.urlencode(params)}")

    def peak_rss(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:  # it has died
            pass
        return 0

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def restart(self) -> "_Server":
        """A new server on the same root (after one died), its audit log kept."""
        self.stop()
        self.log.rename(self.log.with_suffix(f".{time.monotonic_ns()}.log"))
        for d in ("config", "data", "runtime", "cache"):
            (self.base / d).rename(self.base / f"{d}.{self.port}")
        fresh = _Server(self.base, self.root, self.outside)
        fresh.wait_ready()
        return fresh

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait(10)


def _requests(case: dict, valid: str, k: int) -> list[tuple[str, dict]]:
    """``open``, then the ``k``-th (in turn) of the endpoints that read a file of the case's family: each
    endpoint meets a share of every family's cases (the core functions behind them meet every case, in
    process, in test_hostile_corpus.py); what the server adds is its root, its 4xx and its survival."""
    p = case["path"]
    fam = case["family"]
    if fam == "checkpoint":
        ends = [("checkpoint/manifest", {"path": p}), ("checkpoint/tensor", {"path": p, "key": KEY, "bins": 16}),
                ("checkpoint/verify", {"path": p, "deep": "true"}), ("checkpoint/diff", {"path": p, "other": valid}),
                ("checkpoint/plan-load", {"path": p, "dp_shard": 1,
                                          **({} if case["workbench"] else {"model": "tiny"})})]
    elif fam in ("snapshot", "profiler", "timeline"):
        ends = [("memory/timeline", {"path": p, "wait": 8000, "points": 100})]
    elif fam == "run":
        ends = [("run/events", {"path": p, "points": 16}), ("run/pipeline", {"path": p}),
                ("checkpoint/plan-load", {"path": valid, "like": p})]
    elif fam == "plan":
        ends = [("plan", {"path": p}), ("checkpoint/plan-load", {"path": valid, "like": p})]
    else:  # a model config.json
        ends = [("checkpoint/plan-load", {"path": valid, "model": p})]
    return [("open", {"path": p}), ends[k % len(ends)]]


def _hostile_queries(valid: str, snapshot: str) -> list[tuple[str, str]]:
    """(what, path and query) of hostile requests that name no hostile file."""
    api = "/workbench/api/"
    q = urllib.parse.urlencode
    return [
        ("plan of a directory", api + "plan?" + q({"path": "valid"})),
        ("plan-load dtype=evil", api + "checkpoint/plan-load?" + q({"path": valid, "dtype": "evil"})),
        ("invalid UTF-8 in a query", api + "open?path=%ff%fe"),
        ("invalid UTF-8 in a key", api + "checkpoint/tensor?" + q({"path": valid}) + "&key=%c3%28"),
        ("../ out of the root", api + "open?" + q({"path": "../outside/far/secret.json"})),
        ("a link out of the root", api + "open?" + q({"path": "link_out/secret.json"})),
        ("a run directory outside", api + "run/events?" + q({"path": "run_out"})),
        ("a run's events outside", api + "run/events?" + q({"path": "run_out/events.jsonl"})),
        ("like= a link out", api + "checkpoint/plan-load?" + q({"path": valid, "like": "like_out.json"})),
        ("like= a directory link out", api + "checkpoint/plan-load?" + q({"path": valid, "like": "run_out"})),
        ("model= outside", api + "checkpoint/plan-load?" + q({"path": valid, "model": "link_out/secret.json"})),
        ("NUL in a path", api + "open?path=a%00b"),
        ("offset 10^30", api + "checkpoint/manifest?" + q({"path": valid, "offset": 10**30})),
        ("limit -1", api + "checkpoint/manifest?" + q({"path": valid, "limit": -1})),
        ("bins 10^8", api + "checkpoint/tensor?" + q({"path": valid, "key": KEY, "bins": 10**8})),
        ("bins 1e8", api + "checkpoint/tensor?" + q({"path": valid, "key": KEY, "bins": "1e8"})),
        ("points 10^9", api + "memory/timeline?" + q({"path": snapshot, "points": 10**9})),
        ("t0 nan", api + "memory/timeline?" + q({"path": snapshot, "t0": "nan"})),
        ("rank x", api + "memory/timeline?" + q({"path": snapshot, "rank": "x"})),
        ("wait -5", api + "memory/timeline?" + q({"path": snapshot, "wait": -5})),
        ("since -1", api + "run/events?" + q({"path": "valid", "since": -1})),
        ("top -5", api + "checkpoint/diff?" + q({"path": valid, "other": valid, "top": -5})),
        ("deep=maybe", api + "checkpoint/verify?" + q({"path": valid, "deep": "maybe"})),
        ("tp 10^9", api + "checkpoint/plan-load?" + q({"path": valid, "tp": 10**9})),
        ("dp_shard -1", api + "checkpoint/plan-load?" + q({"path": valid, "dp_shard": -1})),
        ("nproc 10^11", api + "checkpoint/plan-load?" + q({"path": valid, "nproc": 10**11})),
        ("an unknown layout field", api + "checkpoint/plan-load?" + q({"path": valid, "evil_field": 1})),
        ("to= garbage", api + "checkpoint/plan-load?" + q({"path": valid, "to": "tp=,=,x==2"})),
        ("no such key", api + "checkpoint/tensor?" + q({"path": valid, "key": "no.such.key"})),
        ("an 8 kB path", api + "open?" + q({"path": "x/" * 4000})),
        ("no such endpoint", api + "nope"),
    ]


def _one_line_error(status: int, body: bytes) -> str | None:
    """None if the answer keeps the contract: 200, or a 4xx with ``{"error": one line}``."""
    if status == 200:
        return None
    if not 400 <= status < 500:
        return f"status {status}: {body[:300]!r}"
    try:
        msg = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status} without a JSON error: {body[:300]!r}"
    if not isinstance(msg, str) or not msg.strip() or "\n" in msg or "Traceback" in msg:
        return f"status {status}, not one line: {msg!r:.300}"
    return None


def _unblock_fifos(top: Path) -> None:
    """Open every FIFO under ``top`` for writing, so a server thread stuck opening it for reading ends."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def _atimes(paths: list[str]) -> dict[str, int]:
    out = {}
    for p in paths:
        st = os.stat(p)
        os.utime(p, ns=(st.st_mtime_ns - 10**11, st.st_mtime_ns))
        out[p] = os.stat(p).st_atime_ns
    return out


def _lstat_tree(top: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def test_hostile_files_and_queries_get_one_line_4xx_and_the_server_survives(hostile_driver, tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile_server")
    root, outside = base / "root", base / "outside"
    built = hostile_driver.ask({"cmd": "server_root", "root": str(root), "outside": str(outside)}, timeout=300)
    cases, valid = built["cases"], built["valid"]
    atimes = _atimes(built["canaries"])
    before = _lstat_tree(outside)
    server = _Server(base, root, outside)
    problems: list[str] = []
    died: list[str] = []
    incomplete: list[str] = []
    try:
        server.wait_ready()
        requests = [(c["name"], ep, params) for k, c in enumerate(cases) for ep, params in _requests(c, valid, k)]
        snapshot = next(c["path"] for c in cases if c["family"] == "snapshot")
        queries = [(f"query: {what}", None, pq) for what, pq in _hostile_queries(valid, snapshot)]
        killers: set[str] = set()
        peak = server.peak_rss()
        for name, endpoint, params in requests + queries:
            if name in killers:  # it killed the server once: its other requests would only do it again
                continue
            t0 = time.monotonic()
            try:
                status, body = server.get(endpoint, params) if endpoint else server.raw(params)
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout) as e:
                try:  # a dying server closes the connection a moment before it exits
                    server.proc.wait(3)
                except subprocess.TimeoutExpired:
                    pass
                if server.proc.poll() is not None:
                    died.append(f"{name} {endpoint or params}: the server died (exit {server.proc.returncode})")
                    killers.add(name)
                    if len(died) >= 6:
                        break
                    server = server.restart()  # to see the rest of the corpus too
                    peak = server.peak_rss()
                    continue
                problems.append(f"{name} {endpoint} {str(params)[:200]}: no answer in {time.monotonic() - t0:.0f} s "
                                f"({e})")
                continue
            now = server.peak_rss()
            if now - peak > (512 << 20):  # which request made the server's memory jump
                problems.append(f"{name} {endpoint or params[:100]}: the server's peak memory rose from "
                                f"{peak / 2**30:.2f} to {now / 2**30:.2f} GiB")
            peak = max(peak, now)
            bad = _one_line_error(status, body)
            if bad:
                problems.append(f"{name} {endpoint or params[:200]}: {bad}")
            elif endpoint == "memory/timeline" and status == 200 and not json.loads(body).get("complete"):
                incomplete.append(params["path"])
        for p in incomplete if not died else []:  # still being read: it gets one more, long, look
            status, body = server.get("memory/timeline", {"path": p, "wait": 30000, "points": 100})
            if status == 200 and not json.loads(body).get("complete"):
                problems.append(f"{p}: memory/timeline still not read after 40 s")
        alive = not died and server.proc.poll() is None
        if alive:
            assert server.raw("/api/status")[0] == 200, "the server stopped answering"
            status, body = server.get("checkpoint/manifest", {"path": valid})
            assert status == 200, f"a valid checkpoint no longer opens: {status} {body[:300]!r}"
            peak = server.peak_rss()  # the server's own peak, since it started (VmHWM)
            if peak > PEAK_RSS:
                problems.append(f"the server's peak memory reached {peak / 2**30:.2f} GiB (cap {PEAK_RSS / 2**30:.0f})")
    finally:
        _unblock_fifos(root)
        _unblock_fifos(outside)
        server.stop()
    audit = server.audit.read_text().splitlines() if server.audit.exists() else []
    moved = [p for p, a in atimes.items() if os.stat(p).st_atime_ns != a]
    after = _lstat_tree(outside)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    report = "\n".join(
        [f"DIED: {d}" for d in died]
        + [f"answer: {p}" for p in problems[:60]] + ([f"... {len(problems) - 60} more"] if len(problems) > 60 else [])
        + [f"opened outside the root: {line}" for line in sorted(set(audit))[:40]]
        + [f"read outside the root (access time moved): {p}" for p in moved[:20]]
        + [f"changed outside the root: {p}" for p in changed[:20]])
    assert not (died or problems or audit or moved or changed), f"{len(cases)} hostile cases:\n{report}"
