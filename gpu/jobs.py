"""The GPU check's subprocesses: each command in its own process group, killed with everything below it when
its time is up, and jobs run side by side on one GPU as far as their predicted memory allows (run_packed).
Standard library only: the check runs before the bundle is installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KILL_GRACE_S = 3.0  # SIGTERM, then this long before SIGKILL


class Job:
    """One command in its own process group, stdout and stderr to WORK/logs/NAME.out|.err."""

    def __init__(self, name: str, cmd: list[str], logs: Path, env: dict[str, str]):
        self.name, self.cmd, self.env = name, cmd, env
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        self.proc: subprocess.Popen | None = None
        self.t0 = self.t1 = self.w0 = 0.0
        self.timed_out = False

    def start(self) -> "Job":
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO,
                                         env=self.env, start_new_session=True)
        self.t0, self.w0 = time.monotonic(), time.time()
        return self

    def wait(self, timeout: float) -> "Job":
        """Wait up to ``timeout`` seconds, then kill the whole process group (torchrun and its ranks too)."""
        assert self.proc is not None
        if not self.t1 and self.proc.poll() is not None:  # ended unwatched (a background job): its files' last write
            last = max((f.stat().st_mtime for f in (self.out, self.err) if f.exists()), default=self.w0)
            self.t1 = self.t0 + max(0.0, last - self.w0)
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
        if not self.t1:
            self.t1 = time.monotonic()
        return self

    def kill(self) -> None:
        kill_all([self])

    def poll(self) -> bool:
        """Whether it has ended; the first call that sees it ended takes that moment as its end."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.t1 = self.t1 or time.monotonic()
        return True

    @property
    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def rc(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    @property
    def seconds(self) -> float:
        return round((self.t1 or time.monotonic()) - self.t0, 1)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def tail(self, lines: int = 30) -> str:
        text = self.err.read_text(errors="replace") if self.err.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def document(self) -> dict[str, Any] | None:
        """The one JSON document the command printed on stdout (None if there is none)."""
        text = self.stdout().strip()
        for start in (0, text.find("{")):
            try:
                doc = json.loads(text[start:]) if start >= 0 else None
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links), also those in sessions of their own: the
    launcher starts torchrun's agent with ``start_new_session``, out of reach of a signal to our group."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(jobs: list["Job"]) -> None:
    """SIGTERM to every running job's process group and to every process below it, then SIGKILL to what is
    still there after the grace. The tree is read first: a process whose parent dies is re-parented, and
    could no longer be found. (A run left behind would hold the GPU's memory during the next part.)"""
    running = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
    pids = {pid for j in running for pid in descendants(j.proc.pid)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for j in running:
            try:
                os.killpg(j.proc.pid, sig)
            except ProcessLookupError:
                pass
        for pid in sorted(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + (KILL_GRACE_S if sig == signal.SIGTERM else 2.0)
        for j in running:
            try:
                j.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while pids and time.monotonic() < end:
            pids = {pid for pid in pids if _alive(pid)}
            if pids:
                time.sleep(0.05)
        running = [j for j in running if j.proc.poll() is None]
        if not running and not pids:
            return


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, which only waits for its parent to read it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def run_packed(jobs: list[tuple["Job", int | None]], capacity: int | None, until: float, poll_s: float = 0.2,
               leave: tuple["Job", ...] = ()) -> None:
    """Run ``jobs`` (each with the GPU memory it is expected to take, None when unknown) side by side: a job
    with no expectation, or every job when no capacity is known, runs alone (those first); then the largest
    first, each started once its expectation fits beside the running ones' within ``capacity`` bytes.
    Every job still running at ``until`` (time.monotonic()) is killed and marked timed out, except those in
    ``leave`` (another part waits for them); a job never started is left unstarted."""
    pending = sorted(jobs, key=lambda j: -(j[1] if j[1] is not None else 1 << 62))
    running: list[tuple[Job, int | None]] = []
    while (pending or running) and time.monotonic() < until:
        running = [(j, need) for j, need in running if not j.poll()]
        for item in list(pending):
            job, need = item
            used = sum(n if n is not None else capacity or 0 for _, n in running)
            alone = need is None or capacity is None
            if not running or (not alone and all(n is not None for _, n in running) and used + need <= capacity):
                job.start()
                running.append(item)
                pending.remove(item)
        time.sleep(poll_s)
    for job, _ in jobs:
        if job.proc is not None and job not in leave:
            job.wait(max(0.0, until - time.monotonic()))
