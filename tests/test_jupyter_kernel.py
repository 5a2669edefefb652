"""In a real Jupyter kernel: interrupting it stops the ranks; killing it does not leave orphans."""

from __future__ import annotations

import os
import time

import pytest
from jupyter_client.manager import start_new_kernel

from workbench.train.events import read_events

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(150)]


def _wait_for(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) is not running
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _pids(run_dir):
    return [e["pid"] for e in read_events(run_dir) if e["type"] in ("start", "launch")]


def _launch_code(run_dir, wait: bool) -> str:
    code = f"import workbench\nrun = workbench.launch('small', nproc=2, dp_shard=2, steps=5000, out={str(run_dir)!r})\n"
    return code + ("run.wait()\n" if wait else "")


def _running(run_dir) -> bool:
    ev = read_events(run_dir) if run_dir.exists() else []
    return any(e["type"] == "step" for e in ev) and len([e for e in ev if e["type"] == "start"]) == 2


def _reply_to(kc, msg_id: str, timeout: float) -> dict:
    """The shell reply to request ``msg_id`` (a reply to an earlier request, such as the kernel_info that
    starting the client sends, may still be queued ahead of it)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
        assert time.monotonic() < deadline, f"no reply to {msg_id} within {timeout}s"


def test_interrupting_the_kernel_stops_every_rank(tmp_path):
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        msg_id = kc.execute(_launch_code(tmp_path, wait=True))
        assert _wait_for(lambda: _running(tmp_path), 90), "the run never started"
        pids = _pids(tmp_path)
        km.interrupt_kernel()
        reply = _reply_to(kc, msg_id, 30)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert _wait_for(lambda: not any(_alive(p) for p in pids), 15), "ranks survived the interrupt"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_killing_the_kernel_takes_the_ranks_down(tmp_path):
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.execute_interactive(_launch_code(tmp_path, wait=False), timeout=60)
        assert _wait_for(lambda: _running(tmp_path), 90), "the run never started"
        pids = _pids(tmp_path)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)  # SIGKILL: no chance to clean up
    assert _wait_for(lambda: not any(_alive(p) for p in pids), 20), "ranks outlived their kernel"
