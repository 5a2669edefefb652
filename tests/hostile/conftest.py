"""The hostile harness's driver, shared by the corpus and fuzz tests: one preloaded process (torch,
workbench, the valid base inputs, every reader called once) that forks the children reading hostile
inputs. It starts once per session and answers JSON commands (``hostile_fuzz.serve``)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hostile_fuzz import LONG_FACTOR

HERE = Path(__file__).resolve().parent


class HostileDriver:
    def __init__(self, proc: subprocess.Popen, log: Path, hello: dict):
        self.proc, self.log, self.hello = proc, log, hello

    def ask(self, cmd: dict, timeout: float) -> dict:
        assert self.proc.poll() is None, f"the hostile driver has exited:\n{self.log_tail()}"
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = _read_line(self.proc, timeout)
        assert line, f"the hostile driver gave no answer to {cmd['cmd']} in {timeout} s:\n{self.log_tail()}"
        answer = json.loads(line)
        assert "error" not in answer, f"{answer['error']}\n{answer.get('tb', '')}\n{self.log_tail()}"
        return answer

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            return ""
    return ""


def _scratch() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="workbench-hostile-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK)
                                 else None))


@pytest.fixture(scope="session")
def hostile_driver(tmp_path_factory):
    work = _scratch()
    log = tmp_path_factory.mktemp("hostile") / "driver.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")  # same counts every run
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(HERE / "hostile_fuzz.py"), "--serve", "--work", str(work)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                start_new_session=True)
    try:
        line = _read_line(proc, 180)
        hello = json.loads(line) if line else {"ready": False, "error": "no answer in 180 s"}
        driver = HostileDriver(proc, log, hello)
        assert hello.get("ready"), f"the hostile driver did not start: {hello}\n{driver.log_tail()}"
        assert not hello["warm"]["problems"], f"a reader refused a valid base input: {hello['warm']['problems']}"
        yield driver
    finally:
        try:
            proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            proc.stdin.flush()
            proc.wait(10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def hostile_long(request) -> bool:
    return bool(request.config.getoption("--hostile-long", False))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--hostile-long", False):  # the long fuzz takes about 20 times as long
        for item in items:
            if item.name.startswith("test_mutation_fuzz"):
                item.add_marker(pytest.mark.timeout(LONG_FACTOR * 900), append=False)
