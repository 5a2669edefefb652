"""`pip install .` for a user without Node: the wheel carries the prebuilt lab extension and the server
extension's config, so a fresh environment lists both as enabled and `jupyter lab` serves them.

The fresh environment gets the package from a wheel built from this checkout's files (a copy, so the
build leaves nothing in the tree) and its dependencies from the project's venv through a .pth line (a
full dependency install would take minutes of the suite). PATH holds the fresh venv's bin only, so no
Node, npm or jupyter command of the project's venv is reachable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest

from helpers import wait_for_server  # tests/helpers.py

REPO = Path(__file__).resolve().parents[1]
EXTENSION = "parallel-workbench-lab"


def _checkout_files(dest: Path) -> None:
    """The files a clone of this checkout has (tracked, plus new ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files a clone has")
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    _checkout_files(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(root / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next((root / "dist").glob("parallel_workbench-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # The dependencies (torch, jupyterlab, ...) come from the project's venv, after the wheel's own files.
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=str(venv / "bin"), HOME=str(root / "home"), JUPYTER_PLATFORM_DIRS="1")
    return {"python": python, "venv": venv, "env": env, "root": root, "wheel": wheel}


def _run(fresh: dict, *args: str) -> str:
    done = subprocess.run([str(fresh["python"]), *args], env=fresh["env"], capture_output=True, text=True,
                          timeout=120, cwd=fresh["root"])
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def test_the_wheel_carries_the_prebuilt_extension_and_no_node_is_reachable(fresh):
    import zipfile

    names = zipfile.ZipFile(fresh["wheel"]).namelist()
    data = [n for n in names if ".data/data/" in n]
    assert any(n.endswith(f"share/jupyter/labextensions/{EXTENSION}/package.json") for n in data), data
    assert any(f"labextensions/{EXTENSION}/static/remoteEntry." in n for n in data), data
    assert any(n.endswith("etc/jupyter/jupyter_server_config.d/parallel_workbench.json") for n in data), data
    # the device profiles time predictions read (workbench.time.devices)
    assert {f"workbench/time/profiles/{p}.json" for p in ("H100-SXM", "H200", "A100-SXM-80GB")} <= set(names)
    assert shutil.which("node", path=fresh["env"]["PATH"]) is None
    assert shutil.which("npm", path=fresh["env"]["PATH"]) is None
    where = _run(fresh, "-c", "import workbench, workbench.jupyter; print(workbench.__file__)")
    assert where.strip().startswith(str(fresh["venv"])), where  # the wheel's copy, not the checkout's


def test_a_fresh_environment_lists_both_extensions_enabled(fresh):
    lab = _run(fresh, "-m", "jupyterlab.labextensions", "list")
    line = next((ln for ln in lab.splitlines() if EXTENSION in ln), "")
    assert "enabled" in line and "OK" in line, lab
    assert str(fresh["venv"]) in lab, lab  # found in the fresh env's share/jupyter, not elsewhere
    server = _run(fresh, "-m", "jupyter_server.extension.serverextension", "list")
    line = next((ln for ln in server.splitlines() if "workbench.jupyter" in ln), "")
    assert "enabled" in line, server
    assert "OK" in server[server.index("workbench.jupyter"):], server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyter_lab_serves_the_extension_and_its_api(fresh):
    port, token = _free_port(), "wheel-test"
    proc = subprocess.Popen([str(fresh["python"]), "-m", "jupyterlab", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
                             f"--ServerApp.root_dir={fresh['root']}",
                             *(["--allow-root"] if os.geteuid() == 0 else [])],
                            env=fresh["env"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        def lab_page() -> str:
            return urllib.request.urlopen(f"{base}/lab?token={token}", timeout=5).read().decode()

        page = wait_for_server(proc, lab_page, "jupyter lab (the fresh env's)", lambda: proc.stderr.read()[-2000:])
        found = re.search(r'<script id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S)
        assert found, page[:500]
        config = json.loads(found.group(1))
        names = [e["name"] for e in config["federated_extensions"]]
        assert EXTENSION in names, names
        entry = next(e for e in config["federated_extensions"] if e["name"] == EXTENSION)
        static = urllib.request.urlopen(f"{base}/lab/extensions/{EXTENSION}/{entry['load']}", timeout=10)
        assert static.status == 200
        # The server extension answers too (its route list is the reply to an unknown endpoint).
        req = urllib.request.Request(f"{base}/workbench/api/open?path=nothing.txt",
                                     headers={"Authorization": f"token {token}"})
        try:
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as e:
            body = e.read().decode()
            assert e.code in (400, 404) and "nothing.txt" in body, (e.code, body)
        else:
            pytest.fail("opening a missing file answered 200")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
