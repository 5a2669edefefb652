"""`make lab` as a user runs it: it serves JupyterLab on notebooks/ and prints the URL."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_make_lab_serves_the_notebooks(repo):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}  # so it prints a real token
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_PORT={port}"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url, lines, deadline = None, [], time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            # JupyterLab's own line, with the real token (not the Makefile's "token=..." hint)
            m = re.search(rf"(http://127\.0\.0\.1:{port}/lab\?token=([0-9a-f]{{16,}}))", line)
            url, token = (m.group(1), m.group(2)) if m else (None, None)
        assert url, "no URL printed:\n" + "".join(lines[-30:])
        names, deadline = None, time.monotonic() + 30
        while names is None:  # the URL is printed a moment before the socket accepts
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=10) as r:
                    names = {item["name"] for item in json.load(r)["content"]}
            except urllib.error.URLError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        notebooks = {p.name for p in (repo / "notebooks").glob("*.ipynb")}
        assert notebooks and notebooks <= names
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
